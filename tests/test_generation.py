"""Generation an app can embed, on tiny models built in the tests: seeded sampling, streaming,
stop conditions, batches, threads and chat."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import CHAIN_TEXT, EOS_ID, count_graph_runs, in_threads

from edgeinfer import Engine
from edgeinfer.sdk.errors import GenerationError, ManifestError, SettingsError

PROMPT = "The capital of France is"
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()


@pytest.fixture(scope="module")
def chain(chain_llama):
    return Engine.load(chain_llama[0], provider="cpu"), chain_llama[1]


# Sampling


def test_seeded_sampling_is_reproducible_in_process_and_across_processes(engine, tiny_llama):
    first = engine.generate(PROMPT, max_new_tokens=24, **SAMPLED).token_ids
    assert engine.generate(PROMPT, max_new_tokens=24, **SAMPLED).token_ids == first
    script = (
        f"from edgeinfer import Engine; import json, sys; e = Engine.load(sys.argv[1], provider='cpu'); "
        f"print(json.dumps(e.generate({PROMPT!r}, max_new_tokens=24, **{SAMPLED!r}).token_ids))"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tiny_llama[1])], capture_output=True, text=True, timeout=300)
    assert json.loads(done.stdout) == first, done.stderr
    assert engine.generate(PROMPT, max_new_tokens=24, **{**SAMPLED, "seed": 8}).token_ids != first
    assert first != engine.generate(PROMPT, max_new_tokens=24).token_ids  # it did not decode greedily


def test_top_k_sampling_draws_only_among_transformers_top_k_at_every_step(engine, hf):
    """At temperature 1 with top_k=3, every sampled token is among the 3 that transformers'
    TopKLogitsWarper keeps for the same context, and sampling does not just follow the argmax."""
    from transformers.generation.logits_process import TopKLogitsWarper

    ids, off_argmax = engine.prompt_ids(PROMPT), 0
    for seed in range(4):
        tokens = engine.generate(PROMPT, max_new_tokens=12, temperature=1.0, top_k=3, seed=seed).token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        kept = TopKLogitsWarper(3)(None, logits)
        assert all(torch.isfinite(kept[step, token]) for step, token in enumerate(tokens)), (seed, tokens)
        off_argmax += sum(token != int(logits[step].argmax()) for step, token in enumerate(tokens))
    assert off_argmax > 0


def test_the_models_generation_defaults_apply_unless_overridden(tiny_llama, engine, tmp_path):
    folder = tmp_path / "defaults"
    shutil.copytree(tiny_llama[1], folder)
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    manifest["generation"] = {"temperature": 0.8, "top_k": 20, "seed": 5, "max_new_tokens": 7}
    (folder / "edgeinfer.json").write_text(json.dumps(manifest))
    with_defaults = Engine.load(folder, provider="cpu")
    assert with_defaults.generate(PROMPT).token_ids == engine.generate(PROMPT, **manifest["generation"]).token_ids
    assert with_defaults.generate(PROMPT, temperature=0).token_ids == engine.generate(PROMPT, max_new_tokens=7).token_ids
    manifest["generation"] = {"top_p": 3}
    (folder / "edgeinfer.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="generation defaults are invalid .*top_p must be .* got 3.*export the model again"):
        Engine.load(folder, provider="cpu")


def test_bad_settings_are_refused_when_the_call_is_made_before_any_work(tiny_llama):
    engine = Engine.load(tiny_llama[1], provider="cpu")
    engine.prefill = None  # any work would fail with a TypeError instead
    with pytest.raises(SettingsError, match="top_p must be a number in"):
        engine.stream(PROMPT, top_p=2.0)  # raised by the call itself, not by the first next()
    with pytest.raises(SettingsError, match="unknown generation setting 'max_tokens': did you mean 'max_new_tokens'"):
        engine.generate(PROMPT, max_tokens=5)
    with pytest.raises(SettingsError, match=r"stop_token_ids \[400\] are outside the vocabulary \(0..319\)"):
        engine.generate(PROMPT, stop_token_ids=[400])
    with pytest.raises(GenerationError, match="a prompt is a string or a list of token ids, got dict"):
        engine.generate({"text": PROMPT})


# Streaming


def test_each_streamed_piece_is_the_tokenizers_decode_of_its_tokens_when_sampling(engine, tiny_llama):
    """The pieces are made token by token (the detokenizer); transformers' tokenizer decodes each
    piece's tokens, and all of them, to the same text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama[0])
    pieces = list(engine.stream(PROMPT, max_new_tokens=30, **SAMPLED))
    tokens = [t for p in pieces for t in p.token_ids]
    assert len(tokens) == 30 and pieces[-1].finish_reason == "length"
    assert [p.text for p in pieces] == [tokenizer.decode(p.token_ids, skip_special_tokens=True) for p in pieces]
    assert "".join(p.text for p in pieces) == tokenizer.decode(tokens, skip_special_tokens=True)


