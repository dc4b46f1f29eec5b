"""The `edgeinfer` command, run as a user runs it: a subprocess, its exit code and its output."""

import json
import os
import re
import subprocess
import sys

import pytest

from edgeinfer import Engine
from edgeinfer.sdk.errors import SettingsError


def edgeinfer(*args, env=None):
    return subprocess.run([sys.executable, "-m", "edgeinfer.cli", *args], capture_output=True, text=True, env=env, timeout=600)


def assert_one_line_error(done, *words):
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()  # progress lines may come before the error
    assert lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1, done.stderr
    for word in words:
        assert word in lines[-1]


def test_run_with_a_missing_path(tmp_path):
    assert_one_line_error(edgeinfer("run", "--model", str(tmp_path / "nope"), "hi"), "does not exist", "edgeinfer export")


def test_run_with_an_unknown_catalog_name():
    assert_one_line_error(edgeinfer("run", "--model", "no-such-model", "hi"), "'no-such-model'", "smollm2-135m-instruct")


def test_run_with_a_folder_that_is_not_an_export(tiny_llama):
    assert_one_line_error(
        edgeinfer("run", "--model", str(tiny_llama[0]), "hi"),
        "not an edgeinfer export",
        "Hugging Face model folder",
        "edgeinfer export",
    )


def test_run_with_a_file_instead_of_a_folder(tiny_llama):
    assert_one_line_error(edgeinfer("info", str(tiny_llama[1] / "edgeinfer.json")), "is a file")


def test_export_of_an_unknown_catalog_name(tmp_path):
    assert_one_line_error(edgeinfer("export", "no-such-model", "-o", str(tmp_path / "out")), "'no-such-model'", "catalog name")
    assert not (tmp_path / "out").exists()


def test_export_of_a_hub_id_that_cannot_be_reached(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = edgeinfer("export", "edgeinfer-tests/does-not-exist", "-o", str(tmp_path / "out"), env=env)
    assert_one_line_error(done, "cannot download edgeinfer-tests/does-not-exist from the Hugging Face hub", "local model folder")
    assert not (tmp_path / "out").exists()


def test_export_into_an_existing_folder_needs_force(tiny_llama, tmp_path):
    assert_one_line_error(edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path)), "already exists", "--force")


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_export_on_a_terminal_redraws_a_progress_line_and_clears_it(tiny_llama, tmp_path):
    """On a terminal (a pseudo-terminal here), `edgeinfer export` draws what a stage is doing,
    with \r and no newline, and clears it before the next line; through a pipe, it draws nothing."""
    primary, secondary = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.cli", "export", str(tiny_llama[0]), "-o", str(tmp_path / "out")],
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
    )
    os.close(secondary)
    drawn = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the terminal closes with the process
            break
        if not chunk:
            break
        drawn += chunk
    assert process.wait(timeout=600) == 0, drawn[-2000:]
    os.close(primary)
    text = drawn.decode()
    lines = re.findall(r"\r      load: (\d+) s, reading ([^\r\n]+)", text)
    assert lines and lines[0][1] == tiny_llama[0].name, text[-2000:]
    assert [int(n) for n, _ in lines] == sorted(int(n) for n, _ in lines)  # the seconds count up
    drawn_line = f"      load: {lines[-1][0]} s, reading {lines[-1][1]}"
    assert "\r" + " " * len(drawn_line) + "\r      load: done in " in text  # cleared before the stage's last line
    assert "peak memory" in text and "exported " in text
    piped = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "piped"))
    assert piped.returncode == 0 and "\r" not in piped.stderr and "[1/6] load" in piped.stderr


def test_symmetric_without_quantize_is_a_usage_error(tiny_llama, tmp_path):
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--symmetric")
    assert done.returncode == 2 and "--symmetric applies to quantized weights: add --quantize int4 or int8" in done.stderr
    assert not (tmp_path / "out").exists()
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--keep-int8", "lm_head")
    assert done.returncode == 2 and "--keep-int8 applies to quantized weights" in done.stderr
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--no-quality")
    assert done.returncode == 2 and "--no-quality applies to quantized weights" in done.stderr
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--embedding-bits", "4")
    assert done.returncode == 2 and "--embedding-bits applies to quantized weights" in done.stderr
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "fast"), "--quantize", "int8", "--no-quality")
    assert done.returncode == 0 and "quality not measured (--no-quality)" in done.stderr, done.stderr
    assert json.loads((tmp_path / "fast" / "edgeinfer.json").read_text())["quantization"]["quality"] == "not measured (--no-quality)"
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--quantize", "int4", "--keep-int8", "embed")
    assert (
        done.returncode != 0
        and "--keep-int8 'embed' names no MatMul of this model: its modules are" in done.stderr
        and "Traceback" not in done.stderr
    )
    assert not (tmp_path / "out").exists()


def test_export_takes_gptq_with_a_calibration_text_and_int8_modules(tiny_llama, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("The keeper climbed the stairs and looked out over the grey water. " * 20)
    out = tmp_path / "out"
    done = edgeinfer(
        "export", str(tiny_llama[0]), "-o", str(out), "--quantize", "int4", "--algorithm", "gptq",
        "--calibration", str(text), "--keep-int8", "lm_head,down_proj:0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    recorded = json.loads((out / "edgeinfer.json").read_text())["quantization"]
    assert (recorded["algorithm"], recorded["calibration"], recorded["keep_int8"]) == ("gptq", str(text), ["lm_head", "down_proj:0"])
    done = edgeinfer(
        "export", str(tiny_llama[0]), "-o", str(tmp_path / "rtn"), "--quantize", "int4", "--algorithm", "rtn",
        "--keep-int8", "none", "--calibration", str(text),
    )  # fmt: skip
    assert done.returncode != 0 and "--calibration is for --algorithm k_quant or gptq, or --keep-int8 auto; not rtn" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "rtn").exists()


def test_int4_is_gptq_with_the_modules_auto_chooses_unless_told(tiny_llama, tmp_path):
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--quantize", "int4")
    assert done.returncode == 0, done.stderr
    recorded = json.loads((tmp_path / "out" / "edgeinfer.json").read_text())["quantization"]
    assert recorded["algorithm"] == "gptq" and recorded["calibration"] is None
    assert recorded["keep_int8"] and "auto" not in recorded["keep_int8"], recorded
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "int8"), "--quantize", "int8")
    recorded = json.loads((tmp_path / "int8" / "edgeinfer.json").read_text())["quantization"]
    assert done.returncode == 0 and (recorded["algorithm"], recorded["keep_int8"]) == ("rtn", []), done.stderr


