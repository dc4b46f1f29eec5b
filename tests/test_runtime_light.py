"""The runtime profile: loading, generating and constrained decoding, and the CLI's module (which
reads the quantization algorithms' names), must not import torch, transformers, optimum or onnx."""

import json
import subprocess
import sys

SCRIPT = """
import importlib, json, sys
from edgeinfer import Engine
cli = importlib.import_module("edgeinfer.cli.main")
assert list(cli.ALGORITHMS) == ["rtn", "k_quant", "gptq", "hqq"]  # --algorithm's choices, from export/algorithms.py
engine = Engine.load(sys.argv[1], provider="cpu")
chat = [t for p in engine.stream_chat([{"role": "user", "content": "hi"}], max_new_tokens=8, temperature=0.8, seed=1) for t in p.token_ids]
greedy = engine.generate("The capital", max_new_tokens=8).token_ids
choice = engine.generate("The capital", temperature=1.0, seed=2, choice=["Paris", "Rome"]).text
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "optimum", "onnx"))
print(json.dumps({"greedy": greedy, "chat": chat, "choice": choice, "heavy": heavy}))
"""


def test_generation_imports_no_torch_transformers_optimum_or_onnx(tiny_llama):
    """The light process gives transformers' greedy tokens, and the sampled chat tokens of the same
    seed in this process, while importing none of the heavy packages."""
    from test_tiny_llama import hf_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeinfer import Engine

    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama[1])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    light = json.loads(done.stdout)
    assert light["heavy"] == []
    assert light["choice"] in ("Paris", "Rome")  # constrained decoding (llguidance) in the light runtime too
    model = AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()
    assert light["greedy"] == hf_greedy(model, AutoTokenizer.from_pretrained(tiny_llama[0])("The capital").input_ids, 8)
    engine = Engine.load(tiny_llama[1], provider="cpu")
    messages = [{"role": "user", "content": "hi"}]
    assert light["chat"] == engine.generate(engine.chat_prompt(messages), max_new_tokens=8, temperature=0.8, seed=1).token_ids


def test_the_shipped_logits_heads_are_the_ones_heads_builds():
    from edgeinfer.sdk import heads

    for element_type in heads.TYPES:
        for kind in ("argmax", "last", "tokens", "copy"):
            assert heads.load_head(kind, element_type) == heads.head_model(kind, element_type), (kind, element_type)
