"""Drop-in replacements for onnxconverter-common's float16 API and onnxruntime's float16 converter.

Replace ::

    from onnxconverter_common import float16, auto_mixed_precision, auto_mixed_precision_model_path
    from onnxruntime.transformers import float16 as ort_float16

with ::

    from onnxmp.compat import float16, auto_mixed_precision, auto_mixed_precision_model_path
    from onnxmp.compat import ort_float16

The functions keep the originals' signatures, defaults and contracts (the I/O types a caller
feeds and reads, in-place updates, files written, ValueError/TypeError/AssertionError where the
originals raise them); onnxmp's algorithm does the work: TF's AMP coloring instead of "everything
not blocked goes fp16", and for the ``auto_`` forms onnxmp's calibration search instead of the
block-list bisection.  Differences on purpose (the full table is docs/compat.md):

* **No clamping.**  The originals clamp initializer values into ``[min_positive_val,
  max_finite_val]`` (a BatchNorm variance of 9.8e7 becomes 1e4).  onnxmp never changes a value: a
  node of the allow, infer or clear list reading a float32 constant with a finite
  ``|value| > max_finite_val``, or with more than half of its non-zero values below
  ``min_positive_val``, stays float32.  fp16's own limits always apply too.
* **Not everything goes fp16**: only what TF's AMP lists and the CUDA kernels allow.  The graph's
  interface still follows ``keep_io_types`` exactly: with False every float32 input and output is
  float16 even when nothing else converts (a Cast inside bridges to float32 nodes).
* **op_block_list** puts ops on the deny list (they also keep the infer/clear ops they feed in
  float32, as TF's deny list does); None means onnxmp's lists, not the originals'
  ``DEFAULT_OP_BLOCK_LIST``.  An entry that is no known op type is an error with a close match.
* **node_block_list** names nodes kept float32 (exact names); a name no node has is a warning.
* **keep_io_types** as a list (onnxruntime's form) names inputs/outputs kept float32; names the
  model lacks are ignored with a warning.
* ``disable_shape_infer`` changes nothing in how onnxmp converts (its inference tolerates
  failures); it keeps the originals' in-place update of a ModelProto argument.
* A path or serialized bytes are accepted wherever the originals want a ModelProto.  Nodes and
  initializers no graph output depends on are dropped.
"""
from __future__ import annotations

from onnxmp.compat import auto_mixed_precision, auto_mixed_precision_model_path, float16, ort_float16
from onnxmp.compat._convert import CompatError
from onnxmp.compat.auto_mixed_precision import auto_convert_mixed_precision
from onnxmp.compat.auto_mixed_precision_model_path import auto_convert_mixed_precision_model_path
from onnxmp.compat.float16 import convert_float_to_float16, convert_float_to_float16_model_path

__all__ = ["CompatError", "auto_convert_mixed_precision", "auto_convert_mixed_precision_model_path",
           "auto_mixed_precision", "auto_mixed_precision_model_path", "convert_float_to_float16",
           "convert_float_to_float16_model_path", "float16", "ort_float16"]