def test_export_takes_hqq_and_an_int8_lm_head(tiny_llama, tmp_path):
    done = edgeinfer(
        "export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--quantize", "int4", "--algorithm", "hqq", "--keep-int8", "lm_head"
    )
    assert done.returncode == 0, done.stderr
    recorded = json.loads((tmp_path / "out" / "edgeinfer.json").read_text())["quantization"]
    assert (recorded["method"], recorded["algorithm"], recorded["keep_int8"]) == ("int4", "hqq", ["lm_head"])
    assert "in windows of 256 (llama-perplexity's way)" in done.stderr
    assert Engine.load(tmp_path / "out", provider="cpu").generate("The capital", max_new_tokens=4).token_ids


def test_debug_shows_the_traceback(tmp_path):
    done = edgeinfer("--debug", "run", "--model", str(tmp_path / "nope"), "hi")
    assert done.returncode != 0 and "Traceback" in done.stderr and "ModelNotFoundError" in done.stderr


def test_run_streams_the_same_text_as_the_sdk(tiny_llama):
    done = edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--provider", "cpu", "--max-new-tokens", "16", "The capital")
    assert done.returncode == 0, done.stderr
    expected = Engine.load(tiny_llama[1], provider="cpu").generate("The capital", max_new_tokens=16)
    assert done.stdout == expected.text + "\n"
    assert "time to first token" in done.stderr and "tokens/s" in done.stderr and "finish: length" in done.stderr
    assert "provider: cpu" in done.stderr


def test_run_answers_through_the_chat_template_by_default(tiny_llama):
    """A model with a chat template gets PROMPT as a user's message, as `ollama run` does; --chat
    says so explicitly, --raw continues PROMPT's text."""
    engine = Engine.load(tiny_llama[1], provider="cpu")
    expected = engine.chat([{"role": "user", "content": "Hello"}], max_new_tokens=8)
    assert expected.prompt_tokens == len(engine.chat_prompt([{"role": "user", "content": "Hello"}]))
    for flags in ([], ["--chat"]):
        done = edgeinfer("run", "--model", str(tiny_llama[1]), *flags, "--max-new-tokens", "8", "Hello")
        assert done.returncode == 0 and done.stdout == expected.text + "\n", flags
        assert f"prompt {expected.prompt_tokens} tokens" in done.stderr
    raw = edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--max-new-tokens", "8", "--json", "Hello")
    assert json.loads(raw.stdout)["token_ids"] == engine.generate("Hello", max_new_tokens=8).token_ids
    chat = edgeinfer("run", "--model", str(tiny_llama[1]), "--max-new-tokens", "8", "--json", "Hello")
    assert json.loads(chat.stdout)["token_ids"] == expected.token_ids


def test_version():
    from edgeinfer import __version__

    done = edgeinfer("--version")
    assert done.returncode == 0 and done.stdout == f"edgeinfer {__version__}\n"


def test_info_says_what_the_export_is_first_and_json_gives_the_manifest(tiny_llama):
    done = edgeinfer("info", str(tiny_llama[1]))
    assert done.returncode == 0, done.stderr
    manifest = json.loads(edgeinfer("info", "--json", str(tiny_llama[1])).stdout)
    assert manifest["architecture"] == "llama" and manifest["kv"]["num_layers"] == 2
    summary, memory, prefix, graphs, speculative, providers = done.stdout.splitlines()
    assert summary == f"{manifest['source']}: llama, 2 layers, context 256 tokens, fp32, in {tiny_llama[1]}"
    assert graphs == "graphs: single, model.onnx for prefill and decode"
    weights = (manifest["files"]["model.onnx"]["size"] + manifest["files"]["model.onnx.data"]["size"]) / 1024
    # 2 layers x 2 kv heads x (16 + 16) values x 4 bytes = 512 bytes a token; 256 tokens = 128 KiB
    assert (
        memory
        == f"memory: weights {weights:.1f} KiB, KV cache 0.5 KiB per token and row, 128.0 KiB for the whole context of 256 tokens"
    )
    assert providers.startswith("providers: cpu: usable; cuda: ")
    assert prefix.startswith("prefix cache: 64 MiB by default, 131072 tokens of prompts")  # 64 MiB / 512 B
    assert speculative == "speculative decoding: yes (--speculative prompt-lookup, or --draft MODEL)"


def test_run_with_an_unknown_provider(tiny_llama):
    done = edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--provider", "bogus", "hi")
    assert done.returncode == 2 and "Invalid value for '--provider'" in done.stderr and "Traceback" not in done.stderr


