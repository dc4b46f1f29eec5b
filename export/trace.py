"""Tracing a transformers 5 causal LM into one ONNX graph with torch.onnx's TorchScript exporter.

transformers 5 takes the KV cache as a `Cache` object, which a traced graph cannot take: the graph
is traced through `Decoder`, a module of plain tensors that builds the cache from them. Its inputs
and outputs are named as optimum-onnx named them, which the rest of export and the runtime read:

    input_ids [batch, sequence], attention_mask [batch, past + sequence], position_ids [batch, sequence]
    (where the model's forward takes them), past_key_values.{layer}.key / .value -> logits [batch,
    sequence, vocab], present.{layer}.key / .value

Each layer's cache shape is read off what the model itself caches for a short prompt, so a family
needs no table of its own: multi-query or expanded heads, keys and values of different widths
(multi-head latent attention) all come out as the model makes them.

Every layer gets a cache that keeps all its tokens. Sliding-window layers still attend within their
window, through the attention mask transformers builds from the layer types; a cache that stops at
the window is the runtime's business (the manifest's attention window), not the traced graph's.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager
from pathlib import Path

from .patches import constant_repeat_interleave, traceable_falcon_alibi

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
OPSET = 14  # the opset optimum-onnx exported decoders with: the patterns export/attention_pattern.py reads were found in it
# The dummy inputs' sizes: all different, so that the tracer cannot mistake one axis for another.
_BATCH, _PAST, _NEW = 2, 3, 5
_AXES = {
    "batch": "batch_size",
    "new": "sequence_length",
    "past": "past_sequence_length",
    "total": "past_sequence_length + sequence_length",
}
# transformers' expert layers (mixture of experts): the implementation a trace can take. The
# default (grouped_mm) counts tokens per expert with torch.histc, which ONNX has no op for; this one
# gathers each token's experts' weights and multiplies them in one batched MatMul.
_TRACEABLE_EXPERTS = "batched_mm"


def cache_names(layers: int) -> tuple[list[str], list[str]]:
    """The past inputs' and present outputs' names, key then value for each layer."""
    past = [f"{PAST_PREFIX}{layer}.{kind}" for layer in range(layers) for kind in ("key", "value")]
    return past, [PRESENT_PREFIX + name[len(PAST_PREFIX) :] for name in past]


def takes_positions(model) -> bool:
    return "position_ids" in inspect.signature(model.forward).parameters


def trace(model, path: Path) -> None:
    """Trace `model` into the ONNX file `path` (its weights as torch.onnx writes them)."""
    import torch

    ids = _dummy_ids(model.config.get_text_config().vocab_size, _PAST + _NEW)
    with torch.no_grad(), traceable_experts(model.config):
        past = _cache_tensors(model(input_ids=ids[:, :_PAST], use_cache=True).cache)
    decoder = Decoder(model, len(past) // 2).eval()
    inputs = {"input_ids": ids[:, _PAST:], "attention_mask": torch.ones(_BATCH, _PAST + _NEW, dtype=torch.int64)}
    if decoder.positions:
        inputs["position_ids"] = torch.arange(_PAST, _PAST + _NEW).expand(_BATCH, _NEW).contiguous()
    past_names, present_names = cache_names(len(past) // 2)
    axes = {
        "input_ids": {0: _AXES["batch"], 1: _AXES["new"]},
        "attention_mask": {0: _AXES["batch"], 1: _AXES["total"]},
        "position_ids": {0: _AXES["batch"], 1: _AXES["new"]},
        "logits": {0: _AXES["batch"], 1: _AXES["new"]},
        **{name: {0: _AXES["batch"], 2: _AXES["past"]} for name in past_names},
        **{name: {0: _AXES["batch"], 2: _AXES["total"]} for name in present_names},
    }
    names = [*inputs, *past_names]
    with warnings.catch_warnings(), traceable_experts(model.config), constant_repeat_interleave(), traceable_falcon_alibi():
        # The tracer's warnings about Python-side shape checks are expected for these models;
        # export's validation stage is the real check of the graph.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            decoder,
            (*inputs.values(), *past),
            str(path),
            dynamo=False,
            input_names=names,
            output_names=["logits", *present_names],
            dynamic_axes={name: axes[name] for name in (*names, "logits", *present_names)},
            opset_version=OPSET,
            do_constant_folding=True,
        )


def trace_hidden(base, path: Path) -> None:
    """Trace `base` (a model without its lm_head) into `path`: input_ids, attention_mask (and
    position_ids where it takes them) -> last_hidden_state [batch, sequence, hidden], no cache."""
    import torch

    ids = _dummy_ids(base.config.vocab_size, _NEW)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(_BATCH, _NEW, dtype=torch.int64)}
    if takes_positions(base):
        inputs["position_ids"] = torch.arange(_NEW).expand(_BATCH, _NEW).contiguous()
    with warnings.catch_warnings(), traceable_experts(base.config), constant_repeat_interleave():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Hidden(base, list(inputs)).eval(),
            tuple(inputs.values()),
            str(path),
            dynamo=False,
            input_names=list(inputs),
            output_names=["last_hidden_state"],
            dynamic_axes={name: {0: _AXES["batch"], 1: _AXES["new"]} for name in (*inputs, "last_hidden_state")},
            opset_version=OPSET,
        )


def _dummy_ids(vocab_size: int, length: int):
    """Token ids to trace with: the same every time (a trace depends on nothing random)."""
    import torch

    return torch.randint(3, max(4, vocab_size), (_BATCH, length), generator=torch.Generator().manual_seed(0))


def _cache_tensors(cache) -> list:
    """Each caching layer's keys and values. Layers that read another layer's cache (Gemma 4's KV
    sharing: always the last ones) hold none, and are left out."""
    return [tensor for layer in cache.layers if layer.keys is not None for tensor in (layer.keys, layer.values)]


def full_length_cache(past):
    """A transformers cache holding `past` (key, value, key, value, ... per layer) in layers that
    keep every token. Built without `update`, whose first concatenation is with an empty tensor of
    another rank, which ONNX's Concat does not take."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache()
    for keys, values in zip(past[0::2], past[1::2]):
        layer = DynamicLayer()
        layer.keys, layer.values, layer.device, layer.is_initialized = keys, values, keys.device, True
        cache.layers.append(layer)
    return cache


