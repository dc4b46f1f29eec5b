"""The CUDA path on a real GPU; skipped cleanly where CUDA cannot run."""
import pytest

from edgeinfer import Engine
from edgeinfer.sdk.kv_cache import KVCache
from edgeinfer.sdk.runtime import cuda_unusable_reason

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_unusable_reason() is not None, reason=f"no CUDA: {cuda_unusable_reason()}")]


def test_cuda_gives_the_cpu_tokens_and_keeps_the_cache_on_the_gpu(tiny_llama):
    gpu = Engine.load(tiny_llama[1], provider="cuda")
    cpu = Engine.load(tiny_llama[1], provider="cpu")
    assert gpu.generate("The capital", max_new_tokens=16).token_ids == cpu.generate("The capital", max_new_tokens=16).token_ids
    cache = KVCache(gpu.manifest.kv)
    gpu.prefill([5, 6, 7], cache)
    gpu.decode(8, cache)
    assert all(v.device_name().lower() == "cuda" for v in cache.past.values())
