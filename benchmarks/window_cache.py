"""What a sliding layer's cache that keeps only its window saves: one export as it is (its sliding
layers' buffers hold the window and an eighth more) beside a copy of it whose every layer keeps
every token (the graph's `sliding_window_cache` turned off, as the split layout does), alternating
round by round.

    python benchmarks/window_cache.py EXPORT [--contexts 128 2048 4096] [--new-tokens 32] [--rounds 2]

Prints, for each, the KV cache one row allocates at the export's context and at each --contexts
value (the buffers' own bytes), and the decode rate after a prompt of each --contexts length (ids
3.., a fixed pattern; --new-tokens greedy tokens past EOS; the engine's own rate, prefill excluded).
The copy lives in a temporary folder (its weights file a hard link where the filesystem allows)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import onnx
from hybrid_decode import alternate  # run as a script from the repository: benchmarks/ is on the path

from edgeinfer import Engine
from edgeinfer.export.split import whole_windows
from edgeinfer.sdk.manifest import MANIFEST_NAME, describe_files, load_manifest


def whole_copy(folder: Path, into: Path) -> Path:
    """`folder` with every layer keeping every token: the graph's windowed attention turned off."""
    manifest = load_manifest(folder)
    if not manifest.kv.windows:
        raise SystemExit(f"{folder} has no layer that keeps only its window (kv.windows): export it with this edgeinfer")
    into.mkdir()
    for path in folder.iterdir():
        if path.name in (manifest.graph.file, MANIFEST_NAME):  # written anew below, not through a link to the export's
            continue
        try:
            os.link(path, into / path.name)
        except OSError:
            shutil.copy(path, into / path.name)
    graph = onnx.load(str(folder / manifest.graph.file), load_external_data=False)
    whole_windows(graph.graph)
    onnx.save(graph, str(into / manifest.graph.file))
    manifest = dataclasses.replace(manifest, kv=dataclasses.replace(manifest.kv, windows=[]))
    dataclasses.replace(manifest, files=describe_files(into)).save(into)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folders = {"window": args.export, "whole": whole_copy(args.export, Path(scratch) / "whole")}
        engines = {kind: Engine.load(folder, provider="cpu", prefix_cache=0) for kind, folder in folders.items()}
        for kind, engine in engines.items():
            for context in sorted({*args.contexts, engine.max_context}):
                mib = engine.runner.new_batch(1, context).cache.nbytes / 2**20
                print(f"{kind}: KV cache of one row of {context} tokens: {mib:.1f} MiB", flush=True)
        alternate(engines, args.contexts, args.new_tokens, args.rounds)


if __name__ == "__main__":
    main()
