"""The embedding table of a quantized export: its rows gathered from 4- or 8-bit blocks
(ONNX Runtime's GatherBlockQuantized), so that no fp32 table is left in the files. A tied table
gathers from the lm_head's own blocks (`quantized_embedding`); a table of its own is rounded to
nearest in blocks of its own (`quantized_table`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import stream
from .graphs import tensor_array


def quantized_embedding(graph, gather, weight: str, bits: int, block_size: int) -> bool:
    """Where the embedding table is the lm_head's weight transposed (tied weights), gather from the
    lm_head's quantized blocks instead: `GatherBlockQuantized` on the same bytes, scales and zero
    points, so no fp32 table is left. MatMulNBits lays its weight out as
    [vocab, blocks, bytes per block], which is the [vocab, hidden] table quantized along hidden;
    GatherBlockQuantized wants it as [vocab, bytes per row]: a Reshape of the same initializer,
    which ONNX Runtime folds into a constant when the session starts (the file holds the bytes
    once; the scales and zero points are shared; without zero points both ops take the same
    default, 2^(bits-1)). Returns whether it applied.

    fp32 exports keep both tables: the lm_head's MatMul weight is pre-packed at load, and ONNX
    Runtime keeps an initializer that another node reads resident after packing it, while the
    embedding table is memory-mapped and only the rows of the tokens seen are ever read. Sharing
    one fp32 tensor saves disk but costs resident memory (docs/manifest.md has the figures)."""
    lm_head = next((n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1] == f"{weight}_Q{bits}"), None)
    initializers = {t.name: t for t in graph.initializer}
    table = gather.input[0]
    if lm_head is None or table not in initializers or gather not in graph.node:
        return False
    hidden = initializers[table].dims[1]
    rows, blocks, per_block = initializers[lm_head.input[1]].dims  # (its bytes may be in a data file)
    if hidden % block_size or blocks * per_block * 8 // bits != hidden:
        return False
    data, shape = f"{weight}_embedding_Q{bits}", f"{weight}_embedding_shape"
    graph.initializer.append(numpy_helper.from_array(np.array([rows, -1], np.int64), shape))
    position = list(graph.node).index(gather)
    graph.node.remove(gather)
    graph.node.insert(position, helper.make_node("Reshape", [lm_head.input[1], shape], [data], name="edgeinfer_embedding_rows"))
    inputs = [data, "input_ids", *lm_head.input[2:4]]
    graph.node.insert(position + 1, _gather_node(inputs, gather.output[0], "edgeinfer_quantized_embedding", bits, block_size))
    if not any(table in n.input for n in graph.node):
        graph.initializer.remove(initializers[table])
    return True


_ROWS_BYTES = 64 << 20  # fp32 table rows rounded at a time


def quantized_table(graph, folder: Path, made: str, bits: int, block_size: int, symmetric: bool) -> bool:
    """Where the embedding table [vocab, hidden] is a weight of its own (untied; still fp32 or
    fp16 once the MatMuls are quantized), round it to nearest in blocks of `block_size` along
    hidden, as MatMulNBits lays out a weight [hidden, vocab] ([vocab, bytes per row] blocks,
    [vocab, blocks] scales, zero points packed as the blocks are), and gather its rows with
    `GatherBlockQuantized`. The blocks are made a band of rows at a time and written to the file
    `made` in `folder` (the graph references them there; `save_graph` copies them). Returns
    whether it applied."""
    gather, table = _embedding_gather(graph)
    if gather is None or table.dims[1] % block_size:
        return False
    names = [f"{table.name}_Q{bits}", f"{table.name}_scales", f"{table.name}_zero_points"]
    vocab, hidden = table.dims
    count = hidden // block_size
    shapes = [(vocab, hidden * bits // 8), (vocab, count), (vocab, -(-count * bits // 8))]
    bands = _rounded_rows(table, folder, bits, block_size, symmetric)
    tensors = _written_blocks(bands, names, folder / made, shapes, helper.tensor_dtype_to_np_dtype(table.data_type))
    graph.initializer.extend(tensors if not symmetric else tensors[:2])
    position = list(graph.node).index(gather)
    graph.node.remove(gather)
    inputs = [names[0], gather.input[1], names[1], *([] if symmetric else [names[2]])]
    graph.node.insert(position, _gather_node(inputs, gather.output[0], "edgeinfer_quantized_table", bits, block_size))
    if not any(table.name in n.input for n in graph.node):
        graph.initializer.remove(table)
        if stream.is_deferred(table):
            stream.forget(table)
    return True


def _embedding_gather(graph):
    """(the Gather of input_ids from a 2-D float table initializer, the table), or (None, None)."""
    initializers = {t.name: t for t in graph.initializer}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids" and n.input[0] in initializers]
    if len(gathers) != 1 or any(a.name == "axis" and a.i != 0 for a in gathers[0].attribute):
        return None, None
    table = initializers[gathers[0].input[0]]
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    return (gathers[0], table) if len(table.dims) == 2 and table.data_type in floats else (None, None)


def _rounded_rows(table, folder: Path, bits: int, block_size: int, symmetric: bool):
    """(blocks [rows, bytes per row], scales [rows, blocks], zero points [rows, packed]) of each
    band of the table's rows, rounded by ONNX Runtime's own MatMulNBits rounding."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    rounding = {4: quantize_matmul_4bits, 8: quantize_matmul_8bits}[bits]
    vocab, hidden = table.dims
    count, per_byte = hidden // block_size, 8 // bits
    band = max(1, _ROWS_BYTES // (4 * hidden))
    read = stream.row_reader(table) if stream.is_deferred(table) else _mapped_rows(table, folder)
    for start in range(0, vocab, band):
        weight = np.ascontiguousarray(read(start, min(vocab, start + band)).T, dtype=np.float32)
        rows = weight.shape[1]
        packed = np.zeros((rows, count, block_size // per_byte), np.uint8)
        scales = np.zeros((rows, count), np.float32)
        zeros = np.zeros((rows, (count + per_byte - 1) // per_byte), np.uint8)
        rounding(packed, weight, scales, zeros, block_size, rows, hidden, symmetric)
        yield packed.reshape(rows, -1), scales, zeros  # (zero points are made, and left out, where symmetric)


def _mapped_rows(table, folder: Path):
    """A function (start, stop) -> the table's rows start:stop, each band through a mapping of its
    own (one mapping of the whole table would keep every page read resident to the end)."""
    return lambda start, stop: np.array(tensor_array(table, folder)[start:stop])


def _written_blocks(bands, names: list[str], path: Path, shapes, scale_type) -> list[onnx.TensorProto]:
    """The three tensors (blocks, scales, zero points) of `shapes`, their `bands` of rows written
    in place at the end of the file `path`, one tensor after another, and referenced there."""
    types = [np.dtype(np.uint8), np.dtype(scale_type), np.dtype(np.uint8)]
    sizes = [int(np.prod(shape)) * kind.itemsize for shape, kind in zip(shapes, types)]
    with open(path, "ab") as out:
        base = out.tell()
    offsets = [base + sum(sizes[:i]) for i in range(3)]
    written = list(offsets)
    with open(path, "r+b") as out:
        out.truncate(base + sum(sizes))
        for band in bands:
            for i, array in enumerate(band):
                out.seek(written[i])
                out.write(np.ascontiguousarray(array, dtype=types[i]).tobytes())
                written[i] = out.tell()
    tensors = []
    for name, shape, kind, offset, size in zip(names, shapes, types, offsets, sizes):
        tensor = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(kind))
        tensor.dims.extend(shape)
        stream.refer(tensor, path.name, offset, size)
        tensors.append(tensor)
    return tensors


def _gather_node(inputs: list[str], output: str, name: str, bits: int, block_size: int):
    return helper.make_node(
        "GatherBlockQuantized",
        inputs,
        [output],
        name=name,
        domain="com.microsoft",
        gather_axis=0,
        quantize_axis=1,
        block_size=block_size,
        bits=bits,
    )


def gathered_table(folder: Path) -> dict | None:
    """How the export in `folder` gathers its embedding rows: {"bits", "blocks": "lm_head" (a tied
    table, the lm_head's blocks) or "own"}, or None where the table stays float."""
    graph = onnx.load(str(Path(folder) / "model.onnx"), load_external_data=False).graph
    for node in graph.node:
        if node.op_type == "GatherBlockQuantized" and node.input[1] == "input_ids":
            bits = next(a.i for a in node.attribute if a.name == "bits")
            return {"bits": bits, "blocks": "lm_head" if node.name == "edgeinfer_quantized_embedding" else "own"}
    return None
