"""LoRA adapters (export/lora.py, sdk/adapters.py): tiny random-weight adapters made with PEFT in the
test, exported beside a tiny llama, and served per row against PEFT's own models."""

from __future__ import annotations

import json
import signal

import numpy as np
import openai
import pytest

from conftest import build_llama, closeness
from test_serve import start

from edgeinfer import Engine, GenerationConfig
from edgeinfer.sdk.errors import ExportError, SettingsError
from edgeinfer.sdk.scheduler import Scheduler

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"all": (ALL, 8), "qv": (["q_proj", "v_proj"], 4), "out": (["o_proj", "down_proj"], 16)}
PROMPT = "The capital of France is"


def make_adapter(base_folder, out, targets, rank, seed, **config):
    """A PEFT LoRA adapter of the model in `base_folder` with random A and B (PEFT starts B at
    zero, which would change nothing), saved to `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_folder),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **config),
    )
    torch.manual_seed(seed)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data.normal_(0, 0.3)
    model.save_pretrained(out)
    return out


def peft_merged(base_folder, adapter):
    """transformers' model with the adapter merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), str(adapter)).merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(HF folder, adapter folders by name, export folder with the three adapters)."""
    from edgeinfer.export import ExportOptions, export_model

    root = tmp_path_factory.mktemp("adapters")
    build_llama(root / "hf")
    folders = {name: make_adapter(root / "hf", root / name, t, r, seed) for seed, (name, (t, r)) in enumerate(ADAPTERS.items())}
    export_model(str(root / "hf"), root / "export", ExportOptions(adapters=tuple((n, str(f)) for n, f in folders.items())))
    return root / "hf", folders, root / "export"


@pytest.fixture(scope="module")
def engine(adapted):
    return Engine.load(adapted[2], provider="cpu", max_batch=4)


def adapter_logits(engine, model, ids, adapter, new_tokens=12):
    """The export's and transformers' logits after `ids` and each of transformers' greedy tokens."""
    import torch

    with torch.no_grad():
        tokens = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=new_tokens, do_sample=False
        )[0, len(ids) :].tolist()
        reference = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float().numpy()
    batch = engine.runner.new_batch()
    engine.runner.assign(batch, 0, adapter)
    ours = [engine.runner.prefill(batch, [ids]).numpy()[0, -1]]
    ours += [engine.runner.decode(batch, [t]).numpy()[0, -1] for t in tokens[:-1]]
    return tokens, np.stack(ours), reference


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_gives_the_tokens_and_logits_of_peft_merged_into_transformers(adapted, engine, name):
    hf, folders, _ = adapted
    ids = engine.prompt_ids(PROMPT)
    tokens, ours, reference = adapter_logits(engine, peft_merged(hf, folders[name]), ids, name)
    cosine, relative = closeness(ours, reference)
    assert cosine > 0.99999 and relative < 1e-4
    assert engine.generate(ids, max_new_tokens=12, adapter=name).token_ids == tokens
    assert tokens != engine.generate(ids, max_new_tokens=12).token_ids  # the adapter changes the output


def test_the_manifest_records_each_adapter_and_its_check_against_peft(adapted, engine):
    manifest = engine.manifest
    assert manifest.format_version == 4 and manifest.lora.file == "model.lora.3.onnx"
    assert sorted(manifest.adapters) == sorted(ADAPTERS)
    assert manifest.adapters["all"]["rank"] == 8 and len(manifest.adapters["all"]["modules"]) == 14
    assert manifest.adapters["qv"]["modules"] == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"]
    for entry in manifest.adapters.values():
        assert entry["check"]["gated"] and entry["check"]["tokens_equal"]
        assert entry["check"]["max_abs_diff_decode"] < entry["check"]["tolerance"]
        assert entry["file"] in manifest.files


