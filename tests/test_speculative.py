"""Speculative decoding: proposed tokens checked in one pass give exactly the greedy tokens of plain
decoding, the same distribution when sampling, and fewer passes where proposals are right."""

import json
import shutil

import numpy as np
import onnx
import pytest
from conftest import build_llama, count_graph_runs

from edgeinfer import Engine
from edgeinfer.sdk.errors import ManifestError, SettingsError
from edgeinfer.sdk.sampling import Sampler
from edgeinfer.sdk.settings import GenerationConfig
from edgeinfer.sdk.speculative import Speculation, lookup

# A tiny llama with small random weights repeats itself after these prompts, in loops of one to
# several tokens, so lookup finds n-grams to propose, some right and some wrong.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [100, 101, 102, 9, 100, 101, 102]]
SMALL_WEIGHTS = dict(initializer_range=0.02)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The repeating tiny llama with its cache written in place, and without the rewrite."""
    from edgeinfer.export import ExportOptions, export_model

    root = tmp_path_factory.mktemp("speculative")
    build_llama(root / "hf", **SMALL_WEIGHTS)
    export_model(str(root / "hf"), root / "in-place")
    export_model(str(root / "hf"), root / "growing", ExportOptions(fuse=False))
    return {"in place": root / "in-place", "growing": root / "growing"}


@pytest.fixture(scope="module", params=["in place", "growing"])
def engine(exports, request):
    engine = Engine.load(exports[request.param], provider="cpu", prefix_cache=0)
    assert engine.manifest.kv.in_place == (request.param == "in place")
    return engine


def test_lookup_proposes_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest of two matches
    assert lookup([4, 1, 2, 5, 6, 1, 2], 5) == [5, 6, 1, 2]  # at most what follows
    assert lookup([1, 2, 3, 4], 3) == []  # no earlier n-gram
    assert lookup([7, 8, 9, 7, 8], 0) == []


def test_several_tokens_in_one_pass_give_the_logits_of_one_at_a_time(engine):
    ids, more = PROMPTS[1], [11, 12, 13, 14]
    one = engine.runner.new_batch(1, 64)
    engine.runner.prefill(one, [ids])
    single = np.concatenate([engine.runner.decode(one, [t]).numpy()[:, -1] for t in more])
    several = engine.runner.new_batch(1, 64)
    engine.runner.prefill(several, [ids])
    np.testing.assert_allclose(engine.runner.verify(several, 0, more).numpy()[0], single, atol=1e-5)


@pytest.mark.parametrize("count", [1, 3, 8])
def test_greedy_tokens_equal_plain_greedy(engine, count):
    totals = [0, 0]
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
        fast = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, speculative="prompt_lookup", num_speculative_tokens=count)
        assert fast.token_ids == plain.token_ids and fast.text == plain.text and fast.finish_reason == "length"
        assert plain.proposed_tokens is None and 0 <= fast.accepted_tokens <= fast.proposed_tokens
        totals = [totals[0] + fast.proposed_tokens, totals[1] + fast.accepted_tokens]
    assert 0 < totals[1] < totals[0]  # guesses were made, some kept and some rejected


def test_never_more_tokens_than_asked_and_stops_hold(engine):
    prompt = PROMPTS[0]
    for limit in range(1, 9):
        plain = engine.generate(prompt, max_new_tokens=limit, ignore_eos=True)
        fast = engine.generate(prompt, max_new_tokens=limit, ignore_eos=True, speculative="prompt_lookup")
        assert fast.token_ids == plain.token_ids and len(fast.token_ids) == limit
    plain = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
    stop_id = plain.token_ids[10]
    for settings in ({"stop_token_ids": [stop_id]}, {"stop": [plain.text[12:15]]}):
        expected = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, **settings)
        fast = engine.generate(prompt, max_new_tokens=40, ignore_eos=True, speculative="prompt_lookup", **settings)
        assert (fast.text, fast.token_ids, fast.finish_reason) == (expected.text, expected.token_ids, "stop")


def test_streamed_pieces_join_to_the_result(engine):
    settings = dict(max_new_tokens=40, ignore_eos=True, speculative="prompt_lookup")
    pieces = list(engine.stream(PROMPTS[0], **settings))
    result = engine.generate(PROMPTS[0], **settings)
    assert "".join(p.text for p in pieces) == result.text
    assert [t for p in pieces for t in p.token_ids] == result.token_ids
    assert (pieces[-1].proposed_tokens, pieces[-1].accepted_tokens) == (result.proposed_tokens, result.accepted_tokens)


def test_a_batch_row_accepts_its_own_count(exports):
    engine = Engine.load(exports["in place"], provider="cpu", prefix_cache=0)
    settings = dict(max_new_tokens=30, ignore_eos=True)
    rows = engine.generate_batch(PROMPTS, speculative="prompt_lookup", **settings)
    assert [r.token_ids for r in rows] == [engine.generate(p, **settings).token_ids for p in PROMPTS]
    assert len({(r.proposed_tokens, r.accepted_tokens) for r in rows}) > 1
    configs = [GenerationConfig(speculative="prompt_lookup", **settings), GenerationConfig(**settings)]
    mixed = engine.generate_batch(PROMPTS[:2], configs)
    assert [r.token_ids for r in mixed] == [r.token_ids for r in rows[:2]] and mixed[1].proposed_tokens is None
    growing = Engine.load(exports["growing"], provider="cpu", prefix_cache=0)
    with pytest.raises(SettingsError, match="one prompt at a time"):
        growing.generate_batch(PROMPTS, speculative="prompt_lookup", **settings)


def test_greedy_with_penalties_bias_and_logprobs_equals_plain(engine):
    settings = dict(max_new_tokens=30, ignore_eos=True, repetition_penalty=1.3, logit_bias={7: 2.0}, logprobs=True, top_logprobs=2)
    plain = engine.generate(PROMPTS[0], **settings)
    fast = engine.generate(PROMPTS[0], speculative="prompt_lookup", **settings)
    assert fast.token_ids == plain.token_ids
    assert [(t.token, round(t.logprob, 4)) for t in fast.logprobs] == [(t.token, round(t.logprob, 4)) for t in plain.logprobs]


def test_right_proposals_save_passes(chain_llama):
    """The chain model says its chain and then EOS; with the chain in the prompt, lookup proposes
    it and the guesses are right up to the chain's end, so far fewer passes make the same output."""
    folder, chain = chain_llama
    engine = Engine.load(folder, provider="cpu", prefix_cache=0)
    prompt = chain + [1]  # the chain once, then its first token again
    runs = count_graph_runs(engine)
    plain = engine.generate(prompt, max_new_tokens=64)
    plain_runs = len(runs)
    runs.clear()
    fast = engine.generate(prompt, max_new_tokens=64, speculative="prompt_lookup", num_speculative_tokens=8)
    assert fast.token_ids == plain.token_ids == chain[1:] and fast.finish_reason == plain.finish_reason == "eos"
    assert fast.proposed_tokens - fast.accepted_tokens <= 2  # lookup's guess after the chain's end: what followed it in the prompt
    assert len(runs) < plain_runs / 3


