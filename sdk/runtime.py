"""The one module that talks to ONNX Runtime: providers, sessions, IO binding, OrtValues."""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from .errors import GraphError, ManifestError, NotAnExportError, ProviderError
from .heads import load_head
from .initializers import ExternalData
from .cpu_kernel import kernel, rewrite

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# Set to a path prefix, ONNX Runtime profiles every run of the model graph and writes PREFIX_<time>.json
# at exit (benchmarks/gpu_check.sh reads the host-device copies from it).
PROFILE_ENV = "EDGEINFER_PROFILE"
_LOAD_ERRORS = (
    ort_state.Fail,
    ort_state.InvalidProtobuf,
    ort_state.InvalidGraph,
    ort_state.NoSuchFile,
    ort_state.InvalidArgument,
    ort_state.RuntimeException,
)
# What ONNX Runtime raises when a run fails: run_with_iobinding raises RuntimeError("Error in
# execution: ..."), and its status classes (none of which derives from RuntimeError) elsewhere.
_RUN_ERRORS = (
    RuntimeError,
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.RuntimeException,
    ort_state.EPFail,
    ort_state.NotImplemented,
    ort_state.EngineError,
    ort_state.InvalidGraph,
    ort_state.NotFound,
)
_ONNX_TYPES = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16}  # ONNX TensorProto codes
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # what OrtValue.data_type() says

Value = ort.OrtValue  # what the runner hands around: a tensor where ONNX Runtime put it (the device, or the host)


def host_value(array: np.ndarray) -> Value:
    """A host Value that owns a copy of `array` (not a view of memory that numpy may free)."""
    value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, "cpu", 0)
    value.update_inplace(np.ascontiguousarray(array))
    return value


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


@functools.cache
def cuda_unusable_reason() -> str | None:
    """None where CUDA can run; otherwise why not, in words a user can act on. Probed once per
    process (allocating one value on the GPU loads the CUDA provider)."""
    if PROVIDERS["cuda"] not in ort.get_available_providers():
        return f"this onnxruntime build ({ort.__version__}) has no CUDA provider: install onnxruntime-gpu"
    logged: list[str] = []
    with _native_stderr_into(logged):
        try:
            ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
            started = True
        except RuntimeError:
            started = False
    if started:
        return None
    missing = next((line.split("with error: ")[-1].strip() for line in logged if "with error: " in line), None)
    return (
        "the CUDA provider could not start (no GPU, or CUDA 13 / cuDNN 9 libraries not found"
        + (f": {missing}" if missing else "")
        + ")"
    )


