"""One export, printing at each stage line the time, the process's memory high-water mark so far
(ru_maxrss: a sampler misses short spikes, such as torch.onnx's while it serializes the graph) and
the most disk the export has held so far (the output folder and its work folder beside it, sampled
every half second), then the peaks.

    python benchmarks/export_memory.py MODEL OUT [--quantize int4|int8] [--algorithm NAME] [--graphs split]

MODEL: a folder, .gguf file, catalog name or hub id, as for `edgeinfer export` (0.5B weights and
more stream, as the command does)."""

import argparse
import os
import resource
import threading
import time
from pathlib import Path

from edgeinfer.export import ExportOptions, Quantization, export_model


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (0 where it is not there yet)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512  # allocated, as df counts them
            except FileNotFoundError:  # removed while walking
                pass
    return total


class DiskPeak:
    """The largest size of a folder's files while it runs, sampled every `every` seconds."""

    def __init__(self, folder: Path, every: float = 0.5):
        self.folder, self.every, self.peak = folder, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            beside = self.folder.parent.glob(f".{self.folder.name}.*")  # the work folder (export/workspace.py)
            self.peak = max(self.peak, sum(folder_bytes(f) for f in [self.folder, *beside]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--quantize", choices=["int4", "int8"])
    parser.add_argument("--algorithm", help="as --algorithm (left out: the default, gptq)")
    parser.add_argument("--graphs", choices=["single", "split"], default="single")
    args = parser.parse_args()
    start = time.perf_counter()
    disk = DiskPeak(args.out)

    def say(message: str) -> None:
        high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        print(
            f"{time.perf_counter() - start:7.1f} s  high-water {high:.2f} GiB  disk {disk.peak / 2**30:.2f} GiB  {message}", flush=True
        )

    quantization = None
    if args.quantize:
        quantization = Quantization(args.quantize, **({"algorithm": args.algorithm} if args.algorithm else {}))
    with disk:
        export_model(args.model, args.out, ExportOptions(force=True, graphs=args.graphs, quantization=quantization), say)
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(
        f"done in {time.perf_counter() - start:.0f} s: peak memory {high:.2f} GiB, peak disk {disk.peak / 2**30:.2f} GiB, "
        f"written {folder_bytes(args.out) / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
