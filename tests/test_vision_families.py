"""Vision-language families beyond SmolVLM's, each a tiny random-weight model from transformers' own
config classes exported and run by the runtime against transformers' processor and model:
- Gemma 3's vision variant: its picture tokens attend to each other both ways (a block in the
  causal mask), so its attention stays as traced; beside tokens these tests pin the logits against
  transformers' with the block, show that they differ without it, and that a picture is never cut
  between two prefill passes;
- Qwen2.5-VL: each picture keeps its own shape (one vision graph for every size, its windows worked
  out in the graph) and its tokens are placed by 3-D rotary positions (time, row, column) that the
  runtime computes, the rotations left in the graph before GroupQueryAttention: these tests pin
  them against transformers' get_rope_index, and show that text positions alone would not pass.
The tests every family shares (tokens with 0, 1 and 2 pictures, a batch, the same picture twice,
the scheduler, a real server) run on both."""

from __future__ import annotations

import io

import numpy as np
import pytest

from vision_models import TOKENS, asked, build_gemma3, build_qwen2_5_vl, build_qwen3_5, built_and_exported, png, transformers_tokens

from edgeinfer import Engine, Scheduler
from edgeinfer.sdk.chat import chat_turn
from edgeinfer.sdk.manifest import PICTURES_FORMAT_VERSION
from edgeinfer.sdk.vision import PICTURE_BASE, rotary_positions, whole_pictures


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers model, processor, export folder) of the tiny Gemma 3."""
    return built_and_exported(tmp_path_factory.mktemp("gemma3"), build_gemma3)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(transformers model, processor, export folder) of the tiny Qwen2.5-VL."""
    return built_and_exported(tmp_path_factory.mktemp("qwen2_5_vl"), build_qwen2_5_vl)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """(transformers model, processor, export folder) of the tiny Qwen 3.5 (its vision-language model)."""
    return built_and_exported(tmp_path_factory.mktemp("qwen3_5"), build_qwen3_5)


@pytest.fixture(params=["gemma3", "qwen", "qwen3_5"])
def family(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["qwen", "qwen3_5"])
def qwen_family(request):
    """Qwen2.5-VL's and Qwen 3.5's: pictures at their own shape, placed by row and column."""
    return request.getfixturevalue(request.param)


def first_logits(engine: Engine, messages: list[dict]) -> np.ndarray:
    """The runtime's logits at the prompt's last position."""
    turn = chat_turn(engine.tokenizer, engine.max_context, messages, vision=engine.manifest.vision)
    engine.runner.see(turn.pictures)
    try:
        return engine.runner.prefill(engine.runner.new_batch(), [turn.ids]).numpy()[0, -1].astype(np.float32)
    finally:
        engine.runner.let_go(turn.pictures)


def processed(processor, messages: list[dict], images: list[bytes]) -> dict:
    from PIL import Image

    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images] or None
    return dict(processor(text=text, images=pictures, return_tensors="pt"))


def transformers_logits(model, processor, messages: list[dict], images: list[bytes], blocks: bool = True) -> np.ndarray:
    """transformers' logits at the prompt's last position: with the picture blocks (token_type_ids),
    as Gemma 3 runs, or (`blocks` False) with a causal mask alone."""
    import torch

    inputs = processed(processor, messages, images)
    if not blocks:
        del inputs["token_type_ids"]
    with torch.no_grad():
        return model(**inputs).logits[0, -1].float().numpy()


# What every family does.


@pytest.mark.parametrize("images", [1, 2, 0], ids=["one image", "two images", "text only"])
def test_a_chat_with_images_gives_transformers_prompt_and_tokens(family, images):
    model, processor, export = family
    pictures = [png(seed, (70 - 20 * seed, 41 + 10 * seed)) for seed in range(images)]
    messages, theirs = asked("What is in the picture?", *pictures)
    ids, tokens = transformers_tokens(model, processor, theirs, pictures)
    engine = Engine.load(export, provider="cpu")
    result = engine.chat(messages, max_new_tokens=TOKENS, ignore_eos=True)
    assert result.token_ids == tokens
    assert result.prompt_tokens == len(ids) and result.image_tokens == list(ids).count(engine.manifest.vision["image_token_id"])


