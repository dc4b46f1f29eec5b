"""The CUDA path on a real GPU; skipped cleanly where CUDA cannot run."""

import pytest

from edgeinfer import Engine
from edgeinfer.sdk.runtime import RowCopy, cuda_unusable_reason

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_unusable_reason() is not None, reason=f"no CUDA: {cuda_unusable_reason()}")]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cuda"), Engine.load(tiny_llama[1], provider="cpu")


def test_cuda_gives_the_cpu_tokens_and_keeps_the_cache_and_logits_on_the_gpu(engines):
    gpu, cpu = engines
    assert gpu.generate("The capital", max_new_tokens=16).token_ids == cpu.generate("The capital", max_new_tokens=16).token_ids
    batch = gpu.runner.new_batch()
    gpu.runner.prefill(batch, [[5, 6, 7]])
    logits = gpu.runner.decode(batch, [8])
    assert all(v.device_name().lower() == "cuda" for v in batch.cache.buffers.values())
    assert logits.device_name().lower() == "cuda"
    assert gpu.runner.heads.argmax(logits) == cpu.runner.heads.argmax(cpu.runner.decode(_prefilled(cpu, [5, 6, 7]), [8]))


def _prefilled(engine, ids):
    cache = engine.runner.new_batch()
    engine.runner.prefill(cache, [ids])
    return cache


def test_cuda_batches_and_sampling(engines):
    gpu, cpu = engines
    prompts = ["Hi", "The capital of France is" * 4]
    assert [r.token_ids for r in gpu.generate_batch(prompts, max_new_tokens=12)] == [
        cpu.generate(p, max_new_tokens=12).token_ids for p in prompts
    ]
    sampled = gpu.generate("The capital", max_new_tokens=12, temperature=0.8, seed=3)
    assert sampled.token_ids == gpu.generate("The capital", max_new_tokens=12, temperature=0.8, seed=3).token_ids
    assert len(sampled.token_ids) == 12


def test_the_memory_plan_reads_the_gpus_free_memory(engines, tiny_llama):
    from edgeinfer.sdk.errors import SettingsError
    from edgeinfer.sdk.memory import available_bytes

    free, where = available_bytes("cuda", None)
    assert where == "the GPU" and free is not None and 0 < free < 2**40
    with pytest.raises(SettingsError, match="the memory limit has .*max_context="):
        Engine.load(tiny_llama[1], provider="cuda", memory_limit=engines[0].memory.weights + 1000)