def test_run_takes_every_generation_setting_as_a_flag(tiny_llama):
    flags = [
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--min-p",
        "0.01",
        "--repetition-penalty",
        "1.1",
        "--seed",
        "4",
        "--stop",
        "zz",
        "--stop",
        "qq",
        "--stop-token-id",
        "300",
        "--max-new-tokens",
        "12",
    ]
    done = edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", *flags, "The capital")
    expected = Engine.load(tiny_llama[1], provider="cpu").generate(
        "The capital",
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.1,
        seed=4,
        stop=["zz", "qq"],
        stop_token_ids=[300],
        max_new_tokens=12,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.text + "\n" and f"finish: {expected.finish_reason}" in done.stderr


def test_every_generation_setting_has_a_flag():
    from edgeinfer.cli.options import GENERATION_OPTIONS
    from edgeinfer.sdk.settings import FIELDS

    names = [option(lambda: None).__click_params__[0].name for option in GENERATION_OPTIONS]
    # response_format comes from one of three flags; --logprobs K sets logprobs and top_logprobs
    expected = set(FIELDS) - {"response_format", "top_logprobs"} | {"json_schema", "regex", "grammar"}
    assert sorted(names) == sorted(expected)


def test_run_takes_constraints_penalties_and_logprobs_as_flags(tiny_llama, tmp_path):
    engine = Engine.load(tiny_llama[1], provider="cpu")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    runs = [
        (
            ["--json-schema", str(tmp_path / "schema.json")],
            {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        ),
        (["--regex", "[0-9]{2}"], {"response_format": {"type": "regex", "pattern": "[0-9]{2}"}}),
        (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
        (
            ["--presence-penalty", "0.5", "--frequency-penalty", "1", "--logit-bias", "5=4", "--logprobs", "2"],
            {"presence_penalty": 0.5, "frequency_penalty": 1.0, "logit_bias": {5: 4.0}, "logprobs": True, "top_logprobs": 2},
        ),
    ]
    for flags, settings in runs:
        done = edgeinfer(
            "run",
            "--model",
            str(tiny_llama[1]),
            "--raw",
            "--json",
            "--max-new-tokens",
            "12",
            "--temperature",
            "1",
            "--seed",
            "3",
            *flags,
            "The capital",
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        expected = engine.generate("The capital", max_new_tokens=12, temperature=1.0, seed=3, **settings)
        assert (result["token_ids"], result["complete"]) == (expected.token_ids, expected.complete), flags
        if "logprobs" in settings:
            assert [t["logprob"] for t in result["logprobs"]] == pytest.approx([t.logprob for t in expected.logprobs])
            assert all(len(t["top"]) == 2 for t in result["logprobs"])
    assert re.fullmatch(
        "[0-9]{2}",
        json.loads(edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--json", "--regex", "[0-9]{2}", "The capital").stdout)[
            "text"
        ],
    )
    both = edgeinfer(
        "run", "--model", str(tiny_llama[1]), "--raw", "--regex", "a", "--json-schema", str(tmp_path / "schema.json"), "x"
    )
    assert both.returncode != 0 and "--json-schema and --regex both constrain the output: pass one" in both.stderr
    bad = edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--logit-bias", "five=1", "x")
    assert bad.returncode != 0 and "'five=1' is not ID=BIAS" in bad.stderr


def test_run_json_prints_one_machine_readable_result(tiny_llama):
    done = edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--json", "--max-new-tokens", "9", "--ignore-eos", "The capital")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    expected = Engine.load(tiny_llama[1], provider="cpu").generate("The capital", max_new_tokens=9)
    assert (result["text"], result["token_ids"], result["finish_reason"]) == (expected.text, expected.token_ids, "length")
    assert result["prompt_tokens"] == expected.prompt_tokens and result["provider"] == "cpu"
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0


def test_run_reads_the_prompt_from_stdin(tiny_llama):
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "run", "--model", str(tiny_llama[1]), "--raw", "--json", "--max-new-tokens", "6", "-"],
        input="The capital\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    expected = Engine.load(tiny_llama[1], provider="cpu").generate("The capital", max_new_tokens=6)
    assert done.returncode == 0 and json.loads(done.stdout)["token_ids"] == expected.token_ids, done.stderr


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--top-p", "2"), ("error: --top-p must be a number in (0, 1]", "got 2.0")),
        (("--max-new-tokens", "0"), ("error: --max-new-tokens must be an integer of at least 1", "got 0")),
        (("--logit-bias", "1=500"), ("error: --logit-bias[1] must be a number in [-100, 100]",)),
        (("--regex", "("), ("error: --json-schema, --regex or --grammar: the regex cannot be used", "unclosed group")),
    ],
)
def test_run_with_an_invalid_setting_names_its_flag_on_one_line(tiny_llama, flags, words):
    """The SDK's messages name its parameters (top_p); the CLI's name its flags (--top-p)."""
    assert_one_line_error(edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", *flags, "hi"), *words)


def chat(folder, lines, *flags):
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "chat", "--model", str(folder), "--max-new-tokens", "6", *flags],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_chat_keeps_the_conversation_and_streams_each_reply(tiny_llama):
    done = chat(tiny_llama[1], ["Hello", "And Paris?"], "--system", "Be brief.")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    engine = Engine.load(tiny_llama[1], provider="cpu")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = engine.chat(messages, max_new_tokens=6).text
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And Paris?"}]
    second = engine.chat(messages, max_new_tokens=6).text
    assert done.stdout == first + "\n" + second + "\n"


def test_chat_reset_starts_a_new_conversation(tiny_llama):
    done = chat(tiny_llama[1], ["Hello", "/reset", "And Paris?", "/exit", "never read"])
    engine = Engine.load(tiny_llama[1], provider="cpu")
    replies = [engine.chat([{"role": "user", "content": text}], max_new_tokens=6).text for text in ("Hello", "And Paris?")]
    assert done.returncode == 0 and done.stdout == "\n".join(replies) + "\n"
    assert "(conversation cleared)" in done.stderr


def test_chat_drops_the_oldest_exchange_when_the_context_is_full(tiny_llama):
    long = "Edge boxes run small language models. " * 6  # about 60 tokens a message; the context is 256
    done = chat(tiny_llama[1], [long + str(i) for i in range(5)])
    assert done.returncode == 0, done.stderr
    assert "oldest exchange was dropped" in done.stderr and len(done.stdout.splitlines()) >= 5


def test_chat_ends_cleanly_on_ctrl_c_at_the_prompt(tiny_llama):
    import signal
    import time

    process = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.cli", "chat", "--model", str(tiny_llama[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    output = ""
    while "> " not in output and time.monotonic() < deadline:  # wait for the first prompt
        output += process.stderr.read(1)
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in output + rest, output + rest


def test_check_confirms_an_export_against_its_source(tiny_llama):
    done = edgeinfer("check", str(tiny_llama[1]), "--against", str(tiny_llama[0]), "--new-tokens", "8")
    assert done.returncode == 0, done.stderr
    assert "greedy tokens (8 after a " in done.stdout and "equal to transformers'" in done.stdout
    assert "rows equal to single runs" in done.stdout and done.stdout.endswith("check passed\n")


def test_check_against_other_weights_fails_in_one_line(tiny_llama, tmp_path):
    from conftest import build_llama

    build_llama(tmp_path / "other", seed=1)
    done = edgeinfer("check", str(tiny_llama[1]), "--against", str(tmp_path / "other"), "--new-tokens", "8")
    assert "ABOVE tolerance" in done.stdout
    assert_one_line_error(done, "does not match", "re-export")


def test_info_lists_the_architectures():
    from edgeinfer.export.families import TESTED

    done = edgeinfer("info", "--architectures")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].strip().split(", ") == list(TESTED) and "internlm2: transformers 5 has no internlm2 model" in done.stdout


