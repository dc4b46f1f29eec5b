"""What Ray Serve adds and gives: the latency the Ray ingress adds to a request against
`edgeinfer serve` alone (the same one-token request, sequentially, alternating servers, p50 and
p90), and the aggregate decode tok/s of `edgeinfer serve`, 1 replica and 2 replicas under 8
streaming clients (benchmarks/serve.py: a 128-token prompt, 64 tokens each). Each server runs alone; all share this machine's cores, so 2 replicas on 2
cores are not expected to gain much.

    python benchmarks/ray_serve.py EXPORT_DIR [--requests 200] [--seconds 15]
"""

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(export: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeinfer.cli",
            "serve",
            "--model",
            export,
            "--port",
            str(port),
            "--provider",
            "cpu",
            "--threads",
            "2",
            "--prefix-cache",
            "0",
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                time.sleep(2)  # every replica up (Ray answers once one is)
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server {' '.join(flags)} did not start")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)


def latencies(url: str, model: str, count: int) -> list[float]:
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 1}
    with httpx.Client(timeout=60) as client:
        client.post(f"{url}/v1/completions", json=body)  # warm-up
        times = []
        for _ in range(count):
            start = time.perf_counter()
            client.post(f"{url}/v1/completions", json=body).raise_for_status()
            times.append(1000 * (time.perf_counter() - start))
    return times


def aggregate(url: str, model: str, seconds: float, scratch: Path) -> float:
    subprocess.run(
        [
            sys.executable,
            str(HERE / "serve.py"),
            "--url",
            f"{url}/v1",
            "--model",
            model,
            "--clients",
            "8",
            "--seconds",
            str(seconds),
            "--json",
            str(scratch),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(scratch.read_text())["levels"][0]["aggregate_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("export_dir")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=15)
    args = parser.parse_args()
    model = Path(args.export_dir).name
    plain, ray = start(args.export_dir), start(args.export_dir, "--ray", "--replicas", "1", "--replica-cpus", "2")
    try:
        runs = {"edgeinfer serve": [], "through Ray": []}
        for _ in range(4):  # alternating, a quarter of the requests each time
            runs["edgeinfer serve"] += latencies(plain[1], model, args.requests // 4)
            runs["through Ray"] += latencies(ray[1], model, args.requests // 4)
    finally:
        stop(plain[0])
        stop(ray[0])
    for name, times in runs.items():
        q = statistics.quantiles(times, n=10)
        print(f"{name:16s} one-token request: p50 {statistics.median(times):6.1f} ms, p90 {q[8]:6.1f} ms ({len(times)} requests)")
    print(
        f"added by the Ray ingress at p50: {statistics.median(runs['through Ray']) - statistics.median(runs['edgeinfer serve']):.1f} ms"
    )
    servers = {
        "edgeinfer serve": [],
        "1 Ray replica (2 CPUs)": ["--ray", "--replicas", "1", "--replica-cpus", "2"],
        "2 Ray replicas (1 CPU each)": ["--ray", "--replicas", "2", "--replica-cpus", "1"],
    }
    for name, flags in servers.items():
        process, url = start(args.export_dir, *flags)
        try:
            rate = aggregate(url, model, args.seconds, Path(args.export_dir).parent / ".ray-bench.json")
            print(f"{name:28s} 8 streaming clients: {rate:6.1f} tok/s aggregate")
        finally:
            stop(process)


if __name__ == "__main__":
    main()
