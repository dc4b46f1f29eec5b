"""The manifest an export writes (the one contract with the runtime): its fields from the model, its
config and its tokenizer, saved beside the graphs."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import LAYERS_FORMAT_VERSION, SINGLE_FORMAT_VERSION, Manifest, TokenizerSpec

from . import spm_merges


_TOOLS = ("edgeinfer", "torch", "transformers", "onnx", "onnxruntime-gpu", "onnxruntime")


def manifest_of(source, model, graph, kv, tokenizer_spec, context: int) -> Manifest:
    config, generation = model.config, model.generation_config
    text = config.get_text_config()  # a vision-language model's (Qwen 3.5's) may name them there alone
    eos = generation.eos_token_id if generation.eos_token_id is not None else getattr(config, "eos_token_id", text.eos_token_id)
    bos = generation.bos_token_id if generation.bos_token_id is not None else getattr(config, "bos_token_id", text.bos_token_id)
    return Manifest(
        format_version=LAYERS_FORMAT_VERSION if kv.layers or kv.state else SINGLE_FORMAT_VERSION,
        source=source,
        architecture=config.model_type,
        dtype="float32",
        vocab_size=logits_width(model),
        max_context=context,
        bos_token_id=bos,
        eos_token_ids=sorted({eos} if isinstance(eos, int) else set(eos or [])),
        graph=graph,
        kv=kv,
        tokenizer=tokenizer_spec,
        generation=generation_defaults(generation),
        tools=_tool_versions(),
    )


def logits_width(model) -> int:
    """The ids the model's head scores: its vocabulary, or fewer where a checkpoint pads the
    embedding table past them (Inkling 2's `unpadded_vocab_size`)."""
    head = model.get_output_embeddings()
    return getattr(head, "out_features", None) or model.config.get_text_config().vocab_size


def generation_defaults(generation) -> dict:
    """The model's generation config in edgeinfer's settings. Sampling settings count only where
    the config samples (`do_sample`), as in transformers; otherwise decoding is greedy."""
    defaults = {}
    if generation.max_new_tokens:
        defaults["max_new_tokens"] = int(generation.max_new_tokens)
    if generation.do_sample:  # a setting left unset samples with transformers' default for it
        defaults.update(
            temperature=float(generation.temperature if generation.temperature is not None else 1.0),
            top_k=int(generation.top_k if generation.top_k is not None else 50),
            top_p=float(generation.top_p if generation.top_p is not None else 1.0),
            min_p=float(generation.min_p or 0.0),
        )
    if generation.repetition_penalty not in (None, 1.0):
        defaults["repetition_penalty"] = float(generation.repetition_penalty)
    return defaults


# The context an export of a model without attention layers serves by default: its fixed-size
# state holds any number of tokens, and a context of its own it has none.
STATE_ONLY_CONTEXT = 2**20


def max_context(config, tokenizer, requested: int | None, attention: bool = True) -> int:
    """The context the export serves: `requested`, else the model's limit (its config, else its
    tokenizer's model_max_length); for a model without `attention` layers that keep every token
    (states, sliding windows), STATE_ONLY_CONTEXT where it names none."""
    names = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length")
    limit = next((int(getattr(config, n)) for n in names if getattr(config, n, None)), None)
    if limit is None and 0 < (tokenizer.model_max_length or 0) < 10**7:  # tokenizers say 1e30 for "no limit"
        limit = int(tokenizer.model_max_length)
    if requested is not None and limit is not None and requested > limit:
        raise ExportError(f"--max-context {requested} is more than this model's context of {limit} tokens: pass at most {limit}")
    if requested is None and limit is None and not attention:
        return STATE_ONLY_CONTEXT
    if requested is None and limit is None:
        raise ExportError(
            f"the {config.model_type} config names no maximum context length: pass --max-context N "
            "(the context the model was trained with)"
        )
    return requested or limit


def save_tokenizer(model, tokenizer, work: Path) -> TokenizerSpec:
    tokenizer.save_pretrained(work)
    spm_merges.rewrite(work / "tokenizer.json")  # a GGUF's rank scores tokenized as llama.cpp does
    model.generation_config.save_pretrained(work)
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if template:
        (work / "chat_template.jinja").write_text(template)
    return TokenizerSpec(
        chat_template="chat_template.jinja" if template else None, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )


def _tool_versions() -> dict[str, str]:
    versions = {}
    for name in _TOOLS:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    return versions
