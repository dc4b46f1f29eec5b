"""llama.cpp's own server test suite (tools/server/tests in the llama-cpp-python sdist) against
`edgeinfer serve`: its tool-call, Responses, Anthropic, embedding, tokenize and template tests,
each server it starts answered by tests/llama_server.py (edgeinfer behind a proxy that adds the
`/v1` prefix and the `model` llama-server takes as optional). Every test not in SKIPPED must pass,
and no response may be a 5xx. SKIPPED says why each is left out; docs/serving.md lists them."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import build_llama

SDIST = "llama-cpp-python==0.3.36"
KEPT = ("vendor/llama.cpp/tools/server/tests/", "vendor/llama.cpp/models/templates/")  # the suite, and the templates it loads
FILES = [
    "unit/test_tool_call.py",
    "unit/test_compat_oai_responses.py",
    "unit/test_compat_anthropic.py",
    "unit/test_embedding.py",
    "unit/test_tokenize.py",
    "unit/test_template.py",
]
# The suite's own `slow` tests load real models from the Hugging Face hub: left out as a group.
# Each test (or node-id prefix) below is left out for the reason given; docs/serving.md lists them.
STORIES = "asserts the text or token counts of llama.cpp's own tiny model"
IMAGES = "sends images to the suite's text-only model (a 400 saying it reads text only); images on a vision-language model: tests/test_vision_serve.py"
LLAMA_INPUTS = "llama.cpp's own embedding input forms (content objects, strings and token lists mixed in a list, an empty string)"
SKIPPED: dict[str, str] = {
    "unit/test_compat_oai_responses.py::test_responses_with_openai_library": STORIES,
    "unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry": "timings_per_token, a llama.cpp-only field",
    "unit/test_tokenize.py::test_tokenize_with_bos": "asserts the BOS id of llama.cpp's model (1); the test model starts no text with BOS",
    "unit/test_template.py::test_reasoning": (
        "llama-server's --reasoning flag, a server-wide enable_thinking for every template (and llama.cpp's own copies of "
        "those templates); edgeinfer takes it per request (chat_template_kwargs, reasoning_effort)"
    ),
    "unit/test_template.py::test_date_inside_prompt[fireworks": "the template reads `functions`, which llama.cpp's own code for it fills",
    "unit/test_compat_anthropic.py::test_anthropic_tool_result_with_image": IMAGES,
    "unit/test_compat_anthropic.py::test_anthropic_vision_format_accepted": IMAGES,
    "unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model": IMAGES,
    "unit/test_compat_anthropic.py::test_anthropic_empty_messages": "an empty messages list: a 400 here, as Anthropic's API answers",
    "unit/test_compat_anthropic.py::test_anthropic_thinking": (
        "thinking on a model that does not think: a 400 naming thinking.budget_tokens here; llama-server ignores it"
    ),
    **{
        f"unit/test_embedding.py::test_embedding_mixed_input[{case}]": LLAMA_INPUTS
        for case in ("-False", "input3-False", "input5-True", "input7-True", "input8-False", "input9-False", "input10-True")
    },
    "unit/test_embedding.py::test_embedding_content_text_same_as_string": LLAMA_INPUTS,
    "unit/test_embedding.py::test_embedding_pooling_none": "--pooling none (a vector per token), which edgeinfer does not give",
    "unit/test_embedding.py::test_embedding_error_prompt_too_long": "asserts llama.cpp's wording ('too large'); the 400 here names the tokens and the context",
    "unit/test_embedding.py::test_embedding_usage_": "asserts the token counts of llama.cpp's bge-small tokenizer",
    **{
        f"unit/test_tool_call.py::test_completion_without_tool_call_fast[meta-llama-Llama-3.3-70B-Instruct-128-{case}-CompletionMode.STREAMED]": (
            "asserts that no content delta is empty; OpenAI's own first chunk carries content '' as edgeinfer's does"
        )
        for case in ("tools0-None", "tools1-None", "tools2-none")
    },
}

pytestmark = pytest.mark.slow


def suite_folder(cache: Path) -> Path:
    """The suite's folder, tools/server/tests of llama.cpp, with ../../../models/templates beside it
    as in llama.cpp's tree: from the sdist, fetched once into `cache` with pip, never installed."""
    target = cache / "llama.cpp"
    if (target / "tools/server/tests/utils.py").exists():
        return target / "tools/server/tests"
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache), SDIST],
        check=True,
        capture_output=True,
    )
    (sdist,) = cache.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as archive:
        root = archive.getmembers()[0].name.split("/")[0] + "/"
        members = [m for m in archive.getmembers() if m.name.startswith(tuple(root + kept for kept in KEPT))]
        for member in members:
            member.name = member.name.removeprefix(root + "vendor/llama.cpp/")
        archive.extractall(target, members=members, filter="data")
    sdist.unlink()
    return target / "tools/server/tests"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(chat export with a tool-calling template, embedding export)."""
    from test_embeddings import sentence_transformers_config
    from test_serve_tools import tool_export
    from test_tools import HERMES

    from edgeinfer.export import ExportOptions, export_model

    root = tmp_path_factory.mktemp("llama-suite")
    chat = tool_export(root / "chat", HERMES)
    build_llama(root / "embed-hf", seed=4, context=2048)  # the suite embeds texts of up to 1,024 tokens
    sentence_transformers_config(root / "embed-hf", "mean", True)
    export_model(str(root / "embed-hf"), root / "embed", ExportOptions(task="embedding"))
    return chat, root / "embed"


def test_llama_cpps_server_suite_passes_against_edgeinfer_with_no_5xx(exports, tmp_path):
    from edgeinfer.models.cache import cache_root

    suite = suite_folder(cache_root() / "peers")
    shim = tmp_path / "llama-server"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).parent / "llama_server.py"}" "$@"\n')
    shim.chmod(0o755)
    log = tmp_path / "statuses.log"
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(shim),
        "EDGEINFER_SUITE_CHAT": str(exports[0]),
        "EDGEINFER_SUITE_EMBED": str(exports[1]),
        "EDGEINFER_SUITE_LOG": str(log),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    deselected = [arg for test in SKIPPED for arg in ("--deselect", test)]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow", *FILES, *deselected]
    done = subprocess.run(command, cwd=suite, env=env, capture_output=True, text=True, timeout=3000)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-6000:]
    statuses = [line.split() for line in log.read_text().splitlines()]
    assert len(statuses) > 100 and not [s for s in statuses if int(s[2]) >= 500], summary
    print(f"llama.cpp's suite: {summary}; {len(statuses)} responses through the proxy, none 5xx")