def test_export_of_an_architecture_edgeinfer_has_never_seen(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "made_up_lm"}')
    done = edgeinfer("export", str(tmp_path / "model"), "-o", str(tmp_path / "out"))
    assert_one_line_error(done, "model type 'made_up_lm' cannot be exported", "trust_remote_code", "edgeinfer info --architectures")


def test_export_with_a_smaller_context(tiny_llama, tmp_path):
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "out"), "--max-context", "64")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "edgeinfer.json").read_text())["max_context"] == 64
    assert len(Engine.load(tmp_path / "out", provider="cpu").generate([5] * 60, max_new_tokens=10).token_ids) == 4
    assert_one_line_error(
        edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "big"), "--max-context", "1000"),
        "--max-context 1000 is more than this model's context of 256 tokens",
    )


def test_bench_prints_a_table_and_writes_json_and_a_plot(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": {"short": [5, 6, 7], "long": list(range(3, 103))}}))
    done = edgeinfer(
        "bench",
        str(tiny_llama[1]),
        "--prompts",
        str(prompts),
        "--new-tokens",
        "8",
        "--repeats",
        "2",
        "--json",
        str(tmp_path / "bench.json"),
        "--plot",
        str(tmp_path / "bench.png"),
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "bench.json").read_text())
    assert list(figures["prompts"]) == ["short", "long"] and figures["new_tokens"] == 8 and figures["repeats"] == 2
    assert [figures["prompts"][n]["prompt_tokens"] for n in ("short", "long")] == [3, 100]
    for row in figures["prompts"].values():
        assert len(row["runs_ttft_ms"]) == 2 and row["ttft_ms"] > 0 and row["decode_tokens_per_s"] > 0
    assert figures["load_s"] > 0 and figures["peak_rss_mib"] >= figures["rss_after_load_mib"] > 0
    table = done.stdout.splitlines()
    assert table[2].split() == ["prompt", "tokens", "TTFT", "ms", "decode", "tok/s"] and table[3].split()[:2] == ["short", "3"]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_verify_reads_every_file_against_the_manifest(tiny_llama, tmp_path):
    import shutil

    copy = shutil.copytree(tiny_llama[1], tmp_path / "export")
    done = edgeinfer("verify", str(copy))
    files = json.loads((copy / "edgeinfer.json").read_text())["files"]
    assert done.returncode == 0 and f"verified {len(files)} files" in done.stdout and "all match the manifest" in done.stdout
    data = bytearray((copy / "tokenizer.json").read_bytes())
    data[10] = ord("X") if data[10] != ord("X") else ord("Y")
    (copy / "tokenizer.json").write_bytes(bytes(data))
    assert_one_line_error(edgeinfer("verify", str(copy)), "tokenizer.json does not match the SHA-256", "export the model again")


def test_run_with_a_smaller_context_and_truncation(tiny_llama):
    prompt = "Edge boxes run small language models. " * 40
    assert_one_line_error(
        edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--max-context", "64", prompt),
        "but the engine's (max_context) context is 64",
        "--truncate left",
    )
    done = edgeinfer(
        "run",
        "--model",
        str(tiny_llama[1]),
        "--raw",
        "--max-context",
        "64",
        "--truncate",
        "left",
        "--max-new-tokens",
        "8",
        "--json",
        prompt,
    )
    result = json.loads(done.stdout)
    assert (result["prompt_tokens"], len(result["token_ids"])) == (56, 8) and result["truncated_tokens"] > 0
    assert_one_line_error(
        edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--memory-limit", "0", "hi"),
        "memory_limit must be an integer of at least 1",
    )


def test_export_into_a_folder_that_cannot_be_made(tiny_llama):
    assert_one_line_error(
        edgeinfer("export", str(tiny_llama[0]), "-o", "/proc/edgeinfer-test/out"),
        "the file system refused /proc/edgeinfer-test (No such file or directory)",
        "export elsewhere",
    )