def test_pieces_are_whole_characters_where_a_character_spans_several_tokens(chain):
    engine, ids = chain
    pieces = list(engine.stream([1], max_new_tokens=40))
    assert "".join(p.text for p in pieces) == "".join(CHAIN_TEXT)
    assert not any("\ufffd" in p.text for p in pieces)
    by_text = {p.text: p.token_ids for p in pieces}
    assert len(by_text["東"]) == 3 and len(by_text["🙂"]) == 4  # one piece, the character's bytes as tokens
    assert [t for p in pieces for t in p.token_ids] == ids[1:]  # EOS ended it and is not part of the output
    assert pieces[-1].finish_reason == "eos"


def test_closing_a_stream_early_stops_the_work_and_the_engine_goes_on(tiny_llama):
    engine = Engine.load(tiny_llama[1], provider="cpu")
    runs = count_graph_runs(engine)
    stream = engine.stream(PROMPT, max_new_tokens=100, ignore_eos=True)
    taken = [next(stream) for _ in range(3)]
    stream.close()
    done = len(runs)
    assert done < 10 and taken[-1].finish_reason is None
    with pytest.raises(StopIteration):
        next(stream)
    expected = Engine.load(tiny_llama[1], provider="cpu").generate(PROMPT, max_new_tokens=10)
    assert engine.generate(PROMPT, max_new_tokens=10).token_ids == expected.token_ids
    assert len(runs) == done + 10  # a prefill and 9 decodes: the closed stream ran nothing after it was closed


# Stop conditions


def test_a_stop_string_across_token_boundaries_ends_generation_before_it(chain):
    engine = chain[0]
    result = engine.generate([1], stop=["; ST", "never"])
    assert result.text == "Edge boxes東京🙂 model" and result.finish_reason == "stop"
    pieces = list(engine.stream([1], stop=["; ST"]))
    assert "".join(p.text for p in pieces) == result.text and not any(";" in p.text for p in pieces)


def test_a_stop_string_inside_a_multibyte_character_sequence(chain):
    assert chain[0].generate([1], stop="京🙂").text == "Edge boxes東"


def test_stop_token_ids_and_eos(chain):
    engine, ids = chain
    x = ids[ids.index(90)]  # the token of "x"
    result = engine.generate([1], stop_token_ids=[x])
    assert (result.text, result.finish_reason, result.token_ids) == ("Edge bo", "stop", ids[1:5])
    assert engine.generate([1]).finish_reason == "eos"


def test_ignore_eos_makes_exactly_max_new_tokens(chain):
    result = chain[0].generate([1], max_new_tokens=30, ignore_eos=True)
    assert len(result.token_ids) == 30 and result.finish_reason == "length"
    assert result.token_ids[len(chain[1]) - 1] == EOS_ID and result.text.startswith("".join(CHAIN_TEXT))


# Batches


def test_batch_rows_equal_each_prompt_alone_with_very_different_lengths(engine):
    prompts = ["Hi", PROMPT * 8, list(range(3, 200)), "Edge boxes run small language models."]
    rows = engine.generate_batch(prompts, max_new_tokens=16)
    alone = [engine.generate(p, max_new_tokens=16) for p in prompts]
    assert [r.token_ids for r in rows] == [a.token_ids for a in alone]
    assert [r.text for r in rows] == [a.text for a in alone]
    assert [r.prompt_tokens for r in rows] == [a.prompt_tokens for a in alone] and rows[2].prompt_tokens == 197


