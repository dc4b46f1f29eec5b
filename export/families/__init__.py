"""What edgeinfer knows about model families, in one place.

The runtime knows no family: it reads the KV layout and inputs from the manifest and the graphs.
Export traces every family alike (export/trace.py: each layer's cache shape is read off what the
model caches), and tries any decoder-only causal language model transformers has: its checks
against PyTorch decide. It knows three things about families:
- which ones the tests prove (TESTED), each by a parity test in tests/test_architectures.py;
- what cannot work, and why (UNSUPPORTED, `not_a_decoder`);
- what a family needs beyond the common trace: its record in FAMILIES (the patches its trace runs
  inside, its vision encoder, its flags), the code of each in its own module here. Adding a family
  that traces as is takes one line; one that needs a patch or an encoder, its module and one entry.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass
from typing import Callable

from ..patches import (
    real_rotary,
    traceable_falcon_alibi,
    traceable_linear_attention,
    traceable_mamba,
    traceable_mamba2,
    traceable_inkling,
    traceable_minimax,
    traceable_recurrent_gemma,
    traceable_routed_experts,
)
from . import gemma3, idefics3, qwen_vl, recurrent_gemma
from .processor import VisionEncoder


@dataclass(frozen=True)
class Family:
    """What export needs to know of a family beyond the common trace. A family that traces as is
    needs none of it (AS_IS); one that needs more names it here, its code in its own module."""

    patches: tuple[Callable, ...] = ()  # context managers (export/patches.py) the trace runs inside
    vision: VisionEncoder | None = None  # a vision-language family's encoder and processor reading
    images_attend_both_ways: bool = False  # a picture's tokens a block in the causal mask
    rotary_3d: bool = False  # position_ids [3, batch, sequence]: time, row, column
    # a selective scan's state kept [batch, heads, state size, head size] (LinearAttention's key by
    # value), where transformers keeps it [batch, heads, head size, state size]
    scan_state_transposed: bool = False
    # the convolution state as transformers keeps it, all K inputs (the family's own convolutions
    # read them: ZAYA's), not the K - 1 that CausalConvWithState takes
    conv_state_whole: bool = False
    own_cache: bool = False  # the trace builds the model's own cache class around its layers (MiniMax's)
    # the trace's dummy prompt runs the patched forwards too, its states then in the cache as the
    # ops keep them (RecurrentGemma's blocks keep theirs on the modules otherwise)
    prompt_patched: bool = False
    prepare: Callable | None = None  # called with the model before the trace (numbering RecurrentGemma's blocks)


AS_IS = Family()
LINEAR_ATTENTION = Family(patches=(traceable_linear_attention,))  # gated DeltaNet layers, short convolutions
MAMBA2 = Family(patches=(traceable_mamba2,), scan_state_transposed=True)  # Mamba-2 mixers beside attention layers
MAMBA = Family(patches=(traceable_mamba,))  # Mamba-1 mixers, alone or beside attention layers
INKLING = Family(patches=(traceable_inkling,))  # attention layers with four short convolutions each

# Every family the tests prove (tests/test_architectures.py, tests/test_vision_families.py); others
# are tried as AS_IS.
FAMILIES = {
    "arcee": AS_IS,
    "bloom": AS_IS,
    "codegen": AS_IS,
    "cohere": AS_IS,
    "deepseek_v3": AS_IS,
    "falcon": Family(patches=(traceable_falcon_alibi,)),
    "gemma": AS_IS,
    "gemma2": AS_IS,
    "gemma3_text": AS_IS,
    "glm": AS_IS,
    "gpt2": AS_IS,
    "gpt_bigcode": AS_IS,
    "gpt_neo": AS_IS,
    "gpt_neox": AS_IS,
    "gpt_oss": AS_IS,
    "gptj": AS_IS,
    "granite": AS_IS,
    "helium": AS_IS,
    "llama": AS_IS,
    "mistral": AS_IS,
    "mpt": AS_IS,
    "nemotron": AS_IS,
    "olmo": AS_IS,
    "olmo2": AS_IS,
    "opt": AS_IS,
    "phi": AS_IS,
    "phi3": AS_IS,
    "qwen2": AS_IS,
    "qwen3": AS_IS,
    "qwen3_moe": AS_IS,
    "smollm3": AS_IS,
    "stablelm": AS_IS,
    "exaone4": AS_IS,
    "gemma4_text": AS_IS,
    "glm4_moe_lite": AS_IS,
    "granite_swa": AS_IS,
    "hunyuan_v1_dense": AS_IS,
    "lfm2": LINEAR_ATTENTION,
    "lfm2_moe": LINEAR_ATTENTION,
    "lfm3": LINEAR_ATTENTION,
    "minicpm3": AS_IS,
    "ministral3": AS_IS,
    "olmo3": AS_IS,
    "olmo_hybrid": LINEAR_ATTENTION,
    "qwen3_5_moe_text": LINEAR_ATTENTION,
    "qwen3_5_text": LINEAR_ATTENTION,
    "seed_oss": AS_IS,
    "qwen3_next": LINEAR_ATTENTION,
    "kimi_linear": LINEAR_ATTENTION,
    # state-space hybrids
    "bamba": MAMBA2,
    "granitemoehybrid": MAMBA2,
    "nemotron_h": MAMBA2,
    "falcon_h1": MAMBA2,
    "zamba2": MAMBA2,
    "mamba2": MAMBA2,
    "lara_mini": LINEAR_ATTENTION,
    "bailing_hybrid": LINEAR_ATTENTION,
    "deepseek_v2": Family(patches=(real_rotary,)),
    "llama4_text": Family(patches=(real_rotary,)),
    "mamba": MAMBA,
    "falcon_mamba": MAMBA,
    "jamba": MAMBA,
    "zamba": MAMBA,
    "dbrx": Family(patches=(traceable_routed_experts,)),
    "jetmoe": Family(patches=(traceable_routed_experts,)),
    "longcat_flash": Family(patches=(traceable_routed_experts,)),
    "zaya": Family(conv_state_whole=True),
    "minimax": Family(patches=(traceable_minimax,), own_cache=True),
    "recurrent_gemma": Family(patches=(traceable_recurrent_gemma,), prompt_patched=True, prepare=recurrent_gemma.number_blocks),
    "inkling_text": INKLING,
    "inkling2_text": INKLING,
    "inkling2_loop_text": INKLING,
    # proven on their config class's defaults, shrunk (tests/architectures.py SHRUNK): as they trace
    "afmoe": AS_IS,
    "apertus": AS_IS,
    "apertus1p5_text": AS_IS,
    "aria_text": AS_IS,
    "axk1": AS_IS,
    "beam": AS_IS,
    "bert-generation": AS_IS,  # in its decoder mode (is_decoder), which keeps a cache
    "biogpt": AS_IS,
    "bitnet": AS_IS,
    "cohere2": AS_IS,
    "cohere2_moe": AS_IS,
    "cohere_compass_text": AS_IS,
    "ctrl": AS_IS,
    "cwm": AS_IS,
    "diffllama": AS_IS,
    "doge": AS_IS,
    "dory": AS_IS,
    "dots1": AS_IS,
    "emu3_text_model": AS_IS,  # the text model Emu3's causal model saves
    "ernie4_5": AS_IS,
    "ernie4_5_moe": AS_IS,
    "exaone": AS_IS,
    "exaone_moe": AS_IS,
    "flex_olmo": AS_IS,
    "flint": AS_IS,
    "fuyu": AS_IS,
    "gemma3n_text": AS_IS,
    "gemma4": AS_IS,
    "gemma4_unified": AS_IS,
    "gemma4_unified_text": AS_IS,
    "git": AS_IS,
    "glm4": AS_IS,
    "glm4_moe": AS_IS,
    "got_ocr2": AS_IS,
    "gpt_neox_japanese": AS_IS,
    "granitemoe": AS_IS,
    "granitemoe_swa": AS_IS,
    "granitemoeshared": AS_IS,
    "hrm_text": AS_IS,
    "hunyuan_v1_moe": AS_IS,
    "hy_v3": AS_IS,
    "hyperclovax": AS_IS,
    "internlm3": AS_IS,
    "iquestcoder": AS_IS,
    "jais2": AS_IS,
    "kolibri1": AS_IS,
    "laguna": AS_IS,
    "mellum": AS_IS,
    "mimo_v2_flash": AS_IS,
    "minimax_m2": AS_IS,
    "minimax_m3_vl_text": AS_IS,
    "ministral": AS_IS,
    "mixtral": AS_IS,
    "mllama_text_model": AS_IS,  # the text model Mllama's causal model saves
    "modernbert-decoder": AS_IS,
    "moshi": AS_IS,
    "moss_transcribe_diarize": AS_IS,
    "nanochat": AS_IS,
    "olmoe": AS_IS,
    "persimmon": AS_IS,
    "phi4_multimodal": AS_IS,
    "phimoe": AS_IS,
    "qwen2_moe": AS_IS,
    "sarvam_mla": AS_IS,
    "sarvam_moe": AS_IS,
    "solar_open": AS_IS,
    "starcoder2": AS_IS,
    "trocr": AS_IS,
    "vaultgemma": AS_IS,
    "xglm": AS_IS,
    "youtu": AS_IS,
    # vision-language: their language model as above, taking image features
    "gemma3": Family(vision=gemma3.VISION, images_attend_both_ways=True),
    "idefics3": Family(vision=idefics3.VISION),
    "qwen2_5_vl": Family(vision=qwen_vl.QWEN2_5_VL, rotary_3d=True),
    "qwen3_5": Family(patches=LINEAR_ATTENTION.patches, vision=qwen_vl.QWEN3_5, rotary_3d=True),
    "smolvlm": Family(vision=idefics3.VISION),
}
TESTED = tuple(name for name, entry in FAMILIES.items() if entry.vision is None)
VISION_LANGUAGE = tuple(name for name, entry in FAMILIES.items() if entry.vision is not None)


def family(model_type: str) -> Family:
    """A family's record; AS_IS for a family the tests do not know."""
    return FAMILIES.get(model_type, AS_IS)


