"""What a constrained tool call costs: the decode rate of a forced call (tool_choice "required",
decoding held to the format's grammar and the tool's schema) against plain greedy decoding of the
same conversation, alternating, medians; and the share of auto turns that called, with every call
checked against its schema.

    python benchmarks/tools.py EXPORT_DIR [--rounds 5]

The call's tool takes a long free-text argument so that its output runs to tens of tokens, as a
real call's arguments do. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics

NOTE = {
    "type": "function",
    "function": {
        "name": "save_note",
        "description": "Save a note about the user's question for later.",
        "parameters": {
            "type": "object",
            "properties": {"title": {"type": "string", "maxLength": 40}, "body": {"type": "string", "maxLength": 300}},
            "required": ["title", "body"],
        },
    },
}
ASK = [{"role": "user", "content": "Write a note about the history of Paris and save it."}]
QUESTIONS = [
    "What is the weather in Paris?",
    "Save a note: buy milk.",
    "Tell me a joke.",
    "Who wrote Hamlet?",
    "Note that the meeting is at 3.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from edgeinfer import Engine

    engine = Engine.load(args.export, provider="cpu")
    engine.chat(ASK, tools=[NOTE], tool_choice="required", max_new_tokens=8)  # warm-up: llguidance's tokenizer, the graph
    plain, called, tokens = [], [], []
    for _ in range(args.rounds):
        result = engine.chat(ASK, tools=[NOTE], tool_choice="required", parallel_tool_calls=False, max_new_tokens=200)
        called.append(result.decode_tokens_per_s)
        tokens.append(len(result.token_ids))
        plain.append(engine.chat(ASK, max_new_tokens=len(result.token_ids), ignore_eos=True).decode_tokens_per_s)
    print(f"plain greedy: median {statistics.median(plain):.1f} tok/s ({', '.join(f'{r:.1f}' for r in plain)})")
    print(f"forced call:  median {statistics.median(called):.1f} tok/s ({', '.join(f'{r:.1f}' for r in called)}), {tokens} tokens")
    print(f"ratio forced / plain: {statistics.median(called) / statistics.median(plain):.3f}")
    auto = [engine.chat([{"role": "user", "content": q}], tools=[NOTE], max_new_tokens=200) for q in QUESTIONS]
    # the last call of a turn that max_new_tokens ended was cut short; the others ended
    calls = [(c, r.finish_reason == "length" and i == len(r.tool_calls) - 1) for r in auto for i, c in enumerate(r.tool_calls)]
    import jsonschema  # the test extra's

    def valid(call) -> bool:
        try:
            jsonschema.validate(json.loads(call.arguments), NOTE["function"]["parameters"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    good = sum(not cut and valid(c) for c, cut in calls)
    cut = sum(cut for _, cut in calls)
    called = sum(bool(r.tool_calls) for r in auto)
    print(
        f"auto: {called} of {len(auto)} turns called; {len(calls)} calls, {good} of the {len(calls) - cut} that ended valid for the schema, {cut} cut by max_new_tokens"
    )


if __name__ == "__main__":
    main()
