"""Flags shared by `run` and `chat`: which model and provider, and every generation setting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from edgeinfer.sdk.settings import FIELDS

MODEL_OPTIONS = [
    click.option("-m", "--model", "model", default=None, help="Export folder or catalog name [default: smollm2-135m-instruct]."),
    click.option("--provider", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"])),
    click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads [default: one per core]."),
    click.option("--max-context", default=None, type=int, help="Tokens (prompt and reply) to serve [default: the export's context]."),
    click.option("--memory-limit", default=None, type=int, help="MiB the weights and KV cache may use [default: what is free]."),
    click.option(
        "--prefix-cache",
        default=None,
        type=click.IntRange(0),
        metavar="MIB",
        help="MiB of prompts' keys and values kept for prompts that start the same way (0: off) [default: 64].",
    ),
    click.option(
        "--draft",
        default=None,
        metavar="MODEL",
        help="A smaller export (folder or catalog name) with the same tokenizer that proposes tokens (--speculative draft).",
    ),
    click.option(
        "--chat-template",
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        metavar="FILE",
        help="A Jinja chat template (or a tokenizer_config.json with one) in place of the export's [default: the export's].",
    ),
]
# Each defaults to None: the model's own default (its generation config) applies.
GENERATION_OPTIONS = [
    click.option("--max-new-tokens", type=int, default=None, help="Most new tokens [default: 256]."),
    click.option("--temperature", type=float, default=None, help="0 is greedy [default: the model's, else 0]."),
    click.option("--top-k", type=int, default=None, help="Sample from the K most likely tokens (0: off)."),
    click.option("--top-p", type=float, default=None, help="Sample from the tokens that make up P of the probability (1: off)."),
    click.option("--min-p", type=float, default=None, help="Drop tokens less than P times as likely as the best (0: off)."),
    click.option("--repetition-penalty", type=float, default=None, help="Penalize tokens already seen (1: off)."),
    click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
    click.option("--stop", multiple=True, help="Stop before this text; repeatable."),
    click.option("--stop-token-id", "stop_token_ids", multiple=True, type=int, help="Stop at this token id; repeatable."),
    click.option("--ignore-eos", is_flag=True, default=None, help="Keep generating past the model's EOS."),
    click.option(
        "--truncate",
        type=click.Choice(["left"]),
        default=None,
        help="Drop the oldest prompt tokens where the prompt and --max-new-tokens do not fit the context [default: refuse].",
    ),
    click.option("--presence-penalty", type=float, default=None, help="OpenAI's: subtract from tokens already generated (-2..2)."),
    click.option("--frequency-penalty", type=float, default=None, help="OpenAI's: subtract per time a token was generated (-2..2)."),
    click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS", help="Add BIAS (-100..100) to token ID; repeatable."),
    click.option(
        "--json-schema",
        "json_schema",
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        help="The output is JSON valid against the schema in this file.",
    ),
    click.option("--regex", default=None, help="The output matches this regular expression."),
    click.option(
        "--grammar",
        default=None,
        type=click.Path(exists=True, dir_okay=False),
        help="The output matches the Lark grammar in this file (llguidance's dialect).",
    ),
    click.option("--choice", multiple=True, help="The output is one of these strings; repeatable."),
    click.option(
        "--logprobs",
        "logprobs",
        type=click.IntRange(0, 20),
        default=None,
        metavar="K",
        help="With --json: each token's log-probability and its K most likely alternatives.",
    ),
    click.option(
        "--speculative",
        type=click.Choice(["prompt-lookup", "draft"]),
        default=None,
        help="Propose tokens (from the prompt and output so far, or from --draft) and check them in one pass: "
        "the same output, usually faster [default: off; draft where --draft is given].",
    ),
    click.option("--num-speculative-tokens", type=int, default=None, help="Most tokens proposed at a time [default: 5]."),
    click.option(
        "--reasoning-budget",
        type=int,
        default=None,
        help="End a reasoning model's thought after N tokens (0: at once) [default: no limit].",
    ),
    click.option(
        "--adapter", default=None, help="Run with this LoRA adapter of the export (edgeinfer export --adapter) [default: none]."
    ),
]


def with_options(options):
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def generation_settings(params: dict, draft: str | None = None) -> dict:
    """Take the generation flags out of a command's `params`; those given become keyword
    settings for the engine (the flags are named after GenerationConfig's fields, but for the
    constraint flags, which become `response_format`). A `draft` model implies `--speculative draft`."""
    response_format = _response_format(params.pop("json_schema", None), params.pop("regex", None), params.pop("grammar", None))
    given = {name: params.pop(name) for name in FIELDS if name in params}
    settings = {name: value for name, value in given.items() if value not in (None, ())}
    if "logprobs" in settings:
        settings["top_logprobs"], settings["logprobs"] = settings["logprobs"], True
    if "logit_bias" in settings:
        settings["logit_bias"] = dict(_bias(pair) for pair in settings["logit_bias"])
    if response_format is not None:
        settings["response_format"] = response_format
    if "speculative" in settings:
        settings["speculative"] = settings["speculative"].replace("-", "_")
    elif draft is not None:
        settings["speculative"] = "draft"
    return settings


def _response_format(json_schema: str | None, regex: str | None, grammar: str | None) -> dict | None:
    given = [flag for flag, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if value]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} both constrain the output: pass one")
    if json_schema:
        try:
            schema = json.loads(Path(json_schema).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise click.BadParameter(f"{json_schema} is not a JSON file ({e})", param_hint="--json-schema") from None
        return {"type": "json_schema", "json_schema": {"schema": schema}}
    if regex:
        return {"type": "regex", "pattern": regex}
    if grammar:
        return {"type": "grammar", "lark": Path(grammar).read_text()}
    return None


def _bias(pair: str) -> tuple[int, float]:
    token, _, bias = pair.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise click.BadParameter(f"{pair!r} is not ID=BIAS (e.g. 50256=-100)", param_hint="--logit-bias") from None


# The settings the flags do not spell as --NAME: the flags that give them.
_OTHER_FLAGS = {"response_format": "--json-schema, --regex or --grammar", "max_batch": "--max-batch", "task": "--task"}
# A parameter as the SDK's messages spell it, NAME=VALUE (max_context=2048, truncate='left'):
# the CLI says --max-context 2048, --truncate left.
_SPELLED = re.compile(r"\b([a-z_]+)=(?:'([^']*)'|([^\s,;:)']+))")


def _flags() -> dict[str, str]:
    """Each generation setting's flag, read off the options themselves."""

    def command():
        pass

    with_options(MODEL_OPTIONS + GENERATION_OPTIONS)(command)
    return {param.name: max(param.opts, key=len) for param in command.__click_params__} | _OTHER_FLAGS


