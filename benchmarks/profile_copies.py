"""Host-device copies per graph run, from an ONNX Runtime profile written under EDGEINFER_PROFILE.

    EDGEINFER_PROFILE=/tmp/p edgeinfer run --model DIR --provider cuda --max-new-tokens 32 "Hello"
    python benchmarks/profile_copies.py /tmp/p_*.json

Prints the runs, the Memcpy nodes ONNX Runtime inserted (copies between the CPU and the device
inside the graph), and the copies per decode run. With the KV cache bound on the device, a decode
run copies only its small host inputs (token ids, mask, positions) in; the cache never crosses.
"""

import collections
import json
import sys


def main(path: str) -> None:
    events = json.loads(open(path).read())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    copies = [
        e
        for e in events
        if e.get("cat") == "Node" and "Memcpy" in e.get("args", {}).get("op_name", "") and e["name"].endswith("kernel_time")
    ]
    by_op = collections.Counter(e["args"]["op_name"] for e in copies)
    bytes_moved = sum(int(e["args"].get("output_size", 0)) for e in copies)
    print(f"{len(runs)} graph runs; Memcpy nodes run {len(copies)} times ({dict(by_op)}), {bytes_moved} bytes in all")
    if len(runs) > 1:  # the first run is the prefill
        print(f"per run after the first: {len(copies) / len(runs):.1f} copies, {bytes_moved / len(runs):.0f} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
