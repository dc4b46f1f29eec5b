"""edgeinfer's own kernel for quantized weights on the CPU provider. An export's 4- and 8-bit weights
are ONNX Runtime's MatMulNBits (blocks of 32, int8 activations); on a CPU with AVX-512 VNNI and a C
compiler, kernels/block_matmul.c is built once into edgeinfer's cache, and as a session loads, each
such node becomes edgeinfer.BlockMatMul over its weights repacked for that kernel (scales in fp16).
Anywhere else, and with EDGEINFER_CPU_KERNEL=0, the graph runs as exported.

Nothing is written next to the export: the packed weights live in the process (the nodes name them
by address), and ONNX Runtime never loads the MatMulNBits copies they replace."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .initializers import ExternalData

SOURCE = Path(__file__).resolve().parent / "kernels" / "block_matmul.c"
SWITCH_ENV = "EDGEINFER_CPU_KERNEL"  # "0": run MatMulNBits as exported
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
_GROUP, _BLOCK = 16, 32  # the kernel's columns a group, rows of K a block


@dataclass(frozen=True)
class Kernel:
    """The built kernel library, or why there is none (`path` None)."""

    path: Path | None
    reason: str


@functools.cache
def kernel() -> Kernel:
    """The kernel library for this machine, built on first use (once per source and CPU)."""
    if os.environ.get(SWITCH_ENV) == "0":
        return Kernel(None, f"{SWITCH_ENV}=0")
    flags = _cpu_flags()
    missing = [f for f in _CPU_FLAGS if f not in flags]
    if missing:
        return Kernel(None, f"this CPU lacks {', '.join(missing)}")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return Kernel(None, "no C compiler (cc or gcc) to build it")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(sorted(flags)).encode()).hexdigest()[:16]
    from edgeinfer.models.cache import cache_root

    library = cache_root() / "kernels" / f"block_matmul-{key}.so"
    if not library.exists():
        error = _build(compiler, library)
        if error:
            return Kernel(None, f"building {SOURCE.name} failed: {error}")
    return Kernel(library, "built for this CPU")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _build(compiler: str, library: Path) -> str | None:
    """Compile into `library` (a temporary name first: concurrent builds each write a whole file)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=library.parent, suffix=".so")
    os.close(fd)
    command = [compiler, "-O3", "-march=native", "-shared", "-fPIC", str(SOURCE), "-o", temporary]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["no message"])[-1]
        ctypes.CDLL(temporary)  # it loads here, or the error says why
        os.replace(temporary, library)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def packed_size(k: int, n: int, bits: int, symmetric: bool) -> int:
    """Bytes of one [K, N] weight in the kernel's layout."""
    return n // _GROUP * (k // _BLOCK) * (64 * bits + 32 + (0 if symmetric else 32))


def pack(library: Path, b: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, k: int, n: int, bits: int) -> np.ndarray:
    """MatMulNBits' B, scales and zero points (None: symmetric) in the kernel's layout."""
    c = _library(library)
    b, scales = np.ascontiguousarray(b, np.uint8), np.ascontiguousarray(scales, np.float32)
    zeros = None if zeros is None else np.ascontiguousarray(zeros, np.uint8)
    out = np.empty(packed_size(k, n, bits, zeros is None), np.uint8)
    zero_points = None if zeros is None else zeros.ctypes.data
    c.edgeinfer_block_pack(b.ctypes.data, scales.ctypes.data, zero_points, k, n, bits, out.ctypes.data)
    return out


def matmul(library: Path, packed: np.ndarray, a: np.ndarray, k: int, n: int, bits: int, symmetric: bool) -> np.ndarray:
    """A [M, K] times the packed weight, on this thread (for tests; sessions run the op)."""
    a = np.ascontiguousarray(a, np.float32).reshape(-1, k)
    y = np.empty((a.shape[0], n), np.float32)
    rows = a.shape[0]
    if _library(library).edgeinfer_block_matmul(packed.ctypes.data, a.ctypes.data, y.ctypes.data, rows, k, n, bits, int(symmetric)):
        raise MemoryError("edgeinfer_block_matmul: out of memory")
    return y