def test_seeded_batch_rows_equal_each_prompt_alone(engine):
    prompts = ["Hi", PROMPT * 6]
    rows = engine.generate_batch(prompts, max_new_tokens=16, **SAMPLED)
    assert [r.token_ids for r in rows] == [engine.generate(p, max_new_tokens=16, **SAMPLED).token_ids for p in prompts]


def test_each_row_of_a_batch_stops_on_its_own(chain):
    engine, ids = chain
    rows = engine.generate_batch([[1], ids[:20], [5, 6, 1]], max_new_tokens=40)
    assert [r.token_ids for r in rows] == [ids[1:], ids[20:], ids[1:]]
    assert [r.finish_reason for r in rows] == ["eos"] * 3
    stopped = engine.generate_batch([[1], ids[:10]], stop="mode", max_new_tokens=40)
    assert [(r.text, r.finish_reason) for r in stopped] == [("Edge boxes東京🙂 ", "stop"), ("京🙂 ", "stop")]


def test_streaming_a_batch_tags_each_piece_with_its_row(chain):
    engine, ids = chain
    texts = ["", ""]
    for row, piece in engine.stream_batch([[1], ids[:13]]):
        texts[row] += piece.text
    assert texts == ["".join(CHAIN_TEXT), "🙂 model; STOP"]
    with pytest.raises(GenerationError, match="stream takes one prompt: use stream_batch"):
        engine.stream([[1], [1]])


def test_generate_with_a_list_of_prompts_still_runs_the_batch_and_warns(engine):
    prompts = ["Hi", PROMPT]
    with pytest.warns(DeprecationWarning, match="call generate_batch"):
        rows = engine.generate(prompts, max_new_tokens=6)
    assert [r.token_ids for r in rows] == [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=6)]
    with pytest.raises(GenerationError, match="stream_batch takes a non-empty list of prompts"):
        engine.generate_batch("Hi")


def test_in_a_batch_the_longest_prompt_sets_the_room_left(engine):
    rows = engine.generate_batch([[5] * 240, [5] * 3], max_new_tokens=30)
    assert [len(r.token_ids) for r in rows] == [16, 16] and {r.finish_reason for r in rows} == {"length"}
    with pytest.raises(GenerationError, match="the longest prompt of the batch has 256 tokens but the model's context is 256"):
        engine.generate_batch([[5] * 256, [5]])


# Threads


def test_one_engine_shared_by_four_threads_gives_every_caller_its_own_answer(engine):
    jobs = [
        (p, s) for p in ("Hi", PROMPT, "Edge boxes", PROMPT * 5) for s in ({}, SAMPLED, {"top_k": 5, "seed": 1, "temperature": 1.0})
    ]
    expected = [engine.generate(p, max_new_tokens=20, **s).token_ids for p, s in jobs]
    answers = {}

    def work(worker):
        for index in range(worker, len(jobs), 4):
            prompt, settings = jobs[index]
            if index % 2:
                answers[index] = [t for piece in engine.stream(prompt, max_new_tokens=20, **settings) for t in piece.token_ids]
            else:
                answers[index] = engine.generate(prompt, max_new_tokens=20, **settings).token_ids

    assert in_threads(work, 4) == []
    assert [answers[i] for i in range(len(jobs))] == expected


# Chat


def test_chat_renders_the_template_with_a_system_message_like_transformers(engine, tiny_llama):
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Где Париж? 東京?"},
    ]
    expected = AutoTokenizer.from_pretrained(tiny_llama[0]).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    assert engine.chat_prompt(messages) == expected
    assert engine.chat(messages, max_new_tokens=8).token_ids == engine.generate(expected, max_new_tokens=8).token_ids
    assert "".join(p.text for p in engine.stream_chat(messages, max_new_tokens=8)) == engine.chat(messages, max_new_tokens=8).text
    with pytest.raises(GenerationError, match="messages must be a non-empty list of"):
        engine.chat([{"content": "no role"}])
