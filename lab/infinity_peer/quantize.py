"""The dense peer's model: `headbudget export --format onnx` quantized with optimum's AVX2 dynamic recipe.

Runs in an environment with infinity-emb 0.0.78 and optimum (not the project's: optimum-onnx needs
transformers < 4.58):

    headbudget export --model CKPT --budget 1 --format onnx --precision fp32 --out PEER/fp32
    python lab/infinity_peer/quantize.py PEER/fp32 PEER/int8

The export fuses some operators the ONNX Runtime way (FusedMatMul, Gelu), which ONNX's shape inference cannot
type; the quantizer is told that an untyped tensor is float (its ``DefaultTensorType`` option), nothing else
changes in optimum's recipe.
"""

from __future__ import annotations

import inspect
import shutil
import sys
from pathlib import Path
from typing import Any

import onnx
from onnxruntime.quantization import onnx_quantizer
from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig

_init = onnx_quantizer.ONNXQuantizer.__init__


def _float_by_default(self: Any, *args: Any, **kwargs: Any) -> None:
    bound = dict(zip(list(inspect.signature(_init).parameters)[1:], args, strict=False)) | kwargs
    bound["extra_options"] = {**(bound.get("extra_options") or {}), "DefaultTensorType": onnx.TensorProto.FLOAT}
    _init(self, **bound)


def main(src: Path, out: Path) -> None:
    onnx_quantizer.ONNXQuantizer.__init__ = _float_by_default
    quantizer = ORTQuantizer.from_pretrained(src, file_name="model.onnx")
    quantizer.quantize(save_dir=out, quantization_config=AutoQuantizationConfig.avx2(is_static=False,
                                                                                      per_channel=False))
    for f in src.iterdir():  # the tokenizer and config beside the quantized model
        if f.suffix != ".onnx" and not (out / f.name).exists():
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: quantize.py EXPORTED_FOLDER OUT_FOLDER")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
