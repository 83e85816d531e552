"""onnxconverter-common's ``float16`` module: ``convert_float_to_float16`` and
``convert_float_to_float16_model_path``, same signatures and defaults (1.16), onnxmp's conversion.

What each argument does here, and every difference from the original, is in
:mod:`onnxmp.compat` and docs/compat.md.
"""
from __future__ import annotations

import os
from typing import Iterable

import onnx

from onnxmp.compat._convert import check_fp16_ready as _check_fp16_ready
from onnxmp.compat._convert import convert_model, returned
from onnxmp.load import ModelLike, load

__all__ = ["DEFAULT_OP_BLOCK_LIST", "convert_float_to_float16", "convert_float_to_float16_model_path"]

# onnxconverter-common's list, for code that reads or extends it.  None (the default) does not mean this list
# here but onnxmp's own lists; passing it puts these ops on the deny list.
DEFAULT_OP_BLOCK_LIST = [
    'ArrayFeatureExtractor', 'Binarizer', 'CastMap', 'CategoryMapper', 'DictVectorizer', 'FeatureVectorizer',
    'Imputer', 'LabelEncoder', 'LinearClassifier', 'LinearRegressor', 'Normalizer', 'OneHotEncoder',
    'RandomUniformLike', 'SVMClassifier', 'SVMRegressor', 'Scaler', 'TreeEnsembleClassifier',
    'TreeEnsembleRegressor', 'ZipMap', 'NonMaxSuppression', 'TopK', 'RoiAlign', 'Resize', 'Range', 'CumSum',
    'Min', 'Max', 'Upsample',
]


def convert_float_to_float16(
    model: ModelLike,
    min_positive_val: float = 1e-7,
    max_finite_val: float = 1e4,
    keep_io_types: bool = False,
    disable_shape_infer: bool = False,
    op_block_list: Iterable[str] | None = None,
    node_block_list: Iterable[str] | None = None,
    check_fp16_ready: bool = True,
) -> onnx.ModelProto:
    """Convert ``model`` to mixed float16 with onnxmp.

    As in onnxconverter-common: ``keep_io_types=False`` makes every float32 graph input and
    output float16; ``True`` keeps them float32.  A model that already holds float16 raises
    ValueError unless ``check_fp16_ready=False``.  The converted model is returned; with
    ``disable_shape_infer=True`` a ModelProto argument is also updated in place (the original
    edits it in place then).  Values are never clamped: a node reading a float32 initializer
    outside ``[min_positive_val, max_finite_val]`` stays float32 instead.
    """
    proto = load(model)
    if check_fp16_ready:
        _check_fp16_ready(proto)
    result = convert_model(proto, min_positive_val=min_positive_val, max_finite_val=max_finite_val,
                           keep_io_types=keep_io_types, op_block_list=op_block_list, node_block_list=node_block_list)
    return returned(model, result, disable_shape_infer)


def convert_float_to_float16_model_path(
    model_path: str | os.PathLike,
    min_positive_val: float = 1e-7,
    max_finite_val: float = 1e4,
    keep_io_types: bool = False,
) -> onnx.ModelProto:
    """Convert the model at ``model_path`` (external data included) and return it; nothing is written.

    The original runs shape inference on a temporary file beside the model so that models
    over 2 GB work; onnxmp's pipeline never needs the whole model in one protobuf message.
    """
    return convert_float_to_float16(load(model_path), min_positive_val, max_finite_val, keep_io_types)
