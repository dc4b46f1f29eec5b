"""What edgeinfer knows about model families, in one place.

The runtime knows no family: it reads the KV layout and inputs from the manifest and the graphs.
Export knows three things about families:
- which ones it supports (every decoder-only family optimum-onnx 0.1.0 exports for
  text-generation-with-past, each proven by a parity test in tests/test_architectures.py);
- what cannot work with optimum-onnx 0.1.0 and transformers 4.57, and why;
- fixes for optimum-onnx configs whose dummy KV cache does not match what transformers' model
  returns (phi with grouped-query attention, falcon's new decoder architecture), or whose graph
  takes no position ids (gemma3_text, nemotron).
Sliding-window layers are handled for every family alike, in graphs.py.
"""

from __future__ import annotations

import functools

SUPPORTED = (
    "arcee",
    "bloom",
    "codegen",
    "cohere",
    "deepseek_v3",
    "falcon",
    "gemma",
    "gemma2",
    "gemma3_text",
    "glm",
    "gpt2",
    "gpt_bigcode",
    "gpt_neo",
    "gpt_neox",
    "gpt_oss",
    "gptj",
    "granite",
    "helium",
    "llama",
    "mistral",
    "mpt",
    "nemotron",
    "olmo",
    "olmo2",
    "opt",
    "phi",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "stablelm",
)
# Families optimum-onnx registers that cannot be exported here, and why.
UNSUPPORTED = {
    "internlm2": "transformers 4.57 has no internlm2 model; its checkpoints need trust_remote_code, which edgeinfer does not run",
}
TASK = "text-generation-with-past"


def onnx_config_constructor(model):
    """optimum-onnx's OnnxConfig for the model (called with the config, use_past and
    use_past_in_inputs), with edgeinfer's fixes where optimum-onnx 0.1.0 gets the family wrong."""
    from optimum.exporters.tasks import TasksManager

    config = model.config
    if config.model_type == "phi" and _kv_heads(config) != config.num_attention_heads:
        return functools.partial(_phi_with_gqa(), task="text-generation")
    if config.model_type == "falcon" and config.new_decoder_architecture:
        return functools.partial(_falcon_new_architecture(), task="text-generation")
    if config.model_type in _POSITIONS_FROM_THE_CACHE:
        return functools.partial(_with_position_ids(config.model_type), task="text-generation")
    return TasksManager.get_exporter_config_constructor("onnx", model, task=TASK, library_name="transformers")


# Families whose optimum-onnx graph takes no position ids: it counts positions from the past's
# length, which in the runtime's in-place layout is the buffer's capacity, not the row's length.
# With them, gemma3_text's rewritten attention passes the logits check (it did not), and
# nemotron's fused graph passes the batch check (export kept its unfused graph).
_POSITIONS_FROM_THE_CACHE = {"gemma3_text": "Gemma3TextOnnxConfig", "nemotron": "NemotronOnnxConfig"}


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


@functools.cache
def _phi_with_gqa():
    """Phi's OnnxConfig builds its dummy past with every attention head; with fewer KV heads the
    trace fails. Phi3's config (same layout, grouped-query aware) has the right generator."""
    from optimum.exporters.onnx.model_configs import Phi3OnnxConfig, PhiOnnxConfig

    class PhiWithGQA(PhiOnnxConfig):
        DUMMY_INPUT_GENERATOR_CLASSES = Phi3OnnxConfig.DUMMY_INPUT_GENERATOR_CLASSES
        DUMMY_PKV_GENERATOR_CLASS = Phi3OnnxConfig.DUMMY_PKV_GENERATOR_CLASS
        NORMALIZED_CONFIG_CLASS = Phi3OnnxConfig.NORMALIZED_CONFIG_CLASS

    return PhiWithGQA


@functools.cache
def _falcon_new_architecture():
    """transformers' falcon with the new decoder architecture caches keys and values for every
    attention head (it expands the KV heads before the cache), but optimum-onnx's dummy past has
    num_kv_heads of them."""
    from optimum.exporters.onnx.model_configs import FalconOnnxConfig
    from optimum.utils.input_generators import DummyTextInputGenerator, FalconDummyPastKeyValuesGenerator

    class ExpandedFalconPast(FalconDummyPastKeyValuesGenerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.num_kv_heads = self.num_attention_heads

    class FalconNewArchitecture(FalconOnnxConfig):
        DUMMY_INPUT_GENERATOR_CLASSES = (DummyTextInputGenerator, ExpandedFalconPast)
        DUMMY_PKV_GENERATOR_CLASS = ExpandedFalconPast

    return FalconNewArchitecture


@functools.cache
def _with_position_ids(model_type: str):
    """The family's OnnxConfig with a `position_ids` input, as optimum-onnx gives llama's: the
    graph then rotates by the positions the runtime passes (each row's slots) instead of counting
    them from the past's length."""
    from optimum.exporters.onnx import model_configs

    class WithPositionIds(getattr(model_configs, _POSITIONS_FROM_THE_CACHE[model_type])):
        @property
        def inputs(self):
            inputs = super().inputs
            inputs["position_ids"] = {0: "batch_size", 1: "sequence_length"}
            return inputs

    return WithPositionIds
