"""`edgeinfer serve`: an OpenAI-compatible HTTP server over the scheduler (needs the `serve` extra:
pip install "edgeinfer[serve]")."""

from .app import create_app
from .server import ServerOptions, run_server

__all__ = ["create_app", "run_server", "ServerOptions"]