@contextmanager
def _native_stderr_into(lines: list[str]):
    """ONNX Runtime logs a failed provider load as an error on the process's stderr (file
    descriptor 2), which is noise where CPU is the answer. For the probe alone, fd 2 goes to a
    temporary file, whose lines are added to `lines`, and then back to exactly what it was; ONNX
    Runtime's logger and its severity are left as the app set them."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


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
    """One ONNX graph in one InferenceSession, always run through IO binding. `source` is the
    path of an .onnx file, or a serialized model (the small heads built in memory)."""

    def __init__(
        self,
        source: Path | bytes,
        provider: str,
        threads: int | None,
        shared: dict | None = None,
        packed: bool = True,
        quantized: bool = False,
    ):
        """`shared`: initializers (OrtValues, by name) the session uses as they are instead of
        reading its own copy (the split layout's weights, on the GPU once for both graphs).
        `packed=False`: for a few runs of an export's own (a session to serve packs): the CPU
        kernels read the weights where the data file is mapped instead of packing a copy of each
        as the session loads, and a run's buffers go back as it ends instead of staying in an arena.
        `quantized`: the graph holds MatMulNBits weights (the manifest says so), which edgeinfer's
        own kernel runs on the CPU where it is built (sdk/cpu_kernel.py; reading the nodes needs onnx)."""
        options = ort.SessionOptions()
        if not packed:
            options.add_session_config_entry("session.disable_prepacking", "1")
            options.enable_cpu_mem_arena = False
        if shared:
            options.add_external_initializers(list(shared), list(shared.values()))
        options.intra_op_num_threads = threads or 0
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        profile = os.environ.get(PROFILE_ENV)
        if profile and not isinstance(source, bytes):  # the model graph, not the heads
            options.enable_profiling, options.profile_file_prefix = True, profile
        providers = [PROVIDERS[provider]] + ([PROVIDERS["cpu"]] if provider != "cpu" else [])
        name = "a built-in head graph" if isinstance(source, bytes) else str(source)
        if not isinstance(source, bytes) and not Path(source).is_file():
            raise NotAnExportError(f"graph {source} is missing: the export is incomplete, export the model again")
        self.weights_kernel: str | None = None  # what runs its quantized weights, and why (None: none here)
        if quantized and provider == "cpu" and packed and not isinstance(source, bytes):
            source = self._take_cpu_kernel(Path(source), options)
        try:
            self.session = ort.InferenceSession(source if isinstance(source, bytes) else str(source), options, providers=providers)
        except _LOAD_ERRORS as e:
            raise NotAnExportError(f"ONNX Runtime cannot load {name} ({e}): the file is damaged, export the model again") from None
        if PROVIDERS[provider] not in self.session.get_providers():
            raise ProviderError(f"ONNX Runtime did not start {PROVIDERS[provider]} for {name}: use provider 'cpu'")
        if options.enable_profiling:
            atexit.register(self.session.end_profiling)  # ONNX Runtime writes the profile then
        self.name = name
        self.device = provider
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.output_types = {o.name: o.type for o in self.session.get_outputs()}

    def _take_cpu_kernel(self, source: Path, options: ort.SessionOptions) -> Path | bytes:
        """The graph with its MatMulNBits nodes run by edgeinfer's kernel where it is built
        (sdk/cpu_kernel.py), over weights packed here; else `source` as it is."""
        built = kernel()
        if built.path is None:
            self.weights_kernel = f"MatMulNBits: edgeinfer's kernel is off ({built.reason})"
            return source
        try:
            rewritten = rewrite(source, built.path)
        except (OSError, ValueError, ImportError) as e:  # a damaged file: the session's load says so
            self.weights_kernel = f"MatMulNBits: the graph could not be repacked ({e})"
            return source
        if rewritten is None:
            self.weights_kernel = "MatMulNBits: no node the kernel takes"
            return source
        model, packed = rewritten
        options.register_custom_ops_library(str(built.path))
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(source.parent))
        self._packed = packed  # the nodes read this memory by address for as long as the session lives
        self.weights_kernel = f"edgeinfer's kernel ({len(packed)} weights, {sum(a.nbytes for a in packed) / 2**20:.1f} MiB)"
        return model

    def input_dtype(self, name: str) -> np.dtype:
        """The numpy dtype of a float input (image features, pixels)."""
        return np.dtype(_NUMPY_TYPES[self.inputs[name].type])

    def check_names(self, inputs: list[str], outputs: list[str]) -> None:
        """The graph must take and give exactly the names the manifest lists."""
        if list(self.inputs) != inputs or self.output_names != outputs:
            raise ManifestError(
                f"{Path(self.name).name} takes {list(self.inputs)} and gives {self.output_names}, but the manifest lists "
                f"{inputs} and {outputs}: the graph and manifest come from different exports, export the model again"
            )

    def run(self, inputs: dict, on_device: list[str], to_host: list[str], into: dict | None = None) -> tuple[dict, dict]:
        """Run once. `inputs` maps names to numpy arrays (copied to the device) or OrtValues
        (bound where they are). Outputs named in `into` are written into the OrtValues given
        there (which may also be inputs: a KV cache updated in place); those in `on_device` stay
        on the device as new OrtValues; those in `to_host` come back as numpy arrays."""
        binding = self.session.io_binding()
        for name, value in inputs.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            elif isinstance(value, tuple):  # (buffer, first row, rows): those rows, where they are
                _bind_row_view(binding, name, *value, self.device)
            else:
                binding.bind_cpu_input(name, value)
        for name, value in (into or {}).items():
            binding.bind_ortvalue_output(name, value)
        for name in on_device:
            binding.bind_output(name, self.device)
        for name in to_host:
            binding.bind_output(name, "cpu")
        _run(self.session, binding, self.name)
        values = binding.get_outputs()[len(into or {}) :]
        device_values = dict(zip(on_device, values[: len(on_device)]))
        host_values = {name: value.numpy() for name, value in zip(to_host, values[len(on_device) :])}
        return device_values, host_values

    def bind(self, inputs: dict, outputs: dict) -> Binding:
        """An IO binding kept across runs, with `inputs` and `outputs` (OrtValues) bound once."""
        return Binding(self, inputs, outputs)

    def allocate(self, shape: list[int], dtype: str) -> ort.OrtValue:
        """An uninitialised buffer on this graph's device."""
        return ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(dtype), self.device, 0)

    def write_row(self, buffer: ort.OrtValue, row: int, values: np.ndarray) -> None:
        """Write `values` (one row's shape) into row `row` of `buffer` [rows, ...] on this graph's device."""
        if self.device == "cpu":
            self.host_view(buffer)[row] = values
            return
        dtype = np.dtype(_NUMPY_TYPES[buffer.data_type()])
        copy = _device_copy(dtype.name, self.device)
        binding = copy.session.io_binding()
        binding.bind_cpu_input("x", np.ascontiguousarray(values, dtype).reshape(-1, values.shape[-1]))
        shape, row_bytes = buffer.shape(), int(np.prod(buffer.shape()[1:])) * dtype.itemsize
        binding.bind_output("y", self.device, 0, dtype, [int(np.prod(shape[1:-1])), shape[-1]], buffer.data_ptr() + row * row_bytes)
        _run(copy.session, binding, copy.name)

    def read_row(self, buffer: ort.OrtValue, row: int) -> np.ndarray:
        """A host copy of row `row` of `buffer` [rows, ...]."""
        if self.device == "cpu":
            return self.host_view(buffer)[row].copy()
        return buffer.numpy()[row].copy()

    def host_view(self, value: ort.OrtValue) -> np.ndarray:
        """A numpy array over a CPU value's own memory (writes go into the value); valid while the
        value lives."""
        if self.device != "cpu":
            raise ProviderError(f"a {self.device} value has no host view: copy it instead")
        dtype, shape = np.dtype(_NUMPY_TYPES[value.data_type()]), value.shape()
        memory = (ctypes.c_byte * (int(np.prod(shape)) * dtype.itemsize)).from_address(value.data_ptr())
        return np.frombuffer(memory, dtype).reshape(shape)

    def allocate_output(self, name: str, shape: list[int]) -> ort.OrtValue:
        """An uninitialised buffer on this graph's device for output `name`, of `shape`."""
        return self.allocate(shape, _NUMPY_TYPES[self.output_types[name]])

    def bind_rows(
        self, pooled: dict[str, tuple[ort.OrtValue, str]], first: int, rows: int, logits: ort.OrtValue | None = None
    ) -> Binding:
        """An IO binding of rows first..first+rows of pooled buffers [pool rows, ...] (a KV pool),
        bound by address so nothing is copied: `pooled` maps each past input to its buffer and the
        present output written into the same rows. The logits go into `logits` where given (kept
        for runs whose logits have one shape: decode passes on the same rows), else into a new
        value on the device at each run, `Binding.outputs()[-1]`."""
        binding = Binding(self, {}, {})
        for past, (buffer, present) in pooled.items():
            shape, dtype = buffer.shape(), np.dtype(_NUMPY_TYPES[buffer.data_type()])
            row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
            address, part = buffer.data_ptr() + first * row_bytes, [rows, *shape[1:]]
            binding.io.bind_input(past, self.device, 0, dtype, part, address)
            binding.io.bind_output(present, self.device, 0, dtype, part, address)
        if logits is not None:
            binding.io.bind_ortvalue_output("logits", logits)
        else:
            binding.io.bind_output("logits", self.device)
        return binding


