"""export/spm_merges.py: a GGUF SentencePiece vocabulary whose scores are merge ranks (Gemma 3's),
rebuilt as the BPE model that merges in score order, as llama.cpp tokenizes it; on hand-made
vocabularies run by the tokenizers library."""

import json

from tokenizers import Tokenizer, models, normalizers

from edgeinfer.export.spm_merges import as_merges, has_rank_scores, merges, rewrite

# minus the merge rank, as Gemma 3's GGUF stores them: "▁history" was merged last of all
VOCAB = [("<unk>", 0.0), ("▁", -1.0), ("h", -2.0), ("i", -3.0), ("s", -4.0), ("t", -5.0), ("o", -6.0), ("r", -7.0), ("y", -8.0),
         ("is", -9.0), ("ist", -10.0), ("or", -11.0), ("ory", -12.0), ("▁h", -13.0), ("▁hist", -30.0), ("▁history", -40.0)]  # fmt: skip


def _unigram(vocab) -> str:
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    return tokenizer.to_str()


def test_rank_scores_read_as_log_probabilities_split_the_word_and_merges_keep_it():
    unigram = Tokenizer.from_str(_unigram(VOCAB))
    assert unigram.encode(" history").tokens != ["▁history"]  # the fragments the Unigram reading gives
    rebuilt = Tokenizer.from_str(as_merges(_unigram(VOCAB)))
    assert rebuilt.encode(" history").tokens == ["▁history"]
    assert rebuilt.encode(" history").ids == [15]  # the ids are the vocabulary's
    assert rebuilt.encode(" his story").tokens == ["▁h", "is", "▁", "s", "t", "ory"]


def test_merges_come_in_the_merged_pieces_score_order():
    assert merges(VOCAB)[:3] == [("i", "s"), ("is", "t"), ("o", "r")]
    assert ("▁hist", "ory") in merges(VOCAB) and ("▁h", "istory") not in merges(VOCAB)  # "istory" is no piece


def test_log_probability_scores_are_left_as_they_are(tmp_path):
    vocab = [(piece, score - 0.5) for piece, score in VOCAB]
    assert not has_rank_scores(json.loads(_unigram(vocab))["model"])
    assert as_merges(_unigram(vocab)) == _unigram(vocab)
    path = tmp_path / "tokenizer.json"
    path.write_text(_unigram(vocab))
    assert not rewrite(path) and path.read_text() == _unigram(vocab)
    path.write_text(_unigram(VOCAB))
    assert rewrite(path) and json.loads(path.read_text())["model"]["type"] == "BPE"
    assert not rewrite(tmp_path / "absent.json")


def test_a_byte_piece_renamed_to_a_character_the_vocabulary_also_has_keeps_its_id():
    """transformers names Gemma's byte piece <0x09> by its character, a tab, which is also a piece of
    its own: each keeps its id (the byte piece under its byte name)."""
    vocab = [("<unk>", 0.0), ("\t", -1.0), ("a", -2.0), ("b", -3.0), ("\t", -4.0)]
    ids = json.loads(as_merges(_unigram(vocab)))["model"]["vocab"]
    assert ids == {"<unk>": 0, "<0x09>": 1, "a": 2, "b": 3, "\t": 4}


def test_a_bpe_tokenizer_is_written_as_it_is(tmp_path):
    from conftest import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    before = (tmp_path / "tokenizer.json").read_text()
    assert not has_rank_scores(json.loads(before)["model"]) and as_merges(before) == before
    assert not rewrite(tmp_path / "tokenizer.json") and (tmp_path / "tokenizer.json").read_text() == before


def test_the_gguf_says_whether_a_text_starts_with_bos(tmp_path):
    """transformers' GGUF conversion does not read whether a text starts with BOS;
    export follows `tokenizer.ggml.add_bos_token`, as llama.cpp does (SmolLM2's GGUF says no)."""
    from gguf import GGUFWriter
    from transformers import LlamaTokenizerFast

    from edgeinfer.export.source import _special_tokens_as_gguf

    inner = Tokenizer(models.BPE({"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}, [("a", "b")]))
    made = []
    for add_bos in (False, True):
        path = tmp_path / f"bos-{add_bos}.gguf"
        writer = GGUFWriter(str(path), "llama")
        writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
        writer.add_bool("tokenizer.ggml.add_eos_token", False)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        tokenizer = LlamaTokenizerFast(tokenizer_object=Tokenizer.from_str(inner.to_str()), bos_token="<s>", eos_token="</s>")
        tokenizer.add_bos_token = not add_bos  # the opposite of the GGUF, for it to undo
        assert tokenizer("ab").input_ids == ([4] if add_bos else [0, 4])
        _special_tokens_as_gguf(tokenizer, path)
        tokenizer.save_pretrained(tmp_path / f"saved-{add_bos}")
        made.append(Tokenizer.from_file(str(tmp_path / f"saved-{add_bos}" / "tokenizer.json")).encode("ab").ids)
    assert made == [[4], [0, 4]]  # the file the runtime reads says it too
