"""Next-token quality of quantized exports against their fp32 export, over export's quality text
(export/quality_text.txt, about 1,200 tokens): top-1 agreement, perplexity over the whole text,
and perplexity llama-perplexity's way (windows of 256 tokens from an empty cache, each scored on
its second half), the figure to set beside a GGUF's `llama-perplexity` over the same text.

    python benchmarks/quality.py FP32_EXPORT QUANTIZED_EXPORT [QUANTIZED_EXPORT ...]

Figures are printed, never asserted. (The llama.cpp side, llama-perplexity on a Q4_K_M GGUF of the
same checkpoint, is not in this script yet.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference")
    parser.add_argument("exports", nargs="+")
    args = parser.parse_args()
    import numpy as np

    from edgeinfer import Engine
    from edgeinfer.export.quantize import QUALITY_TEXT, _teacher_forced_scores, windowed_scores

    reference = Engine.load(args.reference, provider="cpu")
    ids = reference.tokenizer.encode(QUALITY_TEXT.read_text())[: reference.max_context]
    targets = np.array(ids[1:])
    top, scores = _teacher_forced_scores(reference, ids, targets)
    windowed = windowed_scores(reference, ids)
    print(f"fp32: perplexity {np.exp(-scores.mean()):.3f}, windowed {np.exp(-windowed.mean()):.3f}, {len(ids)} tokens")
    for path in args.exports:
        engine = Engine.load(path, provider="cpu")
        their_top, their_scores = _teacher_forced_scores(engine, ids, targets)
        their_windowed = windowed_scores(engine, ids)
        row = {
            "export": path,
            "weights_mib": round((Path(path) / "model.onnx.data").stat().st_size / 2**20, 1),
            "top1_agreement": round(float(np.mean(their_top == top)), 4),
            "perplexity": round(float(np.exp(-their_scores.mean())), 3),
            "perplexity_windowed": round(float(np.exp(-their_windowed.mean())), 3),
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
