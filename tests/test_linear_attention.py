"""Hybrid models: Qwen 3.5's gated DeltaNet layers and the Mamba-2 mixers of the state-space
hybrids (a convolution and a recurrent state instead of a KV cache) traced into ONNX Runtime's
CausalConvWithState and LinearAttention, and the runtime that keeps their state: against
transformers, alone, in batches, in chunks, in the scheduler's continuous batching, where rows
join and leave while others decode, and in speculative decoding."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from architectures import tiny_config
from conftest import export_tiny, scheduled_and_alone
from transformers import AutoModelForCausalLM

from edgeinfer import Engine
from edgeinfer.export.validate import transformers_greedy
from edgeinfer.export.trace import trace
from edgeinfer.sdk.errors import ManifestError, SettingsError
from edgeinfer.sdk.manifest import LAYERS_FORMAT_VERSION
from edgeinfer.sdk.memory import MemoryPlan

PROMPTS = [list(range(3, 43)), [5, 6, 7], list(range(100, 119)), [9] * 11]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(transformers model, export folder) of the tiny qwen3_5: three gated DeltaNet layers and one
    of full attention."""
    return export_tiny("qwen3_5_text", tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_5_text",
        "nemotron_h",
        "mamba",
        *(pytest.param(name, marks=pytest.mark.slow) for name in ("falcon_h1", "kimi_linear", "jamba")),
    ],
)
def hybrid(request, qwen, tmp_path_factory):
    """The tiny qwen3_5; Nemotron-H's (a Mamba-2 layer, experts, attention, an MLP layer: its
    time-step floor clamps a prefill's steps); Falcon-H1's (attention and a Mamba-2 mixer side by
    side in each layer); Kimi Linear's (latent attention kept as traced: a batch's prompts are
    prefilled apart and laid side by side); Mamba's (Mamba-1 mixers alone, no attention: its states
    in rows of a slot cache); Jamba's (Mamba-1 mixers beside attention and experts)."""
    return qwen if request.param == "qwen3_5_text" else export_tiny(request.param, tmp_path_factory.mktemp(request.param))


# each family's layers with a state: gated DeltaNet (Qwen 3.5, Qwen3-Next), Kimi's delta rule, Mamba-2
# (Bamba to Zamba 2; Zamba 2's shared attention block runs beside a mixer of its own), Mamba-1 (Mamba,
# Falcon Mamba, Jamba)
STATE_LAYERS = {
    "qwen3_5_text": 3,
    "qwen3_next": 3,
    "lara_mini": 1,
    "kimi_linear": 2,
    "bailing_hybrid": 3,
    "bamba": 2,
    "granitemoehybrid": 2,
    "nemotron_h": 1,
    "falcon_h1": 2,
    "zamba2": 3,
    "mamba2": 2,
    "mamba": 2,
    "falcon_mamba": 2,
    "jamba": 3,
}


