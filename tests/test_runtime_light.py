"""The runtime profile: loading and generating must not import torch, transformers, optimum or onnx."""
import subprocess
import sys

SCRIPT = """
import sys
from edgeinfer import Engine
engine = Engine.load(sys.argv[1], provider="cpu")
pieces = list(engine.stream_chat([{"role": "user", "content": "hi"}], max_new_tokens=8, temperature=0.8, seed=1, stop="zz"))
result = engine.generate("The capital", max_new_tokens=8)
assert len(result.token_ids) == 8 and len(pieces) >= 1, result
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "optimum", "onnx"))
print(",".join(heavy) or "none")
"""


def test_generation_imports_no_torch_transformers_optimum_or_onnx(tiny_llama):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama[1])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "none"


def test_the_shipped_logits_heads_are_the_ones_heads_builds():
    from edgeinfer.sdk import heads

    for element_type in heads.TYPES:
        for kind in ("argmax", "last"):
            assert heads.load_head(kind, element_type) == heads.head_model(kind, element_type), (kind, element_type)