def _decoder_class():
    import torch

    class Decoder(torch.nn.Module):
        """The model as a function of plain tensors: (input_ids, attention_mask[, position_ids],
        past...) -> (logits, present...)."""

        def __init__(self, model, layers: int):
            super().__init__()
            self.model, self.layers, self.positions = model, layers, takes_positions(model)

        def forward(self, input_ids, attention_mask, *rest):
            positions = {"position_ids": rest[0]} if self.positions else {}
            past = rest[1:] if self.positions else rest
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, cache=full_length_cache(past), use_cache=True, **positions
            )
            return out.logits, *_cache_tensors(out.cache)

    return Decoder


def _hidden_class():
    import torch

    class Hidden(torch.nn.Module):
        """The base model's last hidden state as a function of plain tensors, no cache."""

        def __init__(self, base, names: list[str]):
            super().__init__()
            self.base, self.names = base, names

        def forward(self, *inputs):
            return self.base(**dict(zip(self.names, inputs)), use_cache=False).last_hidden_state

    return Hidden


def Hidden(base, names: list[str]):  # noqa: N802 - builds the class on first use: torch is imported late
    return _hidden_class()(base, names)


def Decoder(model, layers: int):  # noqa: N802 - builds the class on first use: torch is imported late
    return _decoder_class()(model, layers)


@contextmanager
def traceable_experts(config):
    """The model's expert layers (if any) run transformers' traceable implementation meanwhile."""
    if not hasattr(config, "_experts_implementation"):
        yield
        return
    before = config._experts_implementation
    config._experts_implementation = _TRACEABLE_EXPERTS
    try:
        yield
    finally:
        config._experts_implementation = before