def test_rows_of_three_adapters_and_the_base_in_one_batch_each_equal_their_solo_runs(engine):
    names = [None, *ADAPTERS]
    solo = [engine.generate(PROMPT, max_new_tokens=16, adapter=a).token_ids for a in names]
    assert len({tuple(t) for t in solo}) == 4
    batch = engine.generate_batch([PROMPT] * 4, [GenerationConfig(max_new_tokens=16, adapter=a) for a in names])
    assert [r.token_ids for r in batch] == solo
    prompts = [PROMPT, "Hi", "Edge boxes run small language models."]  # one adapter on every row: one A and B shared
    shared = engine.generate_batch(prompts, max_new_tokens=16, adapter="out")
    assert [r.token_ids for r in shared] == [engine.generate(p, max_new_tokens=16, adapter="out").token_ids for p in prompts]
    with Scheduler(engine, max_batch=4) as scheduler:
        requests = [scheduler.submit(PROMPT, max_new_tokens=16, adapter=a) for a in reversed(names)]
        assert [r.result().token_ids for r in requests] == solo[::-1]


def test_base_rows_on_the_adapters_graph_equal_the_base_graph(adapted):
    engine = Engine.load(adapted[2], provider="cpu")
    ids = engine.prompt_ids(PROMPT)
    base_graph = engine.runner.graph
    before = engine.runner.prefill(engine.runner.new_batch(), [ids]).numpy()
    engine.generate(ids, max_new_tokens=2, adapter="qv")  # the adapters' graph serves from here on
    assert engine.runner.graph is not base_graph and any(n.startswith("lora.") for n in engine.runner.graph.inputs)
    after = engine.runner.prefill(engine.runner.new_batch(), [ids]).numpy()
    np.testing.assert_array_equal(after, before)


def test_the_prefix_cache_never_reuses_a_prompt_cached_under_another_adapter(adapted):
    engine = Engine.load(adapted[2], provider="cpu", prefix_cache=16)
    fresh = Engine.load(adapted[2], provider="cpu", prefix_cache=0)
    prompt = " ".join(["Edge boxes run small language models."] * 3)
    first = engine.generate(prompt, max_new_tokens=8, adapter="all")
    other = engine.generate(prompt, max_new_tokens=8, adapter="qv")
    base = engine.generate(prompt, max_new_tokens=8)
    again = engine.generate(prompt, max_new_tokens=8, adapter="all")
    assert first.cached_tokens == other.cached_tokens == base.cached_tokens == 0
    assert again.cached_tokens >= 32
    for result, adapter in ((first, "all"), (other, "qv"), (base, None), (again, "all")):
        assert result.token_ids == fresh.generate(prompt, max_new_tokens=8, adapter=adapter).token_ids


def test_an_unknown_adapter_is_refused_with_the_names_there_are(engine, tiny_llama):
    with pytest.raises(SettingsError, match="unknown adapter 'nope': this export has all, out, qv"):
        engine.generate(PROMPT, adapter="nope")
    with pytest.raises(SettingsError, match="this export has no adapters; add one with `edgeinfer export-adapter"):
        Engine.load(tiny_llama[1], provider="cpu").generate(PROMPT, adapter="all")
    with pytest.raises(SettingsError, match="speculative='draft' proposes with the draft model's base weights"):
        engine.generate(PROMPT, adapter="all", speculative="draft")


def test_export_adapter_adds_an_adapter_to_an_export_in_one_step(adapted, tmp_path):
    from edgeinfer.export import ExportOptions, export_adapter, export_model
    from edgeinfer.sdk.manifest import load_manifest, verify_files

    hf, folders, full = adapted
    export_model(str(hf), tmp_path / "export", ExportOptions(adapters=(("all", str(folders["all"])),)))
    assert load_manifest(tmp_path / "export").lora.file == "model.lora.1.onnx"
    manifest = export_adapter(folders["out"], tmp_path / "export", "out")
    assert sorted(manifest.adapters) == ["all", "out"] and manifest.lora.file == "model.lora.2.onnx"
    assert not (tmp_path / "export" / "model.lora.1.onnx").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folder left
    verify_files(tmp_path / "export", load_manifest(tmp_path / "export").files)
    added, reference = Engine.load(tmp_path / "export", provider="cpu"), Engine.load(full, provider="cpu")
    for adapter in ("all", "out", None):
        assert (
            added.generate(PROMPT, max_new_tokens=12, adapter=adapter).token_ids
            == reference.generate(PROMPT, max_new_tokens=12, adapter=adapter).token_ids
        )
    with pytest.raises(ExportError, match="already has an adapter named 'out'"):
        export_adapter(folders["qv"], tmp_path / "export", "out")


