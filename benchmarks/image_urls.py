"""Image URLs that never answer, or trickle their bytes, against the text requests beside them.

A real `edgeinfer serve` of the SmolVLM-256M-shaped export (benchmarks/vision.py's, kept in WORK)
with --allowed-image-domains 127.0.0.1, and on 127.0.0.1 a host that accepts and never answers and
one that sends a byte every 0.3 s. In rounds that alternate: the time to the first token of text
questions (streamed, a new question each, one at a time) on the idle server, then the same while
16 requests whose pictures are on those hosts (8 silent, 8 trickling) wait for them. Medians, and
their ratio; the slow requests' answers (each should be a 400 at the fetch deadline).

    python benchmarks/image_urls.py WORK [--rounds 3] [--questions 5] [--against OLD_COMMIT]

Each commit is served from a worktree of its own (compare_trees.py); --against serves an older
commit beside HEAD (with --allow-image-urls, which fetched from 127.0.0.1 before --allowed-image-domains).

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
SLOW = 16
TEXT_TIMEOUT_S = 30.0  # a text question's TTFT past it counts as inf
SLOW_TIMEOUT_S = 120.0
_QUESTIONS = itertools.count(1)


def text_ttft(url: str, model: str, n: int) -> float:
    """Seconds to the first streamed token of a new text question (inf past TEXT_TIMEOUT_S)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=TEXT_TIMEOUT_S)
    messages = [{"role": "user", "content": f"{n}. Name a colour."}]
    start = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stream.close()
                return time.perf_counter() - start
    except openai.APITimeoutError:
        return float("inf")
    raise RuntimeError("the stream gave no token")


def slow_requests(url: str, model: str, hosts: list[str]) -> tuple[list[threading.Thread], list]:
    """One chat request per slow host's picture, started in threads; their answers go in the list."""
    import httpx

    answers = []

    def ask(image: str) -> None:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        try:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=SLOW_TIMEOUT_S)
            answers.append((response.status_code, response.json().get("error", {}).get("code")))
        except httpx.TimeoutException:
            answers.append(("no answer", f"within {SLOW_TIMEOUT_S:.0f} s"))

    threads = [threading.Thread(target=ask, args=(host,)) for host in hosts]
    for thread in threads:
        thread.start()
    return threads, answers


def one_round(url: str, model: str, hosts: list[str], questions: int, found: dict) -> None:
    """`questions` text questions on the idle server, then as many beside the slow requests."""
    for _ in range(questions):
        found["idle"].append(text_ttft(url, model, next(_QUESTIONS)))
    threads, said = slow_requests(url, model, hosts)
    time.sleep(1.0)  # the fetches under way
    for _ in range(questions):
        found["loaded"].append(text_ttft(url, model, next(_QUESTIONS)))
    found["in flight"].append(sum(thread.is_alive() for thread in threads))
    for thread in threads:
        thread.join()
    found["answers"] += said


def main() -> None:
    from compare_trees import server_of, trees
    from test_image_urls import Silent, Site
    from vision import exported

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--against", metavar="COMMIT", help="also an older commit, served with --allow-image-urls, alternated")
    args = parser.parse_args()
    export = exported(args.work)
    silent, site = Silent(), Site()
    hosts = [f"http://127.0.0.1:{silent.port}/{i}.png" for i in range(SLOW // 2)] + [
        site.url(f"/trickle?{i}") for i in range(SLOW // 2)
    ]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    commits = [c for c in (args.against, head) if c]
    flags = {args.against: ["--allow-image-urls"], head: ["--allowed-image-domains", "127.0.0.1"]}
    found = {c: {"idle": [], "loaded": [], "in flight": [], "answers": []} for c in commits}
    try:
        with trees(*commits) as packages, contextlib.ExitStack() as servers:
            urls = {c: servers.enter_context(server_of(p, str(export), *flags[c])) for c, p in zip(commits, packages)}
            for commit in commits:
                text_ttft(urls[commit], export.name, 0)  # warm the sessions
            for _ in range(args.rounds):
                for commit in commits:  # alternated
                    one_round(urls[commit], export.name, hosts, args.questions, found[commit])
                    print(
                        f"{commit}: a round, {found[commit]['in flight'][-1]} of {SLOW} slow requests in flight after it", flush=True
                    )
            say(found, args)  # before the servers stop: an old one may take long to
    finally:
        silent.close()
        site.close()


def say(found: dict, args) -> None:
    print(f"{args.rounds} rounds of {args.questions} text questions each, alternated; medians:", flush=True)
    for commit, figures in found.items():
        idle, loaded = statistics.median(figures["idle"]), statistics.median(figures["loaded"])
        answers = figures["answers"]
        print(
            f"  {commit}: TTFT idle {idle * 1000:.1f} ms, beside {SLOW} slow {loaded * 1000:.1f} ms "
            f"(largest {max(figures['loaded']) * 1000:.1f} ms), ratio {loaded / idle:.2f}"
        )
        print(f"    the slow requests' answers: {dict((a, answers.count(a)) for a in set(answers))}", flush=True)


if __name__ == "__main__":
    main()
