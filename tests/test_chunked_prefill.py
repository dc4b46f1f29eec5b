"""Chunked prefill, provably in several passes of the graph: single prompts and batches, with the
cache written in place (GroupQueryAttention) and growing (the attention as traced, `--no-fuse`).
The last position's logits equal one pass and transformers, and so do the greedy tokens."""

import numpy as np
import pytest
import torch
from conftest import count_graph_runs
from test_tiny_llama import hf_greedy
from transformers import AutoModelForCausalLM

from edgeinfer import Engine
from edgeinfer.export import ExportOptions, export_model
from edgeinfer.sdk.errors import SettingsError

CHUNK = 7
LONG = list(range(3, 200))  # 197 tokens: 29 chunks of 7
BATCHES = {
    "similar": [LONG, list(range(10, 160)), list(range(100, 220))],  # 197, 150 and 120 tokens
    "ragged": [LONG, list(range(40, 60)), list(range(5, 14))],  # 197, 20 and 9 tokens
}
# Passes of the graph for each prefill: the padded width in chunks, except an in-place batch, which
# takes one pass (ONNX Runtime's GroupQueryAttention: "batch_size must be 1 when sequence_length > 1
# and past context is given").
RUNS = {
    ("growing", "single"): 29,
    ("in place", "single"): 29,
    ("growing", "similar"): 29,
    ("in place", "similar"): 1,
    ("growing", "ragged"): 29,
    ("in place", "ragged"): 1,
}


@pytest.fixture(scope="module")
def exports(tiny_llama, tmp_path_factory):
    growing = tmp_path_factory.mktemp("growing") / "export"
    export_model(str(tiny_llama[0]), growing, ExportOptions(fuse=False))
    return {"in place": tiny_llama[1], "growing": growing}


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()


def engines(exports, layout):
    """The export in one pass (the default chunk covers the whole context) and in chunks of CHUNK."""
    one = Engine.load(exports[layout], provider="cpu")
    chunked = Engine.load(exports[layout], provider="cpu", prefill_chunk=CHUNK)
    assert one.manifest.kv.in_place == (layout == "in place")
    return one, chunked


def transformers_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize("layout", ["in place", "growing"])
def test_a_single_prompt_in_chunks_equals_one_pass_and_transformers(exports, hf, layout):
    one, chunked = engines(exports, layout)
    runs = count_graph_runs(chunked)
    logits = chunked.runner.prefill(chunked.runner.new_batch(), [LONG]).numpy()[0, -1]
    assert len(runs) == RUNS[layout, "single"]
    single_runs = count_graph_runs(one)
    np.testing.assert_allclose(logits, one.runner.prefill(one.runner.new_batch(), [LONG]).numpy()[0, -1], atol=1e-5)
    assert len(single_runs) == 1
    np.testing.assert_allclose(logits, transformers_logits(hf, LONG), atol=1e-4)
    assert chunked.generate(LONG, max_new_tokens=12).token_ids == hf_greedy(hf, LONG, 12)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("layout", ["in place", "growing"])
def test_a_batch_in_chunks_equals_each_prompt_alone_and_transformers(exports, hf, layout, batch):
    one, chunked = engines(exports, layout)
    prompts = BATCHES[batch]
    runs = count_graph_runs(chunked)
    batch_ = chunked.runner.new_batch(len(prompts))
    logits = chunked.runner.prefill(batch_, prompts).numpy()[:, -1]
    assert len(runs) == RUNS[layout, batch]
    assert int(batch_.cache.lengths.max()) == len(LONG)
    for row, ids in enumerate(prompts):
        np.testing.assert_allclose(logits[row], one.runner.prefill(one.runner.new_batch(), [ids]).numpy()[0, -1], atol=1e-5)
        np.testing.assert_allclose(logits[row], transformers_logits(hf, ids), atol=1e-4)
    rows = chunked.generate_batch(prompts, max_new_tokens=10)
    assert [r.token_ids for r in rows] == [hf_greedy(hf, ids, 10) for ids in prompts]


def test_a_chunk_below_one_token_is_refused(tiny_llama):
    with pytest.raises(SettingsError, match="prefill_chunk must be an integer of at least 1, got 0"):
        Engine.load(tiny_llama[1], provider="cpu", prefill_chunk=0)
