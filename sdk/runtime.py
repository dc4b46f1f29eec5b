"""The one module that talks to ONNX Runtime: providers, sessions, IO binding, OrtValues."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from .errors import ManifestError, NotAnExportError, ProviderError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
_LOAD_ERRORS = (ort_state.Fail, ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.NoSuchFile,
                ort_state.InvalidArgument, ort_state.RuntimeException)
_QUIET, _DEFAULT_SEVERITY = 4, 2


@dataclass(frozen=True)
class RuntimeOptions:
    """How the graphs run. `provider` is "auto", "cpu" or "cuda"; `threads` is ONNX Runtime's
    intra-op thread count (None: its default, one per physical core)."""

    provider: str = "auto"
    threads: int | None = None

    def __post_init__(self):
        if self.provider not in ("auto", *PROVIDERS):
            raise ProviderError(f"unknown provider {self.provider!r}: use 'auto', 'cpu' or 'cuda'")
        if self.threads is not None and self.threads < 1:
            raise ProviderError(f"threads must be at least 1, got {self.threads}")


def cuda_unusable_reason() -> str | None:
    """None where CUDA can run; otherwise why not, in words a user can act on."""
    if PROVIDERS["cuda"] not in ort.get_available_providers():
        return f"this onnxruntime build ({ort.__version__}) has no CUDA provider: install onnxruntime-gpu"
    # Allocating one value on the GPU loads the CUDA provider; its failure is logged as an
    # error by ONNX Runtime, which is noise here, so logging is quieted for the probe.
    ort.set_default_logger_severity(_QUIET)
    try:
        ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
    except RuntimeError:
        return "the CUDA provider could not start (no GPU, or CUDA 13 / cuDNN 9 libraries not found)"
    finally:
        ort.set_default_logger_severity(_DEFAULT_SEVERITY)
    return None


def choose_provider(requested: str) -> tuple[str, str]:
    """The provider to use and a sentence saying why."""
    if requested == "cpu":
        return "cpu", "cpu was requested"
    reason = cuda_unusable_reason()
    if reason is None:
        return "cuda", f"CUDA is usable ({requested} requested)"
    if requested == "cuda":
        raise ProviderError(f"provider 'cuda' cannot run here: {reason}; use provider 'cpu' (or 'auto')")
    return "cpu", f"auto chose cpu: {reason}"


class Graph:
    """One ONNX graph in one InferenceSession, always run through IO binding."""

    def __init__(self, path: Path, provider: str, threads: int | None):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or 0
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers = [PROVIDERS[provider]] + ([PROVIDERS["cpu"]] if provider != "cpu" else [])
        if not Path(path).is_file():
            raise NotAnExportError(f"graph {path} is missing: the export is incomplete, export the model again")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except _LOAD_ERRORS as e:
            raise NotAnExportError(f"ONNX Runtime cannot load {path} ({e}): the file is damaged, export the model again") from None
        if PROVIDERS[provider] not in self.session.get_providers():
            raise ProviderError(f"ONNX Runtime did not start {PROVIDERS[provider]} for {path}: use provider 'cpu'")
        self.path = Path(path)
        self.device = provider
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def check_names(self, inputs: list[str], outputs: list[str]) -> None:
        """The graph must take and give exactly the names the manifest lists."""
        if list(self.inputs) != inputs or self.output_names != outputs:
            raise ManifestError(
                f"{self.path.name} takes {list(self.inputs)} and gives {self.output_names}, but the manifest lists "
                f"{inputs} and {outputs}: the graph and manifest come from different exports, export the model again"
            )

    def run(self, inputs: dict, keep: list[str], fetch: list[str]) -> tuple[dict, dict]:
        """Run once. `inputs` maps names to numpy arrays (copied to the device) or OrtValues
        (bound where they are). Outputs named in `keep` stay on the device as OrtValues;
        those in `fetch` come back to the host as numpy arrays."""
        binding = self.session.io_binding()
        for name, value in inputs.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        for name in keep:
            binding.bind_output(name, self.device)
        for name in fetch:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        kept = dict(zip(keep, values[: len(keep)]))
        fetched = {name: value.numpy() for name, value in zip(fetch, values[len(keep):])}
        return kept, fetched


def sequence_length(value: ort.OrtValue, axis: int) -> int:
    return value.shape()[axis]