def test_a_batch_of_rows_with_and_without_images_gives_each_rows_tokens_alone(family):
    """One left-padded batch (the attention as traced): each row's pictures at other places, its
    positions shifted by its own pictures, and a row of text alone among them."""
    _, _, export = family
    engine = Engine.load(export, provider="cpu", max_batch=3, prefix_cache=0)
    conversations = [
        asked("What is it?", png(1))[0],
        [{"role": "user", "content": "Say something."}],
        asked("Compare.", png(2), png(3, (30, 90)))[0],
    ]
    alone = [engine.chat(m, max_new_tokens=TOKENS, ignore_eos=True).token_ids for m in conversations]
    turns = [chat_turn(engine.tokenizer, engine.max_context, m, vision=engine.manifest.vision) for m in conversations]
    for turn in turns:
        engine.runner.see(turn.pictures)
    batched = engine.generate_batch([turn.ids for turn in turns], max_new_tokens=TOKENS, ignore_eos=True)
    assert len({len(turn.ids) for turn in turns}) == 3  # rows of three lengths: each padded differently
    assert [result.token_ids for result in batched] == alone


def test_the_same_picture_asked_twice_is_encoded_once_and_found_in_the_prefix_cache(family):
    _, _, export = family
    engine = Engine.load(export, provider="cpu")
    picture = png(7)
    first = engine.chat(asked("Describe it.", picture)[0], max_new_tokens=4, ignore_eos=True)
    again = engine.chat(asked("Describe it.", picture)[0], max_new_tokens=4, ignore_eos=True)
    assert engine.runner.images.encoded == 1 and first.token_ids == again.token_ids
    # the prefix cache is off where layers keep a recurrent state (Qwen 3.5's hybrid): its prompt runs
    # again, its picture is not encoded again
    assert (again.cached_tokens > 0) == (not engine.manifest.kv.state)


def test_the_scheduler_serves_picture_requests_with_their_tokens(family):
    """Qwen2.5-VL's attention is GroupQueryAttention: its requests join one continuous batch, each
    prompt prefilled in chunks of 16 beside the others' decoding; Gemma 3's stays as traced, and its
    requests are served one at a time."""
    _, _, export = family
    engine = Engine.load(export, provider="cpu", max_batch=3, prefill_chunk=16)
    conversations = [asked("What is it?", png(1))[0], [{"role": "user", "content": "Say something."}], asked("And this?", png(4))[0]]
    alone = [engine.chat(m, max_new_tokens=TOKENS, ignore_eos=True).token_ids for m in conversations]
    turns = [chat_turn(engine.tokenizer, engine.max_context, m, vision=engine.manifest.vision) for m in conversations]
    with Scheduler(engine, max_batch=3) as scheduler:
        assert scheduler.is_batched == engine.manifest.kv.in_place == ("rotary" in engine.manifest.vision)
        requests = [scheduler.submit(turn.ids, pictures=turn.pictures, max_new_tokens=TOKENS, ignore_eos=True) for turn in turns]
        assert [request.result().token_ids for request in requests] == alone


def test_a_server_answers_clients_sending_pictures_at_once_with_the_sdks_replies(family):
    """A real `edgeinfer serve` and the openai client: three clients at once, two with pictures of
    their own (served one request at a time), each given the SDK's own reply and image tokens."""
    import base64
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from test_serve import start

    _, _, export = family
    engine = Engine.load(export, provider="cpu")
    asks = [[png(1)], [], [png(2, (30, 90))]]
    expected = [engine.chat(asked("What is it?", *p)[0], max_new_tokens=6, temperature=0) for p in asks]

    def ask(pictures: list[bytes]):
        url = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}} for p in pictures]
        client = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": [*url, {"type": "text", "text": "What is it?"}]}]
        return client.chat.completions.create(model="export", messages=messages, max_tokens=6, temperature=0)

    process, served = start(export, "--provider", "cpu")
    try:
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, asks))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert [r.choices[0].message.content for r in replies] == [e.text for e in expected]
    assert [getattr(r.usage.prompt_tokens_details, "image_tokens", 0) for r in replies] == [e.image_tokens for e in expected]
    assert expected[0].image_tokens > 0 and expected[1].image_tokens == 0


