"""Next-token quality of quantized exports against their fp32 export, and of llama.cpp GGUFs against
their F32 GGUF, on the same texts: export's quality text (export/quality_text.txt, what the
export reports) and a held text that nothing calibrates on (export/held_text.txt), or the
`--text` files given.

    python benchmarks/quality.py FP32_EXPORT [EXPORT ...] [--gguf F32_GGUF GGUF ...] [--llama-bin DIR]

Every figure is taken llama-perplexity's way, so that the two engines' rows read alike: windows of
256 tokens, each from an empty cache, scored on its second half. Per model and text: perplexity,
its increase over the model's own full-precision reference (fp32 export, F32 GGUF), the mean KL
divergence from the reference's distribution and how often the two agree on the top token (what
llama-perplexity --kl-divergence prints as "Same top p"); for exports also the perplexity and top-1
agreement over the whole text in one pass (what `edgeinfer export --quantize` reports). The two
engines tokenize the text themselves (their token counts are printed): compare increases and
divergences across engines, not perplexities. The GGUF side runs `llama-perplexity` from
`--llama-bin` (built from the llama-cpp-python sdist as docs/benchmarks.md shows; `--no-repack` is
passed on AMX machines, where llama.cpp's repacking crashed quantized models).

Figures are printed as JSON lines, never asserted.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

TEXTS = [Path(__file__).parents[1] / "export" / name for name in ("quality_text.txt", "held_text.txt")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="the fp32 export")
    parser.add_argument("exports", nargs="*", help="quantized exports of the same model")
    parser.add_argument("--gguf", nargs="+", default=[], help="an F32 GGUF of the same checkpoint, then quantized GGUFs")
    parser.add_argument("--llama-bin", type=Path, help="the folder holding llama-perplexity")
    parser.add_argument("--text", type=Path, action="append", help="a text to score (repeatable; default the two above)")
    args = parser.parse_args()
    if args.gguf and not args.llama_bin:
        parser.error("--gguf needs --llama-bin, the folder holding llama-perplexity")
    for text in args.text or TEXTS:
        for row in export_rows(args.reference, args.exports, text):
            print(json.dumps(row))
        if args.gguf:
            for row in gguf_rows(args.llama_bin, args.gguf, text):
                print(json.dumps(row))


def export_rows(reference_path: str, paths: list[str], text: Path):
    from edgeinfer import Engine
    from edgeinfer.export.quantize import _teacher_forced_scores

    reference = Engine.load(reference_path, provider="cpu")
    ids = reference.tokenizer.encode(text.read_text())[: reference.max_context]
    targets = np.array(ids[1:])
    top, scores = _teacher_forced_scores(reference, ids, targets)
    base = windowed_logprobs(reference, ids)
    base_ppl = _perplexity(base)
    yield _export_row(reference_path, text, ids, base, base, base_ppl, top, scores, top)
    for path in paths:
        engine = Engine.load(path, provider="cpu")
        their_top, their_scores = _teacher_forced_scores(engine, ids, targets)
        yield _export_row(path, text, ids, windowed_logprobs(engine, ids), base, base_ppl, their_top, their_scores, top)


def _export_row(path, text, ids, logprobs, base, base_ppl, top, scores, reference_top) -> dict:
    ppl = _perplexity(logprobs)
    return {
        "engine": "edgeinfer",
        "model": path,
        "text": text.name,
        "tokens": len(ids),
        "window_tokens": sum(len(q) for q, _ in logprobs) * 2,
        "weights_mib": round((Path(path) / "model.onnx.data").stat().st_size / 2**20, 1),
        "windowed_ppl": round(ppl, 3),
        "windowed_ppl_increase": round(ppl / base_ppl - 1, 4),
        "mean_kld": round(_mean_kld(logprobs, base), 5),
        "same_top": round(_same_top(logprobs, base), 4),
        "whole_text_ppl": round(float(np.exp(-scores.mean())), 3),
        "whole_text_top1": round(float(np.mean(top == reference_top)), 4),
    }


def windowed_logprobs(engine, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per window, the log-softmax [scored positions, vocabulary] in float32 of its scored half, and
    the tokens those positions predict."""
    from edgeinfer.export.quantize import leading_bos, second_half, teacher_forced_logits, windows

    out = []
    for window in windows(ids, engine.max_context, leading_bos(ids, engine.manifest)):
        logits = np.concatenate([chunk for _, chunk in teacher_forced_logits(engine, window)])
        half = second_half(logits, len(window)).astype(np.float64)
        half -= half.max(-1, keepdims=True)
        logprobs = (half - np.log(np.exp(half).sum(-1, keepdims=True))).astype(np.float32)
        out.append((logprobs, np.array(window[len(window) - len(logprobs) :])))
    return out


