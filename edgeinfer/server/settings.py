"""The daemon's settings: one frozen object built from the device profile and the flags.

Unsafe combinations are refused here, before anything listens: a non-loopback address
without an API key (unless ``insecure_public`` says so on purpose), an empty API key from
any source (the flag, or ``$EDGEINFER_API_KEY`` set to an empty string, which the CLI's
option parser alone would take for "not set"), a local-image folder that does not exist.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.engine.engine import EngineConfig
from edgeinfer.errors import ServerSettingsError
from edgeinfer.profiles import DeviceProfile, ServerConfig, load_profile

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "EDGEINFER_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Everything ``create_app`` needs; see ``docs/server.md`` for each field's flag."""

    model_dir: Path
    profile: DeviceProfile
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = field(default=None, repr=False)
    model_name: str | None = None  # the id in /v1/models; default: the model folder's name
    backend: str = "auto"
    allow_remote_images: bool = False
    remote_image_timeout_s: float = 10.0
    allowed_local_dir: Path | None = None
    insecure_public: bool = False
    default_max_tokens: int = 256
    engine_config: EngineConfig | None = None  # None: from the profile
    board_root: Path = Path("/")  # where /sys and /etc are read for power- and heat-aware admission

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ServerSettingsError("the API key is empty; give a non-empty --api-key / $EDGEINFER_API_KEY "
                                      "or none at all")
        if not is_loopback(self.host) and self.api_key is None and not self.insecure_public:
            raise ServerSettingsError(
                f"refusing to listen on {self.host} without an API key: anyone on the network could use the "
                f"model. Set --api-key (or $EDGEINFER_API_KEY), bind 127.0.0.1, or pass --insecure-public "
                f"if a firewall or a proxy guards the port")
        if not 0 <= self.port <= 65535:
            raise ServerSettingsError(f"port must be in 0..65535, got {self.port}")
        if self.remote_image_timeout_s <= 0:
            raise ServerSettingsError(f"remote image timeout must be > 0 s, got {self.remote_image_timeout_s}")
        if self.default_max_tokens < 1:
            raise ServerSettingsError(f"default max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.allowed_local_dir is not None:
            if not self.allowed_local_dir.is_dir():
                raise ServerSettingsError(f"--allowed-local-dir {self.allowed_local_dir} is not a folder")
            object.__setattr__(self, "allowed_local_dir", self.allowed_local_dir.resolve())

    @property
    def server(self) -> ServerConfig:
        return self.profile.server

    @property
    def served_model(self) -> str:
        return self.model_name or self.model_dir.resolve().name

    @classmethod
    def build(cls, model_dir: Path, profile: str | None = None, overrides: Sequence[str] = (),
              environ: Mapping[str, str] | None = None, **flags: object) -> ServerSettings:
        """From CLI values: ``profile`` is a name or YAML file (None: $EDGEINFER_PROFILE, else detected).

        With no ``api_key`` flag, ``$EDGEINFER_API_KEY`` is the key when it is set at all, so that
        an empty one is refused rather than read as "no key"."""
        env = os.environ if environ is None else environ
        if flags.get("api_key") is None and API_KEY_ENV in env:
            flags = {**flags, "api_key": env[API_KEY_ENV]}
        return cls(model_dir=Path(model_dir), profile=load_profile(profile, overrides), **flags)  # type: ignore[arg-type]
