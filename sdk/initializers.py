"""An export's initializers read from its external data files, without ONNX Runtime: each file is
mapped once, and an array is a view of the mapping (nothing is copied until the caller copies)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class ExternalData:
    """Initializers of a graph in `folder`, from the data files their entries name."""

    def __init__(self, folder: Path):
        self.folder, self.files = folder, {}

    def array(self, tensor) -> np.ndarray:
        from onnx import numpy_helper
        from onnx.external_data_helper import uses_external_data
        from onnx.helper import tensor_dtype_to_np_dtype

        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)
        info = {entry.key: entry.value for entry in tensor.external_data}
        path = self.folder / info["location"]
        if path not in self.files:
            self.files[path] = np.memmap(path, dtype=np.uint8, mode="r")
        start = int(info.get("offset", 0))
        raw = self.files[path][start : start + int(info["length"])]
        return raw.view(tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tuple(tensor.dims))
