"""The quantization algorithms: one entry each in ALGORITHMS, whose names are `--algorithm`'s
choices and whose fields are what the quantize stage (quantize.py, kquant.py) and the streamed
export read of them. A new algorithm is one entry here and, where it rounds in a new way, its
config. Light to import (the CLI reads the names without the export extra)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """How an algorithm rounds MatMul weights, as the stages read it (one entry of ALGORITHMS,
    whose names are --algorithm's choices). `searches`: each block fitted from activations
    (export/kquant.py), with the inputs' Hessian where `hessian` (gptq); `calibration`: when it runs
    the fp32 graph over a calibration text, "always" (gptq: the built-in text unless one is given),
    "given" (where one is given) or "never"; `float_zeros`: its zero points are floats (HQQ's), which
    ONNX Runtime's GatherBlockQuantized does not take, so a tied lm_head is rounded to nearest in a
    pass of its own and ONNX Runtime's HQQ quantizer, which reads each weight whole, does the rest.
    `about`: what it does, in the words of --algorithm's help."""

    name: str
    about: str = ""
    searches: bool = False
    hessian: bool = False
    calibration: str = "never"
    float_zeros: bool = False

    @property
    def takes_symmetric(self) -> bool:
        """Blocks without zero points: only where the algorithm fits none."""
        return not self.searches and not self.float_zeros

    def config(self, bits: int, block: int, symmetric: bool, level: int):
        """ONNX Runtime's weight-only config for a pass of this algorithm."""
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, HQQWeightOnlyQuantConfig

        if self.float_zeros:
            return HQQWeightOnlyQuantConfig(block_size=block, bits=bits)
        return DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, accuracy_level=level, bits=bits)


ALGORITHMS = {
    a.name: a
    for a in (
        Algorithm("rtn", "round to nearest"),
        Algorithm(
            "k_quant", "searches each block's scale, weighted by --calibration's activations where given", True, calibration="given"
        ),
        Algorithm("gptq", "spreads each weight's error over the rest, from --calibration's activations", True, True, "always"),
        Algorithm("hqq", "float zero points: ONNX Runtime's CPU kernel decodes them slowly", float_zeros=True),
    )
}