def test_the_benchmark_prompts_ship_with_the_repository():
    """`edgeinfer bench --prompts benchmarks/prompts.json` and benchmarks/generation.py read them on a fresh clone."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts.json"
    prompts = json.loads(path.read_text())["prompts"]
    assert {name: len(ids) for name, ids in prompts.items()} == {"p16": 16, "p128": 128, "p512": 512, "p1024": 1024}
    assert all(ids == prompts["p1024"][: len(ids)] for ids in prompts.values())  # prefixes of one text
    assert all(isinstance(t, int) and 0 <= t < 49152 for t in prompts["p1024"])  # SmolLM2's vocabulary


def test_edgeinfer_profile_writes_one_profile_of_the_model_graphs_runs(tiny_llama, tmp_path):
    """EDGEINFER_PROFILE (benchmarks/gpu_check.sh) profiles the model graph: the prefill and one
    run per decode step, and benchmarks/profile_copies.py reads it (no copies on the CPU)."""
    from pathlib import Path

    done = edgeinfer(
        "run",
        "--model",
        str(tiny_llama[1]),
        "--provider",
        "cpu",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "Hi",
        env={**os.environ, "EDGEINFER_PROFILE": str(tmp_path / "profile")},
    )
    assert done.returncode == 0, done.stderr
    (profile,) = tmp_path.glob("profile_*.json")
    runs = [e for e in json.loads(profile.read_text()) if e.get("cat") == "Session" and e.get("name") == "model_run"]
    assert len(runs) == 6  # the prefill made the first token, 5 decode steps the rest
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_copies.py"
    read = subprocess.run([sys.executable, str(script), str(profile)], capture_output=True, text=True, timeout=60)
    assert read.returncode == 0 and read.stdout.startswith("6 graph runs; Memcpy nodes run 0 times"), read.stdout + read.stderr


def test_run_takes_the_prefix_cache_budget(tiny_llama):
    off = edgeinfer(
        "run", "--model", str(tiny_llama[1]), "--raw", "--prefix-cache", "0", "--json", "--max-new-tokens", "6", "The capital"
    )
    assert off.returncode == 0, off.stderr
    expected = Engine.load(tiny_llama[1], provider="cpu").generate("The capital", max_new_tokens=6)
    assert json.loads(off.stdout)["token_ids"] == expected.token_ids
    bad = edgeinfer("run", "--model", str(tiny_llama[1]), "--raw", "--prefix-cache", "-1", "x")
    assert bad.returncode == 2 and "--prefix-cache" in bad.stderr and "-1" in bad.stderr


def test_export_split_then_info_check_and_run_as_a_user_does(tiny_llama, tmp_path):
    """`--graphs split` with both shapes fixed, driven through the command: info names the two
    graphs, `edgeinfer check` passes it against its source (a batch kept within the 16-position
    prefill graph), run gives the single graph's tokens; the flags without --graphs split are
    refused in one line, and nothing is written."""
    out = tmp_path / "split"
    done = edgeinfer(
        "export", str(tiny_llama[0]), "-o", str(out), "--graphs", "split", "--prefill-length", "16", "--static-context", "96"
    )
    assert done.returncode == 0, done.stderr
    assert "[7/7] write" in done.stderr and "greedy tokens equal" in done.stderr
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".onnx", ".data")) == ["decode.onnx", "prefill.onnx", "weights.data"]
    info = edgeinfer("info", str(out))
    assert "graphs: split, prefill.onnx (16 positions) and decode.onnx (a cache of 96 slots, one token a pass)" in info.stdout
    assert json.loads(edgeinfer("info", "--json", str(out)).stdout)["static_context"] == 96
    check = edgeinfer("check", str(out), "--against", str(tiny_llama[0]))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "batch of two prompts: rows equal to single runs" in check.stdout and check.stdout.strip().endswith("check passed")
    run = edgeinfer("run", "The capital of France is", "--raw", "--model", str(out), "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert run.returncode == 0, run.stderr
    expected = Engine.load(tiny_llama[1]).generate("The capital of France is", max_new_tokens=8, ignore_eos=True).token_ids
    assert json.loads(run.stdout.strip().splitlines()[-1])["token_ids"] == expected
    assert_one_line_error(
        edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "bad"), "--static-context", "64"),
        "--static-context",
        "pass --graphs split",
    )
    assert not (tmp_path / "bad").exists()


def test_the_sdks_parameters_are_named_as_the_clis_flags():
    """The SDK's messages spell its parameters (max_context=100); the CLI says its flags."""
    from edgeinfer.cli.options import in_flags

    memory = SettingsError(
        "the model needs 1 MiB, but the memory limit has 2 KiB: load it with max_context=100, or max_batch=2, or free memory"
    )
    assert in_flags(memory) == (
        "the model needs 1 MiB, but the memory limit has 2 KiB: load it with --max-context 100, or --max-batch 2, or free memory"
    )
    draft = SettingsError(
        "speculative='draft' needs a draft model: load the engine with draft=DRAFT_DIR, or use speculative='prompt_lookup'",
        "speculative",
    )
    assert (
        in_flags(draft)
        == "--speculative draft needs a draft model: load the engine with --draft DRAFT_DIR, or use --speculative prompt_lookup"
    )
    assert (
        in_flags(SettingsError("max_new_tokens must be at least 1, got 0", "max_new_tokens"))
        == "--max-new-tokens must be at least 1, got 0"
    )