def model_argument(command):
    """MODEL as the command's argument, or as -m/--model, as `run`, `chat` and `serve` take it."""
    command = click.option("-m", "--model", "model_option", default=None, metavar="MODEL", help="MODEL, as an option.")(command)
    return click.argument("model", required=False)(command)


def one_model(argument: str | None, option: str | None, required: bool = True) -> str | None:
    """The model a command was given, as its argument or as -m/--model."""
    if argument is not None and option is not None and argument != option:
        raise click.UsageError(f"MODEL {argument!r} and --model {option!r} differ: give one of them")
    model = argument if argument is not None else option
    if model is None and required:
        raise click.UsageError("give a MODEL: an export folder or a catalog name (as MODEL or -m MODEL)")
    return model


def in_flags(error) -> str:
    """The message of an edgeinfer error in the CLI's words, on one line: a SettingsError about
    `max_new_tokens` names `--max-new-tokens`, and `max_context=2048` in a message is
    `--max-context 2048` (the SDK's messages name the SDK's parameters)."""
    param = getattr(error, "param", None)
    base = param.split("[", 1)[0] if param else None
    flag = _flags().get(base) if base else None
    message = _as_flags(" ".join(line.strip() for line in str(error).splitlines() if line.strip()))
    if flag is None or message.startswith(flag):
        return message
    if message.startswith(param):
        return f"{flag}{param[len(base) :]}{message[len(param) :]}"
    return f"{flag}: {message}"


def _as_flags(message: str) -> str:
    """`message` with each parameter the SDK spells NAME=VALUE spelled as its flag, where it has one."""
    flags = _flags()

    def flag(spelled: re.Match) -> str:
        name, value = spelled.group(1), spelled.group(2) if spelled.group(2) is not None else spelled.group(3)
        return f"{flags[name]} {value}" if name in flags and name != "response_format" else spelled.group(0)

    return _SPELLED.sub(flag, message)
