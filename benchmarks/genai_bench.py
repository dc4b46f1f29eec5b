"""onnxruntime-genai timed the way `edgeinfer bench` times edgeinfer, run by benchmarks/peers.py in
genai's own virtual environment (it needs transformers 5):

    GENAI_VENV/bin/python benchmarks/genai_bench.py GENAI_MODEL_DIR OUT.json [--prompts benchmarks/prompts.json]

Greedy, exactly 128 new tokens (min_length masks the EOS ids), one warm-up run, then the median of 3
per prompt: TTFT from the call to the first token id in Python, decode rate over the other 127.
genai's session is pinned to 2 intra-op threads and 1 inter-op thread (in genai_config.json, which
its builder writes without a thread count), as `edgeinfer bench --threads 2` runs. Standard library,
numpy and onnxruntime_genai only.
"""

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og

NEW_TOKENS = 128
REPEATS = 3
THREADS = 2


def pin_threads(folder: Path) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    if options.get("intra_op_num_threads") != THREADS or options.get("inter_op_num_threads") != 1:
        options.update(intra_op_num_threads=THREADS, inter_op_num_threads=1)
        path.write_text(json.dumps(config, indent=4))


def generate(model, ids: list[int], num_new: int) -> tuple[float, float]:
    """Seconds to the first new token, and the decode rate of the rest."""
    params = og.GeneratorParams(model)
    total = len(ids) + num_new
    params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
    start = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([ids], dtype=np.int32))
    generator.generate_next_token()
    generator.get_next_tokens()
    first = time.perf_counter()
    for _ in range(num_new - 1):
        generator.generate_next_token()
        generator.get_next_tokens()
    end = time.perf_counter()
    return first - start, (num_new - 1) / (end - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parent / "prompts.json")
    args = parser.parse_args()
    pin_threads(args.model)
    start = time.perf_counter()
    model = og.Model(str(args.model))
    load_s = time.perf_counter() - start
    prompts = json.loads(args.prompts.read_text())["prompts"]
    generate(model, next(iter(prompts.values()))[:16], 8)  # the warm-up
    figures = {}
    for name, ids in prompts.items():
        runs = [generate(model, ids, NEW_TOKENS) for _ in range(REPEATS)]
        figures[name] = {
            "ttft_ms": statistics.median(ttft for ttft, _ in runs) * 1000,
            "decode_tps": statistics.median(rate for _, rate in runs),
        }
        print(f"genai {name}: TTFT {figures[name]['ttft_ms']:.1f} ms, decode {figures[name]['decode_tps']:.1f} tok/s", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.out.write_text(json.dumps({"load_s": load_s, "peak_rss_mib": peak, "prompts": figures}, indent=1))


if __name__ == "__main__":
    main()
