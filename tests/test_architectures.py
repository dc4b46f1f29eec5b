"""Every decoder family edgeinfer supports: a tiny random-weight model of each, built from its
transformers config in the test, exported, and checked against transformers with `check_export`
(the check `edgeinfer check` runs): 16 greedy tokens, prefill and decode logits, and a batch of
two prompts of different lengths against each prompt alone."""

import json

import pytest
import torch
from architectures import COMMON, SHRUNK, TINY, WINDOW, model_type, tiny_config
from generic_tiny import tiny_model
from conftest import build_tokenizer
from transformers import AutoModelForCausalLM

from edgeinfer.export import export_model
from edgeinfer.export.check import check_export
from edgeinfer.export.families import TESTED, UNSUPPORTED
from edgeinfer.sdk.errors import ExportError

PROMPT = list(range(3, 43))  # 40 tokens: longer than every sliding window in TINY
NEW_TOKENS = 16
# Shapes that break naive code, and where each family shows one.
LAYOUT = {
    "falcon": {"num_kv_heads": 1},  # multi-query attention
    "gpt_bigcode": {"num_kv_heads": 1},
    "llama": {"num_kv_heads": 2},  # grouped-query attention
    "phi@gqa": {"num_kv_heads": 2},
    # multi-head latent attention: transformers 5 caches one head of the compressed latent (kv_lora_rank 16)
    # and the rotated key part (qk_rope_head_dim 4), keys and values of different widths
    "deepseek_v3": {"num_kv_heads": 1, "head_size": 16, "value_head_size": 4},
}
# A RECORD, not a requirement: which optimisations applied to each tiny model when it was last
# updated. A family that leaves or joins a set has not regressed by that alone: the parity test
# decides that. test_the_record_of_optimisations_is_current says where the record is out of date.
# - fusion skipped: export kept the unfused graph. None now: nemotron's was, until its graph took
#   position ids instead of counting positions from the cache length.
# - in place: attention rewritten to GroupQueryAttention with the cache written in place
#   (export/attention.py). The others keep the attention as traced, and the manifest says why:
#   ALiBi (bloom, falcon@alibi, mpt), windows the pattern does not take (gpt_neo, gpt_oss), and keys
#   and values of different head sizes (deepseek_v3). gemma3_text's rewritten graph failed the
#   logits check until its graph took position ids.
# - rotary in attention: the rotation moved into GroupQueryAttention, so the graph takes no
#   position ids. olmo2's norms over the whole query and key keep its rotation out for now.
# - without position ids (graphs kept as traced): ALiBi families, and rotary
#   families whose graph counts positions from the cache length.
RECORDED_FUSION_SKIPPED = set()
RECORDED_IN_PLACE = {
    "mamba",  # no attention at all: its states are rows of a slot cache
    "jamba",
    "qwen3_next",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "falcon_h1@norm",
    "zamba2",
    "arcee",
    "codegen",
    "cohere",
    "falcon",
    "falcon@gqa",
    "gpt2",
    "stablelm",
    "phi@gqa",
    "gemma",
    "gemma2",
    "glm",
    "gpt_bigcode",
    "gpt_neox",
    "gptj",
    "granite",
    "helium",
    "llama",
    "mistral",
    "olmo",
    "olmo2",
    "opt",
    "phi",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "gemma3_text",
    "nemotron",
    "exaone4",
    "gemma4_text",
    "hunyuan_v1_dense",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "olmo3",
    "olmo_hybrid",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "seed_oss",
}
RECORDED_ROTARY_IN_ATTENTION = {
    "granitemoehybrid",  # no rotary at all (position_embedding_type None, as Granite 4.0-H ships)
    "jamba",  # no rotary at all
    "mamba",  # no attention, no positions
    "nemotron_h",
    "zamba2",
    "arcee",
    "gemma",
    "gemma2",
    "granite",
    "llama",
    "mistral",
    "olmo",
    "qwen2",
    "smollm3",
    "gemma3_text",  # a rotation written out in ops, after norms over each head
    "qwen3",  # a RotaryEmbedding after norms over each head
    "qwen3_moe",
    "exaone4",
    "seed_oss",
    "lfm2",  # rotations after norms over each head
    "lfm2_moe",
    "lfm3",
}
RECORDED_WITHOUT_POSITION_IDS = {"bloom", "mpt", "falcon@alibi", "kimi_linear"}  # Kimi's latent attention has no positions
FAMILIES = [name for name in TINY if model_type(name) in TESTED]
# the shrunk defaults of the other families, in the slow tier
PARITY = [*FAMILIES, *(pytest.param(name, marks=pytest.mark.slow) for name in SHRUNK)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    """(model, export folder, manifest) of a family's tiny model, exported once for this module."""
    done = {}

    def export(name):
        if name not in done:
            folder = tmp_path_factory.mktemp(name.replace("@", "-"))
            torch.manual_seed(0)
            model = tiny_model(name) if name in SHRUNK else AutoModelForCausalLM.from_config(tiny_config(name)).eval()
            model.save_pretrained(folder / "hf")
            tokenizer.save_pretrained(folder / "hf")
            done[name] = model, folder / "export", export_model(str(folder / "hf"), folder / "export")
        return done[name]

    return export


def test_every_supported_family_has_a_tiny_model():
    assert sorted({model_type(name) for name in TINY} - set(UNSUPPORTED) | set(SHRUNK)) == sorted(TESTED)
    assert max(len(PROMPT), NEW_TOKENS) > WINDOW


@pytest.mark.parametrize("name", PARITY)
def test_family_matches_transformers(name, exported):
    """What must hold for every family: the manifest describes the KV cache the graph really has,
    and the export's tokens, logits and batch rows equal transformers'."""
    model, folder, manifest = exported(name)
    assert manifest.architecture == model_type(name)
    for field, value in LAYOUT.get(name, {}).items():
        assert getattr(manifest.kv, field) == value, field
    result = check_export(folder, model, PROMPT, NEW_TOKENS)
    assert result.tokens == result.expected_tokens and len(result.tokens) == NEW_TOKENS
    assert result.max_abs_diff_prefill <= result.tolerance and result.max_abs_diff_decode <= result.tolerance
    assert result.max_abs_diff_extend <= result.tolerance  # 4 tokens in one pass on a filled cache
    assert result.batch_rows_equal_single


@pytest.mark.parametrize("name", FAMILIES)
def test_the_record_of_optimisations_is_current(name, exported):
    manifest = exported(name)[2]
    fusion, takes_positions = manifest.validation["fusion"], "position_ids" in manifest.graph.inputs
    observed = {
        "fusion skipped": "skipped" in fusion,
        "in place": manifest.kv.in_place,
        "rotary in attention": manifest.kv.in_place and not takes_positions,
        "without position ids": not manifest.kv.in_place and not takes_positions,
    }
    recorded = {
        "fusion skipped": name in RECORDED_FUSION_SKIPPED,
        "in place": name in RECORDED_IN_PLACE,
        "rotary in attention": name in RECORDED_ROTARY_IN_ATTENTION,
        "without position ids": name in RECORDED_WITHOUT_POSITION_IDS,
    }
    assert observed == recorded, (
        f"{name}: the optimisations that applied differ from the RECORDED_* sets ({fusion}). "
        "This is not a parity failure: update the record if the change is intended"
    )
    if manifest.kv.in_place:  # the manifest's account of the rewrite matches the graph it describes
        assert fusion["fused"].get("GroupQueryAttention", 0) == manifest.kv.num_layers


def test_layers_whose_caches_differ_are_each_described_and_counted(exported):
    """Gemma 4's full-attention layer is wider than its sliding ones: the manifest gives each layer's
    shape (format version 5, and 6 for the sliding layers' windows), the memory plan counts each
    (the sliding layers' once per row, the full layer's per token), and every buffer the runtime
    binds has its layer's width."""
    from edgeinfer.sdk.engine import Engine
    from edgeinfer.sdk.manifest import WINDOWS_FORMAT_VERSION
    from edgeinfer.sdk.memory import kv_bytes_per_token, state_bytes_per_row

    _, folder, manifest = exported("gemma4_text")
    assert manifest.format_version == WINDOWS_FORMAT_VERSION and manifest.kv.windows == [WINDOW, WINDOW, -1]
    assert [(layer["kv_heads"], layer["head_size"], layer["value_head_size"]) for layer in manifest.kv.layers] == [
        (2, 16, 16),
        (2, 16, 16),
        (2, 32, 32),
    ]
    assert kv_bytes_per_token(manifest) == 4 * 2 * 64
    assert state_bytes_per_row(manifest, 64) == 4 * 2 * (32 + 32) * (WINDOW + WINDOW // 8 - 1)
    batch = Engine.load(folder, provider="cpu").runner.new_batch(1, 8)
    widths = [batch.cache.buffers[name].shape()[-1] for name in manifest.kv.past]
    assert widths == [16, 16, 16, 16, 32, 32]
    assert exported("llama")[2].kv.layers == [] and exported("llama")[2].format_version == 2  # alike layers: as before


@pytest.mark.xfail(strict=True, raises=ValueError, reason=UNSUPPORTED["internlm2"])
def test_internlm2_is_unknown_to_transformers():
    """The limit itself: transformers 5 raises 'Unrecognized model identifier: internlm2'."""
    tiny_config("internlm2")


def test_unsupported_and_unknown_model_types_are_refused_in_one_line(tmp_path):
    for model_type_, reason in [
        ("internlm2", "transformers 5 has no internlm2 model; its checkpoints need trust_remote_code"),
        ("bart", "it is an encoder-decoder"),
        ("bert", "it is an encoder \\(a masked language model\\)"),
        ("vit", "transformers has no causal language model of this type"),
        ("gemma4_assistant", "it is a draft model that reads its target model's keys and values .* export the target model"),
        ("made_up_lm", "transformers has no model of this type \\(a checkpoint that needs trust_remote_code"),
    ]:
        folder = tmp_path / model_type_
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type_}))
        with pytest.raises(
            ExportError, match=f"model type '{model_type_}' cannot be exported: {reason}.*edgeinfer info --architectures"
        ):
            export_model(str(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "settings", "why"),
    [
        (
            "bert-generation",
            {"is_decoder": False},
            'it runs with a cache only as a decoder: set "is_decoder": true in its config.json',
        ),
        ("openai-gpt", {}, "transformers' model of this family has none \\(each step reads the whole text again\\)"),
    ],
)
def test_a_model_that_keeps_no_cache_is_refused_with_the_way_out(tmp_path, tokenizer, name, settings, why):
    """A model whose forward returns no cache for a prompt (BERT for generation outside its decoder
    mode, GPT-1) fails at the trace with the reason, the way out where there is one, and leaves no
    export folder."""
    from generic_tiny import config_of

    torch.manual_seed(0)
    config = config_of(name)
    for key, value in settings.items():
        setattr(config, key, value)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    with pytest.raises(ExportError, match=f"this {name} model keeps no cache for a prompt, which edgeinfer's graphs need: {why}"):
        export_model(str(tmp_path / "hf"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_context_comes_from_the_config_else_the_tokenizer_else_the_flag():
    from types import SimpleNamespace

    from edgeinfer.export.manifest import max_context

    unlimited = SimpleNamespace(model_max_length=int(1e30))
    assert max_context(SimpleNamespace(model_type="mpt", max_seq_len=2048), unlimited, None) == 2048
    assert max_context(SimpleNamespace(model_type="gpt2", n_positions=1024), unlimited, None) == 1024
    assert max_context(SimpleNamespace(model_type="qwen", seq_length=8192), unlimited, None) == 8192
    assert max_context(SimpleNamespace(model_type="falcon", max_position_embeddings=None, n_positions=512), unlimited, None) == 512
    assert max_context(SimpleNamespace(model_type="bloom"), SimpleNamespace(model_max_length=4096), None) == 4096
    assert max_context(SimpleNamespace(model_type="bloom"), unlimited, 1024) == 1024
    with pytest.raises(ExportError, match="the bloom config names no maximum context length: pass --max-context N"):
        max_context(SimpleNamespace(model_type="bloom"), unlimited, None)


# One family per kind of fusion runs in the fast suite; the others are marked slow.
OPTIMIZER_SAMPLE = {"llama", "gpt2", "phi", "qwen3", "gemma3_text", "gpt_oss", "falcon@gqa"}


@pytest.mark.parametrize("name", [n if n in OPTIMIZER_SAMPLE else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_the_fast_optimizer_gives_onnx_runtimes_graph(name, tmp_path):
    """export/optimize.py runs ORT's fusions on the graph without its matrices and keeps the
    optimizer's output map between changes; its graph must be node for node ORT's own, which
    ORT computes here on the whole graph, weights loaded."""
    import onnx
    from onnxruntime.transformers import optimizer

    from edgeinfer.export.graphs import GRAPH_FILE, export_graph
    from edgeinfer.export.optimize import load_without_weights, optimize
    from edgeinfer.export.patches import state_op_shapes

    torch.manual_seed(0)
    config = tiny_config(name)
    export_graph(AutoModelForCausalLM.from_config(config).eval(), tmp_path)
    heads, hidden = getattr(config, "num_attention_heads", 0) or 0, getattr(config, "hidden_size", 0) or 0
    with state_op_shapes():  # what optimize() runs under: ORT's shape inference then knows the linear-attention ops
        theirs = optimizer.optimize_model(
            str(tmp_path / GRAPH_FILE), model_type="gpt2", opt_level=0, use_gpu=False, num_heads=heads, hidden_size=hidden
        ).model
    ours = optimize(load_without_weights(tmp_path / GRAPH_FILE), heads, hidden)
    assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in theirs.graph.node]
    assert sorted(t.name for t in ours.graph.initializer) == sorted(t.name for t in theirs.graph.initializer)
    assert len(ours.graph.node) < len(onnx.load(str(tmp_path / GRAPH_FILE), load_external_data=False).graph.node) or name in (
        "bloom",
        "mpt",
    )


@pytest.mark.parametrize("name", [n if n in OPTIMIZER_SAMPLE else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_every_dynamic_axis_has_a_name_the_runtime_reads(name, tmp_path):
    """The traced graph's inputs and outputs, as ONNX Runtime sees them: their dynamic axes are
    named batch, sequence, past and past + sequence (export/trace.py) and nothing the tracer made
    up, and every other axis has a size: the runtime sizes its buffers from these."""
    import onnx
    import onnxruntime as ort

    from edgeinfer.export.trace import _AXES, trace

    torch.manual_seed(0)
    path = tmp_path / "model.onnx"
    trace(AutoModelForCausalLM.from_config(tiny_config(name)).eval(), path)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    shapes = {v.name: v.shape for v in (*session.get_inputs(), *session.get_outputs())}
    graph = onnx.load(str(path), load_external_data=False).graph
    written = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*graph.input, *graph.output)}
    assert shapes == written
    batch, new, past, total = (_AXES[k] for k in ("batch", "new", "past", "total"))
    # a model without attention (Mamba's) reads no mask: its graph takes none
    assert shapes["input_ids"] == [batch, new] and shapes.get("attention_mask", [batch, total]) == [batch, total]
    assert shapes["logits"] == [batch, new, model_vocab(name)]
    caches = [(n, s) for n, s in shapes.items() if n.startswith(("past_key_values.", "present.")) and n.endswith(("key", "value"))]
    states = [s for n, s in shapes.items() if n.endswith(("conv", "recurrent"))]  # linear attention: a fixed size
    assert (caches or states) and all(s[0] == batch and s[2] == (past if n.startswith("past") else total) for n, s in caches)
    assert all(isinstance(a, int) and a > 0 for _, s in caches for k, a in enumerate(s) if k not in (0, 2))
    assert all(s[0] == batch and all(isinstance(a, int) and a > 0 for a in s[1:]) for s in states)
    assert len(states) + len(caches) == len([n for n in shapes if n.startswith(("past_key_values.", "present."))])


def model_vocab(name: str) -> int:
    return tiny_config(name).get_text_config().vocab_size


@pytest.mark.parametrize("name", [n if n in OPTIMIZER_SAMPLE else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_the_graph_with_its_weights_written_apart_is_torch_onnxs_own(name, tmp_path, monkeypatch):
    """export_graph traces the model with its matrices hollow (export/stream.py), hands torch.onnx's
    exporter the weights as graph inputs and writes them to the data file itself, each from the
    model's own tensor (export/patches.py `weights_apart`); the graph must be the one torch.onnx's
    own export of the same trace over the real weights writes, with the logits cut to the last
    positions: the same nodes, inputs, outputs, and initializers (names, types, shapes and bytes).
    The weights are drawn at random: torch.onnx merges equal initializers with Identity nodes, where
    export reads the one kept under both names (tests/test_stream.py)."""
    import onnx
    from onnx import numpy_helper

    from edgeinfer.export import graphs
    from edgeinfer.export.trace import trace

    held = []
    write = graphs.write_weights
    monkeypatch.setattr(graphs, "write_weights", lambda path, weights, defer: (held.append(len(weights)), write(path, weights, defer)))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    with torch.no_grad():  # random, as a checkpoint's are: equal weights are merged otherwise (test_stream.py)
        for parameter in model.parameters():
            parameter.normal_(0, 0.1)
    (tmp_path / "ours").mkdir()
    graphs.export_graph(model, tmp_path / "ours")
    (tmp_path / "theirs").mkdir()
    trace(model, tmp_path / "theirs" / graphs.GRAPH_FILE)
    theirs = onnx.load(str(tmp_path / "theirs" / graphs.GRAPH_FILE))
    graphs.last_position_logits(theirs.graph)
    ours = onnx.load(str(tmp_path / "ours" / graphs.GRAPH_FILE))

    def tensors(graph):
        return {t.name: (t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes()) for t in graph.initializer}

    assert held and held[0] > 0  # the weights did go apart
    assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in theirs.graph.node]
    for field in ("input", "output"):
        assert [v.SerializeToString() for v in getattr(ours.graph, field)] == [
            v.SerializeToString() for v in getattr(theirs.graph, field)
        ]
    assert tensors(ours.graph) == tensors(theirs.graph)


# The split layout on one family per kind of attention in the fast suite: rotary in
# GroupQueryAttention, positions fed to it, a sliding window with query-key norms, and ALiBi
# (the attention as traced, whose cache grows). The others are marked slow.
SPLIT_SAMPLE = {"llama", "gpt2", "gemma3_text", "bloom"}


@pytest.mark.parametrize("name", [n if n in SPLIT_SAMPLE else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_the_split_layout_gives_the_single_graphs_results(name, exported, tmp_path):
    """Each family's export split into prefill and decode graphs (export/split.py compares them
    with the one graph through the runtime and raises where they differ), then checked against
    transformers as `edgeinfer check` does. Where the cache is written in place, again with both
    graphs' shapes fixed: the 40-token prompt fills a 48-position prefill graph, and decode runs
    one token a pass on a 64-slot cache."""
    import dataclasses
    import shutil

    from edgeinfer.export.split import split_export

    model, folder, manifest = exported(name)
    if manifest.kv.state:  # a recurrent state: refused, saying so
        shutil.copytree(folder, tmp_path / "split")
        with pytest.raises(ExportError, match="does not take a model with recurrent state"):
            split_export(tmp_path / "split", manifest, None, None)
        return
    variants = [(None, None)] + ([(48, min(64, manifest.max_context))] if manifest.kv.in_place else [])
    for prefill_length, static_context in variants:
        split = tmp_path / f"split-{prefill_length}"
        shutil.copytree(folder, split)
        if static_context is None or static_context >= len(PROMPT) + NEW_TOKENS:
            split_manifest, parity = split_export(split, manifest, prefill_length, static_context)
            assert parity["tokens_equal"] and parity["max_abs_diff"] <= parity["tolerance"]
            assert split_manifest.layout == "split" and not (split / "model.onnx").exists()
            result = check_export(split, model, PROMPT, NEW_TOKENS)
            assert result.tokens == result.expected_tokens and result.batch_rows_equal_single, (prefill_length, static_context)
            assert result.worst <= result.tolerance, (prefill_length, static_context, result)
    if not manifest.kv.in_place:
        with pytest.raises(ExportError, match="--static-context needs"):
            split_export(tmp_path / "split-None", dataclasses.replace(manifest), None, 32)


def test_a_family_the_tests_do_not_name_is_tried_and_the_checks_decide(tokenizer, tmp_path):
    """A family registered with transformers in this process (a Llama under its own name), which no
    record names: export says it is tried, exports it, and its tokens equal transformers'."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from edgeinfer.export.families import FAMILIES

    class UnheardOfConfig(LlamaConfig):
        model_type = "unheard_of_lm"

    class UnheardOfForCausalLM(LlamaForCausalLM):
        config_class = UnheardOfConfig

    AutoConfig.register("unheard_of_lm", UnheardOfConfig, exist_ok=True)
    AutoModelForCausalLM.register(UnheardOfConfig, UnheardOfForCausalLM, exist_ok=True)
    assert "unheard_of_lm" not in FAMILIES
    torch.manual_seed(0)
    model = UnheardOfForCausalLM(UnheardOfConfig(**{**COMMON, "head_dim": 16})).eval()
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    said = []
    export_model(str(tmp_path / "hf"), tmp_path / "out", say=said.append)
    assert "model type 'unheard_of_lm' is not among the families edgeinfer's tests prove: tried" in said[0]
    result = check_export(tmp_path / "out", model, PROMPT, NEW_TOKENS)
    assert result.tokens == result.expected_tokens and result.batch_rows_equal_single


def test_a_family_the_tests_do_not_name_that_fails_says_where_and_what_to_do(tokenizer, tmp_path):
    """A registered family whose MLP computes through complex numbers (aten::polar, which ONNX has
    no type for): the export fails in one line naming the stage, the operator and the way on, and
    leaves nothing."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    class PolarConfig(LlamaConfig):
        model_type = "polar_lm"

    class PolarForCausalLM(LlamaForCausalLM):
        config_class = PolarConfig

        def __init__(self, config):
            super().__init__(config)
            mlp = self.model.layers[0].mlp
            mlp.forward = lambda x: torch.polar(x.abs() + 1, x).real

    AutoConfig.register("polar_lm", PolarConfig, exist_ok=True)
    AutoModelForCausalLM.register(PolarConfig, PolarForCausalLM, exist_ok=True)
    PolarForCausalLM(PolarConfig(**{**COMMON, "head_dim": 16})).save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    with pytest.raises(ExportError) as failed:
        export_model(str(tmp_path / "hf"), tmp_path / "out")
    message = str(failed.value)
    assert message.startswith("torch.onnx could not export this polar_lm model") and "aten::polar" in message
    assert "model type 'polar_lm' is not among the families edgeinfer's tests prove" in message and "--debug" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
