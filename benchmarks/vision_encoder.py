"""Images: the vision graph's time for one picture with its MatMul weights in fp32, int8 and int4
(ONNX Runtime's MatMulNBits, blocks of 32, int8 arithmetic), and how far each one's features are
from fp32's. The copies are made here from an export's vision.onnx; rounds alternate the three on
the same picture, medians.

    python benchmarks/vision_encoder.py EXPORT [--rounds 5] [--threads 1]

EXPORT is a vision-language export (benchmarks/vision.py makes one of SmolVLM-256M's shape in
WORK/export). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def quantized_copy(source: Path, bits: int, folder: Path) -> Path:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=bits, block_size=32, is_symmetric=False, accuracy_level=4)
    quantizer.process()
    path = folder / f"int{bits}.onnx"
    onnx.save(quantizer.model.model, str(path), save_as_external_data=True, location=f"{path.name}.data", size_threshold=1024)
    return path


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="the runtime encodes on half the cores: 1 of 2 here")
    args = parser.parse_args()
    source = args.export / "vision.onnx"
    with tempfile.TemporaryDirectory() as scratch:
        graphs = {"fp32": source, **{f"int{b}": quantized_copy(source, b, Path(scratch)) for b in (8, 4)}}
        sessions = {name: session(path, args.threads) for name, path in graphs.items()}
        shape = [d if isinstance(d, int) else 1 for d in sessions["fp32"].get_inputs()[0].shape]
        pixels = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        features = {name: s.run(None, {"pixel_values": pixels})[0] for name, s in sessions.items()}
        times = {name: [] for name in sessions}
        for _ in range(args.rounds):
            for name, s in sessions.items():
                start = time.perf_counter()
                s.run(None, {"pixel_values": pixels})
                times[name].append(time.perf_counter() - start)
    print(f"pixels {shape}, {args.threads} thread(s), medians of {args.rounds} rounds")
    fp32 = statistics.median(times["fp32"])
    largest = float(np.abs(features["fp32"]).max())
    for name, values in times.items():
        off = float(np.abs(features[name] - features["fp32"]).max())
        print(
            f"{name}: {statistics.median(values) * 1000:.0f} ms ({fp32 / statistics.median(values):.2f}x fp32's speed), "
            f"features within {off:.3g} of fp32's ({off / largest:.1%} of their largest)"
        )


if __name__ == "__main__":
    main()
