"""What edgeinfer leaves of the process's global state: ONNX Runtime's logger after the CUDA
probe, and torch and transformers after tracing."""

import threading
import time

import numpy as np
import onnxruntime as ort
import pytest

from edgeinfer.export.patches import constant_repeat_interleave, traceable_falcon_alibi
from edgeinfer.sdk.runtime import cuda_unusable_reason

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)


@pytest.mark.skipif(
    cuda_unusable_reason() is None or "CUDA provider could not start" not in cuda_unusable_reason(),
    reason="needs onnxruntime-gpu on a machine where its CUDA provider cannot start",
)
def test_the_cuda_probe_is_silent_and_leaves_onnx_runtimes_logger_as_it_was(capfd):
    cuda_unusable_reason.cache_clear()
    reason = cuda_unusable_reason()
    assert "cannot open shared object file" in reason or "not found" in reason
    assert capfd.readouterr().err == ""  # the probe's own error log was captured, not shown
    with pytest.raises(RuntimeError):  # the app's own use of the CUDA provider still logs as before
        ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
    assert "Failed to load library" in capfd.readouterr().err


def test_a_trace_leaves_torch_and_transformers_as_they_were(tmp_path):
    """Tracing a model (export/trace.py) patches torch's repeat_interleave and falcon's ALiBi and
    switches the model's expert layers to a traceable implementation; afterwards all are back."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.models.falcon import modeling_falcon

    from edgeinfer.export.trace import trace

    before = (torch.repeat_interleave, torch.Tensor.repeat_interleave, modeling_falcon.build_alibi_tensor)
    config = Qwen3MoeConfig(**SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, head_dim=8)
    model = AutoModelForCausalLM.from_config(config).eval()
    experts = model.config._experts_implementation
    trace(model, tmp_path / "model.onnx")
    assert (torch.repeat_interleave, torch.Tensor.repeat_interleave, modeling_falcon.build_alibi_tensor) == before
    assert model.config._experts_implementation == experts


def test_concurrent_traces_cannot_leave_a_patch_installed():
    import torch
    from transformers.models.falcon import modeling_falcon

    original, inside, errors = (torch.repeat_interleave, modeling_falcon.build_alibi_tensor), [], []

    def trace():
        try:
            with constant_repeat_interleave(), traceable_falcon_alibi():
                inside.append((torch.repeat_interleave, modeling_falcon.build_alibi_tensor) != original)
                time.sleep(0.02)  # long enough for the other threads to come in, were nothing stopping them
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=trace) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and inside == [True] * 8
    assert (torch.repeat_interleave, modeling_falcon.build_alibi_tensor) == original


@pytest.mark.skipif(
    cuda_unusable_reason() is None or "CUDA provider could not start" not in cuda_unusable_reason(),
    reason="needs onnxruntime-gpu on a machine where its CUDA provider cannot start",
)
def test_an_app_that_silenced_onnx_runtime_stays_silent_after_the_probe(capfd):
    ort.set_default_logger_severity(4)  # the app's choice: nothing below fatal
    try:
        cuda_unusable_reason.cache_clear()
        cuda_unusable_reason()
        with pytest.raises(RuntimeError):
            ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
        assert capfd.readouterr().err == ""  # a probe that reset the severity to 2 would let this error through
    finally:
        ort.set_default_logger_severity(2)  # ONNX Runtime's default, which this test process started with
