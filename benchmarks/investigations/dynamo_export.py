"""Does PyTorch's dynamo ONNX exporter take transformers 5's causal LMs as they are? Each model type
given is built tiny from its transformers config (2 layers, hidden size 64, random weights), wrapped
in a module whose inputs are the flat tensors a decoder graph takes (input_ids, attention_mask,
and each layer's past keys and values, from which the wrapper builds transformers' DynamicCache),
exported with `torch.onnx.export(dynamo=True)` with dynamic batch, sequence and past lengths, and
run by ONNX Runtime's CPU provider over 5 new tokens after 3 cached ones, against the wrapper's
own logits in PyTorch.

It runs in the project's environment with the export extra (transformers 5):

    python benchmarks/investigations/dynamo_export.py llama gemma3_text qwen3

Prints, per model type, the export's seconds and the largest logits difference. Figures, never
asserted; what it printed is in docs/export.md ("Towards transformers 5").

transformers 5 takes the cache as a Cache object, which torch.export's
dynamic_shapes cannot name: hence the wrapper. It gives every layer keys of one width, so model
types whose layers differ (gemma4's two widths, qwen3_5's recurrent state) are out of its reach.
"""

from __future__ import annotations

import argparse
import time

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from mobius_hybrid import SMALL as TINY  # noqa: E402 - the same tiny sizes

SMALL = {**TINY, "num_hidden_layers": 2}


def flat(model):
    """`model` as a module of plain tensors: (input_ids, attention_mask, [k0, v0, k1, v1, ...]) to
    (logits, present k0, v0, ...)."""
    import torch
    from transformers.cache_utils import DynamicCache

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, past):
            cache = DynamicCache(config=self.model.config)
            for layer in range(len(past) // 2):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True)
            return out.logits, *[t for layer in out.cache.layers for t in (layer.keys, layer.values)]

    return Flat()


def export(family: str, folder: str) -> str:
    import onnxruntime as ort
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SMALL)).eval()
    cached, new = 3, 5
    past = [torch.randn(1, SMALL["num_key_value_heads"], cached, SMALL["head_dim"]) for _ in range(2 * SMALL["num_hidden_layers"])]
    ids, mask = torch.randint(3, 300, (1, new)), torch.ones(1, cached + new, dtype=torch.long)
    batch, seq, total, past_len = (torch.export.Dim(n) for n in ("batch", "seq", "total", "past"))
    names = ["input_ids", "attention_mask", *[f"past.{i // 2}.{'kv'[i % 2]}" for i in range(len(past))]]
    path, start = f"{folder}/{family}.onnx", time.perf_counter()
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: total}, [{0: batch, 2: past_len}] * len(past))
    torch.onnx.export(flat(model), (ids, mask, past), f=path, dynamo=True, dynamic_shapes=dynamic, input_names=names)
    seconds = time.perf_counter() - start
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    given = dict(zip(names, [ids.numpy(), mask.numpy(), *[p.numpy() for p in past]]))
    ours = session.run(None, {i.name: given[i.name] for i in session.get_inputs()})[0]
    with torch.no_grad():
        reference = flat(model)(ids, mask, past)[0].numpy()
    return f"exported in {seconds:.1f} s; largest difference {np.abs(ours - reference).max():.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="+", metavar="MODEL_TYPE")
    parser.add_argument("--folder", default="/tmp")
    args = parser.parse_args()
    for family in args.families:
        try:
            print(f"{family}: {export(family, args.folder)}")
        except Exception as e:  # noqa: BLE001 - a survey: whatever fails, says so and goes on to the next type
            print(f"{family}: {type(e).__name__}: {repr(e.__cause__ or e)[:200]}")


if __name__ == "__main__":
    main()
