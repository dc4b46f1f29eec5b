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
the window is the fused graph's (export/attention.py: the manifest's `kv.windows`), not the traced one's.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

from edgeinfer.sdk.errors import ExportError

from .families import family
from .patches import constant_repeat_interleave, missing_symbolics

STATE_KINDS = ("conv", "recurrent")  # a linear-attention layer's state (export/linear_attention.py)


def is_state(name: str) -> bool:
    """Whether a cache tensor's name is a state's: its kind conv or recurrent, a layer's second and
    later convolution states numbered (`conv1`, Inkling's four per layer)."""
    return name.rsplit(".", 1)[-1].rstrip("0123456789") in STATE_KINDS


def _conv_kind(index: int) -> str:
    return "conv" if index == 0 else f"conv{index}"


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


def cache_names(kinds: list[tuple[str, ...]]) -> tuple[list[str], list[str]]:
    """The past inputs' and present outputs' names: for each cached layer, its tensors' kinds
    (key and value; a linear-attention layer's conv and recurrent state)."""
    past = [f"{PAST_PREFIX}{layer}.{kind}" for layer, names in enumerate(kinds) for kind in names]
    return past, [PRESENT_PREFIX + name[len(PAST_PREFIX) :] for name in past]


def takes_positions(model) -> bool:
    return "position_ids" in inspect.signature(model.forward).parameters


def trace(model, path: Path) -> None:
    """Trace `model` into the ONNX file `path` (its weights as torch.onnx writes them). A
    vision-language model's graph also takes `image_features` [image tokens, hidden]: the features
    of the image tokens among `input_ids`, in their order (row by row), put in their place."""
    import torch

    text = model.config.get_text_config()
    ids = _dummy_ids(text.vocab_size, _PAST + _NEW)
    record = family(model.config.model_type)
    if record.prepare is not None:
        record.prepare(model)
    prompt, prompt_cache = _prompted(model, ids[:, :_PAST], record)
    kinds, past = _cache_tensors(prompt_cache, record.conv_state_whole or record.prompt_patched)
    # the head's width: the vocabulary, or fewer rows where a checkpoint pads its table (Inkling 2's)
    logits_width = prompt.logits.shape[-1]
    if record.scan_state_transposed:
        past = _transposed_states(kinds, past)
    image_token = model.config.image_token_id if record.vision is not None else None
    cache_class = type(prompt_cache) if record.own_cache else None
    decoder = Decoder(model, kinds, image_token, record.images_attend_both_ways, cache_class).eval()
    inputs = {"input_ids": ids[:, _PAST:]}
    if image_token is not None:
        inputs["image_features"] = torch.randn(_PAST, text.hidden_size, generator=torch.Generator().manual_seed(0))
    inputs["attention_mask"] = torch.ones(_BATCH, _PAST + _NEW, dtype=torch.int64)
    rotary_3d = record.rotary_3d  # position_ids [3, batch, sequence]: time, row, column
    if decoder.positions:
        shape = (3, _BATCH, _NEW) if rotary_3d else (_BATCH, _NEW)
        inputs["position_ids"] = torch.arange(_PAST, _PAST + _NEW).expand(shape).contiguous()
    past_names, present_names = cache_names(kinds)
    axes = _dynamic_axes(past_names, present_names, rotary_3d)
    names = [*inputs, *past_names]
    with (
        warnings.catch_warnings(),
        traceable_experts(model.config),
        constant_repeat_interleave(),
        missing_symbolics(),
        ExitStack() as patched,
    ):
        for patch in record.patches:
            patched.enter_context(patch())
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
    _outputs_shaped(path, logits_width)


def _dynamic_axes(past_names: list[str], present_names: list[str], rotary_3d: bool) -> dict:
    """Each graph input's and output's axes that vary, by name."""
    return {
        "input_ids": {0: _AXES["batch"], 1: _AXES["new"]},
        "image_features": {0: "image_tokens"},
        "attention_mask": {0: _AXES["batch"], 1: _AXES["total"]},
        "position_ids": {int(rotary_3d): _AXES["batch"], 1 + rotary_3d: _AXES["new"]},
        "logits": {0: _AXES["batch"], 1: _AXES["new"]},
        **{name: _cache_axes(name, _AXES["past"]) for name in past_names},
        **{name: _cache_axes(name, _AXES["total"]) for name in present_names},
    }


def _prompted(model, ids, record):
    """The model's outputs for the dummy prompt `ids`, and the cache it filled: transformers' own
    forwards, or (`record.prompt_patched`) the family's patched ones on a cache made here, which
    then holds the states as the ops keep them. A model that keeps no cache is refused."""
    import torch
    from transformers.cache_utils import DynamicCache

    with torch.no_grad(), traceable_experts(model.config), ExitStack() as patched:
        if record.prompt_patched:
            for patch in record.patches:
                patched.enter_context(patch())
            cache = DynamicCache(config=model.config)
            return model(input_ids=ids, use_cache=True, cache=cache), cache
        prompt = model(input_ids=ids, use_cache=True)
    if getattr(prompt, "cache", None) is None:
        why = (
            'it runs with a cache only as a decoder: set "is_decoder": true in its config.json'
            if getattr(model.config, "is_decoder", None) is False
            else "transformers' model of this family has none (each step reads the whole text again)"
        )
        raise ExportError(f"this {model.config.model_type} model keeps no cache for a prompt, which edgeinfer's graphs need: {why}")
    return prompt, prompt.cache