def test_the_provider_line_is_short_and_verbose_says_why(tiny_llama):
    from edgeinfer.sdk.runtime import cuda_unusable_reason

    reason = cuda_unusable_reason()
    quiet = edgeinfer("run", "--model", str(tiny_llama[1]), "--max-new-tokens", "2", "hi")
    line = next(line for line in quiet.stderr.splitlines() if line.startswith("provider: "))
    loud = edgeinfer("-v", "run", "--model", str(tiny_llama[1]), "--max-new-tokens", "2", "hi")
    if reason is None:  # a machine where CUDA runs
        assert line == "provider: cuda" and "provider: cuda (CUDA is usable" in loud.stderr
    else:
        assert line == "provider: cpu (CUDA is not usable here: --verbose says why)"
        assert f"provider: cpu (auto chose cpu: {reason})" in loud.stderr
    assert edgeinfer("run", "--model", str(tiny_llama[1]), "--provider", "cpu", "--max-new-tokens", "2", "hi").stderr.startswith(
        "provider: cpu\n"
    )


def test_an_int4_export_prints_its_own_lines_only(tiny_llama, tmp_path):
    """ONNX Runtime's quantizer logs every weight at INFO: not on the CLI's stderr, unless --verbose."""
    done = edgeinfer("export", str(tiny_llama[0]), "-o", str(tmp_path / "q"), "--quantize", "int4", "--no-quality")
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if "INFO" in line or "Warning" in line], done.stderr


def test_models_are_managed_by_name_in_the_cache(tiny_llama, tmp_path, monkeypatch):
    """list, info/show, verify, run and Engine.load take a catalog name whose export is in the cache
    (the tiny llama's export stands in for it: the test fetches nothing); rm removes it; -m/--model
    is the same as MODEL."""
    import shutil

    from edgeinfer.sdk.errors import ModelNotFoundError

    monkeypatch.setenv("EDGEINFER_CACHE", str(tmp_path / "cache"))
    name = "smollm2-135m-instruct"
    assert "no exports in" in edgeinfer("list").stdout
    shutil.copytree(tiny_llama[1], tmp_path / "cache" / "exports" / name)
    row = json.loads(edgeinfer("list", "--json").stdout)
    sizes = sum(f.stat().st_size for f in (tmp_path / "cache" / "exports" / name).iterdir())
    assert (row["name"], row["context"], row["precision"], row["bytes"]) == (
        name,
        Engine.load(tiny_llama[1]).max_context,
        "fp32",
        sizes,
    )
    info = edgeinfer("info", name)
    assert info.returncode == 0 and info.stdout == edgeinfer("info", "-m", name).stdout == edgeinfer("show", name).stdout
    assert "verified" in edgeinfer("verify", "-m", name).stdout
    ran = edgeinfer("run", "-m", name, "--raw", "--json", "--max-new-tokens", "4", "The capital")
    expected = Engine.load(tiny_llama[1], provider="cpu").generate("The capital", max_new_tokens=4).token_ids
    assert (
        json.loads(ran.stdout)["token_ids"]
        == expected
        == Engine.load(name, provider="cpu").generate("The capital", max_new_tokens=4).token_ids
    )
    differ = edgeinfer("info", str(tiny_llama[1]), "-m", name)
    assert differ.returncode == 2 and differ.stderr.splitlines() == [
        f"error: MODEL '{tiny_llama[1]}' and --model '{name}' differ: give one of them (`edgeinfer info --help` shows the options)"
    ]
    removed = edgeinfer("rm", name)
    assert removed.returncode == 0 and f"removed {name}" in removed.stderr and not (tmp_path / "cache" / "exports" / name).exists()
    assert_one_line_error(edgeinfer("rm", name), f"no export named '{name}'")
    with pytest.raises(ModelNotFoundError, match=f"not exported on this machine yet: export it once with `edgeinfer pull {name}`"):
        Engine.load(name, provider="cpu")


def test_chat_commands_are_never_sent_to_the_model(tiny_llama, tmp_path):
    """/help, /set, /show, /save, /load, /bye (ollama's words) and an unknown command are the
    chat's own; three double quotes open and close a message of several lines."""
    saved = tmp_path / "conversation.json"
    lines = ["/help", "/nope", "/set temperature 0.9", "/set seed 4", "/set top_k x", "/set system Be brief.", "/show"]
    lines += ['"""', "Hello", "there", '"""', f"/save {saved}", "/bye", "never read"]
    done = chat(tiny_llama[1], lines)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    engine = Engine.load(tiny_llama[1], provider="cpu")
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    reply = engine.chat(asked, max_new_tokens=6, temperature=0.9, seed=4).text
    assert done.stdout == reply + "\n"  # one reply: nothing else reached the model
    assert all(usage in done.stderr for usage in ("/set NAME VALUE", "/save FILE", "/load FILE", "/bye"))
    assert "'/nope' is not a command here (/help lists them)" in done.stderr
    assert (
        "top_k takes an integer, not 'x'" in done.stderr
        and "settings: max_new_tokens 6, seed 4, temperature 0.9; 0 messages, a system message" in done.stderr
    )
    assert json.loads(saved.read_text()) == [*asked, {"role": "assistant", "content": reply}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conversation.json"]  # no partial file left beside it
    loaded = chat(tiny_llama[1], [f"/load {saved}", "And Paris?"])
    follow = engine.chat(
        [*asked, {"role": "assistant", "content": reply}, {"role": "user", "content": "And Paris?"}], max_new_tokens=6
    )
    assert loaded.stdout == follow.text + "\n" and "(loaded 3 messages" in loaded.stderr
    assert "error: " in chat(tiny_llama[1], [f"/load {tmp_path / 'none.json'}"]).stderr


def test_chat_says_its_speed_with_verbose(tiny_llama):
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "-v", "chat", "--model", str(tiny_llama[1]), "--max-new-tokens", "6"],
        input="Hello\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and re.search(r"time to first token \d+ ms, [\d.]+ tokens/s", done.stderr), done.stderr
    assert "tokens/s" not in chat(tiny_llama[1], ["Hello"]).stderr


