"""The manifest contract, on hand-made data."""

import json

import pytest

from edgeinfer.sdk.errors import ManifestError, NotAnExportError
from edgeinfer.sdk.manifest import FORMAT_VERSION, GraphSpec, KVSpec, Manifest, TokenizerSpec, describe_files, load_manifest


def sample(files=None) -> Manifest:
    past = ["past_key_values.0.key", "past_key_values.0.value"]
    return Manifest(
        source="test",
        architecture="llama",
        dtype="float32",
        vocab_size=10,
        max_context=32,
        bos_token_id=1,
        eos_token_ids=[2],
        graph=GraphSpec("model.onnx", ["input_ids", *past], ["logits"]),
        kv=KVSpec(1, 2, 4, "float32", 2, past, ["present.0.key", "present.0.value"]),
        tokenizer=TokenizerSpec(chat_template=None),
        files=files or {},
    )


def test_round_trip_through_json(tmp_path):
    sample().save(tmp_path)
    assert load_manifest(tmp_path) == sample()


def test_a_newer_format_version_is_refused(tmp_path):
    data = sample().to_dict() | {"format_version": FORMAT_VERSION + 1}
    (tmp_path / "edgeinfer.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="newer than this edgeinfer reads.*upgrade edgeinfer"):
        load_manifest(tmp_path)


def test_a_version_1_manifest_is_read_with_its_decode_graph_for_both_phases(tmp_path):
    data = sample().to_dict() | {"format_version": 1}
    graph = data.pop("graph")
    data |= {
        "prefill": {"file": "prefill.onnx", "inputs": ["input_ids"], "outputs": ["logits"]},
        "decode": graph | {"file": "decode.onnx"},
    }
    (tmp_path / "edgeinfer.json").write_text(json.dumps(data))
    manifest = load_manifest(tmp_path)
    assert manifest.graph == GraphSpec("decode.onnx", graph["inputs"], graph["outputs"]) and manifest.format_version == 1


def test_a_malformed_manifest_names_the_way_out(tmp_path):
    (tmp_path / "edgeinfer.json").write_text(json.dumps({"format_version": 1, "source": "x"}))
    with pytest.raises(ManifestError, match="malformed.*edgeinfer export"):
        load_manifest(tmp_path)
    (tmp_path / "edgeinfer.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(tmp_path)


def test_truncated_and_missing_files_are_named(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"x" * 100)
    sample(files=describe_files(tmp_path)).save(tmp_path)
    assert load_manifest(tmp_path).files["model.onnx"]["size"] == 100
    (tmp_path / "model.onnx").write_bytes(b"x" * 60)
    with pytest.raises(NotAnExportError, match="model.onnx has 60 bytes but the manifest says 100"):
        load_manifest(tmp_path)
    (tmp_path / "model.onnx").unlink()
    with pytest.raises(NotAnExportError, match="model.onnx is missing"):
        load_manifest(tmp_path)


def test_kv_layout_must_pair_past_and_present():
    with pytest.raises(ManifestError, match="2 past inputs but 1 present"):
        KVSpec(1, 2, 4, "float32", 2, ["a", "b"], ["c"])


def test_folders_that_are_not_exports(tmp_path):
    with pytest.raises(NotAnExportError, match="does not exist"):
        load_manifest(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NotAnExportError, match="Hugging Face model folder.*edgeinfer export"):
        load_manifest(tmp_path)
