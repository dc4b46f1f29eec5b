"""Resident memory of the split layout's two CPU sessions against the single graph's one, each
way of loading them in its own process:

    for mode in single split noprepack shared shared-noprepack; do
        python benchmarks/investigations/split_memory.py $mode SINGLE_EXPORT SPLIT_EXPORT; done

SINGLE_EXPORT: `edgeinfer export MODEL -o SINGLE_EXPORT`; SPLIT_EXPORT: the same with --graphs split.
Prints the resident memory over the interpreter's after load, a 100-token prefill and 5 decode steps
(the KV inputs sized for SmolLM2: 3 KV heads of 64)."""

import os
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
import psutil
from onnx.external_data_helper import uses_external_data

mode, single_dir, split_dir = sys.argv[1], sys.argv[2], sys.argv[3]
proc = psutil.Process()
base = proc.memory_info().rss


def opts(prepack=True):
    o = ort.SessionOptions()
    o.intra_op_num_threads = 2
    if not prepack:
        o.add_session_config_entry("session.disable_prepacking", "1")
    return o


def shared_values(path):
    m = onnx.load(path, load_external_data=False)
    vals = {}
    data = np.fromfile(os.path.join(split_dir, "weights.data"), dtype=np.uint8)
    for t in m.graph.initializer:
        if uses_external_data(t):
            info = {e.key: e.value for e in t.external_data}
            off, ln = int(info.get("offset", 0)), int(info["length"])
            arr = data[off : off + ln].view(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims))
            vals[t.name] = ort.OrtValue.ortvalue_from_numpy(arr)
    return vals


sessions = []
if mode == "single":
    sessions.append(ort.InferenceSession(f"{single_dir}/model.onnx", opts()))
else:
    if mode.startswith("shared"):
        vals = shared_values(f"{split_dir}/decode.onnx")
    for name, prepack in (("prefill", mode not in ("noprepack", "shared-noprepack")), ("decode", True)):
        o = opts(prepack)
        if mode.startswith("shared"):
            o.add_external_initializers(list(vals), list(vals.values()))
        sessions.append(ort.InferenceSession(f"{split_dir}/{name}.onnx", o))
# one prefill and a few decodes
ids = np.arange(3, 103)[None]
s0 = sessions[0]
feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "logits_to_keep": np.array(1)}
if mode == "single":
    for i in s0.get_inputs():
        if i.name.startswith("past"):
            feed[i.name] = np.zeros((1, 3, 256, 64), np.float32)
t = time.perf_counter()
s0.run(["logits"], feed)
pt = time.perf_counter() - t
if mode != "single":
    d = sessions[1]
    f2 = {"input_ids": ids[:, :1], "attention_mask": np.ones((1, 101), np.int64), "logits_to_keep": np.array(1)}
    for i in d.get_inputs():
        if i.name.startswith("past"):
            f2[i.name] = np.zeros((1, 3, 256, 64), np.float32)
    t = time.perf_counter()
    for _ in range(5):
        d.run(["logits"], f2)
    dt = (time.perf_counter() - t) / 5
else:
    dt = 0
print(
    f"{mode}: rss {(proc.memory_info().rss - base) / 2**20:.0f} MiB over the interpreter, prefill {pt * 1000:.0f} ms, decode {dt * 1000:.1f} ms"
)
maps = open("/proc/self/maps").read().count("weights.data")
mi = proc.memory_full_info()
print(f"  maps of weights.data: {maps}, uss {mi.uss / 2**20:.0f} MiB, shared {mi.shared / 2**20:.0f} MiB")
