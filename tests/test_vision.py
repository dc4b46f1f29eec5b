"""Images in: a tiny Idefics3 (SmolVLM's architecture) exported, its vision graph and language model
run by the runtime with no torch, against transformers' own processor and model: the same prompt
ids, pixels and greedy tokens with an image and without, alone and batched; the same picture asked
twice encoded once; bad images refused in SDK words."""

from __future__ import annotations

import io
import threading

import pytest

from vision_models import TILED, TOKENS, asked, build_idefics3, build_smolvlm, built_and_exported, oriented, png, transformers_tokens

from edgeinfer import Engine, Scheduler
from edgeinfer.sdk.chat import chat_turn
from edgeinfer.sdk.errors import SettingsError


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """(transformers model, processor, export folder) of the tiny Idefics3."""
    return built_and_exported(tmp_path_factory.mktemp("idefics3"), build_idefics3)


@pytest.mark.parametrize("images", [1, 2, 0], ids=["one image", "two images", "text only"])
def test_a_chat_with_images_gives_transformers_prompt_and_tokens(idefics3, images):
    model, processor, export = idefics3
    pictures = [png(seed) for seed in range(images)]
    messages, theirs = asked("What is in the picture?", *pictures)
    ids, tokens = transformers_tokens(model, processor, theirs, pictures)
    engine = Engine.load(export, provider="cpu")
    result = engine.chat(messages, max_new_tokens=TOKENS, ignore_eos=True)
    assert result.token_ids == tokens
    assert result.prompt_tokens == len(ids)
    turn = chat_turn(engine.tokenizer, engine.max_context, messages, vision=engine.manifest.vision)
    assert [processor.tokenizer.convert_tokens_to_ids("<image>") if t >= 1 << 32 else t for t in turn.ids] == list(ids)
    assert len(turn.pictures) == images


def test_the_same_picture_asked_twice_is_encoded_once_and_its_prompt_found_in_the_prefix_cache(idefics3):
    _, _, export = idefics3
    engine = Engine.load(export, provider="cpu")
    picture = png(7)
    first = engine.chat(asked("Describe it.", picture)[0], max_new_tokens=4, ignore_eos=True)
    again = engine.chat(asked("Describe it.", picture)[0], max_new_tokens=4, ignore_eos=True)
    other = engine.chat(asked("Describe it.", png(8))[0], max_new_tokens=4, ignore_eos=True)
    assert engine.runner.images.encoded == 2  # the first picture once, the other once
    assert first.token_ids == again.token_ids and again.cached_tokens > 0
    # the other picture's tokens are not the first's: the prefix cache stops where the pictures differ
    turn = chat_turn(engine.tokenizer, engine.max_context, asked("Describe it.", picture)[0], vision=engine.manifest.vision)
    first_image_token = next(i for i, t in enumerate(turn.ids) if t >= 1 << 32)
    assert other.cached_tokens <= first_image_token


def test_a_batch_of_rows_with_and_without_images_gives_each_rows_tokens_alone(idefics3):
    _, _, export = idefics3
    engine = Engine.load(export, provider="cpu", max_batch=4)
    conversations = [
        asked("What is it?", png(1))[0],
        [{"role": "user", "content": "Say something."}],
        asked("Compare them.", png(2), png(3))[0],
        asked("And this?", png(1))[0],
    ]
    alone = [engine.chat(m, max_new_tokens=TOKENS, ignore_eos=True).token_ids for m in conversations]
    turns = [chat_turn(engine.tokenizer, engine.max_context, m, vision=engine.manifest.vision) for m in conversations]
    for turn in turns:
        engine.runner.see(turn.pictures)
    results = [None] * len(turns)
    with Scheduler(engine, max_batch=4) as scheduler:
        requests = [scheduler.submit(turn.ids, max_new_tokens=TOKENS, ignore_eos=True) for turn in turns]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, requests[i].result().token_ids)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert results == alone


