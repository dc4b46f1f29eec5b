"""A copy of a checkpoint's first layers exported as a streamed export's check copy is (fp32, fused),
and its greedy tokens against transformers' on the same copy: for a model too large to run whole
in PyTorch on this machine.

    python benchmarks/truncated_tokens.py CHECKPOINT [--layers 2] [--tokens 16]

Prints the two token lists, whether they are equal, and the largest logits difference the export
measured."""

import argparse
import tempfile
from pathlib import Path

import torch

from edgeinfer.export import ExportOptions, export_model
from edgeinfer.export.source import Source, load_model
from edgeinfer.sdk import Engine

PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]  # fixed ids, all below every vocabulary here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="truncated-")) / "export"
    manifest = export_model(str(args.checkpoint), out, ExportOptions(layers=args.layers, stream=False), print)
    ours = Engine.load(out).generate(PROMPT, max_new_tokens=args.tokens, ignore_eos=True).token_ids
    model, _ = load_model(Source("copy", str(args.checkpoint)), with_tokenizer=False, layers=args.layers)
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, eos_token_id=None
        )[0, len(PROMPT) :].tolist()
    print(f"edgeinfer    {ours}")
    print(f"transformers {theirs}")
    validation = manifest.validation
    print(
        f"first {args.layers} layers: {args.tokens} greedy tokens {'equal' if ours == theirs else 'DIFFER'}; largest logits "
        f"difference {max(validation['max_abs_diff_prefill'], validation['max_abs_diff_decode']):.2e} (tolerance {validation['tolerance']:.2e})"
    )


if __name__ == "__main__":
    main()
