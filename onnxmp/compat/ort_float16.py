"""onnxruntime's ``onnxruntime.transformers.float16``: ``convert_float_to_float16`` with its
signature and defaults (1.19), onnxmp's conversion.

``from onnxmp.compat import ort_float16 as float16`` replaces
``from onnxruntime.transformers import float16``.  Differences: :mod:`onnxmp.compat`.
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

import numpy as np
import onnx

from onnxmp.compat._convert import convert_model, returned
from onnxmp.errors import OnnxMPError
from onnxmp.load import ModelLike, load

log = logging.getLogger("onnxmp.compat")

__all__ = ["DEFAULT_OP_BLOCK_LIST", "convert_float_to_float16"]

FP16_SUBNORMAL_MIN = 5.96e-08
FP16_MAX = float(np.finfo(np.float16).max)

# onnxruntime's list, for code that reads or extends it.  None (the default) does not mean this list
# here but onnxmp's own lists; passing it puts these ops on the deny list.
DEFAULT_OP_BLOCK_LIST = [
    'ArrayFeatureExtractor', 'Binarizer', 'CastMap', 'CategoryMapper', 'DictVectorizer', 'FeatureVectorizer',
    'Imputer', 'LabelEncoder', 'LinearClassifier', 'LinearRegressor', 'Normalizer', 'OneHotEncoder',
    'RandomUniformLike', 'SVMClassifier', 'SVMRegressor', 'Scaler', 'TreeEnsembleClassifier',
    'TreeEnsembleRegressor', 'ZipMap', 'NonMaxSuppression', 'TopK', 'RoiAlign', 'Range', 'CumSum', 'Min', 'Max',
    'Upsample',
]
try:  # the installed onnxruntime's own list where it ships one (1.32 added TreeEnsemble)
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST as _INSTALLED
except Exception:  # noqa: BLE001 - no onnxruntime, or one without the transformers tools
    _INSTALLED = None
if _INSTALLED is not None:
    DEFAULT_OP_BLOCK_LIST = list(_INSTALLED)


def convert_float_to_float16(
    model: ModelLike,
    min_positive_val: float = 5.96e-08,
    max_finite_val: float = 65504.0,
    keep_io_types: bool | list[str] = False,
    disable_shape_infer: bool = False,
    op_block_list: Iterable[str] | None = None,
    node_block_list: Iterable[str] | None = None,
    force_fp16_initializers: bool = False,
    force_fp16_inputs: Mapping[str, list[int]] | None = None,
    use_bfloat16_as_blocked_nodes_dtype: bool = False,
) -> onnx.ModelProto:
    """Convert ``model`` (a ModelProto or a path) to mixed float16 with onnxmp.

    ``keep_io_types``: True keeps every graph input and output float32, False makes every float32
    one float16, a list names those kept float32 (names the model lacks are ignored).  As in
    onnxruntime, ``min_positive_val`` below fp16's smallest subnormal or ``max_finite_val`` above
    65504 is an AssertionError, and with ``disable_shape_infer=True`` a ModelProto argument is
    updated in place as well as returned.

    ``force_fp16_initializers`` and ``force_fp16_inputs`` are accepted without effect: onnxmp
    never stores a value that a float32 node reads in float16 (the node stayed float32 to keep
    that value), and each op input's type follows its schema and the CUDA kernel.
    ``use_bfloat16_as_blocked_nodes_dtype=True`` (blocked nodes in bfloat16 inside an fp16
    model) is refused: onnxmp converts to one low-precision type.
    """
    assert min_positive_val >= FP16_SUBNORMAL_MIN, (
        "invalid min_positive_val. smallest positive float16 value: subnormal 5.96e-08, and normalized 6.104e-05")
    assert max_finite_val <= FP16_MAX, "invalid max_finite_val. largest float16 value: 65504"
    if use_bfloat16_as_blocked_nodes_dtype:
        raise OnnxMPError("use_bfloat16_as_blocked_nodes_dtype=True is not supported: onnxmp converts to one "
                          "low-precision type and keeps blocked nodes in float32",
                          hint="leave it False, or convert with onnxmp.convert(model, precision='bfloat16')")
    if force_fp16_initializers or force_fp16_inputs:
        log.warning("force_fp16_initializers / force_fp16_inputs have no effect in onnxmp: initializers read in "
                    "float32 stay float32, and op inputs follow their schema and kernel")
    proto = load(model)
    result = convert_model(proto, min_positive_val=min_positive_val, max_finite_val=max_finite_val,
                           keep_io_types=keep_io_types, op_block_list=op_block_list, node_block_list=node_block_list)
    return returned(model, result, disable_shape_infer)
