"""The walk of one streamed tool-call request through the code, counted: the app of a commit in this
process on one export (a Scheduler behind it, as `edgeinfer serve` runs it), one streamed chat
completion with a required tool call sent twice, and the second one's calls recorded (on every
thread: the event loop, the workers, the scheduler). Printed: the stops (distinct functions of the
package called), the files they are in, and the calls in all; the same for the request's side
alone (every thread but the scheduler's: HTTP, the chat turn, the replies); and how many times
app.py was entered from outside it (from the web framework or another file).

    python benchmarks/request_walk.py EXPORT_DIR COMMIT [COMMIT ...]

Each commit is imported from a worktree, as benchmarks/compare_trees.py does, in a process of its
own. Counts, not timings: the same on any machine for the same commits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trees import in_tree, trees  # noqa: E402

ONE_WALK = r"""
import asyncio, json, os, sys, threading
import httpx
from edgeinfer import Engine, Scheduler
from edgeinfer.serve.app import create_app

export = sys.argv[1]
tree = os.path.dirname(os.path.dirname(os.path.realpath(sys.modules["edgeinfer.serve.app"].__file__)))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
           "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
        "temperature": 0, "tools": [WEATHER], "tool_choice": "required", "stream": True}
calls, recording = [], [False]
names = {}

def where(code):
    path = names.get(code.co_filename)
    if path is None:
        real = os.path.realpath(code.co_filename)
        inside = real.startswith(tree + os.sep) and not real.startswith(os.path.join(tree, ".venv"))
        path = names[code.co_filename] = os.path.relpath(real, tree) if inside else ""
    return path

def profile(frame, event, arg):
    if event != "call" or not recording[0]:
        return
    callee = where(frame.f_code)
    if callee:
        caller = where(frame.f_back.f_code) if frame.f_back is not None else ""
        calls.append((threading.current_thread().name != "edgeinfer-scheduler", caller, callee, frame.f_code.co_qualname))

async def main():
    app = create_app(lambda: Scheduler(Engine.load(export, provider="cpu"), max_batch=2), "m")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://walk") as client:
            for _ in range(600):
                if (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit(f"the export did not load: {app.state.loaded.error}")
            for round_ in range(2):
                recording[0] = round_ == 1
                async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                    text = "".join([chunk async for chunk in reply.aiter_text()])
                recording[0] = False
            assert "tool_calls" in text, text[:300]

threading.setprofile(profile)
sys.setprofile(profile)
asyncio.run(main())
sys.setprofile(None)
stops = sorted({(callee, name) for _, _, callee, name in calls})
served = {(callee, name) for on_request, _, callee, name in calls if on_request}
entries = sum(1 for _, caller, callee, _ in calls if callee == "serve/app.py" and caller != "serve/app.py")
print(json.dumps({"imported_from": tree, "stops": len(stops), "files": len({f for f, _ in stops}), "calls": len(calls),
                  "request_side_stops": len(served), "request_side_files": len({f for f, _ in served}), "app_py_entries": entries,
                  "by_file": {f: sum(1 for g, _ in stops if g == f) for f in sorted({f for f, _ in stops})}}))
"""


def walk(package: Path, export: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ONE_WALK, str(Path(export).resolve())], **in_tree(package), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("commits", nargs="+")
    args = parser.parse_args()
    with trees(*args.commits) as packages:
        for commit, package in zip(args.commits, packages):
            counted = walk(package, args.export)
            by_file = counted.pop("by_file")
            print(f"{commit}: {json.dumps(counted)}")
            print("  stops by file: " + ", ".join(f"{f} {n}" for f, n in by_file.items()))


if __name__ == "__main__":
    main()
