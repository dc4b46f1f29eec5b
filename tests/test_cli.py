"""The `edgeinfer` command, run as a user runs it: a subprocess, its exit code and its output."""
import json
import os
import subprocess
import sys

from edgeinfer import Engine


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
    assert_one_line_error(edgeinfer("run", "--model", str(tiny_llama[0]), "hi"), "not an edgeinfer export",
                          "Hugging Face model folder", "edgeinfer export")


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


def test_debug_shows_the_traceback(tmp_path):
    done = edgeinfer("--debug", "run", "--model", str(tmp_path / "nope"), "hi")
    assert done.returncode != 0 and "Traceback" in done.stderr and "ModelNotFoundError" in done.stderr


def test_run_streams_the_same_text_as_the_sdk(tiny_llama):
    done = edgeinfer("run", "--model", str(tiny_llama[1]), "--provider", "cpu", "--max-new-tokens", "16", "The capital")
    assert done.returncode == 0, done.stderr
    expected = Engine.load(tiny_llama[1], provider="cpu").generate("The capital", max_new_tokens=16)
    assert done.stdout == expected.text + "\n"
    assert "time to first token" in done.stderr and "tokens/s" in done.stderr and "finish: length" in done.stderr
    assert "provider: cpu" in done.stderr


def test_run_chat_wraps_the_prompt_in_the_template(tiny_llama):
    done = edgeinfer("run", "--model", str(tiny_llama[1]), "--chat", "--max-new-tokens", "8", "Hello")
    engine = Engine.load(tiny_llama[1], provider="cpu")
    expected = engine.generate(engine.chat_prompt([{"role": "user", "content": "Hello"}]), max_new_tokens=8)
    assert done.returncode == 0 and done.stdout == expected.text + "\n"
    assert f"prompt {expected.prompt_tokens} tokens" in done.stderr


def test_info_prints_the_manifest_and_providers(tiny_llama):
    done = edgeinfer("info", str(tiny_llama[1]))
    assert done.returncode == 0, done.stderr
    manifest_text, providers = done.stdout.rsplit("\n}\n", 1)
    manifest = json.loads(manifest_text + "\n}")
    assert manifest["architecture"] == "llama" and manifest["kv"]["num_layers"] == 2
    assert providers.startswith("providers: cpu: usable; cuda: ")


def test_run_with_an_unknown_provider(tiny_llama):
    done = edgeinfer("run", "--model", str(tiny_llama[1]), "--provider", "bogus", "hi")
    assert done.returncode == 2 and "Invalid value for '--provider'" in done.stderr and "Traceback" not in done.stderr