def _config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "is DoRA"),
        ({"modules_to_save": ["lm_head"]}, r"trains whole modules \(lm_head; modules_to_save\)"),
        ({"peft_type": "IA3"}, "is a IA3 adapter: edgeinfer serves LoRA adapters"),
        ({"bias": "all"}, "trains biases"),
    ],
)
def test_adapters_the_export_cannot_serve_are_refused_naming_why(adapted, tmp_path, change, message):
    import shutil

    from edgeinfer.export.lora import read_peft

    folder = _config(shutil.copytree(adapted[1]["qv"], tmp_path / "adapter"), **change)
    with pytest.raises(ExportError, match=message):
        read_peft(folder)


def test_bad_adapter_folders_names_and_mismatched_bases_are_refused_before_any_work(adapted, tmp_path):
    from edgeinfer.export import ExportOptions, export_model

    hf, folders, _ = adapted
    with pytest.raises(ExportError, match="is not a PEFT adapter folder"):
        export_model(str(hf), tmp_path / "a", ExportOptions(adapters=(("x", str(hf)),)))
    with pytest.raises(ExportError, match="adapter name 'a:b' is not usable"):
        ExportOptions(adapters=(("a:b", str(folders["qv"])),))
    with pytest.raises(ExportError, match="two --adapter options are named 'x'"):
        ExportOptions(adapters=(("x", str(folders["qv"])), ("x", str(folders["all"]))))
    with pytest.raises(ExportError, match="the split layout"):
        ExportOptions(graphs="split", adapters=(("x", str(folders["qv"])),))
    build_llama(tmp_path / "wider", intermediate_size=96)
    wider = make_adapter(tmp_path / "wider", tmp_path / "wider-adapter", ["down_proj"], 4, 0)
    with pytest.raises(ExportError, match="does not fit this base model: its model.layers.0.mlp.down_proj maps 96 to 64"):
        export_model(str(hf), tmp_path / "b", ExportOptions(adapters=(("w", str(wider)),)))
    embedding = make_adapter(hf, tmp_path / "embedding", ["embed_tokens"], 4, 0)
    with pytest.raises(ExportError, match=r"changes an embedding \(base_model.model.model.embed_tokens\)"):
        export_model(str(hf), tmp_path / "c", ExportOptions(adapters=(("e", str(embedding)),)))
    assert not [p.name for p in tmp_path.iterdir() if p.name in ("a", "b", "c")]


def test_the_server_serves_each_adapter_as_base_colon_name(adapted, engine):
    process, url = start(adapted[2], "--provider", "cpu", "--max-batch", "4")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        name = adapted[2].name
        listed = {m.id: m for m in client.models.list().data}
        assert sorted(listed) == sorted([name, *(f"{name}:{a}" for a in ADAPTERS)])
        assert listed[f"{name}:qv"].model_extra["parent"] == name
        for adapter in (None, *ADAPTERS):
            model = name if adapter is None else f"{name}:{adapter}"
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
            assert reply.model == model
            assert reply.choices[0].text == engine.generate(PROMPT, max_new_tokens=12, adapter=adapter).text
        with pytest.raises(openai.NotFoundError, match=f"'{name}' has no adapter 'nope'; its adapters are '{name}:all'"):
            client.completions.create(model=f"{name}:nope", prompt=PROMPT, max_tokens=2)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_the_command_line_exports_adds_and_runs_adapters(adapted, engine, tmp_path):
    """`edgeinfer export --adapter`, `edgeinfer export-adapter` and `edgeinfer run --adapter`, as a user runs them."""
    import subprocess
    import sys

    hf, folders, _ = adapted
    cli = [sys.executable, "-m", "edgeinfer.cli"]
    done = subprocess.run(
        [*cli, "export", str(hf), "-o", str(tmp_path / "e"), "--adapter", f"all={folders['all']}"], capture_output=True, text=True
    )
    assert (
        done.returncode == 0
        and "adapter all: rank 8 on 14 modules; against PEFT: largest logits difference" in done.stderr + done.stdout
    )
    done = subprocess.run(
        [*cli, "export-adapter", str(folders["qv"]), "--base", str(tmp_path / "e"), "--name", "qv"], capture_output=True, text=True
    )
    assert done.returncode == 0 and f"added adapter qv to {tmp_path / 'e'}: it has all, qv" in done.stderr + done.stdout
    for adapter in ("all", "qv"):
        run = [*cli, "run", PROMPT, "--raw", "--model", str(tmp_path / "e"), "--adapter", adapter, "--max-new-tokens", "8", "--json"]
        done = subprocess.run(run, capture_output=True, text=True)
        assert (
            done.returncode == 0 and json.loads(done.stdout)["text"] == engine.generate(PROMPT, max_new_tokens=8, adapter=adapter).text
        )
    done = subprocess.run([*cli, "run", PROMPT, "--model", str(tmp_path / "e"), "--adapter", "nope"], capture_output=True, text=True)
    assert done.returncode == 1 and "unknown adapter 'nope': this export has all, qv" in done.stderr