def load_weights(graph_file: Path, provider: str) -> dict[str, ort.OrtValue]:
    """The initializers `graph_file` keeps in its external data file, each one OrtValue on the
    provider's device, for `Graph(shared=...)`: the split layout's two sessions then hold one
    copy of the weights on a GPU instead of one each."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(graph_file), load_external_data=False)
    values, reader = {}, ExternalData(Path(graph_file).parent)
    for tensor in model.graph.initializer:
        if not uses_external_data(tensor):
            continue
        array = np.ascontiguousarray(reader.array(tensor))
        owner = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, provider, 0)._get_c_value()
        owner.update_inplace(array)  # copied onto the device
        # A session takes only values whose memory it does not own: the same memory seen through
        # DLPack, which keeps `owner` alive as long as the view lives.
        values[tensor.name] = ort.OrtValue(ort_state.OrtValue.from_dlpack(owner.to_dlpack(), False))
    return values


class Binding:
    """An IO binding kept across runs. What is bound once (the KV cache's buffers, the logits)
    stays bound; each run rebinds only the host inputs it is given (those the graph takes). A
    decode step then costs two binds and a run from Python, instead of binding every past and
    present again."""

    def __init__(self, graph: Graph, inputs: dict, outputs: dict):
        self._session, self._name, self._takes, self._device = graph.session, graph.name, set(graph.inputs), graph.device
        self.io = graph.session.io_binding()
        for name, value in inputs.items():
            self.io.bind_ortvalue_input(name, value)
        for name, value in outputs.items():
            self.io.bind_ortvalue_output(name, value)

    def keep_rows(self, views: dict[str, tuple[ort.OrtValue, int, int] | ort.OrtValue]) -> None:
        """Bind each input to rows of a buffer, (buffer, first row, rows), or to a value, for every run from now on."""
        for name, view in views.items():
            if isinstance(view, ort.OrtValue):
                self.io.bind_ortvalue_input(name, view)
            else:
                _bind_row_view(self.io, name, *view, self._device)

    def run(self, inputs: dict[str, np.ndarray], fresh: tuple[str, ...] = ()) -> None:
        """Run with `inputs` bound anew. Outputs named in `fresh` get a new value of this run's
        shape (ONNX Runtime otherwise writes into the value the last run allocated)."""
        for name, value in inputs.items():
            if name in self._takes:
                self.io.bind_cpu_input(name, value)
        for name in fresh:
            self.io.bind_output(name, self._device)
        _run(self._session, self.io, self._name)

    def outputs(self) -> list[ort.OrtValue]:
        """Every output of the last run, in the order they were bound."""
        return self.io.get_outputs()


def _bind_row_view(binding, name: str, buffer: ort.OrtValue, first: int, rows: int, device: str) -> None:
    """Bind input `name` to rows first..first+rows-1 of `buffer` [rows, ...], by address: nothing is copied."""
    shape, dtype = buffer.shape(), np.dtype(_NUMPY_TYPES[buffer.data_type()])
    row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
    binding.bind_input(name, device, 0, dtype, [rows, *shape[1:]], buffer.data_ptr() + first * row_bytes)


@functools.cache
def _device_copy(dtype: str, provider: str) -> Graph:
    """The Identity graph that copies between the host and a device buffer at an address (one per
    type and provider: runs with their own bindings share it)."""
    return Graph(load_head("copy", {"float32": 1, "float16": 10}[dtype]), provider, threads=1)


def _run(session: ort.InferenceSession, binding, name: str) -> None:
    try:
        session.run_with_iobinding(binding)
    except _RUN_ERRORS as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GraphError(
            f"ONNX Runtime failed running {Path(name).name} ({first}): on a GPU, serve a smaller "
            "max_context or batch; otherwise check the export with `edgeinfer check`, or export it again"
        ) from e


class HostCopy:
    """Copies the first tokens of one row of CPU buffers [rows, kv_heads, capacity, head_size] to
    and from the host through views of their memory (the prefix cache's copier on the CPU provider)."""

    def __init__(self, graph: Graph):
        self._graph = graph

    def write(self, buffer: ort.OrtValue, row: int, values: np.ndarray) -> None:
        """Write `values` [kv_heads, tokens, head_size] into the first tokens of `row`."""
        self._graph.host_view(buffer)[row, :, : values.shape[1]] = values

    def read(self, buffer: ort.OrtValue, row: int, tokens: int) -> np.ndarray:
        """A view of the first `tokens` of `row`, [kv_heads, tokens, head_size], valid while the buffer lives."""
        return self._graph.host_view(buffer)[row, :, :tokens]

    def fill(self, buffer: ort.OrtValue, present: ort.OrtValue, slots: int) -> None:
        """Copy the first `slots` positions of `present` [rows, kv_heads, positions, head_size] into
        the same rows of `buffer`."""
        self._graph.host_view(buffer)[:, :, :slots] = self._graph.host_view(present)[:, :, :slots]


class RowCopy:
    """Copies the first tokens of one row of KV buffers [rows, kv_heads, capacity, head_size] between
    the host and the buffers' device, head by head (a head's tokens are contiguous), through an
    Identity graph bound at their addresses: how the prefix cache reads and writes a row of the
    server's pool where the buffers have no host view (CUDA)."""

    def __init__(self, dtype: str, provider: str):
        self._graph = _device_copy(dtype, provider)
        self._dtype = np.dtype(dtype)

    def write(self, buffer: ort.OrtValue, row: int, values: np.ndarray) -> None:
        """Write `values` [kv_heads, tokens, head_size] into the first tokens of `row`."""
        for head, part in enumerate(values):
            binding = self._graph.session.io_binding()
            binding.bind_cpu_input("x", np.ascontiguousarray(part, self._dtype))
            binding.bind_output("y", self._graph.device, 0, self._dtype, list(part.shape), self._address(buffer, row, head))
            _run(self._graph.session, binding, self._graph.name)

    def read(self, buffer: ort.OrtValue, row: int, tokens: int) -> np.ndarray:
        """A host copy of the first `tokens` of `row`, [kv_heads, tokens, head_size]."""
        _, heads, _, width = buffer.shape()
        out = np.empty((heads, tokens, width), self._dtype)
        for head in range(heads):
            binding = self._graph.session.io_binding()
            binding.bind_input("x", self._graph.device, 0, self._dtype, [tokens, width], self._address(buffer, row, head))
            binding.bind_output("y", "cpu")
            _run(self._graph.session, binding, self._graph.name)
            out[head] = binding.get_outputs()[0].numpy()
        return out

    def fill(self, buffer: ort.OrtValue, present: ort.OrtValue, slots: int) -> None:
        """Copy the first `slots` positions of `present` [rows, kv_heads, positions, head_size] into
        the same rows of `buffer` [rows, kv_heads, capacity, head_size], on the device, head by head."""
        rows, heads, positions, width = present.shape()
        for row in range(rows):
            for head in range(heads):
                source = present.data_ptr() + (row * heads + head) * positions * width * self._dtype.itemsize
                binding = self._graph.session.io_binding()
                binding.bind_input("x", self._graph.device, 0, self._dtype, [slots, width], source)
                binding.bind_output("y", self._graph.device, 0, self._dtype, [slots, width], self._address(buffer, row, head))
                _run(self._graph.session, binding, self._graph.name)

    def _address(self, buffer: ort.OrtValue, row: int, head: int) -> int:
        _, heads, capacity, width = buffer.shape()
        return buffer.data_ptr() + (row * heads + head) * capacity * width * self._dtype.itemsize


@dataclass
class Bindings:
    """What a batch keeps bound from one step to the next (runner.Batch): per number of rows, a
    decode pass's binding of those rows of the cache with the logits value it overwrites
    (`decode`); per row, a binding of that row alone (`rows`), for passes of several tokens on
    one row, whose logits ONNX Runtime allocates at each run; and the argmax head bound to one
    logits value and to the host array `token_ids` that receives its greedy tokens."""

    decode: dict[int, tuple[Binding, ort.OrtValue]] = field(default_factory=dict)
    rows: dict[int, Binding] = field(default_factory=dict)
    argmax: Binding | None = None
    argmax_logits: ort.OrtValue | None = None
    token_ids: np.ndarray | None = None


class LogitsHeads:
    """The heads of `heads.py`, run on the device that holds the logits.

    This is the line between device and host in generation: the logits stay where the graph
    made them, and only token ids (greedy) or one position's logits (sampling) cross it."""

    def __init__(self, logits_type: str, provider: str):
        if logits_type not in _ONNX_TYPES:
            raise ManifestError(
                f"the graphs give logits of type {logits_type}, which edgeinfer cannot sample from: export the model again"
            )
        self._argmax = Graph(load_head("argmax", _ONNX_TYPES[logits_type]), provider, threads=1)
        self._last = Graph(load_head("last", _ONNX_TYPES[logits_type]), provider, threads=1)
        self._type, self._provider = _ONNX_TYPES[logits_type], provider

    @functools.cached_property
    def _tokens(self) -> Graph:
        """The `tokens` head, loaded at its first use (speculative decoding): not at every load."""
        return Graph(load_head("tokens", self._type), self._provider, threads=1)

    def argmax(self, logits: ort.OrtValue, bindings: Bindings | None = None) -> list[int]:
        """Each row's greedy token: the largest logit of its last position. Given a generation's
        bindings, the head stays bound to `logits` and to a host array for the ids."""
        if bindings is None:
            return self._argmax.run({"logits": logits}, on_device=[], to_host=["argmax"])[1]["argmax"].tolist()
        if bindings.argmax_logits is not logits:
            bindings.token_ids = np.zeros(logits.shape()[0], np.int64)
            bindings.argmax_logits = logits
            bindings.argmax = self._argmax.bind({"logits": logits}, {"argmax": ort.OrtValue.ortvalue_from_numpy(bindings.token_ids)})
        bindings.argmax.run({})
        return bindings.token_ids.tolist()

    def last(self, logits: ort.OrtValue) -> np.ndarray:
        """Each row's last-position logits on the host, [batch, vocab] float32."""
        return self._last.run({"logits": logits}, on_device=[], to_host=["last"])[1]["last"].astype(np.float32, copy=False)

    def tokens(self, logits: ort.OrtValue) -> np.ndarray:
        """The greedy token of every position, [batch, positions] (on the device that holds them)."""
        return self._tokens.run({"logits": logits}, on_device=[], to_host=["tokens"])[1]["tokens"]

    @staticmethod
    def every(logits: ort.OrtValue) -> np.ndarray:
        """Every position's logits on the host, [batch, positions, vocab] float32."""
        return logits.numpy().astype(np.float32, copy=False)