# Families that cannot be exported here, and why.
UNSUPPORTED = {
    "internlm2": "transformers 5 has no internlm2 model; its checkpoints need trust_remote_code, which edgeinfer does not run",
}


def not_a_decoder(model_type: str) -> str | None:
    """Why `model_type` cannot be a decoder-only language model, in words; None where it can be."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if model_type in VISION_LANGUAGE:
        return None
    if model_type not in CONFIG_MAPPING:
        return "transformers has no model of this type (a checkpoint that needs trust_remote_code, which edgeinfer does not run)"
    causal = causal_lm_class(CONFIG_MAPPING[model_type])
    if causal is None:
        return "transformers has no causal language model of this type"
    if "shared_kv_states" in inspect.signature(causal.forward).parameters:
        return (
            "it is a draft model that reads its target model's keys and values (shared_kv_states), not a language "
            "model alone: export the target model"
        )
    if _default_config(CONFIG_MAPPING[model_type]).get("is_encoder_decoder") is True:
        return "it is an encoder-decoder"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "it is an encoder (a masked language model), whose causal head is a decoder mode"
    return None


def causal_lm_class(config_class):
    """The causal language model class that takes `config_class`: AutoModelForCausalLM's (transformers'
    own, and any registered in this process), or the causal-LM class of the same family whose config
    is this one (a composite model's text model, which its causal model saves as its own type:
    Emu3's `emu3_text_model`, Mllama's `mllama_text_model`); None where there is none."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config_class in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    module = config_class.__module__.split(".")
    family_module = module[2] if module[:2] == ["transformers", "models"] else None
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if family_module and model_type_to_module_name(model_type) == family_module:
            found = getattr(transformers, name, None)
            if found is not None and found.config_class is config_class:
                return found
    return None


def _default_config(config_class) -> dict:
    """A config class's defaults; its class attributes where it cannot be built without arguments."""
    try:
        return config_class().to_dict()
    except Exception:  # noqa: BLE001 - a family's own validation of an empty config
        return {"is_encoder_decoder": getattr(config_class, "is_encoder_decoder", False)}
