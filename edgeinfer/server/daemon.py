"""Run the app under uvicorn until SIGTERM / SIGINT; the exit status says how it ended.

A stop gives the requests in flight the profile's ``shutdown_grace_s``. Then the app ends
what is left itself (:meth:`Runtime.begin_shutdown`): queued requests get a JSON 503 with
Retry-After, running streams an error event and ``data: [DONE]``. uvicorn waits a little
longer than the grace period (``ANSWER_MARGIN_S``) so that those answers go out before it
would cancel anything, and the process exits 0.
"""

from __future__ import annotations

import copy
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG

from edgeinfer.errors import exit_code_for
from edgeinfer.server.app import create_app
from edgeinfer.server.settings import ServerSettings

log = logging.getLogger("edgeinfer.server")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
ANSWER_MARGIN_S = 5.0  # after the grace period: time to send the 503s and the streams' last events


class GracefulServer(uvicorn.Server):
    """uvicorn's server that tells the app when a shutdown starts, not only when it ends."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.runtime = app.state.runtime

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.runtime.begin_shutdown()
        await super().shutdown(sockets)


def build_server(settings: ServerSettings, app: FastAPI, log_level: str = "info") -> GracefulServer:
    return GracefulServer(uvicorn_config(settings, app, log_level), app)


def uvicorn_config(settings: ServerSettings, app, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level, lifespan="on",
        log_config=_log_config(log_level),
        # uvicorn stops listening at once, then waits this long for requests in flight; the app
        # itself ends what is left at shutdown_grace_s, and answers them in the margin.
        timeout_graceful_shutdown=settings.server.shutdown_grace_s + ANSWER_MARGIN_S,
        proxy_headers=False, server_header=False,
    )


def _log_config(level: str) -> dict:
    """uvicorn's logging, with edgeinfer's own messages (model ready, load errors) beside them."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["edgeinfer"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def serve(settings: ServerSettings, log_level: str = "info", sockets: list[socket.socket] | None = None) -> int:
    """Serve until stopped. 0 after a graceful stop; the load error's exit code if the model fails to load."""
    status = 0
    server: uvicorn.Server | None = None

    def on_load_failure(error: BaseException) -> None:
        nonlocal status
        status = exit_code_for(error)
        if server is not None:
            server.should_exit = True

    server = build_server(settings, create_app(settings, on_load_failure), log_level)
    # uvicorn raises the stop signal again once it has shut down gracefully; a handler that
    # only notes it turns that into a normal return (exit status 0) instead of death by signal.
    previous = {sig: signal.signal(sig, _noted) for sig in STOP_SIGNALS}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _noted(sig: int, frame: FrameType | None) -> None:
    log.info("stopped by %s", signal.Signals(sig).name)
