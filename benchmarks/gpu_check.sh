#!/usr/bin/env bash
# The CUDA path on a machine with an NVIDIA GPU, from a fresh clone (it has not run on one yet):
#   bash benchmarks/gpu_check.sh
# Installs the project, exports SmolLM2 in fp16, runs the CUDA tests (pictures through three vision families, a hybrid model's LinearAttention and
# CausalConvWithState, and a sliding layer's window in a buffer of exactly the window, among them), prints `edgeinfer bench` on
# CUDA next to the CPU, the host-device copies per decode step (ONNX Runtime's profiler) and where
# the KV cache lives. It fails, loudly, where CUDA cannot run: it never skips.
set -euo pipefail
out=${GPU_CHECK_DIR:-/tmp/edgeinfer-gpu-check}
mkdir -p "$out"
fail() { echo "gpu_check: FAILED: $*" >&2; exit 1; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "nvidia-smi found no NVIDIA GPU"
python3 -m venv "$out/venv" && . "$out/venv/bin/activate"
pip install -q torch==2.13.0 && pip install -q -e ".[export,test]"
python -c "from edgeinfer.sdk.runtime import cuda_unusable_reason as r; m = r(); print('CUDA:', m or 'usable'); exit(1 if m else 0)" \
  || fail "ONNX Runtime cannot use CUDA here (the line above says why)"

edgeinfer export smollm2-135m-instruct -o "$out/fp16" --dtype fp16 --force
pytest -m cuda -q -rs | tee "$out/pytest.txt"
grep -q " skipped" "$out/pytest.txt" && fail "CUDA tests were skipped"

edgeinfer bench "$out/fp16" --provider cuda --repeats 1 --json "$out/bench-cuda.json"
edgeinfer bench smollm2-135m-instruct --provider cpu --repeats 1 --json "$out/bench-cpu.json"

rm -f "$out"/profile_*.json
EDGEINFER_PROFILE="$out/profile" edgeinfer run --model "$out/fp16" --provider cuda --max-new-tokens 32 --ignore-eos "The capital of France is"
python benchmarks/profile_copies.py "$(ls "$out"/profile_*.json | head -1)"
python - "$out/fp16" <<'PY'
import sys
from edgeinfer import Engine
engine = Engine.load(sys.argv[1], provider="cuda")
batch = engine.runner.new_batch(1, 64)
logits = engine.runner.prefill(batch, [engine.prompt_ids("The capital of France is")])
logits = engine.runner.decode(batch, [engine.runner.heads.argmax(logits)[0]])
places = {value.device_name() for value in batch.cache.buffers.values()} | {logits.device_name()}
print("KV cache and logits live on:", ", ".join(sorted(places)))
sys.exit(0 if places == {"cuda"} else 1)
PY
echo "gpu_check: passed"
