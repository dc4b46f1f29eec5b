"""A random-weight bf16 checkpoint of a real model's shape, for export benchmarks at size: the tensor
names and shapes come from the model built on the meta device (no memory), and the weights are
written shard by shard, so no more than one shard (2 GiB) is ever in memory.

    python benchmarks/random_checkpoint.py SHAPE OUT [--layers N]

SHAPE is one of SHAPES below; --layers keeps the first N layers (a copy small enough to hold in
PyTorch, for checking tokens against transformers). Weights are normal with standard deviation 0.02,
norms are ones; the tokenizer is the tests' tiny one (its ids fit every vocabulary here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = {
    # Llama-3.2-1B's layers with a 49,152-token vocabulary, tied: 1.07B weights (issue 46's 1B model)
    "llama-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # a Qwen 3.5-shaped hybrid of about 0.75B weights: 18 gated DeltaNet layers and 6 of full
    # attention (every fourth), Qwen 3.5's 248,320-token vocabulary, tied
    "qwen3_5-0.8b": dict(
        model_type="qwen3_5_text",
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        vocab_size=248320,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    # its full-attention counterpart of about the same size (0.73B): 28 layers of Qwen 3's attention
    "qwen3-0.8b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=248320,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    # Granite-4.0-H-1B's published shape: 36 Mamba-2 layers and 4 of attention (NoPE), a shared
    # MLP in every layer, a 100,352-token vocabulary, tied: 1.46B weights
    "granite-4.0-h-1b": dict(
        model_type="granitemoehybrid",
        hidden_size=1536,
        intermediate_size=4096,
        shared_intermediate_size=4096,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=40,
        num_attention_heads=12,
        num_key_value_heads=4,
        mamba_n_heads=48,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        position_embedding_type="nope",
        layer_types=(["mamba"] * 5 + ["attention"]) + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4,
        vocab_size=100352,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    # its full-attention counterpart of about the same size (1.46B): Llama layers of its width, heads
    # and MLP, 52 of them
    "llama-1.5b": dict(
        model_type="llama",
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=52,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=100352,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    # Qwen2.5-1.5B-Instruct's published shape (qwen2): untied embeddings, a 151,936-token vocabulary,
    # biases on q, k and v: 1.54B weights
    "qwen2-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
    # Llama-3.1-8B: 8.03B weights
    "llama-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
}
SHARD_BYTES = 2 * 2**30


def write(shape: str, out: Path, layers: int | None = None) -> int:
    """Write the checkpoint into `out`; returns its number of weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(SHAPES[shape])
    if layers:
        settings["num_hidden_layers"] = layers
    config = AutoConfig.for_model(settings.pop("model_type"), **settings, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [type(model).__name__]  # what other builders (onnxruntime-genai's) read
    config.save_pretrained(out)
    generator, shard, size, index, total = torch.Generator().manual_seed(0), {}, 0, {}, 0
    for name, meta in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shard[name] = _random(tuple(meta.shape), "norm" in name, generator)
        size, total = size + shard[name].numel() * 2, total + shard[name].numel()
        if size >= SHARD_BYTES:
            _save(shard, out, index)
            shard, size = {}, 0
    if shard:
        _save(shard, out, index)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * total}, "weight_map": index}, indent=1)
    )
    _tokenizer(out)
    return total


def _save(shard: dict, out: Path, index: dict) -> None:
    """Write one shard and note where its tensors are."""
    from safetensors.torch import save_file

    file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
    save_file(shard, str(out / file), metadata={"format": "pt"})
    index.update(dict.fromkeys(shard, file))


def _random(shape: tuple, is_norm: bool, generator):
    import torch

    if is_norm:
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def _tokenizer(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import build_tokenizer

    build_tokenizer().save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    total = write(args.shape, args.out, args.layers)
    print(f"{args.out}: {total / 1e9:.2f}B weights, {2 * total / 2**30:.2f} GiB of bf16")


if __name__ == "__main__":
    main()