@pytest.mark.parametrize(
    "name", [n if n in ("qwen3_5_text", "nemotron_h", "mamba") else pytest.param(n, marks=pytest.mark.slow) for n in STATE_LAYERS]
)
def test_the_traced_state_layers_give_transformers_own(name, tmp_path):
    """The graph traced with export/patches.py's `traceable_linear_attention`, `traceable_mamba2` or `traceable_mamba`:
    one op per layer for the convolution and for the delta rule or the selective scan (no loop),
    and its logits over a prefill, two decode steps and a chunk of two, each pass on the state the
    last one handed back, equal transformers' over the whole sequence."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    trace(model, tmp_path / "model.onnx")
    graph = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    layers = STATE_LAYERS[name]
    assert (ops["CausalConvWithState"], ops["LinearAttention"], ops["Loop"] + ops["Scan"]) == (layers, layers, 0)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = [5, 9, 17, 33, 2, 71, 8, 100, 42, 7]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    state = {
        i.name: np.zeros([1 if d == "batch_size" else 0 if isinstance(d, str) else d for d in i.shape], np.float32)
        for i in session.get_inputs()
        if i.name.startswith("past")
    }
    got = []
    for start, end in ((0, 6), (6, 7), (7, 8), (8, 10)):
        feed = {
            "input_ids": np.array([ids[start:end]]),
            "attention_mask": np.ones((1, end), np.int64),
            "position_ids": np.arange(start, end)[None],
            **state,
        }
        names = {i.name for i in session.get_inputs()}  # Granite 4.0-H's attention takes no positions
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {k: v for k, v in feed.items() if k in names})))
        got.append(outputs["logits"][0])
        state = {name.replace("present.", "past_key_values.", 1): value for name, value in outputs.items() if name != "logits"}
    assert np.abs(np.concatenate(got) - expected).max() < 1e-4


def test_the_manifest_lists_each_layers_state_and_the_plan_counts_it(qwen):
    manifest = Engine.load(qwen[1], provider="cpu").manifest
    assert manifest.format_version == LAYERS_FORMAT_VERSION and manifest.kv.num_layers == 1 and manifest.kv.in_place
    assert [(s["layer"], s["kind"], s["shape"]) for s in manifest.kv.state] == [
        (layer, kind, shape) for layer in range(3) for kind, shape in (("conv", [128, 3]), ("recurrent", [4, 16, 16]))
    ]
    plan = MemoryPlan.of(manifest, 64, 2)
    assert plan.state_per_row == 3 * (128 * 3 + 4 * 16 * 16) * 4
    assert plan.kv == (plan.kv_per_token * 64 + plan.state_per_row) * 2
    assert manifest.validation["fusion"]["fused"]["LinearAttention"] == 3


def test_a_mamba2_state_is_kept_as_the_scan_reads_it_and_counted(hybrid):
    """Nemotron-H's Mamba-2 layer (0) keeps [heads, state size, head size] (8, 8, 16: transformers'
    last two axes swapped), its convolution the 128 channels of x and 2 groups of B and C of 8;
    its attention layer (2) keeps its name across the layers that cache nothing (1, 3)."""
    manifest = Engine.load(hybrid[1], provider="cpu").manifest
    if manifest.architecture != "nemotron_h":
        pytest.skip("Nemotron-H's layout")
    assert [(s["layer"], s["kind"], s["shape"]) for s in manifest.kv.state] == [(0, "conv", [160, 3]), (0, "recurrent", [8, 8, 16])]
    assert manifest.kv.past == ["past_key_values.2.key", "past_key_values.2.value"]
    assert MemoryPlan.of(manifest, 64, 1).state_per_row == (160 * 3 + 8 * 8 * 16) * 4


def test_a_mamba1_model_keeps_its_states_in_rows_and_no_context_limit(hybrid):
    """Mamba's two Mamba-1 layers keep [channels, kernel - 1] and [channels, state size] (128, 3
    and 128, 16: transformers' own layout, the op's [state size, 1] an axis more), no keys or
    values: the states are rows of a slot cache, written in place, and the export serves the
    context its fixed-size state allows (no limit of its own) with nothing counted per token."""
    manifest = Engine.load(hybrid[1], provider="cpu").manifest
    if manifest.architecture != "mamba":
        pytest.skip("Mamba's layout")
    assert [(s["layer"], s["kind"], s["shape"]) for s in manifest.kv.state] == [
        (layer, kind, shape) for layer in range(2) for kind, shape in (("conv", [128, 3]), ("recurrent", [128, 16]))
    ]
    assert manifest.kv.past == [] and manifest.kv.in_place and manifest.max_context == 2**20
    plan = MemoryPlan.of(manifest, manifest.max_context, 2)
    assert plan.kv_per_token == 0 and plan.kv == 2 * 2 * (128 * 3 + 128 * 16) * 4


def test_generation_equals_transformers_alone_in_a_batch_and_in_chunks(hybrid):
    model, folder = hybrid
    expected = [transformers_greedy(model, p, 12) for p in PROMPTS]
    engine = Engine.load(folder, provider="cpu")
    assert [engine.generate(p, max_new_tokens=12, ignore_eos=True).token_ids for p in PROMPTS] == expected
    assert [r.token_ids for r in engine.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True)] == expected
    chunked = Engine.load(folder, provider="cpu", prefill_chunk=4)  # a 40-token prompt in 10 passes on the state
    assert chunked.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True).token_ids == expected[0]
    assert engine.runner.prefix_cache.budget == 0  # a block's state is not kept: the prefix cache is off


def test_rows_joining_and_leaving_a_running_batch_each_get_what_they_get_alone(hybrid):
    """The scheduler's decode passes carry rows that are not decoding (prefilling, or just ended):
    their state must come out of such a pass as it went in."""
    scheduled, alone = scheduled_and_alone(Engine.load(hybrid[1], provider="cpu", prefill_chunk=5), PROMPTS)
    assert scheduled == alone


def test_speculative_decoding_puts_the_state_back_where_a_proposal_is_rejected(hybrid):
    """A recurrent state cannot forget the tokens of a rejected proposal: it is put back as it was
    before the pass and the kept tokens run again (runner.take_back). The greedy tokens are plain
    decoding's, alone and in a batch; a draft model with a state is refused."""
    engine = Engine.load(hybrid[1], provider="cpu")
    # the last prompt holds most of the vocabulary: a model that never repeats itself still gets proposals
    prompts = [
        [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
        [9] * 11,
        [100, 101, 102, 9, 100, 101, 102],
        list(range(3, 40)),
        list(range(259, 59, -1)),
    ]
    if not engine.manifest.kv.in_place:  # Kimi Linear's traced attention cannot take tokens back: refused up front
        with pytest.raises(SettingsError, match="cannot take back the tokens of a rejected draft"):
            engine.generate(prompts[0], max_new_tokens=4, speculative="prompt_lookup")
        return
    plain = [engine.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    fast = [engine.generate(p, max_new_tokens=24, ignore_eos=True, speculative="prompt_lookup") for p in prompts]
    assert [r.token_ids for r in fast] == plain
    # passes saved; Nemotron-H's and Mamba's tiny models never repeat themselves: each proposal is rejected and put back
    assert sum(r.accepted_tokens for r in fast) > 0 or engine.manifest.architecture in ("nemotron_h", "mamba")
    assert any(r.proposed_tokens > r.accepted_tokens for r in fast)  # and the state put back
    batch = engine.generate_batch(prompts, max_new_tokens=24, ignore_eos=True, speculative="prompt_lookup")
    assert [r.token_ids for r in batch] == plain
    with pytest.raises(ManifestError, match=r"keeps a recurrent state .* or speculative='prompt_lookup'"):
        engine.attach_draft(Engine.load(hybrid[1], provider="cpu"))


def test_the_optimizer_fuses_a_hybrid_graphs_norms(qwen):
    """With export/patches.py's `state_op_shapes`, ONNX Runtime's shape inference gets through the
    linear-attention ops, and the skip + RMS norm fusion applies to the hybrid as to any family;
    without it the optimizer gives up on the graph's shapes and leaves the norms as ops."""
    fused = Engine.load(qwen[1], provider="cpu").manifest.validation["fusion"]["fused"]
    assert fused["SkipSimplifiedLayerNormalization"] == 2 * 4 and fused["GroupQueryAttention"] == 1  # two per layer


HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "olmo_hybrid", "lfm3", *list(STATE_LAYERS)[1:]]
# families whose states have their own shapes: four convolutions a layer (Inkling), the convolution
# kept whole (ZAYA), a state without a convolution (MiniMax), a state per channel (RecurrentGemma)
HYBRIDS += ["inkling_text", "zaya", "minimax", "recurrent_gemma"]


@pytest.mark.parametrize("name", [n if n == "qwen3_5_text" else pytest.param(n, marks=pytest.mark.slow) for n in HYBRIDS])
def test_the_default_int4_export_of_every_hybrid_runs_its_calibration_over_zero_states(name, tmp_path):
    """`edgeinfer export --quantize int4` (GPTQ over the calibration text, --keep-int8 auto's
    measure) runs the fp32 graph with its convolution and recurrent states fed as zeros: the graphs
    of linear attention take them as inputs, and an export that left them out stopped there."""
    from conftest import build_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(name)).save_pretrained(tmp_path / "hf")
    build_tokenizer().save_pretrained(tmp_path / "hf")
    assert_default_int4_export(tmp_path / "hf", tmp_path / "int4")


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen2_5_vl", marks=pytest.mark.slow)])
def test_the_default_int4_export_of_a_qwen_vision_model_calibrates_with_3d_positions(family, tmp_path):
    """Qwen's vision-language models take position_ids [3, batch, sequence]: the calibration text
    goes in as text, its three rows of positions equal (Qwen 3.5's language model is the hybrid)."""
    import vision_models

    getattr(vision_models, f"build_{family}")(tmp_path / "hf")
    assert_default_int4_export(tmp_path / "hf", tmp_path / "int4")


def assert_default_int4_export(source, out):
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "edgeinfer.cli", "export", str(source), "-o", str(out), "--quantize", "int4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    quality = json.loads((out / "edgeinfer.json").read_text())["quantization"]
    assert quality["method"] == "int4" and quality["algorithm"] == "gptq"
    assert quality["keep_int8"] and "auto" not in quality["keep_int8"]  # the modules the measure chose
    assert quality["top1_agreement"] > 0.6
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    bits = collections.Counter(next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits")
    assert bits[4] > 0 and bits[8] > 0