def _outputs_shaped(path: Path, vocab_size: int) -> None:
    """Give the outputs the shapes they have: the tracer sometimes names a static axis it could not
    follow (LFM 3's, as `Concatpresent.1.value_dim_1`), which ONNX Runtime sees as the size it is.
    Each present output takes its past input's sizes (the sequence axis of keys and values
    excepted), the logits [batch, sequence, vocabulary]."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)  # the weights are held apart, or in their file
    graph = model.graph
    pasts = {i.name: i.type.tensor_type.shape.dim for i in graph.input if i.name.startswith(PAST_PREFIX)}
    for output in graph.output:
        dims = output.type.tensor_type.shape.dim
        if output.name == "logits":
            dims[2].Clear()
            dims[2].dim_value = vocab_size
        for dim, given in zip(dims, pasts.get(PAST_PREFIX + output.name[len(PRESENT_PREFIX) :], [])):
            if given.HasField("dim_value"):
                dim.Clear()
                dim.dim_value = given.dim_value
    onnx.save(model, str(path))


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


def _cache_axes(name: str, length: str) -> dict[int, str]:
    """A cache tensor's dynamic axes: keys and values grow along axis 2; a state has a fixed size."""
    return {0: _AXES["batch"]} if is_state(name) else {0: _AXES["batch"], 2: length}


def _cache_tensors(cache, conv_state_whole: bool = False) -> tuple[list[tuple[str, ...]], list]:
    """Each cached layer's tensor kinds and its tensors, in order, from the cache transformers
    filled for a prompt: a linear-attention layer's convolution state there holds the kernel's K
    inputs, the op's K - 1 (all K where the family's own convolutions read them,
    `conv_state_whole`). A layer with no cache of its own (an MLP or experts layer between others,
    Nemotron-H's) is kept, holding nothing; the last layers that read another layer's cache (Gemma
    4's KV sharing) are left out."""
    kinds, tensors = [], []
    own = getattr(cache, "linear_cache", [])  # MiniMax's cache keeps its linear layers' states apart
    for index in range(max(len(cache.layers), len(own))):
        names, values = _layer_tensors(cache.layers[index]) if index < len(cache.layers) else ((), ())
        if index < len(own) and hasattr(own[index], "shape"):
            names, values = (*names, "recurrent"), (*values, own[index])
        kinds.append(names)
        tensors += [
            value[..., 1:] if name.startswith("conv") and not conv_state_whole else value for name, value in zip(names, values)
        ]
    while kinds and not kinds[-1]:
        kinds.pop()
    return kinds, tensors


def _transposed_states(kinds: list[tuple[str, ...]], past: list) -> list:
    """`past` with each recurrent state's last two axes swapped (a selective scan's [batch, heads,
    head size, state size] as LinearAttention keeps it, [batch, heads, state size, head size])."""
    names = [name for layer in kinds for name in layer]
    return [t.transpose(-1, -2).contiguous() if name == "recurrent" else t for name, t in zip(names, past)]


def full_length_cache(past, kinds, cache_class=None):
    """A transformers cache holding `past` (each layer's tensors, of `kinds`): attention layers
    that keep every token, linear-attention layers holding their state, layers with both, and
    layers with none. Built without `update`, whose first concatenation is with an empty tensor of
    another rank, which ONNX's Concat does not take. `cache_class`: a DynamicCache of the model's
    own (MiniMax's, which its model requires), else DynamicCache."""
    from transformers.cache_utils import DynamicCache

    cache, tensors = (cache_class or DynamicCache)(), iter(past)
    for names in kinds:
        cache.layers.append(_cache_layer(dict(zip(names, tensors))))
    return cache


def _cache_layer(tensors: dict):
    """One layer of the cache: keys and values, a convolution and recurrent state, both, or none."""
    from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

    if not tensors:
        return DummyLayer()
    if "conv" in tensors or "recurrent" in tensors:
        layer = LinearAttentionAndFullAttentionLayer() if "key" in tensors else LinearAttentionLayer()
        convs = [tensors[kind] for kind in map(_conv_kind, range(len(tensors))) if kind in tensors]
        states = max(1, len(convs))
        # a short convolution's layer has no recurrent state; a linear attention's may have no convolution
        layer.conv_states = {i: convs[i] if i < len(convs) else None for i in range(states)}
        layer.recurrent_states = {i: tensors.get("recurrent") if i == 0 else None for i in range(states)}
        layer.has_previous_state = dict.fromkeys(range(states), True)
        _assign_states_in_updates(layer)
    else:
        layer = DynamicLayer()
    if "key" in tensors:
        layer.keys, layer.values, layer.device, layer.is_initialized = tensors["key"], tensors["value"], tensors["key"].device, True
    return layer