def test_the_rejection_rule_keeps_the_distribution():
    """A proposal kept with its probability, else a draw without it: the chosen token follows the
    model's distribution exactly, whatever is proposed."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    expected = np.array([0.5, 0.3, 0.15, 0.05])
    for proposal in (0, 1, 3):
        sampler = Sampler(GenerationConfig(temperature=1.0, seed=proposal))
        draws = [sampler.choose(logits, proposal=proposal)[0] for _ in range(20000)]
        observed = np.bincount(draws, minlength=4) / len(draws)
        assert np.abs(observed - expected).sum() / 2 < 0.015, (proposal, observed)


def test_sampled_output_has_the_distribution_of_plain_sampling(exports):
    """1,000 seeded draws of 3 tokens, with and without speculation (the model as its own draft, so
    its argmax is proposed at every step and kept about 40% of the time): the empirical
    distributions of each position's token are within a total-variation distance that sampling
    noise explains (two plain runs with other seeds differ by 0.06 and 0.09 at positions 1 and 2;
    a rule that always keeps the proposal gives 0.64, one that may draw the rejected token again 0.26)."""
    folder = exports["in place"]
    engine = Engine.load(folder, provider="cpu", prefix_cache=0, draft=folder)
    draws, settings = 1000, dict(max_new_tokens=3, ignore_eos=True, temperature=0.3, top_k=3)
    rows = {
        spec: engine.generate_batch(
            [PROMPTS[0]] * draws, [GenerationConfig(seed=s, speculative=spec, **settings) for s in range(draws)]
        )
        for spec in (None, "draft")
    }
    proposed, accepted = (sum(getattr(r, n) for r in rows["draft"]) for n in ("proposed_tokens", "accepted_tokens"))
    assert proposed >= draws and 0.2 * proposed < accepted < 0.8 * proposed
    for position, bound in ((1, 0.15), (2, 0.2)):
        counts = [np.bincount([r.token_ids[position] for r in rows[spec]], minlength=320) / draws for spec in rows]
        assert np.abs(counts[0] - counts[1]).sum() / 2 < bound, position


def test_a_draft_model_gives_plain_greedy_tokens(exports, tmp_path):
    from edgeinfer.export import export_model

    build_llama(tmp_path / "other-hf", seed=1, **SMALL_WEIGHTS)
    export_model(str(tmp_path / "other-hf"), tmp_path / "other")
    target = exports["in place"]
    plain = Engine.load(target, provider="cpu", prefix_cache=0)
    for draft, all_right in ((target, True), (tmp_path / "other", False)):
        engine = Engine.load(target, provider="cpu", prefix_cache=0, draft=draft)
        for prompt in PROMPTS:
            expected = plain.generate(prompt, max_new_tokens=30, ignore_eos=True)
            fast = engine.generate(prompt, max_new_tokens=30, ignore_eos=True, speculative="draft", num_speculative_tokens=4)
            assert fast.token_ids == expected.token_ids
            assert (fast.accepted_tokens == fast.proposed_tokens) == all_right and fast.proposed_tokens > 0
        rows = engine.generate_batch(PROMPTS, max_new_tokens=30, ignore_eos=True, speculative="draft")
        assert [r.token_ids for r in rows] == [plain.generate(p, max_new_tokens=30, ignore_eos=True).token_ids for p in PROMPTS]


def test_a_draft_with_another_vocabulary_or_a_shorter_context_is_refused(tiny_llama, tmp_path):
    from edgeinfer.export import ExportOptions, export_model

    build_llama(tmp_path / "hf", vocab_size=384)
    export_model(str(tmp_path / "hf"), tmp_path / "wide")
    with pytest.raises(ManifestError, match="another vocabulary"):
        Engine.load(tiny_llama[1], provider="cpu", draft=tmp_path / "wide")
    export_model(str(tiny_llama[0]), tmp_path / "short", ExportOptions(max_context=64))
    with pytest.raises(SettingsError, match="serves 64 tokens, fewer than this engine's 256: load the engine with max_context=64"):
        Engine.load(tiny_llama[1], provider="cpu", draft=tmp_path / "short")
    engine = Engine.load(tiny_llama[1], provider="cpu", max_context=64, draft=tmp_path / "short")
    assert engine.draft.max_context == 64 and engine.generate([5, 6], speculative="draft", max_new_tokens=8).proposed_tokens > 0


def test_bad_settings_are_refused(tiny_llama):
    engine = Engine.load(tiny_llama[1], provider="cpu", prefix_cache=0)
    with pytest.raises(SettingsError, match="speculative must be"):
        engine.generate([5, 6], speculative="ngram")
    for count in (0, 33):
        with pytest.raises(SettingsError, match="num_speculative_tokens"):
            engine.generate([5, 6], speculative="prompt_lookup", num_speculative_tokens=count)
    with pytest.raises(SettingsError, match="needs a draft model"):
        engine.generate([5, 6], speculative="draft")


def test_an_export_without_logits_to_keep_is_refused_for_speculation(tiny_llama, tmp_path):
    """An export made before the graph took `logits_to_keep` still generates, and says to export
    again for speculative decoding."""
    old = tmp_path / "old"
    shutil.copytree(tiny_llama[1], old)
    model = onnx.load(str(old / "model.onnx"), load_external_data=False)
    graph = model.graph
    graph.input.remove(next(i for i in graph.input if i.name == "logits_to_keep"))
    graph.initializer.append(onnx.helper.make_tensor("logits_to_keep", onnx.TensorProto.INT64, [], [1]))
    onnx.save(model, str(old / "model.onnx"))
    manifest = json.loads((old / "edgeinfer.json").read_text())
    manifest["graph"]["inputs"].remove("logits_to_keep")
    manifest["files"]["model.onnx"]["size"] = (old / "model.onnx").stat().st_size
    (old / "edgeinfer.json").write_text(json.dumps(manifest))
    engine = Engine.load(old, provider="cpu", prefix_cache=0)
    expected = Engine.load(tiny_llama[1], provider="cpu", prefix_cache=0).generate(PROMPTS[0], max_new_tokens=8).token_ids
    assert engine.generate(PROMPTS[0], max_new_tokens=8).token_ids == expected
    with pytest.raises(SettingsError, match="export the model again"):
        engine.generate(PROMPTS[0], speculative="prompt_lookup")
    from test_cli import edgeinfer

    assert "speculative decoding: no, the graph gives the last position's logits only" in edgeinfer("info", str(old)).stdout


def test_a_row_whose_guesses_fail_pauses():
    class Wrong:
        def propose(self, tokens, count):
            return [0] * count

        def record(self, proposed, accepted):
            pass

    speculation = Speculation(Wrong(), most=4)
    made = []
    for _ in range(12):
        proposal = speculation.propose([1, 2, 3], room=10)
        made.append(len(proposal))
        if proposal:
            speculation.record(len(proposal), 0)
    assert made == [4, 0, 3, 0, 0, 0, 2, 0, 0, 0, 0, 0]  # pauses of 1, 3, 7 steps; a shorter guess each time
    assert speculation.proposed == 9


def test_the_scheduler_serves_speculating_rows_beside_plain_ones(exports):
    """Requests from threads, some with speculation and some without, greedy and sampled: each gets
    what it gets alone (greedy: the plain tokens)."""
    from conftest import in_threads

    from edgeinfer import Scheduler

    engine = Engine.load(exports["in place"], provider="cpu", prefix_cache=0)
    jobs = [(PROMPTS[i % 3], {"speculative": "prompt_lookup"} if i % 2 else {}) for i in range(8)]
    jobs.append((PROMPTS[0], {"speculative": "prompt_lookup", "temperature": 0.8, "seed": 5}))
    expected = [engine.generate(prompt, max_new_tokens=30, ignore_eos=True, **settings) for prompt, settings in jobs]
    results = [None] * len(jobs)

    def call(job):
        prompt, settings = jobs[job]
        results[job] = scheduler.submit(prompt, max_new_tokens=30, ignore_eos=True, **settings).result()

    with Scheduler(engine, max_batch=4) as scheduler:
        assert in_threads(call, len(jobs)) == []
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [(r.proposed_tokens, r.accepted_tokens) for r in results] == [(e.proposed_tokens, e.accepted_tokens) for e in expected]
    plain = engine.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    assert [r.token_ids for r in results[:3]] == [plain.token_ids, *(e.token_ids for e in expected[1:3])]
    assert sum(r.accepted_tokens or 0 for r in results) > 0


def test_the_server_speculates_by_default_or_per_request_and_reports_it_in_usage(exports):
    import openai
    from test_serve import start

    folder = exports["in place"]
    engine = Engine.load(folder, provider="cpu", prefix_cache=0)
    expected = engine.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True, speculative="prompt_lookup")
    for flags, extra in ((["--speculative", "prompt-lookup"], {}), ([], {"speculative": "prompt_lookup"})):
        process, url = start(folder, "--provider", "cpu", *flags)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            answer = client.completions.create(
                model=folder.name, prompt=PROMPTS[0], max_tokens=30, extra_body={"ignore_eos": True, **extra}
            )
            assert answer.choices[0].text == expected.text
            details = answer.usage.completion_tokens_details
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (
                expected.accepted_tokens,
                expected.proposed_tokens - expected.accepted_tokens,
            )
            stream = client.completions.create(
                model=folder.name,
                prompt=PROMPTS[0],
                max_tokens=30,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, **extra},
            )
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
            assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == expected.accepted_tokens
            plain = client.completions.create(
                model=folder.name, prompt=PROMPTS[0], max_tokens=30, extra_body={"ignore_eos": True, "speculative": None}
            )
            assert plain.choices[0].text == expected.text
        finally:
            process.kill()
            process.wait(timeout=30)


def test_a_server_with_a_draft_speculates_with_it_by_default(exports):
    import openai
    from test_serve import start

    folder = exports["in place"]
    expected = Engine.load(folder, provider="cpu", prefix_cache=0, draft=folder).generate(
        PROMPTS[1], max_new_tokens=30, ignore_eos=True, speculative="draft"
    )
    process, url = start(folder, "--provider", "cpu", "--draft", str(folder))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=folder.name, prompt=PROMPTS[1], max_tokens=30, extra_body={"ignore_eos": True})
        details = answer.usage.completion_tokens_details
        assert answer.choices[0].text == expected.text
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (expected.accepted_tokens, 0)
        assert expected.accepted_tokens > 0  # the model as its own draft: every greedy guess is kept
    finally:
        process.kill()
        process.wait(timeout=30)


def test_the_cli_takes_speculation_and_a_draft(exports):
    import re

    from test_cli import edgeinfer

    folder = exports["in place"]
    engine = Engine.load(folder, provider="cpu", prefix_cache=0)
    prompt = engine.tokenizer.decode(PROMPTS[0])
    expected = engine.generate(prompt, max_new_tokens=30, ignore_eos=True)
    base = ["run", "--raw", "--model", str(folder), "--max-new-tokens", "30", "--ignore-eos"]
    plain = edgeinfer(*base, prompt)
    lookup_run = edgeinfer(*base, "--speculative", "prompt-lookup", "--num-speculative-tokens", "3", prompt)
    draft_run = edgeinfer(*base, "--draft", str(folder), prompt)
    assert plain.returncode == lookup_run.returncode == draft_run.returncode == 0, lookup_run.stderr + draft_run.stderr
    assert lookup_run.stdout == draft_run.stdout == plain.stdout == expected.text + "\n"
    assert "speculative:" not in plain.stderr and "proposed tokens kept" in lookup_run.stderr
    kept = re.search(r"speculative: (\d+) of (\d+) proposed tokens kept", draft_run.stderr)
    assert kept and kept[1] == kept[2] != "0"  # the model as its own draft: every greedy guess is right
    refused = edgeinfer(*base, "--speculative", "draft", prompt)
    assert refused.returncode == 1 and "needs a draft model" in refused.stderr and "Traceback" not in refused.stderr


def test_a_row_never_checks_past_its_budget(chain_llama):
    """Lookup could propose the whole chain; a row proposes at most what its budget leaves (its
    cache holds exactly prompt + max_new_tokens slots), and stops at the budget."""
    folder, chain = chain_llama
    engine = Engine.load(folder, provider="cpu", prefix_cache=0)
    for limit in range(1, 9):
        fast = engine.generate(chain + [1], max_new_tokens=limit, speculative="prompt_lookup", num_speculative_tokens=8)
        assert fast.token_ids == chain[1 : limit + 1] and fast.finish_reason == "length"


def test_a_draft_forgets_its_rejected_guesses(exports):
    """After a check, the draft's cache holds the sequence as it now stands: its next guesses are
    those of a fresh draft given the same tokens."""
    from edgeinfer.sdk.speculative import DraftModel

    draft = Engine.load(exports["in place"], provider="cpu", prefix_cache=0)
    kept = DraftModel(draft, capacity=128)
    tokens = list(PROMPTS[1])
    for accepted, other in ((1, 7), (0, 9), (3, 11), (2, 13)):
        guesses = kept.propose(tokens, 4)
        assert guesses == DraftModel(draft, capacity=128).propose(tokens, 4)
        kept.record(4, accepted)
        tokens += guesses[:accepted] + [other]  # the model kept `accepted` guesses, then chose `other`
