"""`edgeinfer export` against onnxruntime-genai's model builder on one checkpoint, alternating, each
in a fresh process: wall time and peak RSS of each run.

    python benchmarks/export_race.py CHECKPOINT --genai-python /path/to/genai-venv/bin/python \\
        [--rounds 2] [--edgeinfer-args "--quantize int4 --algorithm rtn"] [--genai-args "-p int4 -e cpu"]

CHECKPOINT: a Hugging Face folder (benchmarks/random_checkpoint.py writes one). genai's builder
needs transformers 5 and its own environment (`pip install onnxruntime-genai==0.18 torch==2.13.0
transformers==5.24.0` in a virtual environment of its own)."""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(command: list[str], log: Path) -> tuple[float, int, int]:
    """(seconds, peak RSS in bytes, exit status) of `command`, its output written to `log`."""
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - start, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--genai-python", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--edgeinfer-args", default="--quantize int4 --algorithm rtn")
    parser.add_argument("--genai-args", default="-p int4 -e cpu")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="export-race-"))
    edgeinfer = Path(sys.executable).with_name("edgeinfer")
    runs = {
        "edgeinfer": [
            str(edgeinfer),
            "export",
            str(args.checkpoint),
            "-o",
            str(work / "edgeinfer"),
            *shlex.split(args.edgeinfer_args),
        ],
        "genai": [
            args.genai_python,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(args.checkpoint),
            "-o",
            str(work / "genai"),
            "-c",
            str(work / "genai-cache"),
            *shlex.split(args.genai_args),
        ],
    }
    try:
        for round_ in range(1, args.rounds + 1):
            for name, command in runs.items():
                for folder in ("edgeinfer", "genai", "genai-cache"):
                    shutil.rmtree(work / folder, ignore_errors=True)
                seconds, peak, code = timed(command, work / f"{name}.log")
                status = "" if code == 0 else f"  FAILED ({code}): see {work / f'{name}.log'}"
                print(f"round {round_}  {name:9}  {seconds:6.1f} s  peak {peak / 2**30:5.2f} GiB{status}", flush=True)
                if code:
                    return
    finally:
        for folder in ("edgeinfer", "genai", "genai-cache"):
            shutil.rmtree(work / folder, ignore_errors=True)


if __name__ == "__main__":
    main()
