"""Where onnxruntime's CUDA EP would run each node of a graph, and what crosses host and device.

No GPU is needed: the placement is simulated from onnxruntime's own rules, as its sources state them
(``onnxmp/data/ort_cuda_placement.json``, ``scripts/gen_cuda_placement.py`` names the files and
commits read):

1. *Level-1 constant folding* runs before partitioning: a node whose inputs are all constants
   (initializers, Constants, ``Shape``/``Size`` of a static shape) never runs
   (:func:`~onnxmp.training.build.autodiff.fold.fold_constants` computes the same set).
2. *Kernel lookup* (``CUDAExecutionProvider::GetCapability``): a node runs on the CUDA EP only where
   a CUDA kernel takes its op at its opset and the element types of its tensors (the float types from
   :class:`onnxmp.kernels.KernelTable`, the others from ``int_types``); otherwise on the CPU EP.
3. *GetCpuPreferredNodes* (``fallback_cpu_capability.cc``) moves shape arithmetic to the CPU: starting
   from the consumers of every CPU-memory output of a CUDA node (``Shape``, ``Size``), in topological
   order, a node goes to the CPU when each input is a small initializer (at most 100 elements), a graph
   input, or a CPU tensor that its CUDA kernel would *not* take in CPU memory, and none is
   float16/bfloat16; its consumers become candidates in turn.  A CPU-EP node (no kernel) makes its
   outputs CPU tensors and its consumers candidates too.
4. *Memcpy insertion*: a CPU tensor read by a CUDA kernel's device-memory input is copied host to
   device (``MemcpyFromHost``) on every run; a device tensor read by a CPU node or by a CUDA kernel's
   CPU-memory input (``Reshape``'s shape, ``Slice``'s starts ...) is copied device to host, a sync.

:func:`place` returns both sets of copies and ``feed``: the CPU-placed nodes whose results reach a
host-to-device copy, the shape arithmetic that feeds device data inside the step.  Graph inputs and
initializers are where their consumers need them (fed or uploaded once), so they cost no copy here.
"""
from __future__ import annotations

import functools
import heapq
import json
from dataclasses import dataclass, field
from importlib import resources

import numpy as np
import onnx

from onnxmp.domains import is_onnx_domain
from onnxmp.kernels import ContribSchemas, KernelTable
from onnxmp.normalize import infer_tensor_types

CUDA = "CUDAExecutionProvider"
_FLOATS = frozenset({"float", "double", "float16", "bfloat16"})  # what KernelTable answers for


@functools.cache
def facts() -> dict:
    """The packaged CUDA placement facts (``ort_cuda_placement.json``)."""
    return json.loads(resources.files("onnxmp").joinpath("data", "ort_cuda_placement.json").read_text("utf-8"))


def _in_range(rows, opset: int, since=lambda r: r[0], until=lambda r: r[1]):
    for row in reversed(rows):
        if since(row) <= opset and (until(row) is None or opset <= until(row)):
            return row
    return None


def memory_types(domain: str, op_type: str, opset: int) -> tuple[frozenset[int], frozenset[int]]:
    """(inputs, outputs) the CUDA kernel of ``op_type`` at ``opset`` keeps in CPU memory."""
    rows = facts()["memory"].get(domain or "ai.onnx", {}).get(op_type, [])
    row = _in_range(rows, opset, lambda r: r["since"], lambda r: r["until"])
    return (frozenset(row["cpu_inputs"]), frozenset(row["cpu_outputs"])) if row else (frozenset(), frozenset())


def _type_name(elem_type: int) -> str | None:
    """onnx's element type as the kernel tables name it (``float``, ``int64``, ``bfloat16``)."""
    return onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type else None