@pytest.mark.parametrize(
    "image, words",
    [
        (b"", "the image is empty (0 bytes)"),
        (b"not an image at all", "the image cannot be decoded"),
        (png(1)[:60], "the image cannot be decoded"),
        (12, "an image is a path, bytes or a PIL image, not int"),
        ("/nonexistent/picture.png", "cannot read the image /nonexistent/picture.png"),
    ],
    ids=["empty", "not an image", "truncated", "a number", "a missing file"],
)
def test_a_bad_image_is_refused_in_sdk_words(idefics3, image, words):
    _, _, export = idefics3
    engine = Engine.load(export, provider="cpu")
    with pytest.raises(SettingsError) as refused:
        engine.chat(asked("What is it?", image)[0], max_new_tokens=2)
    assert words in str(refused.value) and refused.value.param == "messages"


def test_an_image_sent_to_a_text_only_model_says_what_takes_one(tiny_llama):
    engine = Engine.load(tiny_llama[1], provider="cpu")
    with pytest.raises(SettingsError, match="this model reads text only, and a message holds an image"):
        engine.chat(asked("What is it?", png(1))[0], max_new_tokens=2)
    # text parts alone are one text, as the template takes it
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    assert (
        engine.chat(parts, max_new_tokens=4, ignore_eos=True).token_ids
        == engine.chat([{"role": "user", "content": "Hello there"}], max_new_tokens=4, ignore_eos=True).token_ids
    )


def _cli(*args: str, lines: list[str] | None = None):
    import subprocess
    import sys

    command = [sys.executable, "-m", "edgeinfer.cli", *args]
    stdin = "".join(f"{line}\n" for line in lines) if lines is not None else None
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=300)


