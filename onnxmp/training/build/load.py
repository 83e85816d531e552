"""Build stage ``load``'s checks: the model at an opset and IR version onnxruntime-training 1.19 loads,
small enough for its gradient builder, with its Constant-node weights as initializers."""
from __future__ import annotations

import functools
import logging
import os
from typing import Iterable

import onnx
import onnx.version_converter

from onnxmp.domains import is_onnx_domain, onnx_opset
from onnxmp.errors import OnnxMPError, first_line
from onnxmp.training._ort import MAX_OPSET, cap_ir_version
from onnxmp.training.nodes import attribute

log = logging.getLogger("onnxmp.training")


def check_trainable_size(model: onnx.ModelProto | str | os.PathLike) -> None:
    """Refuse a model whose weights and graph exceed protobuf's 2 GB limit, before reading any weight.

    onnxruntime-training 1.19.2 cannot differentiate it: onnxblock hands the forward model, weights
    included, to the C++ gradient builder as ONE serialized ModelProto
    (``onnxblock/_training_graph_utils.py``: ``GradientGraphBuilder(model.SerializeToString(), ...)``),
    and the training model it returns holds every weight again.  No external-data path exists there.
    """
    from onnxmp.external import PROTOBUF_LIMIT, data_bytes
    from onnxmp.load import load

    size = data_bytes(model if isinstance(model, onnx.ModelProto) else load(model, lazy_external=True))
    if size > PROTOBUF_LIMIT:
        raise OnnxMPError(
            f"the model is {size / 1e9:.2f} GB; onnxmp cannot build training artifacts over 2 GB (each gradient "
            f"builder takes or writes the whole model, weights included, as one serialized protobuf, which is "
            f"limited to 2 GB)",
            "train a model under 2 GB; convert, emulate and validate handle this one")


def supported_versions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` at an opset and IR version onnxruntime-training 1.19 loads."""
    opset = model_opset(model)
    if opset > MAX_OPSET:
        log.info("converting the model from opset %d to %d for onnxruntime-training 1.19", opset, MAX_OPSET)
        try:
            model = onnx.version_converter.convert_version(model, MAX_OPSET)
        except Exception as exc:
            raise OnnxMPError(f"the model uses opset {opset}; onnxruntime-training 1.19 loads at most {MAX_OPSET} "
                              f"and the conversion failed: {first_line(exc, 300)}",
                              f"export the model at opset <= {MAX_OPSET}") from None
    cap_ir_version(model)
    return model


def promote_constants(model: onnx.ModelProto, names: Iterable[str]) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` in which the ``Constant`` nodes producing ``names`` are initializers.

    Some exporters write weights as Constant nodes; ORT trains initializers only.
    The forward model keeps its Constant nodes, and :meth:`Trainer.export_inference`
    writes the trained values back into them.  Returns the copy and the names promoted.
    """
    wanted = set(names)
    initializers = {t.name for t in model.graph.initializer}
    constants = {n.output[0]: n for n in model.graph.node
                 if n.op_type == "Constant" and is_onnx_domain(n.domain) and n.output[0] in wanted
                 and n.output[0] not in initializers and attribute(n, "value", None) is not None}
    if not constants:
        return model, []
    result = onnx.ModelProto()
    result.CopyFrom(model)
    kept = [n for n in result.graph.node if not (n.op_type == "Constant" and n.output[0] in constants)]
    result.graph.ClearField("node")
    result.graph.node.extend(kept)
    for name, node in constants.items():
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attribute(node, "value", None))
        tensor.name = name
        result.graph.initializer.append(tensor)
    log.info("training %d Constant-node weight(s) as initializers", len(constants))
    return result, sorted(constants)


def model_opset(model: onnx.ModelProto) -> int:
    opset = onnx_opset(model)
    if opset is None:
        raise OnnxMPError("the model imports no default-domain opset", "re-export it with an opset")
    return opset


def ort_version() -> str:
    from onnxmp import runtime

    return runtime.version()


@functools.lru_cache(maxsize=None)
def runtime_loads_opset(opset: int) -> bool:
    """Whether the installed onnxruntime loads a model of default-domain ``opset`` (asked of it: an
    Identity model at that opset, the runtime being the judge)."""
    from onnx import TensorProto, helper

    from onnxmp import runtime

    probe = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "opset_probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
        opset_imports=[helper.make_opsetid("", opset)])
    cap_ir_version(probe)
    try:
        runtime.session(probe, what=f"opset {opset} probe")
    except OnnxMPError:  # onnxruntime's "opset N is under development / not supported" failures
        return False
    return True