def _perplexity(windowed: list[tuple[np.ndarray, np.ndarray]]) -> float:
    return float(np.exp(-np.concatenate([q[np.arange(len(q)), targets] for q, targets in windowed]).mean()))


def _mean_kld(windowed, base) -> float:
    """KL(reference || model) per scored position, averaged: llama-perplexity's "Mean KLD"."""
    return float(np.mean(np.concatenate([(np.exp(b) * (b - q)).sum(-1) for (q, _), (b, _) in zip(windowed, base)])))


def _same_top(windowed, base) -> float:
    return float(np.mean(np.concatenate([q.argmax(-1) == b.argmax(-1) for (q, _), (b, _) in zip(windowed, base)])))


def gguf_rows(llama_bin: Path, ggufs: list[str], text: Path):
    """llama-perplexity on each GGUF over `text` in windows of 256, the first GGUF (F32) saving the
    logits that the others' KL divergence is measured from."""
    with tempfile.TemporaryDirectory() as scratch:
        saved = Path(scratch) / "base.kld"
        base = _llama_perplexity(llama_bin, ggufs[0], text, ["--kl-divergence-base", str(saved)])
        yield _gguf_row(ggufs[0], text, base, base["ppl"])
        for gguf in ggufs[1:]:
            yield _gguf_row(
                gguf,
                text,
                _llama_perplexity(llama_bin, gguf, text, ["--kl-divergence-base", str(saved), "--kl-divergence"]),
                base["ppl"],
            )


def _gguf_row(gguf: str, text: Path, figures: dict, base_ppl: float) -> dict:
    return {
        "engine": "llama.cpp",
        "model": gguf,
        "text": text.name,
        "window_tokens": figures["tokens"],
        "weights_mib": round(Path(gguf).stat().st_size / 2**20, 1),
        "windowed_ppl": round(figures["ppl"], 3),
        "windowed_ppl_increase": round(figures["ppl"] / base_ppl - 1, 4),
        "mean_kld": figures.get("kld", 0.0),
        "same_top": figures.get("same_top", 1.0),
    }


def _llama_perplexity(llama_bin: Path, gguf: str, text: Path, extra: list[str]) -> dict:
    command = [str(llama_bin / "llama-perplexity"), "-m", gguf, "-f", str(text), "-c", "256", "-b", "256", "-t", "2", *extra]
    if "amx" in Path("/proc/cpuinfo").read_text():
        command.append("--no-repack")
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    log = done.stdout + done.stderr
    figures = {"ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", log).group(1))} if "Final estimate" in log else {}
    if "Mean PPL(Q)" in log:
        figures["ppl"] = float(re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log).group(1))
        figures["kld"] = float(re.search(r"Mean\s+KLD:\s*([\d.]+)", log).group(1))
        figures["same_top"] = float(re.search(r"Same top p:\s*([\d.]+)", log).group(1)) / 100
    chunks = re.search(r"over (\d+) chunks, n_ctx=(\d+)", log)
    figures["tokens"] = int(chunks.group(1)) * int(chunks.group(2))  # those in whole windows
    return figures


if __name__ == "__main__":
    main()
