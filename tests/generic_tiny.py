"""A tiny random-weight model of any causal-LM family transformers registers, from its config
class's defaults with the sizes shrunk: how families outside architectures.TINY are tried.

Where architectures.TINY has an entry for the family, that entry is used. Otherwise each size
attribute the default config has is set small, and every per-layer list (layer kinds, a hybrid's
pattern string) is cut to the fewest layers that keep each of its kinds, in order; then the
family's few settings in architectures.ADJUSTED where the shrunk sizes disagree with each other
(a rotary size, an expert grouping)."""

from __future__ import annotations

from architectures import ADJUSTED, COMMON, LATENT, TINY, tiny_config

SMALL = {
    "vocab_size": 320,
    "hidden_size": 64,
    "n_embd": 64,
    "n_embed": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")


def not_decoder_only(model_type: str) -> str | None:
    """Why a causal-LM family is not a decoder-only language model (export's own rule); None where it is one."""
    from edgeinfer.export.families import not_a_decoder

    return not_a_decoder(model_type)


def tiny_model(model_type: str):
    """The family's tiny model, checked to run in transformers: a prompt, then two tokens on its cache."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from edgeinfer.export.families import causal_lm_class

    config = config_of(model_type)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:  # a composite model's text model, saved as its own type (Emu3's emu3_text_model)
        model = causal_lm_class(type(config))._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # a router initialized to zeros ties every expert: real checkpoints' are not
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = getattr(model(input_ids=ids[:, :4], use_cache=True), "past_key_values", None)  # RecurrentGemma's has none
        model(input_ids=ids[:, 4:], past_key_values=cache, use_cache=True)
    return model


def config_of(model_type: str):
    from transformers import AutoConfig

    if model_type in TINY:
        return tiny_config(model_type)
    default = AutoConfig.for_model(model_type)
    sizes = _shrunk(default)
    for name in getattr(default, "sub_configs", {}):  # a composite model's text, vision or audio config
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sizes[name] = {**sub.to_dict(), **_shrunk(sub)}
    for name, value in ADJUSTED.get(model_type, {}).items():  # a sub-config's settings go on top of its shrunk ones
        sizes[name] = {**sizes[name], **value} if isinstance(value, dict) and isinstance(sizes.get(name), dict) else value
    return AutoConfig.for_model(model_type, **sizes)


def _shrunk(default) -> dict:
    """The small sizes of one config: those of SMALL it has, its layers cut (see the module's text)."""
    sizes = {name: value for name, value in {**COMMON, **SMALL, **LATENT}.items() if _has(default, name)}
    if "kv_lora_rank" in sizes:  # latent attention: a key and value head per query head
        sizes["num_key_value_heads"] = sizes.get("num_attention_heads", 4)
    layers = next((getattr(default, name) for name in LAYER_COUNTS if _has(default, name)), None)
    if isinstance(layers, int):
        kept = _kept_layers(default, layers)
        for name in LAYER_COUNTS:
            if _has(default, name):
                sizes[name] = len(kept)
        sizes |= _cut_per_layer(default, layers, kept)
    if default.to_dict().get("per_layer_config"):  # some layers' own (large) sizes, by index: every layer alike
        sizes["per_layer_config"] = {}
    return sizes


def _has(config, name: str) -> bool:
    return name in config.to_dict() or name in getattr(config, "attribute_map", {})


def _per_layer(config, layers: int) -> dict:
    """The config's attributes with one entry per layer."""
    return {
        name: value
        for name, value in config.to_dict().items()
        if isinstance(value, (list, str)) and len(value) == layers and layers > 2 and name not in ("model_type",)
    }


def _kept_layers(config, layers: int) -> list[int]:
    """The fewest layers, at least 2, that keep each kind every per-layer list names: each kind's first layer."""
    kept = {0, 1}
    for values in _per_layer(config, layers).values():
        seen = {}
        for i, value in enumerate(values):
            seen.setdefault(str(value), i)
        kept |= set(seen.values())
    return sorted(kept)


def _cut_per_layer(config, layers: int, kept: list[int]) -> dict:
    cut = {}
    for name, values in _per_layer(config, layers).items():
        picked = [values[i] for i in kept]
        cut[name] = "".join(picked) if isinstance(values, str) else picked
    return cut
