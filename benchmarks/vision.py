"""Images: what a picture costs. On a random-weight checkpoint of SmolVLM-256M-Instruct's shape
(tests/vision_models.py: SmolLM2-135M's layers, a SigLIP base encoder on 512x512 squares, 64 tokens
a picture; the hub is not reachable here, and the figures depend on the shapes, not the weights),
exported once:

- the vision graph's time for one picture;
- the time to the first token of a question with a new picture, the same question without one,
  and the same picture asked again (its tokens found in the prefix cache), in rounds that
  alternate the three, medians;
- through a real `edgeinfer serve` and the openai client: 8 streaming clients, 2 of them sending a
  new picture with each request, the largest gap between two chunks of every stream, and errors.

    python benchmarks/vision.py WORK [--rounds 5] [--threads N] [--quantize int8]

WORK keeps the checkpoint and the export between runs. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
QUESTION = "What is in this picture? Describe it."
_RUNS = itertools.count(1)


def picture(seed: int) -> bytes:
    """A random 640x480 photo-sized picture, as PNG."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((480, 640, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def exported(work: Path, quantize: str | None = None) -> Path:
    """The export of the SmolVLM-256M-shaped checkpoint (made once, kept in WORK): fp32, or with
    `--quantize` (its vision graph's MatMuls then in int8) in WORK/export-QUANTIZE."""
    import torch
    from vision_models import SMOLVLM_256M, build_idefics3

    from edgeinfer.export import ExportOptions, Quantization, export_model

    folder = work / (f"export-{quantize}" if quantize else "export")
    if not (folder / "edgeinfer.json").exists():
        if not (work / "hf" / "config.json").exists():
            build_idefics3(work / "hf", shape=SMOLVLM_256M, dtype=torch.bfloat16)
        options = ExportOptions(quantization=Quantization(quantize), quality=False) if quantize else ExportOptions()
        start = time.perf_counter()
        export_model(str(work / "hf"), folder, options, say=lambda line: print("  export:", line, flush=True))
        print(f"exported in {time.perf_counter() - start:.0f} s")
    return folder


def first_token_s(engine, messages: list[dict]) -> float:
    """Wall time from the call to the first token (encoding the pictures included)."""
    start = time.perf_counter()
    for _ in engine.stream_chat(messages, max_new_tokens=1, ignore_eos=True):
        break
    return time.perf_counter() - start


def ttft_rounds(export: Path, rounds: int, threads: int | None) -> dict:
    from edgeinfer import Engine
    from edgeinfer.sdk.vision import picture as made, user_message

    engine = Engine.load(export, provider="cpu", threads=threads)
    vision = engine.manifest.vision
    first_token_s(engine, [user_message(QUESTION, [picture(999)])])  # warm the sessions
    times = {"encode": [], "text alone": [], "new picture": [], "same picture again": []}
    for n in range(rounds):
        item = made(picture(100 + n), vision)
        start = time.perf_counter()
        engine.runner.images.add([item])
        times["encode"].append(time.perf_counter() - start)
        times["text alone"].append(first_token_s(engine, [{"role": "user", "content": f"{n + 1}. {QUESTION}"}]))  # new each round
        times["new picture"].append(first_token_s(engine, [user_message(QUESTION, [picture(200 + n)])]))
        times["same picture again"].append(first_token_s(engine, [user_message(QUESTION, [picture(200 + n)])]))
    return {name: statistics.median(values) for name, values in times.items()}


def serve(export: Path, threads: int | None):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_serve import start

    flags = ["--provider", "cpu", "--max-batch", "8", "--model", f"vlm={export}"]
    return start(None, *flags, *(["--threads", str(threads)] if threads else []))


def streaming_gaps(url: str, seconds: float = 40.0, picture_clients: int = 2) -> dict:
    """8 clients for `seconds`: `picture_clients` of them send a new picture with each request,
    the others ask text questions; every stream's largest gap between chunks (after its first),
    the requests and the errors."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    stop_at, lock, run = time.monotonic() + seconds, threading.Lock(), next(_RUNS)
    found = {"text": [], "picture": [], "requests": 0, "errors": [], "ttft": {"text": [], "picture": []}}

    def client_loop(kind: str, index: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            if kind == "picture":
                url = "data:image/png;base64," + base64.b64encode(picture(100_000 * run + 1000 * index + n)).decode()  # never seen
                content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
            else:
                content = f"{QUESTION} (client {index}, question {n})"
            try:
                gap, ttft = one_stream(client, content)
            except Exception as error:  # noqa: BLE001 - a benchmark counts every failure, whatever it is
                with lock:
                    found["errors"].append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                found[kind].append(gap)
                found["ttft"][kind].append(ttft)
                found["requests"] += 1

    workers = [threading.Thread(target=client_loop, args=("picture" if i < picture_clients else "text", i)) for i in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return found


def one_stream(client, content) -> tuple[float, float]:
    """(largest gap between chunks after the first, time to the first) of one streamed reply."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content}], max_tokens=48, stream=True, extra_body={"ignore_eos": True}
    )
    arrivals = [time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return max(gaps, default=0.0), arrivals[0] - start if arrivals else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--quantize", choices=["int4", "int8"], default=None, help="export with --quantize (the encoder in int8)")
    args = parser.parse_args()
    export = exported(args.work, args.quantize)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, {args.rounds} rounds, medians (ms):")
    for name, seconds in ttft_rounds(export, args.rounds, args.threads).items():
        print(f"  {name:<22} {seconds * 1000:8.1f}")
    process, url = serve(export, args.threads)
    try:
        for picture_clients in (0, 2, 0, 2):  # alternated: 8 text clients, then 2 of the 8 sending pictures
            print(f"8 streaming clients, {picture_clients} sending pictures, {args.seconds:.0f} s:")
            say_gaps(streaming_gaps(url, args.seconds, picture_clients))
    finally:
        process.terminate()
        process.wait(timeout=60)


def say_gaps(found: dict) -> None:
    for kind in ("text", "picture"):
        gaps, ttfts = found[kind], found["ttft"][kind]
        if gaps:
            print(
                f"  {kind} streams: {len(gaps)} requests, largest gap {max(gaps) * 1000:.0f} ms (median of the largest "
                f"{statistics.median(gaps) * 1000:.0f} ms), median TTFT {statistics.median(ttfts) * 1000:.0f} ms"
            )
    print(f"  requests {found['requests']}, errors {len(found['errors'])}" + (f": {found['errors'][:3]}" if found["errors"] else ""))


if __name__ == "__main__":
    main()
