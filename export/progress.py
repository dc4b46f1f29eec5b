"""The export's stages as the user sees them: "[i/n] name" when one starts, its time when it ends, a
live line on a terminal, and a failure inside one named with its stage."""

from __future__ import annotations

import functools
import shutil
import threading
import time
from contextlib import contextmanager

from edgeinfer.sdk.errors import EdgeInferError, ExportError
from edgeinfer.sdk.memory import give_back_freed_memory

from .source import first_line

_OPTIONAL_STAGES = {
    "fuse": "--no-fuse exports without this stage",
    "fp16": "an fp32 export skips this stage",
    "quantize": "an export without --quantize skips this stage",
    "split": "the default layout (--graphs single) skips this stage",
    "adapters": "an export without --adapter skips this stage",
}


@functools.cache
def _stage_failures() -> tuple[type[Exception], ...]:
    """What a stage's libraries (torch, transformers, onnx, ONNX Runtime) raise on a model
    they cannot handle: Python's own kinds, onnx's checker and shape inference errors, and ONNX
    Runtime's status errors (which derive from Exception alone)."""
    import onnx.checker
    import onnx.shape_inference
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    ort = [kind for kind in vars(ort_errors).values() if isinstance(kind, type) and issubclass(kind, Exception)]
    return (
        ArithmeticError,
        AssertionError,
        AttributeError,
        ImportError,
        LookupError,
        MemoryError,
        RuntimeError,
        TypeError,
        ValueError,
        onnx.checker.ValidationError,
        onnx.shape_inference.InferenceError,
        *ort,
    )


class Stages:
    """The stages in order: "[i/n] name" when one starts, "name: done in X s" when it ends, and, on
    a terminal (`live`), one line redrawn twice a second with what the stage is doing and for how long."""

    def __init__(self, say, names: list[str], live=None):
        self._say, self.names, self.index, self.live = say, names, 0, live
        self._lock, self._status, self._drawn, self._began = threading.Lock(), None, 0, time.perf_counter()

    @property
    def total(self) -> float:
        return time.perf_counter() - self._began

    def say(self, message: str) -> None:
        with self._lock:
            self._clear()
            self._say(message)

    def progress(self, doing: str, fraction: float | None = None) -> None:
        """What the stage is doing now, and how far along it is (0 to 1) where that is known."""
        if self._status is not None:
            self._status = (self._status[0], self._status[1], doing, fraction)

    @contextmanager
    def __call__(self, name: str):
        self.index += 1
        self.say(f"[{self.index}/{len(self.names)}] {name}")
        start = time.perf_counter()
        self._status = (name, start, "", None)
        ticker = _Ticker(self._draw) if self.live is not None else None
        try:
            yield
        except (EdgeInferError, OSError):  # the stages' own errors, and the file system's (export_model)
            raise
        except _stage_failures() as e:  # anything else is a bug: one line that says so, the traceback kept as the cause
            around = f"; {_OPTIONAL_STAGES[name]}" if name in _OPTIONAL_STAGES else ""
            raise ExportError(
                f"the {name} stage failed with {type(e).__name__}: {first_line(e)}: this is a bug in edgeinfer, "
                f"please report it with the output of --debug{around}"
            ) from e
        finally:
            if ticker:
                ticker.stop()
            self._status = None
            with self._lock:
                self._clear()
            give_back_freed_memory()
        self.say(f"      {name}: done in {time.perf_counter() - start:.1f} s")

    def _draw(self) -> None:
        with self._lock:
            if self._status is None:
                return
            name, start, doing, fraction = self._status
            line = f"      {name}: {time.perf_counter() - start:.0f} s" + (f", {doing}" if doing else "")
            if fraction is not None:
                line += f" ({fraction:.0%})"
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self._clear()
            self.live.write(line[:width])
            self.live.flush()
            self._drawn = len(line[:width])

    def _clear(self) -> None:
        if self._drawn and self.live is not None:
            self.live.write("\r" + " " * self._drawn + "\r")
            self.live.flush()
            self._drawn = 0


class _Ticker:
    """Calls `draw` twice a second on a daemon thread until stopped."""

    def __init__(self, draw):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(draw,), daemon=True, name="edgeinfer-export-progress")
        self._thread.start()

    def _run(self, draw) -> None:
        while not self._stop.wait(0.5):
            draw()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
