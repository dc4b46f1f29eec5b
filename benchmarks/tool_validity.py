"""How often tool calls are valid, per call format: a model's own chat template and the tests'
templates in each family's format (Hermes, Llama 3, Mistral, pythonic, Gemma's tool_code, and
ChatML for the generic format) swapped in turn onto one export. For each: forced calls
(tool_choice "required") sampled at temperature 1.0, the share valid against the tool's schema;
and auto turns (tool_choice "auto", one call a turn) over a few questions, the share that called and the share of
the calls opened that are valid (a call cut by max_new_tokens counts as not valid).

    python benchmarks/tool_validity.py EXPORT_DIR [--forced 30] [--seeds 3]

Figures are printed, never asserted. A swapped template is one the model was not trained on:
what it measures is the constraint, not the model's judgement of when to call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

QUESTIONS = ["What is the weather in Paris?", "Add 2 and 40.", "Tell me a joke.", "Is it cold in Oslo today?", "Who wrote Hamlet?"]


def templates() -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import CHATML
    from test_tools import GEMMA, HERMES, LLAMA3, MISTRAL, PYTHONIC

    return {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL, "pythonic": PYTHONIC, "gemma": GEMMA, "generic": CHATML}


def valid(call, schemas: dict) -> bool:
    import jsonschema  # the test extra's

    try:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return True


def measure(engine, tools: list, schemas: dict, forced: int, seeds: int) -> str:
    good = 0
    for seed in range(forced):
        result = engine.chat(
            [{"role": "user", "content": QUESTIONS[seed % 2]}],
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_new_tokens=200,
        )
        good += result.finish_reason == "tool_calls" and all(valid(c, schemas) for c in result.tool_calls)
    turns = [
        engine.chat(
            [{"role": "user", "content": q}], tools=tools, parallel_tool_calls=False, temperature=1.0, seed=seed, max_new_tokens=200
        )
        for q in QUESTIONS
        for seed in range(seeds)
    ]
    called = [r for r in turns if r.tool_calls]
    calls = [(c, r.finish_reason) for r in called for c in r.tool_calls]
    opened_valid = sum(reason != "length" and valid(c, schemas) for c, reason in calls)
    return (
        f"{tool_format(engine):>9} | forced valid {good}/{forced} | auto called {len(called)}/{len(turns)} turns | "
        f"opened calls valid {opened_valid}/{len(calls)}"
    )


def tool_format(engine) -> str:
    from edgeinfer.sdk.tools import tool_format as read

    format = read(engine.tokenizer)
    return "generic" if format.name == "generic" else format.syntax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("--forced", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_tools import SCHEMAS, TOOLS

    from edgeinfer import Engine

    engine = Engine.load(args.export, provider="cpu")
    own = engine.tokenizer.chat_template
    for name, template in (({"own": own} if own else {}) | templates()).items():  # a GGUF may carry no template
        engine.tokenizer.chat_template = template
        print(f"{name:>8}: {measure(engine, TOOLS, SCHEMAS, args.forced, args.seeds)}", flush=True)
    engine.tokenizer.chat_template = own


if __name__ == "__main__":
    main()