def _formals(node: onnx.NodeProto, opset: int):
    """(input type strings, output type strings) of ``node``'s schema, per position; None if unknown."""
    domain = node.domain or ""
    try:
        schema = (onnx.defs.get_schema(node.op_type, opset, domain) if is_onnx_domain(domain)
                  else ContribSchemas.default().schema(node.op_type, domain, opset))
    except onnx.defs.SchemaError:
        schema = None
    if schema is None:
        return None

    def spread(formals, count):
        strs = [f.type_str for f in formals]
        return [strs[min(i, len(strs) - 1)] for i in range(count)] if strs else []
    return spread(schema.inputs, len(node.input)), spread(schema.outputs, len(node.output))


class CudaKernels:
    """Does the CUDA EP register a kernel for a node (op, opset, element types)."""

    def __init__(self, table: KernelTable | None = None):
        self.table = table or KernelTable.default()
        self.ints = facts()["int_types"]

    def runs(self, node: onnx.NodeProto, opset: int, types: dict[str, int]) -> bool:
        domain = node.domain or "ai.onnx"
        if domain == "ai.onnx.ml" or not self.table.has_kernel(CUDA, domain, node.op_type, opset):
            return False
        formals = _formals(node, opset)
        if formals is None:
            return True
        int_row = _in_range(self.ints.get(domain, {}).get(node.op_type, []), opset)
        int_params = int_row[2] if int_row else {}
        for names, strs in ((node.input, formals[0]), (node.output, formals[1])):
            for name, param in zip(names, strs):
                dtype = _type_name(types.get(name, 0)) if name else None
                if dtype is None or param.startswith("tensor("):
                    continue
                if dtype in _FLOATS:
                    if self.table.supports(CUDA, domain, node.op_type, opset, param, dtype) is False:
                        return False
                elif param in int_params and dtype not in int_params[param]:
                    return False
        return True


@dataclass
class Placement:
    """The CUDA EP's placement of one graph (node indices into ``graph.node``)."""

    cpu: set[int] = field(default_factory=set)          # on the CPU EP (no CUDA kernel, or CPU-preferred)
    preferred: set[int] = field(default_factory=set)    # of those, moved by GetCpuPreferredNodes
    folded: set[int] = field(default_factory=set)       # constant-folded before partitioning
    copies: dict[str, list[int]] = field(default_factory=dict)   # host->device: value -> CUDA consumers
    to_host: dict[str, list[int]] = field(default_factory=dict)  # device->host: value -> consumers
    feed: set[int] = field(default_factory=set)         # CPU nodes whose results reach a host->device copy
    bool_values: frozenset[str] = frozenset()           # the graph's bool tensors (masks)
    values: dict = field(default_factory=dict)          # the constants' values (small ones, folded ones)
    shapes: dict = field(default_factory=dict)          # value -> dims (int, or a name/None where dynamic)

    def summary(self) -> dict:
        return {"copies": len(self.copies), "feed": len(self.feed), "to_host": len(self.to_host),
                "cpu": len(self.cpu)}


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {(o.domain or "ai.onnx"): o.version for o in model.opset_import}


def _shapes(types: dict[str, onnx.TypeProto]) -> dict[str, tuple | None]:
    out = {}
    for name, tp in types.items():
        if tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
            out[name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                              for d in tp.tensor_type.shape.dim)
    return out


