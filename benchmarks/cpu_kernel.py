"""edgeinfer's CPU kernel (sdk/cpu_kernel.py) against ONNX Runtime's MatMulNBits on the same 4-bit (or `--bits 8`) weights,
per call, in ONNX Runtime sessions: the chain of benchmarks/investigations/matmulnbits_rows.py
([K, N] then [N, K], `--layers` pairs, quantized by ONNX Runtime's quantizer), once as MatMulNBits
and once rewritten to edgeinfer.BlockMatMul, `--threads` intra-op threads, `--rows` rows (1 is a
decode step, 8 eight streams, 512 a prompt), alternated over `--rounds`, medians of the best of
five runs each.

    python benchmarks/cpu_kernel.py [--bits 4] [--k 1536] [--n 8960] [--layers 8] [--rows 1,8,512] [--rounds 7]

Prints per scheme (zero points, symmetric) and rows: microseconds a call for each, the ratio, and at
one row the bytes each reads a call over its time (GB/s; 1.5B shapes with 8 layers are 70-140 MB,
past the caches). Figures, never asserted."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent / "investigations"))
from matmulnbits_rows import chain  # noqa: E402

from edgeinfer.sdk import cpu_kernel  # noqa: E402
from edgeinfer.sdk.runtime import Graph  # noqa: E402


def sessions(k: int, n: int, layers: int, bits: int, symmetric: bool, threads: int, folder: Path):
    """(MatMulNBits session, BlockMatMul session, MatMulNBits' bytes, the kernel's bytes): the chain
    saved as an export saves its graph, loaded as edgeinfer loads one."""
    model_bytes, ort_bytes = chain(k, n, layers, bits, 32, 4, symmetric)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    theirs = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    path = folder / f"chain-{bits}-{int(symmetric)}.onnx"
    onnx.save(onnx.load_from_string(model_bytes), path, save_as_external_data=True, location=path.name + ".data")
    ours = Graph(path, "cpu", threads, quantized=True)
    return theirs, ours, ort_bytes, sum(a.nbytes for a in ours._packed)


def best_of_five(session, x: np.ndarray) -> float:
    time.sleep(0.2)  # the other session's idle threads stop spinning
    session.run(None, {"x": x})
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        session.run(None, {"x": x})
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--n", type=int, default=8960)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="1,8,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bits", type=int, choices=[4, 8], default=4)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    if cpu_kernel.kernel().path is None:
        sys.exit(f"edgeinfer's CPU kernel is not built here: {cpu_kernel.kernel().reason}")
    rows, calls = [int(r) for r in args.rows.split(",")], 2 * args.layers
    print("| scheme | rows | MatMulNBits us a call | edgeinfer us a call | speedup | GB/s MatMulNBits / edgeinfer |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for symmetric in (False, True):
            theirs, ours, ort_bytes, our_bytes = sessions(
                args.k, args.n, args.layers, args.bits, symmetric, args.threads, Path(folder)
            )
            for m in rows:
                x = np.random.default_rng(m).standard_normal((m, args.k)).astype(np.float32)
                times = {"theirs": [], "ours": []}
                for _ in range(args.rounds):
                    times["theirs"].append(best_of_five(theirs, x) / calls)
                    times["ours"].append(best_of_five(ours.session, x) / calls)
                t, o = statistics.median(times["theirs"]), statistics.median(times["ours"])
                rates = f"{ort_bytes / calls / t / 1e9:.1f} / {our_bytes / calls / o / 1e9:.1f}" if m == 1 else ""
                scheme = "symmetric" if symmetric else "zero points"
                print(f"| {scheme} | {m} | {t * 1e6:.0f} | {o * 1e6:.0f} | {t / o:.2f} | {rates} |")


if __name__ == "__main__":
    main()