def test_run_image_and_chat_image_send_the_picture_with_the_message(idefics3, tmp_path):
    import json

    _, _, export = idefics3
    picture = tmp_path / "p.png"
    picture.write_bytes(oriented(png(4), 6))  # a phone photo: read upright, as png(4)
    engine = Engine.load(export, provider="cpu")
    expected = engine.chat(asked("What is it?", png(4))[0], max_new_tokens=6)
    done = _cli(
        "run", "-m", str(export), "--provider", "cpu", "--image", str(picture), "What is it?", "--max-new-tokens", "6", "--json"
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (
        result["token_ids"] == expected.token_ids and result["prompt_tokens"] == expected.prompt_tokens and result["image_tokens"] == 9
    )
    raw = _cli("run", "-m", str(export), "--image", str(picture), "--raw", "x")
    assert raw.returncode == 2 and "--image goes with a chat turn (the template places the picture): leave out --raw" in raw.stderr
    lines = [f"/image {tmp_path / 'missing.png'}", f"/image {picture}", "What is it?", "/bye"]
    chatted = _cli("chat", "-m", str(export), "--provider", "cpu", "--max-new-tokens", "6", lines=lines)
    assert chatted.returncode == 0 and chatted.stdout == expected.text + "\n", chatted.stderr
    assert (
        f"cannot read the image {tmp_path / 'missing.png'}" in chatted.stderr
        and "(p.png goes with your next message)" in chatted.stderr
    )


def test_the_memory_plan_counts_the_vision_graph_and_the_manifest_says_what_an_image_becomes(idefics3):
    from edgeinfer.sdk.manifest import VISION_FORMAT_VERSION, load_manifest
    from edgeinfer.sdk.memory import MemoryPlan

    _, processor, export = idefics3
    manifest = load_manifest(export)
    graphs = ("model.onnx", "model.onnx.data", "vision.onnx", "vision.onnx.data")
    assert MemoryPlan.of(manifest, 64, 1).weights == sum((export / name).stat().st_size for name in graphs)
    assert manifest.format_version == VISION_FORMAT_VERSION and manifest.vision["tokens_per_image"] == processor.image_seq_len
    assert manifest.vision["steps"] == [{"op": "longest_edge", "size": 96}, {"op": "resize", "height": 48, "width": 48}]
    checked = manifest.validation["vision"]
    assert checked["ids_equal"] and checked["tokens_equal"] and checked["max_abs_diff_pixels"] < 1e-6


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    """The tiny Idefics3 whose processor cuts pictures into tiles (SmolVLM's published default)."""
    return built_and_exported(tmp_path_factory.mktemp("idefics3-tiled"), build_idefics3, shape=TILED)


@pytest.mark.parametrize("size", [(70, 41), (30, 90), (48, 48), (200, 20)], ids=["wide", "tall", "square", "a strip"])
def test_tiled_pictures_give_transformers_prompt_and_tokens(tiled, size):
    """Each picture cut as the processor cuts it (rows and columns from its shape), the tiles' text
    named by row and column, the whole picture after them."""
    model, processor, export = tiled
    image = png(11, size)
    messages, theirs = asked("What is in the picture?", image)
    ids, tokens = transformers_tokens(model, processor, theirs, [image])
    engine = Engine.load(export, provider="cpu")
    result = engine.chat(messages, max_new_tokens=TOKENS, ignore_eos=True)
    assert result.token_ids == tokens and result.prompt_tokens == len(ids)
    assert engine.manifest.vision["tiles"]["size"] == 48 and engine.manifest.validation["vision"]["ids_equal"]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_picture_is_turned_upright_by_its_exif_orientation_before_anything_else(tiled, orientation):
    """A photo stored turned, with the EXIF orientation (1-8) that turns it back, reads as the upright
    picture does in transformers: the same pixels, and, a 120x40 picture being two tiles side by
    side upright and two stacked turned, the same prompt and tokens."""
    import numpy as np

    from edgeinfer.sdk.vision import picture

    model, processor, export = tiled
    upright = png(7, (120, 40))
    stored = oriented(upright, orientation)
    ids, tokens = transformers_tokens(model, processor, asked("What is it?", upright)[1], [upright])
    engine = Engine.load(export, provider="cpu")
    result = engine.chat(asked("What is it?", stored)[0], max_new_tokens=TOKENS, ignore_eos=True)
    assert (result.token_ids, result.prompt_tokens) == (tokens, len(ids))
    vision = engine.manifest.vision
    assert np.array_equal(picture(stored, vision).pixels, picture(upright, vision).pixels)
    if orientation == 6:  # a phone's JPEG: the tag in its APP1 segment, a PIL image keeping it
        from PIL import Image

        jpeg = oriented(upright, 6, "JPEG")
        assert picture(jpeg, vision).pixels.shape == picture(upright, vision).pixels.shape
        assert np.array_equal(picture(Image.open(io.BytesIO(jpeg)), vision).pixels, picture(jpeg, vision).pixels)


def test_info_says_what_a_picture_becomes(idefics3, tiled):
    for export, words in (
        (idefics3[2], "pictures: read as one square, 9 tokens each (vision.onnx)"),
        (tiled[2], "pictures: read as 48x48 tiles and the whole picture as one more, 9 tokens each (vision.onnx)"),
    ):
        done = _cli("info", str(export))
        assert done.returncode == 0 and words in done.stdout, done.stdout


def test_pictures_of_waiting_requests_stay_until_their_requests_end_however_small_the_store(idefics3):
    """A store with room for no picture at all: each request's pictures are held from submit to its
    end (a 1-row scheduler makes the others wait in the queue), then let go."""
    _, _, export = idefics3
    engine = Engine.load(export, provider="cpu")
    conversations = [asked("What is it?", png(20 + i))[0] for i in range(3)]
    alone = [engine.chat(m, max_new_tokens=4, ignore_eos=True).token_ids for m in conversations]
    store = engine.runner.images
    assert store.held == 0
    store.max_bytes = 1
    turns = [chat_turn(engine.tokenizer, engine.max_context, m, vision=engine.manifest.vision) for m in conversations]
    with Scheduler(engine, max_batch=1) as scheduler:
        busy = scheduler.submit([5, 6, 7], max_new_tokens=200, ignore_eos=True)  # the row, while the others queue
        requests = [scheduler.submit(t.ids, pictures=t.pictures, max_new_tokens=4, ignore_eos=True) for t in turns]
        assert [r.result().token_ids for r in requests] == alone and len(busy.result().token_ids) == 200
    assert store.held == 0 and store.kept == 0  # each let go at its end, and none fits the room
    engine.chat(conversations[0], max_new_tokens=2)
    assert store.held == 0


def test_pictures_a_failed_encoding_held_are_let_go(idefics3):
    """The vision graph failing on a picture (here: pixels of the wrong shape for it) leaves no hold behind."""
    import dataclasses

    from edgeinfer.sdk.errors import EdgeInferError
    from edgeinfer.sdk.vision import picture

    engine = Engine.load(idefics3[2], provider="cpu")
    item = picture(png(30), engine.manifest.vision)
    wrong = dataclasses.replace(item, key=item.key + 1, pixels=item.pixels[:, :, :7, :7])
    with pytest.raises(EdgeInferError):
        engine.runner.see([item, wrong])
    assert engine.runner.images.held == 0 and engine.runner.images.kept == 1  # the good one kept, neither held


def test_quantize_puts_the_vision_graphs_matmuls_in_int8_and_the_check_records_the_cost(idefics3, tmp_path):
    """--quantize int4: the language model in int4, the encoder's MatMuls in int8 (MatMulNBits, bits
    8); its features stay near the fp32 encoder's, and the picture check is recorded, not gated."""
    import numpy as np
    import onnx

    from edgeinfer.export import ExportOptions, Quantization, export_model
    from edgeinfer.sdk.vision import picture

    _, _, fp32 = idefics3
    export_model(str(fp32.parent / "hf"), tmp_path / "q", ExportOptions(quantization=Quantization("int4"), quality=False))
    graph = onnx.load(str(tmp_path / "q" / "vision.onnx"), load_external_data=False)
    nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {8}
    engine, plain = Engine.load(tmp_path / "q", provider="cpu"), Engine.load(fp32, provider="cpu")
    assert engine.manifest.quantization["vision"] == {"method": "int8", "block_size": 32, "matmuls": len(nbits)}
    checked = engine.manifest.validation["vision"]
    assert checked["ids_equal"] and checked["max_abs_diff_pixels"] < 1e-5
    item = picture(png(5), engine.manifest.vision)
    engine.runner.images.add([item])
    plain.runner.images.add([item])
    ours, theirs = (e.runner.images._row(item.ids()[0]) for e in (engine, plain))  # the first token's features
    difference = float(np.abs(ours - theirs).max())
    assert 0 < difference < 0.05 * float(np.abs(theirs).max())
    assert len(engine.chat(asked("What is it?", png(5))[0], max_new_tokens=4, ignore_eos=True).token_ids) == 4


@pytest.mark.parametrize("shape", [None, TILED], ids=["whole", "tiled"])
def test_smolvlm_in_its_own_classes_exports_from_the_command_line_and_gives_transformers_tokens(tmp_path, shape):
    """SmolVLM's checkpoints are saved as model_type smolvlm with SmolVLMProcessor (not Idefics3's
    classes): its processor needs num2words (the export extra), names the whole picture's tag
    global_image_token, and keeps image_seq_len in processor_config.json."""
    model, processor = build_smolvlm(tmp_path / "hf", **({"shape": shape} if shape else {}))
    done = _cli("export", str(tmp_path / "hf"), "-o", str(tmp_path / "export"))
    assert done.returncode == 0, done.stderr
    assert "prompt ids equal, " in done.stderr and "greedy tokens equal" in done.stderr
    engine = Engine.load(tmp_path / "export", provider="cpu")
    assert engine.manifest.architecture == "smolvlm" and engine.manifest.vision["tokens_per_image"] == 9
    for pictures in ([png(1, (90, 50))], [png(2), png(3)], []):
        messages, theirs = asked("What is in the picture?", *pictures)
        ids, tokens = transformers_tokens(model, processor, theirs, pictures)
        result = engine.chat(messages, max_new_tokens=TOKENS, ignore_eos=True)
        assert (result.token_ids, result.prompt_tokens) == (tokens, len(ids))
