"""One export, printing at each stage line the time, the process's memory high-water mark so far
(ru_maxrss: a sampler misses short spikes, such as torch.onnx's while it serializes the graph) and
the most disk the export has held so far (the output folder and its work folder beside it, sampled
every half second), then the peaks.

    python benchmarks/export_memory.py MODEL OUT [--quantize int4|int8] [--algorithm NAME] [--graphs split]
        [--stream] [--keep-int8 MODULES]

MODEL: a folder, .gguf file, catalog name or hub id, as for `edgeinfer export` (0.5B weights and
more stream, as the command does; --stream streams a smaller one, such as a copy of a large
model's first layers). --keep-int8 as the command's (left out: auto)."""

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
    parser.add_argument("--stream", action="store_true", default=None, help="stream the export whatever the model's size")
    parser.add_argument("--keep-int8", help="as --keep-int8: modules kept at 8 bits, comma-separated")
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
        settings = {"algorithm": args.algorithm} if args.algorithm else {}
        if args.keep_int8 is not None:
            settings["keep_int8"] = tuple(m for m in args.keep_int8.split(",") if m)
        quantization = Quantization(args.quantize, **settings)
    options = ExportOptions(force=True, graphs=args.graphs, quantization=quantization, stream=args.stream)
    with disk:
        export_model(args.model, args.out, options, say)
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(
        f"done in {time.perf_counter() - start:.0f} s: peak memory {high:.2f} GiB, peak disk {disk.peak / 2**30:.2f} GiB, "
        f"written {folder_bytes(args.out) / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