def _assign_states_in_updates(layer) -> None:
    """Make the layer's state updates assign the new state instead of copying into the old one in
    place (transformers' `copy_`, which a trace of the cache's inputs cannot follow): a family whose
    own code updates its states (ZAYA's) then gives the new states as the pass's outputs."""

    def update_conv_state(conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
        full = torch.cat([layer.conv_states[state_idx], conv_states], dim=-1)
        layer.conv_states[state_idx] = full[..., -layer.conv_states[state_idx].shape[-1] :]
        return full

    def update_recurrent_state(recurrent_states, state_idx=0, **kwargs):
        layer.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    import torch

    layer.update_conv_state, layer.update_recurrent_state = update_conv_state, update_recurrent_state


def _decoder_class():
    import torch

    class Decoder(torch.nn.Module):
        """The model as a function of plain tensors: (input_ids[, image_features], attention_mask[,
        position_ids], past...) -> (logits, present...)."""

        def __init__(self, model, kinds: list, image_token: int | None = None, blocks: bool = False, cache_class=None):
            super().__init__()
            self.model, self.kinds, self.positions, self.image_token = model, kinds, takes_positions(model), image_token
            self.blocks, self.cache_class = blocks, cache_class

        def forward(self, input_ids, *rest):
            tokens = {"input_ids": input_ids}
            if self.image_token is not None:
                tokens = {"inputs_embeds": self._with_images(input_ids, rest[0])}
                rest = rest[1:]
            attention_mask, rest = rest[0], rest[1:]
            positions = {"position_ids": rest[0]} if self.positions else {}
            past = rest[1:] if self.positions else rest
            cache = full_length_cache(past, self.kinds, self.cache_class)
            mask = (
                self._block_masks(input_ids, tokens["inputs_embeds"], attention_mask, cache, positions)
                if self.blocks
                else attention_mask
            )
            out = self.model(**tokens, attention_mask=mask, cache=cache, use_cache=True, **positions)
            return out.logits, *_present(cache)  # the cache passed in, filled (not every output carries it)

        def _block_masks(self, input_ids, embeds, attention_mask, cache, positions) -> dict:
            """The causal masks (full and sliding) with each run of image tokens among the pass's
            own tokens a block that attends to itself both ways, as transformers builds them from
            token_type_ids. The past's tokens are all before the pass's, so the causal part
            already lets a picture's later tokens see its earlier ones there: a picture split
            between the past and the pass is right wherever its first part was prefilled whole."""
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            is_image = input_ids == self.image_token
            starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
            groups = torch.where(is_image, starts.to(torch.int64).cumsum(1) - 1, -1)
            past = groups.new_full((groups.shape[0], attention_mask.shape[1] - groups.shape[1]), -1)
            text = self.model.config.get_text_config()
            masks = {"config": text, "inputs_embeds": embeds, "attention_mask": attention_mask, "cache": cache}
            masks.update(position_ids=positions.get("position_ids"), block_sequence_ids=torch.cat([past, groups], 1))
            built = {"full_attention": create_causal_mask(**masks)}
            if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
                built["sliding_attention"] = create_sliding_window_causal_mask(**masks)
            return built

        def _with_images(self, input_ids, features):
            """The token embeddings, the k-th image token's replaced by the k-th row of `features`
            (a gather, not masked_scatter: it exports to plain ONNX ops, and takes no rows at all)."""
            embeds = self.model.get_input_embeddings()(input_ids)
            is_image = input_ids == self.image_token
            order = (is_image.reshape(-1).to(torch.int64).cumsum(0) - 1).clamp(min=0).reshape(input_ids.shape)
            rows = torch.cat([features.to(embeds.dtype), embeds.new_zeros(1, embeds.shape[-1])])
            return torch.where(is_image.unsqueeze(-1), rows[order], embeds)

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


def _present(cache) -> list:
    """The cache's tensors after the pass, in `_cache_tensors`'s order (a state as it is kept)."""
    return [t for layer in cache.layers for t in _layer_tensors(layer)[1]]


def _layer_tensors(layer) -> tuple[tuple[str, ...], tuple]:
    """A cache layer's tensor kinds and tensors: keys and values; a linear-attention layer's
    convolution and recurrent state (a short convolution's, the first alone); both where a layer
    runs attention and a mixer side by side (Falcon-H1's); none for a layer without a cache."""
    kinds, tensors = (("key", "value"), (layer.keys, layer.values)) if getattr(layer, "keys", None) is not None else ((), ())
    if hasattr(layer, "recurrent_states"):
        convs = [layer.conv_states[i] for i in sorted(layer.conv_states) if layer.conv_states[i] is not None]
        recurrent = layer.recurrent_states.get(0)
        kinds += tuple(map(_conv_kind, range(len(convs)))) + (("recurrent",) if recurrent is not None else ())
        tensors += (*convs, *((recurrent,) if recurrent is not None else ()))
    return kinds, tensors


def Decoder(model, kinds: list[tuple[str, ...]], image_token: int | None = None, blocks: bool = False, cache_class=None):  # noqa: N802 - builds the class on first use
    return _decoder_class()(model, kinds, image_token, blocks, cache_class)


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