def place(model: onnx.ModelProto, kernels: CudaKernels | None = None) -> Placement:
    """The CUDA EP's placement of ``model``'s main graph (nodes in topological order)."""
    from onnxmp.training.build.autodiff.fold import fold_constants, initial_values

    kernels = kernels or CudaKernels()
    graph = model.graph
    opsets = _opsets(model)
    tps = infer_tensor_types(model)
    types = {n: tp.tensor_type.elem_type for n, tp in tps.items() if tp.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in graph.initializer})
    constant = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in graph.initializer}
    shapes = _shapes(tps)
    folded_values = fold_constants(graph, model.opset_import, shapes, initial_values(graph))
    result = Placement(bool_values=frozenset(n for n, t in types.items() if t == onnx.TensorProto.BOOL),
                       values=folded_values, shapes=shapes)
    nodes = list(graph.node)
    for i, node in enumerate(nodes):
        outs = [o for o in node.output if o]
        if outs and all(o in folded_values for o in outs) and node.op_type != "Constant":
            result.folded.add(i)
        if node.op_type == "Constant" or i in result.folded:
            constant.update({o: int(np.asarray(folded_values[o]).size) if o in folded_values else 1 << 30
                             for o in outs})
    graph_inputs = {v.name for v in graph.input} - set(constant)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            if name:
                consumers.setdefault(name, []).append(i)

    live = [i for i, n in enumerate(nodes) if i not in result.folded and n.op_type != "Constant"]
    opset = {i: opsets.get(nodes[i].domain or "ai.onnx", 1) for i in live}
    cuda = {i for i in live if kernels.runs(nodes[i], opset[i], types)}
    result.cpu = set(live) - cuda
    memory = {i: memory_types(nodes[i].domain, nodes[i].op_type, opset[i]) for i in cuda}
    result.preferred = _cpu_preferred(nodes, cuda, result.folded, memory, consumers, types, constant, graph_inputs)
    result.cpu |= result.preferred
    cuda -= result.preferred

    def on_cpu(name: str) -> bool | None:
        """Where ``name`` lives: True on the host, False on the device, None anywhere (constant, input)."""
        if name in constant or name in graph_inputs or name not in producer:
            return None
        i = producer[name]
        if i in result.cpu:
            return True
        return list(nodes[i].output).index(name) in memory[i][1]

    for i in live:
        for k, name in enumerate(nodes[i].input):
            where = on_cpu(name) if name else None
            if where is None:
                continue
            wants_host = i in result.cpu or k in memory[i][0]
            if where and not wants_host:
                result.copies.setdefault(name, []).append(i)
            elif not where and wants_host:
                result.to_host.setdefault(name, []).append(i)
    # feed: the CPU nodes upstream of a copied value, through CPU nodes
    stack = [producer[name] for name in result.copies]
    while stack:
        i = stack.pop()
        if i in result.feed or i not in result.cpu:
            continue
        result.feed.add(i)
        stack.extend(producer[n] for n in nodes[i].input if n in producer)
    return result


def _cpu_preferred(nodes, cuda: set[int], folded: set[int], memory: dict, consumers: dict, types: dict,
                   constant: dict, graph_inputs: set[str]) -> set[int]:
    """GetCpuPreferredNodes: the CUDA candidates ``cuda`` that go to the CPU (see the module's docstring)."""
    rules = facts()["cpu_preferred"]
    small, device_types = rules["small_initializer_elements"], set(rules["device_types"])
    queue: list[int] = []
    cpu_args: set[str] = set()
    for i in sorted(cuda):
        for k, name in enumerate(nodes[i].output):
            if name and k in memory[i][1]:
                cpu_args.add(name)
                queue.extend(consumers.get(name, ()))
    heapq.heapify(queue)  # node indices are the topological order: the lowest first, as ORT's queue
    visited: set[int] = set()
    chosen: set[int] = set()
    while queue:
        i = heapq.heappop(queue)
        if i in visited:
            continue
        visited.add(i)
        node = nodes[i]
        if i not in cuda:
            # a CPU-EP node (no CUDA kernel): its outputs are CPU tensors (folded nodes never run)
            if i not in folded and node.op_type != "Constant":
                cpu_args.update(o for o in node.output if o)
                for o in node.output:
                    for c in consumers.get(o, ()):
                        heapq.heappush(queue, c)
            continue
        place_in_cpu = True
        for k, name in enumerate(node.input):
            if name and _type_name(types.get(name, 0)) in device_types:
                place_in_cpu = False
                break
            if name and (constant.get(name, small + 1) <= small or name in graph_inputs):
                continue
            if not name or name not in cpu_args or k in memory[i][0]:
                place_in_cpu = False
                break
        if place_in_cpu:
            chosen.add(i)
            cpu_args.update(o for o in node.output if o)
            for o in node.output:
                for c in consumers.get(o, ()):
                    heapq.heappush(queue, c)
    return chosen