def test_cuda_speculation_and_the_prefix_cache_give_the_cpu_tokens(engines, tiny_llama):
    """Speculative checks (rows bound alone by address) and the prefix cache's row copies
    (runtime.RowCopy) on the GPU: the tokens of plain decoding on the CPU."""
    from edgeinfer import Scheduler

    _, cpu = engines
    gpu = Engine.load(tiny_llama[1], provider="cuda", prefix_cache=16)
    assert isinstance(gpu.runner.copier, RowCopy)
    start = [(7 * i) % 300 + 3 for i in range(100)]
    prompts = [start + [5], start + [6], [5, 6, 7, 5, 6]]
    expected = [cpu.generate(p, max_new_tokens=16, ignore_eos=True).token_ids for p in prompts]
    gpu.generate(prompts[0], max_new_tokens=1)  # leaves 3 blocks
    assert [gpu.generate(p, max_new_tokens=16, ignore_eos=True, speculative="prompt_lookup").token_ids for p in prompts] == expected
    assert [r.token_ids for r in gpu.generate_batch(prompts, max_new_tokens=16, ignore_eos=True)] == expected
    with Scheduler(gpu, max_batch=2) as scheduler:
        results = [scheduler.submit(p, max_new_tokens=16, ignore_eos=True, speculative="prompt_lookup").result() for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert gpu.prefix_cache.hit_tokens >= 3 * 96


@pytest.mark.parametrize("shapes", [{}, {"prefill_length": 16, "static_context": 96}])
def test_cuda_runs_the_split_layout_on_one_copy_of_the_weights(tiny_llama, tmp_path, shapes):
    """Both sessions take the weights loaded once on the GPU; the prefill graph's presents are
    copied into the cache on the device."""
    from edgeinfer.export import ExportOptions, export_model

    export_model(str(tiny_llama[0]), tmp_path / "split", ExportOptions(graphs="split", **shapes))
    gpu, cpu = Engine.load(tmp_path / "split", provider="cuda"), Engine.load(tiny_llama[1], provider="cpu")
    assert gpu.runner._shared_weights and all(v.device_name().lower() == "cuda" for v in gpu.runner._shared_weights.values())
    for prompt in ["The capital", "The capital of France is" * 2]:
        assert (
            gpu.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids
            == cpu.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids
        )


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The tiny qwen3_5 (three gated DeltaNet layers of four), exported: ONNX Runtime's
    LinearAttention and CausalConvWithState run on CUDA with their state bound in place."""
    from conftest import export_tiny

    return export_tiny("qwen3_5_text", tmp_path_factory.mktemp("qwen3_5"))[1]


def test_cuda_runs_a_hybrid_models_state_as_the_cpu_does(hybrid):
    gpu, cpu = Engine.load(hybrid, provider="cuda"), Engine.load(hybrid, provider="cpu")
    prompts = [list(range(3, 43)), [5, 6, 7], list(range(100, 119))]
    expected = [cpu.generate(p, max_new_tokens=12, ignore_eos=True).token_ids for p in prompts]
    assert [gpu.generate(p, max_new_tokens=12, ignore_eos=True).token_ids for p in prompts] == expected
    assert [r.token_ids for r in gpu.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)] == expected
    batch = gpu.runner.new_batch(2, 64)
    assert all(batch.cache.buffers[s["past"]].device_name().lower() == "cuda" for s in gpu.manifest.kv.state)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """The tiny EXAONE 4 (a sliding layer of window 16 beside a full one), exported: CUDA's
    GroupQueryAttention keeps the window in a buffer of exactly the window's slots."""
    from conftest import export_tiny

    return export_tiny("exaone4", tmp_path_factory.mktemp("exaone4"))[1]


def test_cuda_keeps_a_sliding_layers_window_as_the_cpu_does(windowed):
    gpu, cpu = Engine.load(windowed, provider="cuda", prefill_chunk=8), Engine.load(windowed, provider="cpu", prefill_chunk=8)
    prompts = [list(range(3, 43)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(100, 119))]
    settings = dict(max_new_tokens=30, ignore_eos=True)
    expected = [cpu.generate(p, **settings).token_ids for p in prompts]
    assert [gpu.generate(p, **settings).token_ids for p in prompts] == expected
    assert [gpu.generate(p, speculative="prompt_lookup", **settings).token_ids for p in prompts] == expected
    assert [r.token_ids for r in gpu.generate_batch(prompts, **settings)] == expected
    assert gpu.generate(prompts[0], **settings).token_ids == expected[0]  # again, from the prefix cache
    batch = gpu.runner.new_batch(2, 64)
    name = gpu.manifest.kv.past[0]  # the sliding layer's keys
    assert gpu.manifest.kv.windows[0] > 0 and batch.cache.buffers[name].shape()[2] == gpu.manifest.kv.windows[0]


@pytest.fixture(scope="module", params=["idefics3", "gemma3", "qwen2_5_vl"])
def vision_export(request, tmp_path_factory):
    """A tiny vision-language export of each kind: SmolVLM's, Gemma 3's (picture blocks, attention
    as traced) and Qwen2.5-VL's (3-D rotary positions beside GroupQueryAttention)."""
    import vision_models

    build = getattr(vision_models, f"build_{request.param}")
    return vision_models.built_and_exported(tmp_path_factory.mktemp(request.param), build)[2]


def test_cuda_reads_pictures_as_the_cpu_does(vision_export):
    """The vision graph on the GPU, its features fed to the language model there: the CPU's tokens,
    alone and in a batch with a row of text."""
    from vision_models import asked, png

    from edgeinfer.sdk.chat import chat_turn

    gpu, cpu = Engine.load(vision_export, provider="cuda"), Engine.load(vision_export, provider="cpu")
    messages = asked("What is in the picture?", png(1), png(2))[0]
    assert (
        gpu.chat(messages, max_new_tokens=8, ignore_eos=True).token_ids
        == cpu.chat(messages, max_new_tokens=8, ignore_eos=True).token_ids
    )
    turns = [
        chat_turn(gpu.tokenizer, gpu.max_context, m, vision=gpu.manifest.vision)
        for m in (messages, [{"role": "user", "content": "Hi"}])
    ]
    for turn in turns:
        gpu.runner.see(turn.pictures)
    batched = gpu.generate_batch([turn.ids for turn in turns], max_new_tokens=8, ignore_eos=True)
    assert [r.token_ids for r in batched] == [
        cpu.chat(m, max_new_tokens=8, ignore_eos=True).token_ids for m in (messages, [{"role": "user", "content": "Hi"}])
    ]
