"""One export, printing at each stage line the time and the process's memory high-water mark so far
(ru_maxrss: a sampler misses short spikes, such as torch.onnx's while it serializes the graph).

    python benchmarks/export_memory.py MODEL OUT [--quantize int4|int8] [--graphs split]

MODEL: a folder, .gguf file, catalog name or hub id, as for `edgeinfer export`."""

import argparse
import resource
import time

from edgeinfer.export import ExportOptions, Quantization, export_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--quantize", choices=["int4", "int8"])
    parser.add_argument("--graphs", choices=["single", "split"], default="single")
    args = parser.parse_args()
    start = time.perf_counter()

    def say(message: str) -> None:
        high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        print(f"{time.perf_counter() - start:7.1f} s  high-water {high:.2f} GiB  {message}", flush=True)

    options = ExportOptions(force=True, graphs=args.graphs, quantization=Quantization(args.quantize) if args.quantize else None)
    export_model(args.model, args.out, options, say)


if __name__ == "__main__":
    main()