@functools.cache
def _library(path: Path) -> ctypes.CDLL:
    c = ctypes.CDLL(str(path))
    c.edgeinfer_block_pack.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    c.edgeinfer_block_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    return c


def rewrite(graph_file: Path, library: Path) -> tuple[bytes, list[np.ndarray]] | None:
    """`graph_file` with each MatMulNBits the kernel takes made edgeinfer.BlockMatMul, and the packed
    weights its new nodes read; None when no node qualifies. A node names its weights by address
    (attributes `weights`, `weights_bytes`), so the caller must keep the arrays as long as a session
    of the graph lives: an initializer handed to ONNX Runtime from memory is copied, and the weights
    would be held twice. The graph's other initializers stay in its external data file."""
    import onnx
    from onnx import helper

    model = onnx.load(str(graph_file), load_external_data=False)
    graph, initializers = model.graph, {t.name: t for t in model.graph.initializer}
    specs = {index: spec for index, node in enumerate(graph.node) if (spec := _takes(node, initializers))}
    if not specs:
        return None
    packed = _packed_weights(library, Path(graph_file).parent, initializers, specs.values())
    for index, (k, n, bits, b, _, zeros) in specs.items():
        node, weights = graph.node[index], packed[b]
        new = helper.make_node("BlockMatMul", [node.input[0]], list(node.output), node.name, domain="edgeinfer")
        attributes = {"K": k, "N": n, "bits": bits, "symmetric": int(zeros is None)}
        attributes.update(weights=weights.ctypes.data, weights_bytes=weights.nbytes)
        new.attribute.extend(helper.make_attribute(key, value) for key, value in attributes.items())
        node.CopyFrom(new)
    _drop_unread(graph)
    model.opset_import.append(helper.make_opsetid("edgeinfer", 1))
    return model.SerializeToString(), list(packed.values())


def _packed_weights(library: Path, folder: Path, initializers: dict, specs) -> dict[str, np.ndarray]:
    """Each weight the specs name, packed once, the weights spread over the CPU's cores (ctypes lets
    go of the GIL while the C packs)."""
    reader, jobs = ExternalData(folder), {}
    for k, n, bits, b, scales, zeros in specs:
        zero_points = None if zeros is None else reader.array(initializers[zeros])
        jobs.setdefault(b, (reader.array(initializers[b]), reader.array(initializers[scales]), zero_points, k, n, bits))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = pool.map(lambda job: pack(library, *job), jobs.values())
        return dict(zip(jobs, done))


def _takes(node, initializers) -> tuple[int, int, int, str, str, str | None] | None:
    """(K, N, bits, B, scales, zero points or None) of a MatMulNBits node the kernel computes the same
    way: 4 or 8 bits, blocks of 32, fp32 activations rounded to int8, integer zero points, no group
    index or bias, its weights constant."""
    from onnx import TensorProto

    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return None
    attributes = {a.name: a.i for a in node.attribute}
    k, n = attributes.get("K", 0), attributes.get("N", 0)
    if attributes.get("bits") not in (4, 8) or attributes.get("block_size") != _BLOCK or attributes.get("accuracy_level") != 4:
        return None
    if k % _BLOCK or n % _GROUP or len(node.input) < 3 or any(node.input[4:]):
        return None
    zeros = node.input[3] if len(node.input) > 3 and node.input[3] else None
    weights = [node.input[1], node.input[2]] + ([zeros] if zeros else [])
    if any(w not in initializers for w in weights):
        return None
    if initializers[node.input[2]].data_type != TensorProto.FLOAT:
        return None  # fp16 activations (the scales are of their type): the kernel reads fp32
    if zeros and initializers[zeros].data_type != TensorProto.UINT8:
        return None  # float zero points: not the kernel's arithmetic
    return k, n, attributes["bits"], node.input[1], node.input[2], zeros


def _drop_unread(graph) -> None:
    """Remove the initializers no node reads any more (MatMulNBits' copies; a tied embedding table's
    gather still reads the lm_head's and keeps them)."""
    read = {name for node in graph.node for name in node.input}
    read |= {name for node in graph.node for a in node.attribute if a.g for n in a.g.node for name in n.input}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
