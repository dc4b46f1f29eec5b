"""Gemma 3's vision variant: a tiny random-weight Gemma3ForConditionalGeneration exported and run by
the runtime against transformers' processor and model. Its picture tokens attend to each other both
ways (a block in the causal mask), so beside tokens these tests pin the logits against transformers'
with the block and show that they differ without it, and that a picture is never cut between two
prefill passes."""

from __future__ import annotations

import io

import numpy as np
import pytest

from vision_models import TOKENS, asked, build_gemma3, built_and_exported, png, transformers_tokens

from edgeinfer import Engine, Scheduler
from edgeinfer.sdk.chat import chat_turn
from edgeinfer.sdk.vision import PICTURE_BASE, whole_pictures


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers model, processor, export folder) of the tiny Gemma 3."""
    return built_and_exported(tmp_path_factory.mktemp("gemma3"), build_gemma3)


def first_logits(engine: Engine, messages: list[dict]) -> np.ndarray:
    """The runtime's logits at the prompt's last position."""
    turn = chat_turn(engine.tokenizer, engine.max_context, messages, vision=engine.manifest.vision)
    engine.runner.see(turn.pictures)
    try:
        return engine.runner.prefill(engine.runner.new_batch(), [turn.ids]).numpy()[0, -1].astype(np.float32)
    finally:
        engine.runner.let_go(turn.pictures)


def transformers_logits(model, processor, messages: list[dict], images: list[bytes], blocks: bool = True) -> np.ndarray:
    """transformers' logits at the prompt's last position: with the picture blocks (token_type_ids),
    as Gemma 3 runs, or (`blocks` False) with a causal mask alone."""
    import torch
    from PIL import Image

    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = dict(processor(text=text, images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt"))
    if not blocks:
        del inputs["token_type_ids"]
    with torch.no_grad():
        return model(**inputs).logits[0, -1].float().numpy()


def test_the_manifest_says_pictures_attend_both_ways_and_the_attention_stays_as_traced(gemma3):
    _, _, export = gemma3
    from edgeinfer.sdk.manifest import BLOCKS_FORMAT_VERSION

    manifest = Engine.load(export, provider="cpu").manifest
    vision = manifest.vision
    assert manifest.format_version == BLOCKS_FORMAT_VERSION  # an edgeinfer that would cut pictures refuses it
    assert vision["attention"] == "bidirectional" and vision["tokens_per_image"] == 9
    assert vision["marker"] == "<start_of_image>" and vision["expansion"] == "\n\n<start_of_image>{image}<end_of_image>\n\n"
    assert vision["steps"] == [{"op": "resize", "height": 48, "width": 48}] and vision["mean"] == [0.5, 0.5, 0.5]
    fusion = manifest.validation["fusion"]
    assert "GroupQueryAttention" not in fusion["fused"] and "attend to each other both ways" in fusion["attention"]
    checked = manifest.validation["vision"]
    assert checked["ids_equal"] and checked["tokens_equal"] and checked["max_abs_diff_logits"] < 1e-5


@pytest.mark.parametrize("images", [1, 2, 0], ids=["one image", "two images", "text only"])
def test_a_chat_with_images_gives_transformers_prompt_and_tokens(gemma3, images):
    model, processor, export = gemma3
    pictures = [png(seed) for seed in range(images)]
    messages, theirs = asked("What is in the picture?", *pictures)
    ids, tokens = transformers_tokens(model, processor, theirs, pictures)
    engine = Engine.load(export, provider="cpu")
    result = engine.chat(messages, max_new_tokens=TOKENS, ignore_eos=True)
    assert result.token_ids == tokens
    assert result.prompt_tokens == len(ids) and result.image_tokens == 9 * images


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
    monkeypatch.setattr(type(chunked.runner), "_passes", lambda self, spans, prompts, width=None: spans)
    assert np.abs(first_logits(chunked, messages) - whole).max() > 1e-3


def test_whole_pictures_joins_the_spans_that_would_cut_a_picture():
    picture = [PICTURE_BASE + place for place in range(5)]
    prompt = [1, 2, *picture, 3, 4]  # the picture at 2..6
    spans = [(0, 3), (3, 6), (6, 8), (8, 9)]
    assert whole_pictures(spans, [prompt]) == [(0, 8), (8, 9)]
    assert whole_pictures(spans, [[1, 2, 3, 4, 5, 6, 7, 8, 9]]) == spans
    # left-padded to 12: the picture at 5..9 of the row
    assert whole_pictures([(0, 4), (4, 8), (8, 12)], [prompt], width=12) == [(0, 4), (4, 12)]


def test_the_same_picture_asked_twice_is_encoded_once_and_found_in_the_prefix_cache(gemma3):
    _, _, export = gemma3
    engine = Engine.load(export, provider="cpu")
    picture = png(7)
    first = engine.chat(asked("Describe it.", picture)[0], max_new_tokens=4, ignore_eos=True)
    again = engine.chat(asked("Describe it.", picture)[0], max_new_tokens=4, ignore_eos=True)
    assert engine.runner.images.encoded == 1
    assert first.token_ids == again.token_ids and again.cached_tokens > 0


def test_a_batch_of_rows_with_and_without_images_gives_each_rows_tokens_alone(gemma3):
    """One left-padded batch (the attention as traced): the pictures' blocks sit at other places in
    each row, and a row of text alone among them."""
    _, _, export = gemma3
    engine = Engine.load(export, provider="cpu", max_batch=3, prefix_cache=0)
    conversations = [
        asked("What is it?", png(1))[0],
        [{"role": "user", "content": "Say something."}],
        asked("Compare.", png(2), png(3))[0],
    ]
    alone = [engine.chat(m, max_new_tokens=TOKENS, ignore_eos=True).token_ids for m in conversations]
    turns = [chat_turn(engine.tokenizer, engine.max_context, m, vision=engine.manifest.vision) for m in conversations]
    for turn in turns:
        engine.runner.see(turn.pictures)
    batched = engine.generate_batch([turn.ids for turn in turns], max_new_tokens=TOKENS, ignore_eos=True)
    assert len({len(turn.ids) for turn in turns}) == 3  # rows of three lengths: each padded differently
    assert [result.token_ids for result in batched] == alone


def test_the_scheduler_serves_picture_requests_of_this_export_one_at_a_time_with_their_tokens(gemma3):
    _, _, export = gemma3
    engine = Engine.load(export, provider="cpu")
    conversations = [asked("What is it?", png(1))[0], [{"role": "user", "content": "Say something."}]]
    alone = [engine.chat(m, max_new_tokens=TOKENS, ignore_eos=True).token_ids for m in conversations]
    turns = [chat_turn(engine.tokenizer, engine.max_context, m, vision=engine.manifest.vision) for m in conversations]
    with Scheduler(engine, max_batch=2) as scheduler:
        assert not scheduler.is_batched
        requests = [scheduler.submit(turn.ids, pictures=turn.pictures, max_new_tokens=TOKENS, ignore_eos=True) for turn in turns]
        assert [request.result().token_ids for request in requests] == alone


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