# Gemma 3: pictures that attend both ways.


def test_the_manifest_says_pictures_attend_both_ways_and_the_attention_stays_as_traced(gemma3):
    _, _, export = gemma3
    manifest = Engine.load(export, provider="cpu").manifest
    vision = manifest.vision
    assert manifest.format_version == PICTURES_FORMAT_VERSION  # an edgeinfer that would cut pictures refuses it
    assert vision["attention"] == "bidirectional" and vision["tokens_per_image"] == 9
    assert vision["marker"] == "<start_of_image>" and vision["expansion"] == "\n\n<start_of_image>{image}<end_of_image>\n\n"
    assert vision["steps"] == [{"op": "resize", "height": 48, "width": 48}] and vision["mean"] == [0.5, 0.5, 0.5]
    fusion = manifest.validation["fusion"]
    assert "GroupQueryAttention" not in fusion["fused"] and "attend to each other both ways" in fusion["attention"]
    checked = manifest.validation["vision"]
    assert checked["ids_equal"] and checked["tokens_equal"] and checked["max_abs_diff_logits"] < 1e-5


def test_picture_tokens_attend_to_each_other_both_ways_as_in_transformers(gemma3):
    model, processor, export = gemma3
    pictures = [png(3), png(4)]
    messages, theirs = asked("Compare them.", *pictures)
    ours = first_logits(Engine.load(export, provider="cpu"), messages)
    with_blocks = transformers_logits(model, processor, theirs, pictures)
    causal = transformers_logits(model, processor, theirs, pictures, blocks=False)
    assert np.abs(ours - with_blocks).max() < 1e-5
    assert np.abs(ours - causal).max() > 1e-3  # the blocks matter here: a causal mask alone would not pass


def test_a_picture_is_never_cut_between_prefill_passes(gemma3, monkeypatch):
    """Chunks of 4 tokens would cut each 9-token picture: the passes are joined around it, and the
    logits are those of one pass; cut, the picture's first tokens miss its last ones."""
    model, processor, export = gemma3
    pictures = [png(5)]
    messages, theirs = asked("What is it?", *pictures)
    whole = transformers_logits(model, processor, theirs, pictures)
    chunked = Engine.load(export, provider="cpu", prefill_chunk=4, prefix_cache=0)
    assert np.abs(first_logits(chunked, messages) - whole).max() < 1e-5
    monkeypatch.setattr(type(chunked.runner.pictures), "passes", lambda self, spans, prompts, width=None: spans)
    assert np.abs(first_logits(chunked, messages) - whole).max() > 1e-3


def test_whole_pictures_joins_the_spans_that_would_cut_a_picture():
    picture = [PICTURE_BASE + place for place in range(5)]
    prompt = [1, 2, *picture, 3, 4]  # the picture at 2..6
    spans = [(0, 3), (3, 6), (6, 8), (8, 9)]
    assert whole_pictures(spans, [prompt]) == [(0, 8), (8, 9)]
    assert whole_pictures(spans, [[1, 2, 3, 4, 5, 6, 7, 8, 9]]) == spans
    # left-padded to 12: the picture at 5..9 of the row
    assert whole_pictures([(0, 4), (4, 8), (8, 12)], [prompt], width=12) == [(0, 4), (4, 12)]


def test_a_sampled_image_token_goes_as_padding_and_pictures_keep_their_features():
    """Two rows that each sampled the image token (no picture of their own) beside a picture: the
    graph gets one feature row per picture token, none for the sampled ones."""
    from edgeinfer.sdk.kv_cache import PAD_ID
    from edgeinfer.sdk.vision import ImageStore, Picture

    image_token = 9
    store = ImageStore(lambda pixels: np.arange(8, dtype=np.float32).reshape(1, 2, 4), hidden_size=4, dtype="float32")
    item = Picture(key=5, pixels=np.zeros((1, 3, 2, 2), np.float32), text="", tokens=2)
    store.add([item])
    ids, features = store.feeds(np.array([[10, image_token, *item.ids()], [image_token, 3, 4, 5]]), image_token)
    assert ids.tolist() == [[10, PAD_ID, image_token, image_token], [PAD_ID, 3, 4, 5]]
    assert features.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