def _on_a_terminal(command: list[str], steps, env=None, timeout: float = 120) -> bytes:
    """What `command` writes to a pseudo-terminal, given keys by `steps`: (text it waits for, keys)."""
    import select
    import time

    primary, secondary = os.openpty()
    process = subprocess.Popen(command, stdin=secondary, stdout=secondary, stderr=secondary, env=env, start_new_session=True)
    os.close(secondary)
    seen, deadline = b"", time.monotonic() + timeout
    steps = list(steps)
    while time.monotonic() < deadline:
        if steps and steps[0][0].encode() in seen[seen.rfind(b"\x00") + 1 :]:
            seen += b"\x00"  # a mark: each step waits for text after the last one's keys
            os.write(primary, steps.pop(0)[1].encode())
        ready = select.select([primary], [], [], 0.1)[0]
        if ready:
            try:
                chunk = os.read(primary, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif process.poll() is not None and not steps:
            break
    process.kill()
    process.wait(timeout=30)
    os.close(primary)
    return seen


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("guarded", [True, False])
def test_keys_typed_during_a_reply_are_neither_shown_nor_sent(guarded):
    """The chat's guard around a streaming reply (the control: the same wait without it echoes the
    keys and leaves them pending, as the terminal does)."""
    guard = "_keys_unshown()" if guarded else "contextlib.nullcontext()"
    child = (
        "import contextlib, select, sys, time\nfrom edgeinfer.cli.chat import _keys_unshown\n"
        f"with {guard}:\n    print('inside', flush=True)\n    time.sleep(1.5)\n"
        "print('pending' if select.select([sys.stdin], [], [], 0.5)[0] else 'nothing', flush=True)\n"
    )
    shown = _on_a_terminal([sys.executable, "-c", child], [("inside", "typed\r")])
    assert (b"typed" in shown, b"pending" in shown) == ((False, False) if guarded else (True, True)), shown


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_chat_on_a_terminal_keeps_a_line_history(tiny_llama, tmp_path):
    """Up recalls the last message (readline), and the history is kept for the next chat."""
    env = {**os.environ, "EDGEINFER_CACHE": str(tmp_path)}
    command = [sys.executable, "-m", "edgeinfer.cli", "chat", "--model", str(tiny_llama[1]), "--max-new-tokens", "4"]
    shown = _on_a_terminal(command, [("> ", "Hello there\r"), ("\n> ", "\x1b[A\r"), ("\n> ", "/bye\r")], env=env)
    assert b"^[[A" not in shown and shown.count(b"Hello there") >= 2, shown
    # readline keeps a line once where it repeats the one before
    assert (tmp_path / "chat_history").read_text().splitlines()[-2:] == ["Hello there", "/bye"]


def test_serve_says_where_the_page_is_and_refuses_a_taken_port_before_it_says_it_listens(tiny_llama):
    import signal

    from test_serve import server_log, start

    process, url = start(tiny_llama[1], "--provider", "cpu")
    try:
        port = url.rsplit(":", 1)[1]
        assert f"listening on {url}: the chat page at {url}/, the OpenAI API under /v1" in server_log(process)
        taken = edgeinfer("serve", "--model", str(tiny_llama[1]), "--port", port)
        assert_one_line_error(taken, f"port {port} on 127.0.0.1 is in use (another server?)", "--port")
        assert "listening" not in taken.stderr and "Errno" not in taken.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_bench_plot_without_matplotlib_is_refused_before_the_benchmark(tiny_llama, tmp_path):
    hidden = tmp_path / "hidden" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": str(hidden.parent)}
    figures = tmp_path / "figures.json"
    done = edgeinfer("bench", "-m", str(tiny_llama[1]), "--plot", str(tmp_path / "p.png"), "--json", str(figures), env=env)
    assert_one_line_error(done, "--plot needs matplotlib: pip install 'edgeinfer[plot]', or leave out --plot")
    assert not figures.exists() and "provider" not in done.stderr  # nothing was loaded or measured


def test_served_models_are_named_by_name_dir_or_by_their_hub_id_and_listed_with_their_figures(tiny_llama, tmp_path):
    """--model NAME=DIR names a model; an export made from a hub id is named by it, not by its
    folder ("onnx"); /v1/models gives each one's context, precision, size and export time."""
    import shutil
    import signal

    import httpx
    from test_serve import start

    copy = tmp_path / "onnx"
    shutil.copytree(tiny_llama[1], copy)
    manifest = json.loads((copy / "edgeinfer.json").read_text())
    (copy / "edgeinfer.json").write_text(json.dumps({**manifest, "source": "Org/Tiny-Llama"}))
    sizes = sum(f["size"] for f in manifest["files"].values())
    for flags, name in ([["--model", str(copy)], "Org/Tiny-Llama"], [["--model", f"mine={tiny_llama[1]}"], "mine"]):
        process, url = start(None, *flags, "--provider", "cpu")
        try:
            (entry,) = httpx.get(f"{url}/v1/models").json()["data"]
            folder = copy if name != "mine" else tiny_llama[1]
            created = int((folder / "edgeinfer.json").stat().st_mtime)
            assert entry.pop("memory_bytes") > sizes  # the weights and the KV cache planned
            assert entry == {
                "loaded": True,
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "edgeinfer",
                "context_length": 256,
                "precision": "fp32",
                "size_bytes": sizes,
            }
            body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def test_check_holds_a_quantized_export_to_the_quality_it_recorded(tiny_llama, tmp_path):
    """An int4 export's logits differ from fp32's by design: `check` measures its quality again and
    holds it to the manifest's figures (a manifest that recorded other figures fails)."""
    import shutil

    out = tmp_path / "int4"
    assert edgeinfer("export", str(tiny_llama[0]), "-o", str(out), "--quantize", "int4").returncode == 0
    recorded = json.loads((out / "edgeinfer.json").read_text())["quantization"]
    done = edgeinfer("check", str(out), "--against", str(tiny_llama[0]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "int4 weights: tokens and logits differ from fp32's by design; the quality is checked instead" in done.stdout
    assert f"as the manifest recorded ({recorded['top1_agreement']:.1%}, {recorded['perplexity']:.2f})" in done.stdout
    assert done.stdout.strip().endswith("check passed")
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    manifest = json.loads((moved / "edgeinfer.json").read_text())
    manifest["quantization"]["top1_agreement"] -= 0.5
    (moved / "edgeinfer.json").write_text(json.dumps(manifest))
    failed = edgeinfer("check", str(moved), "--against", str(tiny_llama[0]))
    assert failed.returncode == 1 and "MOVED from the manifest's figures: top-1 agreement" in failed.stdout


def test_ps_shows_what_a_running_server_holds(tiny_llama, tmp_path):
    import signal

    import httpx
    from conftest import linked_copy
    from test_serve import start

    for name in ("a", "b"):
        linked_copy(tiny_llama[1], tmp_path / "models" / name)
    process, url = start(None, "--models", str(tmp_path / "models"), "--provider", "cpu", "--keep-alive", "60")
    try:
        body = {"model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        done = edgeinfer("ps", "--url", url)
        assert done.returncode == 0, done.stderr
        rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[1:]}
        loaded, pinned, memory, unit, until, seconds = rows["a"]
        assert (
            (loaded, pinned, seconds) == ("yes", "no", "s") and unit in ("KiB", "MiB") and 0 < float(until) <= 60 and float(memory) > 0
        )
        assert rows["b"] == ["no", "no", "-", "-"]
        listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert listed["a"]["memory_bytes"] > 0 and "memory_bytes" not in listed["b"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert_one_line_error(edgeinfer("ps", "--url", url), f"no server answers at {url}", "start one (edgeinfer serve), or pass --url")


def test_a_hub_id_is_exported_into_the_cache_at_its_first_use_and_found_there_after(tiny_llama, tmp_path, monkeypatch):
    """Offline, a hub id that is not in the cache is one line naming the hub and the ways out, and
    leaves nothing behind; one whose export is in the cache (the tiny llama's stands in) runs by
    its id, and list and rm know it."""
    import shutil

    monkeypatch.setenv("EDGEINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_one_line_error(edgeinfer("run", "-m", "Org/Not-Here", "hi"), "cannot download Org/Not-Here from the Hugging Face hub")
    assert not (tmp_path / "cache" / "exports" / "Org" / "Not-Here").exists()
    shutil.copytree(tiny_llama[1], tmp_path / "cache" / "exports" / "Org" / "Tiny")
    ran = edgeinfer("run", "-m", "Org/Tiny", "--raw", "--json", "--max-new-tokens", "4", "The capital")
    expected = Engine.load(tiny_llama[1], provider="cpu").generate("The capital", max_new_tokens=4).token_ids
    assert json.loads(ran.stdout)["token_ids"] == expected and "exporting" not in ran.stderr
    assert json.loads(edgeinfer("list", "--json").stdout)["name"] == "Org/Tiny"
    assert "removed Org/Tiny" in edgeinfer("rm", "Org/Tiny").stderr
    assert not (tmp_path / "cache" / "exports" / "Org" / "Tiny").exists()


@pytest.mark.parametrize("hosts", ["http://images.example.com", "images.example.com:8080", "a,,b", "user@host"])
def test_allowed_image_domains_takes_hosts_only(tiny_llama, hosts):
    done = edgeinfer("serve", "-m", str(tiny_llama[1]), "--allowed-image-domains", hosts, "--port", "1")
    assert done.returncode == 2 and "is not a host: give names or addresses, comma-separated, without scheme or port" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_int4_export_with_a_4_bit_table_runs_and_says_which_kernel_runs_its_weights(tiny_llama, tmp_path):
    """`export --quantize int4 --embedding-bits 4`: the manifest records the untied table's 4-bit
    blocks; `edgeinfer -v run` names what runs the weights (edgeinfer's CPU kernel where it is
    built, else MatMulNBits and why), and with `EDGEINFER_CPU_KERNEL=0` says MatMulNBits runs them."""
    import json

    from edgeinfer.sdk import cpu_kernel

    out = tmp_path / "int4"
    done = edgeinfer(
        "export", str(tiny_llama[0]), "-o", str(out), "--quantize", "int4", "--symmetric", "--embedding-bits", "4", "--no-quality"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "edgeinfer.json").read_text())["quantization"]["embedding"] == {"bits": 4, "blocks": "own"}
    ran = edgeinfer("-v", "run", "--model", str(out), "--max-new-tokens", "4", "--temperature", "0", "hello")
    assert ran.returncode == 0, ran.stderr
    built = cpu_kernel.kernel()
    expected = (
        "quantized weights: edgeinfer's kernel ("
        if built.path
        else f"quantized weights: MatMulNBits: edgeinfer's kernel is off ({built.reason})"
    )
    assert expected in ran.stderr, ran.stderr
    off = edgeinfer(
        "-v",
        "run",
        "--model",
        str(out),
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
        "hello",
        env={**os.environ, cpu_kernel.SWITCH_ENV: "0"},
    )
    assert off.returncode == 0 and f"MatMulNBits: edgeinfer's kernel is off ({cpu_kernel.SWITCH_ENV}=0)" in off.stderr, off.stderr
