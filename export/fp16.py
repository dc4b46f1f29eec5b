"""`--dtype fp16`: the checked fp32 graph converted to float16 weights, activations, KV cache and
logits, for GPUs (half the memory and bandwidth of fp32, and the type CUDA's GroupQueryAttention
takes). ONNX Runtime's own converter does it; the converted graph is checked like every other (its
logits against PyTorch's fp32, with fp16's tolerance, greedy tokens, and a batch against single
prompts) and the figures go in the manifest."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import Manifest

from .check import check_against
from .graphs import GRAPH_FILE, save_graph
from .validate import Reference


def convert_to_fp16(folder: Path, reference: Reference, manifest: Manifest) -> tuple[Manifest, dict]:
    """Replace the graph in `folder` by its float16 form; returns the manifest that describes it and
    the check's figures. Raises if its logits are not within fp16's tolerance of PyTorch's
    fp32 `reference` (of the fuse stage's CHECK_PROMPT)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = convert_float_to_float16(onnx.load(str(folder / GRAPH_FILE)), keep_io_types=False, disable_shape_infer=True)
    save_graph(half, folder)
    manifest = dataclasses.replace(manifest, dtype="float16", kv=dataclasses.replace(manifest.kv, dtype="float16"))
    manifest.save(folder)
    result = check_against(folder, reference)
    worst = result.worst
    if worst > result.tolerance or not result.batch_rows_equal_single:
        raise ExportError(
            f"the float16 graph's logits differ from PyTorch by {worst:.3g} (tolerance {result.tolerance:.3g})"
            + ("" if result.batch_rows_equal_single else " and its batch rows differ from single prompts")
            + ": this model does not run in float16, export it in fp32"
        )
    return manifest, {
        "max_abs_diff_prefill": result.max_abs_diff_prefill,
        "max_abs_diff_decode": result.max_abs_diff_decode,
        "max_abs_diff_extend": result.max_abs_diff_extend,
        "tolerance": result.tolerance,
        "greedy_tokens_equal": result.tokens_equal,
    }
