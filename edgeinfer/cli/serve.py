"""``edgeinfer serve``: the HTTP daemon (OpenAI-compatible chat about images, /v1/vqa, /metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.options import BackendOption, ModelOption, ProfileOption, SetOption
from edgeinfer.demo import DEMO_MODEL_DIR


def serve(
    *,
    model: ModelOption = None,
    profile: ProfileOption = None,
    set_: SetOption = None,
    backend: BackendOption = "auto",
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on. Anything but loopback needs --api-key (or --insecure-public).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="EDGEINFER_API_KEY", show_default=False,
        help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics. Prefer the environment "
             "variable: a flag shows in the process list.")] = None,
    allow_remote_images: Annotated[bool, typer.Option(
        "--allow-remote-images", help="Fetch http(s) image URLs (size-capped, time-limited). Off by "
                                      "default: it lets clients make the device fetch any URL.")] = False,
    remote_image_timeout: Annotated[float, typer.Option(
        "--remote-image-timeout", help="Seconds one remote image may take, all told.")] = 10.0,
    allowed_local_dir: Annotated[Optional[Path], typer.Option(
        "--allowed-local-dir", help="Allow file:// image URLs for files inside this folder only.")] = None,
    insecure_public: Annotated[bool, typer.Option(
        "--insecure-public", help="Allow a non-loopback --host without an API key (a firewall or "
                                  "proxy must guard the port).")] = False,
    model_name: Annotated[Optional[str], typer.Option(
        "--model-name", help="Model id in /v1/models (default: the folder's name).")] = None,
    max_tokens: Annotated[int, typer.Option(
        "--default-max-tokens", help="max_tokens of a request that gives none.")] = 256,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
) -> None:
    """Serve the model over HTTP until SIGTERM; requests in flight get the profile's shutdown grace."""
    from edgeinfer.server.daemon import serve as run
    from edgeinfer.server.settings import ServerSettings

    with cli_errors():
        settings = ServerSettings.build(
            model or DEMO_MODEL_DIR, profile, set_ or (), backend=backend, host=host, port=port, api_key=api_key, model_name=model_name,
            allow_remote_images=allow_remote_images, remote_image_timeout_s=remote_image_timeout,
            allowed_local_dir=allowed_local_dir, insecure_public=insecure_public, default_max_tokens=max_tokens)
    status = run(settings, log_level=log_level)
    if status:
        raise typer.Exit(status)
