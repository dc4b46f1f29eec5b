"""Whether two commits answer the same requests with the same bytes: a server of each commit on one
export, and the same agent requests sent to both (Chat Completions, Responses and Messages; whole
and streamed; tools required, auto and none; a tool result turn; greedy and seeded sampling; a
refused request per API). Ids, call ids and timestamps differ from run to run and are replaced by
placeholders; everything else is compared byte for byte.

    python benchmarks/api_bytes.py EXPORT_DIR OLD_COMMIT [NEW_COMMIT]

Prints one line per request (same, or the first line that differs) and the count of each. Each
commit is imported from a worktree, as benchmarks/compare_trees.py does.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trees import server_of, trees  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ASK = "What is the weather in Paris?"
CALLED = [
    {"role": "user", "content": ASK},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER["function"]["parameters"]}
# A stored response's id and a call's id differ in each run: the placeholders that stand for them
IDS = re.compile(r"(chatcmpl-|cmpl-|resp_|msg_|rs_|call_|toolu_|fc_)[0-9a-f]{16,}")
TIMES = re.compile(r'"(created|created_at)": ?\d+')
CHOICE = re.compile(r'"choices": \[\{"index": (\d+)')


def by_choice(text: str) -> str:
    """A stream's lines with each choice's together, in order (the choices of n > 1 interleave as
    their rows happen to be stepped)."""
    lines = text.split("\n")
    return "\n".join(sorted(lines, key=lambda line: int(m.group(1)) if (m := CHOICE.search(line)) else -1))


def requests(model: str) -> list[tuple[str, str, dict]]:
    """(name, path, body) of each request sent."""
    chat = {"model": model, "messages": [{"role": "user", "content": ASK}], "max_tokens": 40, "tools": [WEATHER]}
    responses = {"model": model, "input": ASK, "max_output_tokens": 40, "tools": [{"type": "function", **WEATHER["function"]}]}
    messages = {"model": model, "max_tokens": 40, "messages": [{"role": "user", "content": ASK}], "tools": [ANTHROPIC_TOOL]}
    made = []
    for stream in (False, True):
        for choice, sampled in (
            ("required", {"temperature": 0}),
            ("auto", {"temperature": 0.8, "seed": 7}),
            ("none", {"temperature": 0}),
        ):
            tag = f"{'stream' if stream else 'whole'} {choice}"
            made.append((f"chat {tag}", "/v1/chat/completions", {**chat, **sampled, "tool_choice": choice, "stream": stream}))
            made.append((f"responses {tag}", "/v1/responses", {**responses, **sampled, "tool_choice": choice, "stream": stream}))
            anthropic_choice = {"required": "any", "auto": "auto", "none": "none"}[choice]
            made.append(
                (
                    f"messages {tag}",
                    "/v1/messages",
                    {**messages, **sampled, "tool_choice": {"type": anthropic_choice}, "stream": stream},
                )
            )
        made.append(
            (f"chat result turn {stream}", "/v1/chat/completions", {**chat, "messages": CALLED, "temperature": 0, "stream": stream})
        )
        made.append((f"chat n=2 {stream}", "/v1/chat/completions", {**chat, "tools": None, "n": 2, "seed": 3, "stream": stream}))
        made.append(
            (
                f"completions {stream}",
                "/v1/completions",
                {"model": model, "prompt": ASK, "max_tokens": 20, "seed": 1, "stream": stream},
            )
        )
    made += [
        ("chat refused", "/v1/chat/completions", {**chat, "max_tokens": 10**6}),
        ("responses refused", "/v1/responses", {**responses, "tool_choice": {"type": "function", "name": "nope"}}),
        ("messages refused", "/v1/messages", {**messages, "tool_choice": {"type": "tool"}}),
        ("completions refused", "/v1/completions", {"model": model, "prompt": ASK, "temperature": -1}),
    ]
    return made


def answers(package: Path, export: str) -> dict[str, str]:
    """Each request's normalized response (status and body) from a server of `package`."""
    with server_of(package, export) as url:
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        got = {}
        for label, path, body in requests(name):
            reply = httpx.post(url + path, json={k: v for k, v in body.items() if v is not None}, timeout=120)
            got[label] = f"{reply.status_code}\n" + by_choice(TIMES.sub(r'"\1": 0', IDS.sub(r"\1ID", reply.text)))
        return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    args = parser.parse_args()
    with trees(args.old, args.new) as (old_package, new_package):
        old, new = answers(old_package, args.export), answers(new_package, args.export)
    same = 0
    for label, text in old.items():
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        if new[label] == text:
            same += 1
            print(f"same     {label}: {len(text)} bytes, sha256 {digest}")
        else:
            at = next(i for i, (a, b) in enumerate(zip(text.splitlines() + [""], new[label].splitlines() + [""])) if a != b)
            print(f"DIFFERS  {label}: line {at}\n  old: {text.splitlines()[at][:300]}\n  new: {new[label].splitlines()[at][:300]}")
    print(f"{same} of {len(old)} responses the same, byte for byte (ids and timestamps replaced)")


if __name__ == "__main__":
    main()
