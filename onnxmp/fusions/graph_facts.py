"""What onnxruntime's fusion matchers read of one graph (:class:`GraphFacts`), restated so that
onnxmp's matchers (:mod:`onnxmp.fusions.norms`, :mod:`onnxmp.fusions.gelus`) ask the same questions
ORT's graph_utils and optimizer_utils ask."""
from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from typing import Callable, Mapping

import onnx

from onnxmp.domains import is_onnx_domain

FLOAT = onnx.TensorProto.FLOAT
_SUPPORTED = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                        onnx.TensorProto.BFLOAT16})


class Lookup:
    """A ``name -> value or None`` function as a mapping's ``get``, for GraphFacts' types and shapes."""

    def __init__(self, read: Callable[[str], object]):
        self._read = read

    def get(self, name: str, default=None):
        value = self._read(name)
        return default if value is None else value


class GraphFacts:
    """What the matchers read of one graph: producers, consumer edges, constants, ranks and types.

    ``types`` and ``shapes`` may be given, anything with a mapping's ``get`` (the coloring passes
    the index's, as :class:`Lookup`; ``scripts/bench_speed.py`` the fp32 run's); otherwise they are
    read from the graph's declarations and initializers.  Everything but the op types is
    built on first use: most graphs hold none of the ops a matcher starts from, and those pay one
    pass over their node list (the matchers ask :meth:`has` first)."""

    def __init__(self, graph: onnx.GraphProto, types: Mapping[str, int] | None = None,
                 shapes: Mapping[str, tuple] | None = None, outer_constants: Mapping[str, onnx.TensorProto] = {}):
        self.graph = graph
        self.nodes = list(graph.node)
        self.op_types = {node.op_type for node in self.nodes if is_onnx_domain(node.domain)}
        self._given_types, self._given_shapes, self._outer = types, shapes, outer_constants

    def has(self, *op_types: str) -> bool:
        """Whether the graph holds a node of every one of ``op_types`` (ai.onnx domain)."""
        return self.op_types.issuperset(op_types)

    @cached_property
    def producer(self) -> dict[str, int]:
        return {name: k for k, node in enumerate(self.nodes) for name in node.output if name}

    @cached_property
    def edges(self) -> dict[str, list[int]]:
        """Tensor -> the reading nodes, one per input slot."""
        edges: dict[str, list[int]] = defaultdict(list)
        for k, node in enumerate(self.nodes):
            for name in node.input:
                if name:
                    edges[name].append(k)
        return edges

    @cached_property
    def position(self) -> dict[str, int]:
        """Node name -> its place in ``nodes`` (what the matchers return are names)."""
        return {node.name: k for k, node in enumerate(self.nodes)}

    @cached_property
    def graph_outputs(self) -> set[str]:
        return {v.name for v in self.graph.output}

    @cached_property
    def constants(self) -> dict[str, onnx.TensorProto]:
        constants: dict[str, onnx.TensorProto] = dict(self._outer)
        constants.update((t.name, t) for t in self.graph.initializer)
        for node in self.nodes:
            if node.op_type == "Constant" and is_onnx_domain(node.domain):
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    constants[node.output[0]] = value
        return constants

    @cached_property
    def _declared(self) -> tuple[dict[str, int], dict[str, tuple]]:
        types, shapes = {}, {}
        for v in (*self.graph.input, *self.graph.value_info, *self.graph.output):
            t = v.type.tensor_type
            if v.type.WhichOneof("value") == "tensor_type":
                types.setdefault(v.name, t.elem_type)
                if t.HasField("shape"):
                    shapes.setdefault(v.name, tuple(
                        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim))
        for name, tensor in self.constants.items():
            types.setdefault(name, tensor.data_type)
            shapes.setdefault(name, tuple(tensor.dims))
        return types, shapes

    @cached_property
    def types(self) -> Mapping[str, int]:
        return self._declared[0] if self._given_types is None else self._given_types

    @cached_property
    def shapes(self) -> Mapping[str, tuple]:
        """Dims: ints, dim_param strings, None where unknown."""
        return self._declared[1] if self._given_shapes is None else self._given_shapes

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        if shape is None and name in self.constants:  # a constant no declaration describes
            shape = self.constants[name].dims
        return None if shape is None else len(shape)

    # -- what ORT's graph_utils and optimizer_utils ask -------------------------------------------
    def op(self, k: int, op_type: str) -> bool:
        if k < 0:
            return False
        node = self.nodes[k]
        return node.op_type == op_type and is_onnx_domain(node.domain)

    def out_edges(self, k: int) -> int:
        """Node.GetOutputEdgesCount: one edge per reading input slot."""
        return sum(len(self.edges.get(name, ())) for name in self.nodes[k].output if name)

    def check_out_edges(self, k: int, count: int) -> bool:
        """optimizer_utils::CheckOutputEdges: exactly ``count`` edges and no graph output."""
        return self.out_edges(k) == count and not self.writes_graph_output(k)

    def shapes_equal(self, a: str, b: str) -> bool:
        """Both shapes known and the same, dim by dim: the same value or the same dim_param."""
        sa, sb = self.shapes.get(a), self.shapes.get(b)
        return sa is not None and sa == sb and None not in sa

    def writes_graph_output(self, k: int) -> bool:
        return any(name in self.graph_outputs for name in self.nodes[k].output)

    def children(self, k: int) -> list[int]:
        """Consumers of node ``k``, one per edge, in node order."""
        return sorted(c for name in self.nodes[k].output if name for c in self.edges.get(name, ()))

    def first_child(self, k: int, op_type: str) -> int | None:
        return next((c for c in self.children(k) if self.op(c, op_type)), None)

    def parent(self, k: int, index: int) -> int | None:
        inputs = self.nodes[k].input
        return self.producer.get(inputs[index]) if index < len(inputs) else None

    def parents(self, k: int) -> list[int]:
        return [p for name in self.nodes[k].input if name and (p := self.producer.get(name)) is not None]

    def first_parent(self, k: int, op_type: str) -> int | None:
        return next((p for p in self.parents(k) if self.op(p, op_type)), None)

    def supported(self, k: int, inputs: int | None = None) -> bool:
        """IsSupportedDataType: every (or the first ``inputs``) input is float16/32/64 or bfloat16;
        an input of unknown type passes (ORT knows it; the caller's types may not)."""
        names = self.nodes[k].input[:inputs] if inputs is not None else self.nodes[k].input
        return all(self.types.get(name, FLOAT) in _SUPPORTED for name in names if name)

    def scalar(self, name: str) -> float | None:
        tensor = self.constants.get(name)
        if tensor is None:
            return None
        values = onnx.numpy_helper.to_array(tensor)
        return float(values.reshape(-1)[0]) if values.size == 1 else None

    def axes(self, k: int) -> list[int] | None:
        """The ``axes`` of a ReduceMean: the attribute, or (opset 18) a constant second input."""
        node = self.nodes[k]
        for attr in node.attribute:
            if attr.name == "axes":
                return list(attr.ints)
        if len(node.input) > 1 and node.input[1] in self.constants:
            return [int(a) for a in onnx.numpy_helper.to_array(self.constants[node.input[1]]).reshape(-1)]
        return None
