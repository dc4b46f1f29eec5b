"""Soak: many generations in one process, and the resident memory at the start and the end.

    python benchmarks/soak.py [--tiny 1000] [--default 100] [--model DIR|NAME] [--json FILE]

Runs `--tiny` generations on a tiny random llama (built and exported here; needs the export
extra) and `--default` on MODEL (default: the catalog's default model, exported into the cache
on first use). The generations cycle through prompts of different lengths, greedy and seeded
sampling, streaming, and batches of three. RSS is read after loading, after the warm-up (the
first tenth of the runs) and at the end; growth is the end against the warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from edgeinfer import Engine

WORDS = "edge boxes run small language models on the cpu and the gpu through onnx runtime".split()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no /proc/self/status: the soak reads RSS on Linux")


def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


def one_run(engine: Engine, i: int, lengths: tuple[int, ...], new_tokens: int) -> int:
    """Generation `i` of the cycle; returns the tokens it made."""
    text = prompt(i, lengths[i % len(lengths)])
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {}
    kind = i % 4
    if kind == 0:
        return len(engine.generate(text, max_new_tokens=new_tokens, **sampling).token_ids)
    if kind == 1:
        return sum(len(p.token_ids) for p in engine.stream(text, max_new_tokens=new_tokens, **sampling))
    if kind == 2:
        rows = engine.generate_batch([text, prompt(i + 1, 3), prompt(i + 2, lengths[0])], max_new_tokens=new_tokens, **sampling)
        return sum(len(r.token_ids) for r in rows)
    stream = engine.stream(text, max_new_tokens=new_tokens, **sampling)  # an app that stops reading early
    made = len(next(stream).token_ids)
    stream.close()
    return made


def soak(engine: Engine, runs: int, lengths: tuple[int, ...], new_tokens: int, label: str) -> dict:
    start_rss = rss_mib()
    warm_up = max(1, runs // 10)
    tokens, began = 0, time.perf_counter()
    for i in range(runs):
        tokens += one_run(engine, i, lengths, new_tokens)
        if i + 1 == warm_up:
            gc.collect()
            warm_rss = rss_mib()
    gc.collect()
    end_rss = rss_mib()
    figures = {
        "runs": runs,
        "tokens": tokens,
        "seconds": round(time.perf_counter() - began, 1),
        "rss_after_load_mib": round(start_rss, 1),
        "rss_after_warm_up_mib": round(warm_rss, 1),
        "rss_end_mib": round(end_rss, 1),
        "growth_after_warm_up_pct": round(100 * (end_rss / warm_rss - 1), 2),
    }
    print(
        f"{label}: {runs} generations ({tokens} tokens) in {figures['seconds']} s; RSS after load {start_rss:.1f} MiB, "
        f"after warm-up ({warm_up} runs) {warm_rss:.1f} MiB, at the end {end_rss:.1f} MiB: "
        f"{figures['growth_after_warm_up_pct']:+.2f}% after warm-up",
        flush=True,
    )
    return figures


def tiny_export(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from edgeinfer.export import export_model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        [" ".join(WORDS)] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder / "hf")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder / "hf")
    export_model(str(folder / "hf"), folder / "export")
    return folder / "export"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", type=int, default=1000)
    parser.add_argument("--default", type=int, default=100)
    parser.add_argument("--model", default=None, help="export folder or catalog name for the --default runs")
    parser.add_argument("--json", default="soak.json")
    args = parser.parse_args()
    results = {}
    if args.tiny:
        with tempfile.TemporaryDirectory() as folder:
            engine = Engine.load(tiny_export(Path(folder)), provider="cpu")
            results["tiny"] = soak(engine, args.tiny, (4, 40, 120), 24, "tiny llama")
            del engine
    if args.default:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from edgeinfer.cli.resolve import resolve_export

        engine = Engine.load(resolve_export(args.model, lambda message: print(message, file=sys.stderr)), provider="cpu")
        results["default"] = soak(engine, args.default, (8, 100, 400), 32, engine.manifest.source)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
