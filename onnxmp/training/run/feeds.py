"""What a batch feeds the graphs, and what onnxruntime says when a run fails.

:class:`Feeds` checks a batch against the manifest (arity, dtypes, the loss's labels) before
onnxruntime sees it, and :meth:`Feeds.run` turns onnxruntime's run errors into one
:class:`~onnxmp.errors.OnnxMPError` line: the batch's fault, a gradient of the wrong shape (named by
the contract's ``GRAD_SHAPE`` node), or a node of the graph.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

import numpy as np

from onnxmp import runtime
from onnxmp.errors import OnnxMPError
from onnxmp.training.artifacts import Artifacts
from onnxmp.training.contract import GRAD_SHAPE
from onnxmp.training.labels import check_labels, label_run_error
from onnxmp.training.losses import LOSSES


class Feeds:
    def __init__(self, artifacts: Artifacts):
        self.artifacts = artifacts
        self.names = artifacts.inputs
        self.dtypes = {name: np.dtype(d) for name, d in artifacts.manifest["input_dtypes"].items()}

    def __call__(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` in :attr:`Artifacts.inputs` order (model inputs, then labels), checked, by name."""
        names = self.names
        if len(arrays) != len(names):
            raise OnnxMPError(f"a batch needs {len(names)} arrays ({', '.join(names)}), got {len(arrays)}")
        manifest = self.artifacts.manifest
        label = manifest["label_input"]
        checked = {}
        for name, array in zip(names, arrays):
            if name == label and isinstance(manifest.get("loss"), str) and manifest["loss"] in LOSSES:
                rows = len(arrays[0]) if len(arrays) > 1 else len(array)
                array = check_labels(manifest["loss"], array, rows=rows, shape=manifest.get("output_shape", []),
                                     options=manifest.get("loss_options"))
            elif np.asarray(array).dtype.kind not in "biuf":
                raise OnnxMPError(f"input {name} has dtype {np.asarray(array).dtype}; the model wants "
                                  f"{self.dtypes[name]}")
            checked[name] = np.ascontiguousarray(array, dtype=self.dtypes[name])
        return checked

    def run(self, graph: str, call: Callable[[Mapping[str, np.ndarray]], object], feeds: Mapping[str, np.ndarray]):
        """``call(feeds)`` (an engine's ``train`` or ``evaluate``), its onnxruntime errors as one line."""
        try:
            return call(feeds)
        except OnnxMPError:
            raise
        except Exception as exc:  # ORT's errors (RuntimeError natively, pybind's Fail... otherwise)
            raise self.run_error(str(exc), graph) from None

    def run_error(self, text: str, graph: str) -> OnnxMPError:
        """ORT's run error as a one-line OnnxMPError.  ORT checks the feeds against the graph's
        inputs before it runs a node: only such an error is the batch's fault for sure.  One
        from a node may still come from the batch (labels the loss rejects), or from the graph."""
        err = label_run_error(text, self.names)
        if err:
            return err
        inputs = f"inputs are {', '.join(self.names)} with dtypes {self.artifacts.manifest['input_dtypes']}"
        node = re.search(r"while running (\S+) node\. Name:'([^']*)'", text)
        if node is None:
            return OnnxMPError(f"onnxruntime rejected the batch: {runtime.reason(text, node=False)}", inputs)
        op_type, name = node.groups()
        if name.startswith(GRAD_SHAPE):
            param = name[len(GRAD_SHAPE):]
            return OnnxMPError(f"onnxruntime computed a gradient of the wrong shape for parameter {param!r}: "
                               f"{runtime.reason(text, node=False)}",
                               f"one of its gradient builders did not sum it back over a broadcast; train without "
                               f"it (frozen=[{param!r}]) and report the model")
        where = f"{op_type} node {name!r}" if name else f"a {op_type} node onnxruntime added"
        return OnnxMPError(f"onnxruntime failed in {where} of the {graph} graph: {runtime.reason(text, node=False)}",
                           f"if the batch is right ({inputs}), the artifacts are at fault: rebuild them "
                           "with this onnxmp version, and report the model if it persists")
