"""Flags shared by `run` and `chat`: which model and provider, and every generation setting."""
from __future__ import annotations

import click

from edgeinfer.sdk.settings import FIELDS

MODEL_OPTIONS = [
    click.option("--model", "model", default=None, help="Export folder or catalog name [default: smollm2-135m-instruct]."),
    click.option("--provider", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"])),
    click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads [default: one per core]."),
    click.option("--max-context", default=None, type=int, help="Tokens (prompt and reply) to serve [default: the export's context]."),
    click.option("--memory-limit", default=None, type=int, help="MiB the weights and KV cache may use [default: what is free]."),
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
    click.option("--truncate", type=click.Choice(["left"]), default=None,
                 help="Drop the oldest prompt tokens where the prompt and --max-new-tokens do not fit the context [default: refuse]."),
]


def with_options(options):
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


def generation_settings(params: dict) -> dict:
    """Take the generation flags out of a command's `params`; those given become keyword
    settings for the engine (the flags are named after GenerationConfig's fields)."""
    given = {name: params.pop(name) for name in FIELDS if name in params}
    return {name: value for name, value in given.items() if value not in (None, ())}
