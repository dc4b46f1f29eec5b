"""Running the app with uvicorn, and stopping it cleanly: the first SIGTERM or Ctrl-C stops the
scheduler taking requests, lets the running ones end within the grace period, ends the rest with
finish reason "length", and only then lets uvicorn close its connections and exit 0."""
from __future__ import annotations

import logging
import threading

import uvicorn

from .app import create_app

log = logging.getLogger("edgeinfer.serve")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float):
        super().__init__(config)
        self.grace, self._draining = grace, False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self._draining = True
        threading.Thread(target=self._drain, name="edgeinfer-drain", daemon=True).start()

    def _drain(self) -> None:
        scheduler = self.config.app.state.loaded.scheduler
        log.info("stopping: no new requests; running ones get %.0f s to finish", self.grace)
        if scheduler is not None:
            scheduler.close(self.grace)
        self.should_exit = True


def run_server(load, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               grace: float = 30.0) -> None:
    failed = []

    def stop(error):
        failed.append(error)
        server.should_exit = True

    app = create_app(load, model_name, api_key, on_load_error=stop)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = _Server(config, grace)
    log.info("listening on http://%s:%d (OpenAI API under /v1); loading %s", host, port, model_name)
    server.run()
    if failed:
        raise failed[0]