@pytest.fixture(scope="module", params=["fp32", "int8", "int4"])
def quantized_adapted(request, adapted):
    """An export of the tiny llama with the "all" and "out" adapters, at each precision."""
    from edgeinfer.export import ExportOptions, export_model
    from edgeinfer.export.quantize import Quantization

    hf, folders, root = adapted[0], adapted[1], adapted[2].parent
    out = root / f"export-{request.param}"
    if not out.exists():
        quantization = None if request.param == "fp32" else Quantization(request.param)
        chosen = tuple((n, str(folders[n])) for n in ("all", "out"))
        export_model(str(hf), out, ExportOptions(quantization=quantization, adapters=chosen))
    return request.param, Engine.load(out, provider="cpu", max_batch=8, prefix_cache=0)


def logprobs_of(result) -> list[float]:
    return [entry.logprob for entry in result.logprobs]


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_rows_of_one_adapter_give_what_one_row_alone_gives_on_every_precision(quantized_adapted, rows):
    """Each row binds its own A and B: one pair shared by all rows made MatMul multiply the rows as
    one matrix, in another summation order than one row alone, and on a quantized base (whose
    kernels round the activations to 8 bits) the last bits grew into other tokens. On int8 and int4
    the logprobs are those of the row alone to the bit."""
    precision, engine = quantized_adapted
    prompts = [PROMPT, "Hi", "Edge boxes run small language models."]
    asked = dict(max_new_tokens=16, logprobs=True)
    alone = {(p, a): engine.generate(p, adapter=a, **asked) for p in prompts for a in (None, "all", "out")}
    cases = {
        "one adapter": [(prompts[i % 3], "all") for i in range(rows)],
        "one adapter, one prompt": [(PROMPT, "out")] * rows,
        "mixed with the base": [(prompts[i % 3], (None, "all", "out")[i % 3]) for i in range(rows)],
    }
    for case, mix in cases.items():
        batch = engine.generate_batch([p for p, _ in mix], [GenerationConfig(adapter=a, **asked) for _, a in mix])
        for (prompt, adapter), result in zip(mix, batch):
            expected = alone[(prompt, adapter)]
            assert result.token_ids == expected.token_ids, (case, prompt, adapter)
            if precision != "fp32":  # fp32's base MatMul itself takes another path for one row than for several
                assert logprobs_of(result) == logprobs_of(expected), (case, prompt, adapter)


def test_concurrent_requests_of_one_adapter_through_the_server_answer_as_one_alone(quantized_adapted):
    """The issue's case through the API: requests of one adapter at once, on each precision, give
    the tokens (and on int8 and int4 the logprobs, to the bit) of one request alone."""
    import threading

    precision, engine = quantized_adapted
    model = f"{engine.folder.name}:all"
    process, url = start(engine.folder, "--provider", "cpu", "--max-batch", "4", "--prefix-cache", "0")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        asked = dict(model=model, prompt=PROMPT, max_tokens=16, logprobs=1)
        alone = client.completions.create(**asked).choices[0]
        together = [None] * 4
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, client.completions.create(**asked).choices[0]))
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for choice in together:
            assert choice.text == alone.text
            if precision != "fp32":
                assert choice.logprobs.token_logprobs == alone.logprobs.token_logprobs
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
