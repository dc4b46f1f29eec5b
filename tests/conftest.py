"""Tiny random-weight models built inside the tests (no downloads), exported once per session."""
from __future__ import annotations

import pytest

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["The capital of France is Paris.", "Edge boxes run small language models.",
          "ONNX Runtime executes graphs on CPUs and GPUs.", "Prefill reads the prompt; decode makes one token at a time.",
          "Ünïcödé text, 東京, and emoji 🙂 must survive the byte-level tokenizer."] * 20


def build_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def build_llama(folder, eos_token_id=None, seed=0, **overrides):
    """A 2-layer llama with grouped-query attention and random weights, saved with its tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=eos_token_id, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=eos_token_id)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(HF folder, export folder) of a tiny llama without EOS, so greedy runs to the length limit."""
    from edgeinfer.export import export_model

    root = tmp_path_factory.mktemp("tiny-llama")
    build_llama(root / "hf")
    export_model(str(root / "hf"), root / "export")
    return root / "hf", root / "export"
