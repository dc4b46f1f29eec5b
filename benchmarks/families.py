"""Every decoder-only causal-LM family transformers registers, tried: a tiny random-weight model of
each (its config class's defaults, shrunk), exported in fp32 and checked against transformers
(16 greedy tokens, logits, a batch against each prompt alone).

    python benchmarks/families.py [--only TYPE...] [--timeout 300] [--out results.jsonl] [--quantize int4]

With `--quantize int4` each family is exported with the default int4 (GPTQ over the calibration
text, `--keep-int8 auto`) instead: its tokens differ from fp32's by design, so the line gives its
top-1 agreement with transformers over the quality text (as the export measured it), whether its
graph holds 4-bit and 8-bit MatMuls, and whether a batch gives each prompt what it gets alone.

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


def try_one(model_type: str, quantize: str | None = None) -> dict:
    """Export the tiny model of `model_type` (in fp32, or with the default `quantize`) and check it;
    the outcome as a dict."""
    import torch
    from conftest import build_tokenizer
    from generic_tiny import tiny_model

    from edgeinfer.export import ExportOptions, export_model
    from edgeinfer.export.check import check_export
    from edgeinfer.export.quantize import Quantization

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
            options = ExportOptions(quantization=Quantization(quantize) if quantize else None)
            manifest = export_model(str(folder / "hf"), folder / "export", options)
            result = check_export(folder / "export", model)
            bits = quantized_bits(folder / "export") if quantize else None
        except Exception as e:  # noqa: BLE001 - the export's failure is the finding
            return {"family": model_type, "outcome": "failed", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
    if quantize:
        return quantized_outcome(model_type, manifest.quantization, bits, result)
    outcome = "equal" if result.passed else "differs"
    return {"family": model_type, "outcome": outcome, "why": f"tokens equal {result.tokens_equal}, worst {result.worst:.2e}"}


def quantized_bits(folder: Path) -> dict[int, int]:
    """{bits: MatMulNBits nodes} in the export's graph."""
    import onnx

    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    return {b: sum(1 for n in nodes if next(a.i for a in n.attribute if a.name == "bits") == b) for b in (4, 8)}


def quantized_outcome(model_type: str, quality: dict, bits: dict[int, int], result) -> dict:
    """A quantized export runs where its graph holds 4-bit MatMuls and a batch gives each prompt
    what it gets alone; its top-1 agreement with transformers is the figure to read."""
    runs = bits[4] > 0 and result.batch_rows_equal_single
    why = (
        f"top-1 {quality['top1_agreement']:.1%}, MatMulNBits 4-bit {bits[4]} 8-bit {bits[8]}, "
        f"batch rows equal alone {result.batch_rows_equal_single}, tokens equal fp32 transformers' {result.tokens_equal}"
    )
    return {"family": model_type, "outcome": "runs" if runs else "differs", "why": why, "top1": quality["top1_agreement"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quantize", choices=["int4", "int8"], default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(try_one(args.one, args.quantize)))
        return
    decoders, others = families()
    for name, why in others.items():
        print(f"{name:28} not tried: {why}")
    counts = {}
    out = open(args.out, "a") if args.out else None
    for name in args.only or decoders:
        line = run_one(name, args.timeout, args.quantize)
        counts[line["outcome"]] = counts.get(line["outcome"], 0) + 1
        print(f"{name:28} {line['outcome']:14} {line['why']}", flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
    print(" ".join(f"{k}: {v}" for k, v in counts.items()), f"of {sum(counts.values())}")


def run_one(name: str, timeout: int, quantize: str | None = None) -> dict:
    command = [sys.executable, __file__, "--one", name, *(["--quantize", quantize] if quantize else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
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
