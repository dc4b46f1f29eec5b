"""Every decoder-only causal-LM family transformers registers, tried: a tiny random-weight model of
each (its config class's defaults, shrunk), exported in fp32 and checked against transformers
(16 greedy tokens, logits, a batch against each prompt alone).

    python benchmarks/families.py [--only TYPE...] [--timeout 300] [--out results.jsonl]

Each family runs in its own process under a time limit; one line per family (exported and equal,
differs, or failed and where), then the count. Families that are not decoder-only (encoders whose
causal-LM head is a decoder mode, encoder-decoders, speech and music models) are listed apart."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def families() -> tuple[list[str], dict[str, str]]:
    """(decoder-only causal-LM model types, {other model type: why it is not one})."""
    from generic_tiny import not_decoder_only
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    others = {name: why for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if (why := not_decoder_only(name))}
    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(others)), others


def try_one(model_type: str) -> dict:
    """Export the tiny model of `model_type` and check it; the outcome as a dict."""
    import torch
    from conftest import build_tokenizer
    from generic_tiny import tiny_model

    from edgeinfer.export import export_model
    from edgeinfer.export.check import check_export

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        try:
            torch.manual_seed(0)
            model = tiny_model(model_type)
            model.save_pretrained(folder / "hf")
            build_tokenizer().save_pretrained(folder / "hf")
        except Exception as e:  # noqa: BLE001 - the family's own code: reported, not raised
            return {"family": model_type, "outcome": "no tiny model", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        try:
            export_model(str(folder / "hf"), folder / "export")
            result = check_export(folder / "export", model)
        except Exception as e:  # noqa: BLE001 - the export's failure is the finding
            return {"family": model_type, "outcome": "failed", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
    outcome = "equal" if result.passed else "differs"
    return {"family": model_type, "outcome": outcome, "why": f"tokens equal {result.tokens_equal}, worst {result.worst:.2e}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(try_one(args.one)))
        return
    decoders, others = families()
    for name, why in others.items():
        print(f"{name:28} not tried: {why}")
    counts = {}
    out = open(args.out, "a") if args.out else None
    for name in args.only or decoders:
        line = run_one(name, args.timeout)
        counts[line["outcome"]] = counts.get(line["outcome"], 0) + 1
        print(f"{name:28} {line['outcome']:14} {line['why']}", flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
    print(" ".join(f"{k}: {v}" for k, v in counts.items()), f"of {sum(counts.values())}")


def run_one(name: str, timeout: int) -> dict:
    try:
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"family": name, "outcome": "failed", "why": f"no result in {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {
            "family": name,
            "outcome": "failed",
            "why": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:300]}",
        }
    return json.loads(lines[-1])


if __name__ == "__main__":
    main()