# Qwen2.5-VL and Qwen 3.5: pictures at their own shape, placed by row and column.


def test_the_manifest_places_pictures_by_row_and_column_and_the_attention_is_fused(qwen_family):
    _, _, export = qwen_family
    manifest = Engine.load(export, provider="cpu").manifest
    vision = manifest.vision
    assert manifest.format_version == PICTURES_FORMAT_VERSION
    assert vision["rotary"] == "3d" and vision["grid"] == 8 and "tokens_per_image" not in vision
    assert vision["steps"] == [{"op": "fit_pixels", "multiple": 8, "min_pixels": 256, "max_pixels": 9216}]
    assert vision["marker"] == "<|image_pad|>" and vision["expansion"] == "{image}" and vision["resample"] == "bicubic"
    fusion = manifest.validation["fusion"]  # the rotations stay in the graph, fed to GroupQueryAttention rotated
    assert fusion["fused"]["GroupQueryAttention"] >= 1 and manifest.kv.in_place
    checked = manifest.validation["vision"]
    assert checked["ids_equal"] and checked["tokens_equal"] and checked["max_abs_diff_logits"] < 1e-5
    assert checked["max_abs_diff_pixels"] < 1e-5  # the runtime's pixels laid out as the processor's patches


@pytest.mark.parametrize(
    "size, tokens",
    [((70, 41), 5 * 9), ((30, 90), 11 * 4), ((8, 8), 2 * 2), ((300, 200), 9 * 14), ((400, 3), 1 * 24)],
    ids=["wide", "tall", "below the least pixels", "above the most pixels", "a strip"],
)
def test_pictures_of_every_shape_give_transformers_prompt_and_tokens(qwen_family, size, tokens):
    """One vision graph for every size: windows of 2x2 tokens, whole and partial, worked out in it."""
    model, processor, export = qwen_family
    picture = png(11, size)
    messages, theirs = asked("What is in the picture?", picture)
    ids, expected = transformers_tokens(model, processor, theirs, [picture])
    result = Engine.load(export, provider="cpu").chat(messages, max_new_tokens=TOKENS, ignore_eos=True)
    assert result.image_tokens == tokens and result.prompt_tokens == len(ids)
    assert result.token_ids == expected


def test_rotary_positions_are_transformers_rope_index(qwen_family):
    model, processor, export = qwen_family
    pictures = [png(1), png(2, (30, 90))]
    messages, theirs = asked("Compare them.", *pictures)
    inputs = processed(processor, theirs, pictures)
    expected, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    engine = Engine.load(export, provider="cpu")
    turn = chat_turn(engine.tokenizer, engine.max_context, messages, vision=engine.manifest.vision)
    positions, shift = rotary_positions(turn.ids, {p.key: p.grid for p in turn.pictures})
    assert positions.tolist() == expected[:, 0].tolist() and shift == int(delta[0, 0])
    assert shift < 0  # 45 + 44 picture tokens took 9 + 11 positions


def test_the_pictures_positions_matter_text_positions_alone_would_not_pass_and_chunks_keep_them(qwen_family):
    import torch

    model, processor, export = qwen_family
    pictures = [png(3)]
    messages, theirs = asked("What is it?", *pictures)
    inputs = processed(processor, theirs, pictures)
    engine = Engine.load(export, provider="cpu", prefix_cache=0)
    turn = chat_turn(engine.tokenizer, engine.max_context, messages, vision=engine.manifest.vision)
    engine.runner.see(turn.pictures)
    ours = engine.runner.prefill(engine.runner.new_batch(), [turn.ids]).numpy()[0, -1]
    with torch.no_grad():
        theirs_logits = model(**inputs).logits[0, -1].numpy()
        count = inputs["input_ids"].shape[1]
        flat = torch.arange(count).view(1, 1, -1).expand(3, 1, -1)
        text_positions = model(**inputs, position_ids=flat).logits[0, -1].numpy()
    assert np.abs(ours - theirs_logits).max() < 1e-5
    assert np.abs(ours - text_positions).max() > 1e-3
    chunked = Engine.load(export, provider="cpu", prefix_cache=0, prefill_chunk=5)  # positions sliced pass by pass
    chunked.runner.see(turn.pictures)
    assert np.abs(chunked.runner.prefill(chunked.runner.new_batch(), [turn.ids]).numpy()[0, -1] - theirs_logits).max() < 1e-5


