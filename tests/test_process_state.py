"""What edgeinfer leaves of the process's global state: ONNX Runtime's logger after the CUDA
probe, and transformers' DynamicCache after tracing."""

import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
from transformers import LlamaConfig, MistralConfig, cache_utils

from edgeinfer.export.patches import full_length_caches
from edgeinfer.sdk.runtime import cuda_unusable_reason

ORIGINAL = cache_utils.DynamicCache.__dict__["__init__"]
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


def test_tracing_patches_the_cache_only_for_sliding_window_models_and_restores_it():
    with full_length_caches(LlamaConfig(**SMALL)):
        assert cache_utils.DynamicCache.__dict__["__init__"] is ORIGINAL
    sliding = MistralConfig(**SMALL, sliding_window=4)
    assert all(isinstance(layer, cache_utils.DynamicSlidingWindowLayer) for layer in cache_utils.DynamicCache(config=sliding).layers)
    with full_length_caches(sliding):
        cache = cache_utils.DynamicCache(config=sliding)
        assert cache.layers == [] or not any(isinstance(layer, cache_utils.DynamicSlidingWindowLayer) for layer in cache.layers)
        cache_utils.DynamicCache(None, config=sliding)  # the config given by keyword, as transformers may
    assert cache_utils.DynamicCache.__dict__["__init__"] is ORIGINAL


def test_concurrent_exports_cannot_leave_the_patch_installed():
    sliding, inside, errors = MistralConfig(**SMALL, sliding_window=4), [], []

    def trace():
        try:
            with full_length_caches(sliding):
                inside.append(cache_utils.DynamicCache.__dict__["__init__"] is not ORIGINAL)
                time.sleep(0.02)  # long enough for the other threads to come in, were nothing stopping them
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=trace) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and inside == [True] * 8
    assert cache_utils.DynamicCache.__dict__["__init__"] is ORIGINAL


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
