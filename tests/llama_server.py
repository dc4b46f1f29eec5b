"""llama-server's command line, answered by `edgeinfer serve`: what llama.cpp's own server test
suite starts (its `LLAMA_SERVER_BIN_PATH`), so that the suite drives edgeinfer
(tests/test_llama_suite.py).

It starts `edgeinfer serve` on a port of its own, on the tiny export that stands for the model the
suite names (`$EDGEINFER_SUITE_EMBED` where it asks for `--embedding`, else `$EDGEINFER_SUITE_CHAT`),
served under the suite's `--alias`, and listens on the suite's `--port` as a proxy that adds what
llama-server takes as optional and edgeinfer does not:

- the `/v1` prefix of the OpenAI routes llama-server also serves at the root (/chat/completions);
- the request's `model`: llama-server serves its one model whatever a request names (the suite
  sends "gpt-4.1"), so the proxy names the model served.

Every response's method, path and status is appended to `$EDGEINFER_SUITE_LOG`, which the test
reads for 5xx. The flags edgeinfer has no use for (sampling defaults, batch sizes, the hub) are
read and left; the test's skip list says which tests depend on them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn

ROOT_ROUTES = {"/completions", "/chat/completions", "/embeddings", "/models", "/responses", "/messages", "/messages/count_tokens"}


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--alias", default="tinyllama-2")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--ctx-size", type=int, default=None)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--embedding", action="store_true")
    parser.add_argument("--chat-template-file", default=None)
    return parser.parse_known_args(argv)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_edgeinfer(args: argparse.Namespace, folder: Path) -> tuple[subprocess.Popen, str]:
    """`edgeinfer serve` of the stand-in export, named as the suite's alias."""
    export = Path(os.environ["EDGEINFER_SUITE_EMBED" if args.embedding else "EDGEINFER_SUITE_CHAT"])
    served = folder / args.alias.replace("/", "_")
    served.mkdir()
    for file in export.iterdir():
        os.link(file, served / file.name)
    port = free_port()
    context = json.loads((export / "edgeinfer.json").read_text())["max_context"]
    flags = ["--model", str(served), "--port", str(port), "--provider", "cpu", "--max-batch", str(max(1, args.parallel))]
    flags += ["--max-context", str(min(args.ctx_size or context, context))]
    flags += ["--api-key", args.api_key] if args.api_key else []
    flags += ["--chat-template", args.chat_template_file] if args.chat_template_file else []
    flags += ["--grace", "0"]
    process = subprocess.Popen([sys.executable, "-m", "edgeinfer.cli", "serve", *flags], preexec_fn=_die_with_parent)
    return process, f"http://127.0.0.1:{port}"


def _die_with_parent() -> None:
    """In the child: SIGKILL once this shim ends, however it ends (the suite kills a shim that is slow to stop)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def proxy(upstream: str, model: str, log: Path):
    """The ASGI app that forwards each request to `upstream`, path and body completed."""
    client = httpx.AsyncClient(base_url=upstream, timeout=600)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        path = "/v1" + path if path in ROOT_ROUTES else path
        body = named(body, model)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")]
        query = scope["query_string"].decode()
        request = client.build_request(scope["method"], path + (f"?{query}" if query else ""), headers=headers, content=body)
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError:  # edgeinfer is not listening yet (or has stopped)
            await send({"type": "http.response.start", "status": 502, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        with open(log, "a") as out:
            out.write(f"{scope['method']} {scope['path']} {response.status_code}\n")
        kept = [
            (k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() not in ("content-length", "transfer-encoding")
        ]
        await send({"type": "http.response.start", "status": response.status_code, "headers": kept})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def named(body: bytes, model: str) -> bytes:
    """A JSON object's `model` set to the model served (llama-server serves its one model whatever is named)."""
    try:
        value = json.loads(body) if body else None
    except ValueError:
        return body
    if not isinstance(value, dict):
        return body
    return json.dumps({**value, "model": model}).encode()


def main() -> None:
    args = arguments(sys.argv[1:])
    # beside the test's log, in its tmp_path: llama.cpp's suite kills a server that takes over 5 s to
    # stop (SIGTERM, then SIGKILL), and the rmtree at the end does not run then
    folder = Path(tempfile.mkdtemp(prefix="edgeinfer-llama-suite-", dir=Path(os.environ["EDGEINFER_SUITE_LOG"]).parent))
    process, upstream = start_edgeinfer(args, folder)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{upstream}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    if process.poll() is not None:
        sys.exit(f"edgeinfer serve stopped with {process.returncode}")
    app = proxy(upstream, args.alias, Path(os.environ["EDGEINFER_SUITE_LOG"]))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)
    try:
        uvicorn.Server(config).run()  # until SIGTERM, which uvicorn takes
    finally:
        process.kill()
        process.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