def test_a_qwen_processor_is_built_without_torchvision_as_transformers_builds_it(qwen_family):
    """export/vision.py load_processor: without torchvision (as here) transformers cannot load the
    saved Qwen processor; edgeinfer builds the same class from its image processor and tokenizer
    (patches.images_only), and it gives the processor's own ids and pixels; the patch is undone after."""
    from transformers import AutoProcessor, processing_utils

    from edgeinfer.export.vision import load_processor

    model, processor, export = qwen_family
    folder = export.parent / "hf"
    with pytest.raises(ImportError, match="Torchvision"):
        AutoProcessor.from_pretrained(folder)
    loaded = load_processor(str(folder))
    assert type(loaded) is type(processor) and loaded.video_processor is None
    messages = asked("What is it?", png(1))[1]
    ours, theirs = processed(loaded, messages, [png(1)]), processed(processor, messages, [png(1)])
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist() and (ours["pixel_values"] == theirs["pixel_values"]).all()
    with pytest.raises(AttributeError):  # the class check is transformers' own again
        type(processor)(image_processor=loaded.image_processor, tokenizer=loaded.tokenizer, video_processor=None)
    assert processing_utils.ProcessorMixin.check_argument_for_proper_class.__name__ == "check_argument_for_proper_class"


def test_info_lists_the_vision_families():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "info", "--architectures"], capture_output=True, text=True, timeout=120
    )
    listed = done.stdout
    assert done.returncode == 0, done.stderr
    assert "vision-language, with their vision encoder" in listed
    assert "  gemma3, idefics3, qwen2_5_vl, qwen3_5, smolvlm\n" in listed


def test_info_says_pictures_keep_their_shape(qwen_family):
    from edgeinfer.cli.main import _pictures_text

    _, _, export = qwen_family
    text = _pictures_text(Engine.load(export, provider="cpu").manifest.vision)
    assert text.startswith("pictures: read at their own shape, 256 to 9,216 pixels, a token each 8x8 square (vision.onnx)")


def test_quantizing_a_qwen_encoder_turns_its_linear_layers_into_int8_matmuls(qwen_family, tmp_path):
    """Qwen's encoders trace their linear layers as Gemm, which the quantizer does not take: export
    makes each a MatMul and an Add first, so --quantize reaches them; the features stay near fp32's."""
    import shutil

    import onnxruntime as ort

    from edgeinfer.export.vision import quantize_vision

    _, _, export = qwen_family
    copy = shutil.copytree(export, tmp_path / "copy")
    done = quantize_vision(copy)
    assert done["method"] == "int8" and done["matmuls"] >= 10  # every linear layer of the two blocks and the merger
    pixels = np.random.default_rng(0).standard_normal((1, 3, 40, 72)).astype(np.float32)
    fp32, int8 = (ort.InferenceSession(str(f / "vision.onnx")).run(None, {"pixel_values": pixels})[0] for f in (export, copy))
    assert fp32.shape == int8.shape == (45, 64)
    assert 0 < np.abs(fp32 - int8).max() < 0.03 * np.abs(fp32).max()


def test_a_picture_too_long_for_qwen_is_refused_in_sdk_words(qwen):
    """Qwen's processor refuses a picture more than 200 times as long as it is wide; so does the
    runtime, before any encoding, with the way out."""
    from edgeinfer.sdk.errors import SettingsError

    engine = Engine.load(qwen[2], provider="cpu")
    with pytest.raises(
        SettingsError, match="a picture of 402 x 2 pixels is more than 200 times as long as it is wide.*crop it"
    ) as refused:
        engine.chat(asked("What is it?", png(1, (402, 2)))[0], max_new_tokens=2)
    assert refused.value.param == "messages" and engine.runner.images.encoded == 0
