"""The HTTP daemon: an OpenAI-compatible API over the engine (see docs/server.md).

``create_app(settings)`` builds the FastAPI app; nothing is loaded at import.
"""

from edgeinfer.server.app import create_app
from edgeinfer.server.settings import ServerSettings, ServerSettingsError

__all__ = ["ServerSettings", "ServerSettingsError", "create_app"]
