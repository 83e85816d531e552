"""The simulated CUDA EP placement (onnxmp.training.build.placement) on small graphs."""
from __future__ import annotations

import onnx
import onnx.parser

from onnxmp.training.build.placement import memory_types, place
from placement_graphs import HEAD, divide_by_first_dim, parsed


def _model(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


def _ops(model, indices):
    return sorted(model.graph.node[i].op_type for i in indices)


def test_a_graph_input_lets_float32_math_follow_the_shape_to_the_cpu():
    # GetCpuPreferredNodes skips graph inputs: Div(x, f) with x fed goes to the CPU, nothing is copied
    model = parsed(divide_by_first_dim(divided="x"))
    placed = place(model)
    assert not placed.copies and _ops(model, placed.preferred) == ["Cast", "Div", "Gather"]


def test_a_shape_read_as_reshapes_cpu_input_is_no_copy():
    model = _model(HEAD + """
    g (float16[N, 4] x) => (float16[M] y) {
        s = Shape(x)
        one = Constant<value = int64[1] {-1}>()
        y = Reshape(x, one)
        n = Gather<axis = 0>(s, zero)
        zero = Constant<value = int64 {0}>()
    }""".replace("y = Reshape(x, one)", "shape = Concat<axis = 0>(one, n1)\n        n1 = Unsqueeze(n, zero1)\n"
                 "        zero1 = Constant<value = int64[1] {0}>()\n        y = Reshape(x, shape)"))
    placed = place(_sorted(model))
    assert not placed.copies and not placed.feed
    assert {"Gather", "Unsqueeze", "Concat"} <= set(_ops(_sorted(model), placed.preferred))


def test_a_size_cast_into_float_math_is_a_copy_and_its_arithmetic_the_feed():
    model = parsed(divide_by_first_dim())
    placed = place(model)
    assert list(placed.copies) == ["f"]
    assert _ops(model, placed.feed) == ["Cast", "Gather"]


def test_a_static_shape_is_folded_before_placement():
    model = parsed(divide_by_first_dim("2, 4", divided="x"))
    placed = place(model)
    assert not placed.copies and _ops(model, placed.folded) == ["Cast", "Gather", "Shape"]


def test_a_node_without_a_cuda_kernel_for_its_type_runs_on_the_cpu():
    # the CUDA EP registers ArgMax for float types only
    model = _sorted(_model(HEAD + """
    g (int64[N, 4] x, float[N] w) => (float[N] y) {
        i = ArgMax<axis = 1, keepdims = 0>(x)
        f = Cast<to = 1>(i)
        y = Mul(w, f)
    }"""))
    placed = place(model)
    assert _ops(model, placed.cpu) == ["ArgMax"] and not placed.preferred
    # the walk starts only from CPU outputs of CUDA nodes: Cast stays on CUDA and i is copied to it
    assert list(placed.copies) == ["i"]
    floats = _sorted(_model(HEAD + """
    g (float[N, 4] x) => (int64[N] i) {
        i = ArgMax<axis = 1, keepdims = 0>(x)
    }"""))
    assert not place(floats).cpu


def test_the_walk_stops_at_low_precision_inputs_and_device_tensors():
    # GetCpuPreferredNodes: a float16 input, or a device tensor, keeps a node on CUDA
    model = _sorted(_model(HEAD + """
    g (float16[N, 4] x, int64[N] ids) => (float16[N, 4] y, int64[N] z) {
        s = Shape(x)
        zero = Constant<value = int64 {0}>()
        n = Gather<axis = 0>(s, zero)
        h = Cast<to = 10>(n)
        y = Mul(x, h)
        d = Add(ids, ids)
        z = Add(d, n)
    }"""))
    placed = place(model)
    # Cast reads only the CPU int64: to the CPU; Mul reads float16 x: CUDA, so h is copied;
    # z's Add reads d, a device tensor: CUDA, so n is copied too
    assert _ops(model, placed.preferred) == ["Cast", "Gather"]
    assert sorted(placed.copies) == ["h", "n"]


def test_memory_types_come_from_the_kernel_registrations():
    assert memory_types("", "Reshape", 14) == (frozenset({1}), frozenset())
    assert memory_types("", "Shape", 15) == (frozenset(), frozenset({0}))
    assert memory_types("", "Squeeze", 11) == (frozenset(), frozenset())  # axes is an attribute there
    assert memory_types("", "Add", 14) == (frozenset(), frozenset())


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxmp.normalize import toposort_all

    toposort_all(model)
    return model


def test_the_packaged_facts_are_what_the_generator_writes():
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    import gen_cuda_placement

    packaged = json.loads((root / "onnxmp" / "data" / "ort_cuda_placement.json").read_text())
    assert json.loads(json.dumps(gen_cuda_placement.build())) == packaged


# Rows corrected against the registrations (gen_cuda_placement.MEMORY_COMMIT): each changes the copies.

def test_clip_reads_min_and_max_on_the_device():
    # math/clip.cc registers Clip-11+ without a CPU-memory input: a shape-derived bound is copied to it
    model = _sorted(_model(HEAD + """
    g (float[N, 4] x) => (float[N, 4] y) {
        r = Relu(x)
        s = Shape(r)
        zero = Constant<value = int64 {0}>()
        n = Gather<axis = 0>(s, zero)
        f = Cast<to = 1>(n)
        y = Clip(r, f)
    }"""))
    assert memory_types("", "Clip", 13) == (frozenset(), frozenset())
    placed = place(model)
    assert list(placed.copies) == ["f"] and _ops(model, placed.feed) == ["Cast", "Gather"]
    assert not placed.to_host


def test_onehot_keeps_its_values_in_cpu_memory():
    # tensor/onehot.cc: depth (1) and values (2) are CPU inputs: values made on the device go to the host
    model = _sorted(_model(HEAD + """
    g (int64[N] ids, float[2] v) => (float[N, 10] y) {
        depth = Constant<value = int64[1] {10}>()
        w = Neg(v)
        y = OneHot(ids, depth, w)
    }"""))
    assert memory_types("", "OneHot", 11) == (frozenset({1, 2}), frozenset())
    placed = place(model)
    assert list(placed.to_host) == ["w"] and not placed.copies


def test_resize_10_keeps_its_scales_in_cpu_memory():
    # tensor/resize.cc registers Resize-10 with scales (1) on the CPU, as Resize-11+ with roi/scales/sizes
    model = _sorted(_model('<ir_version: 5, opset_import: ["" : 10]>\n' + """
    g (float[1, 1, N, 4] x, float[4] a) => (float[1, 1, M, 8] y) {
        sc = Abs(a)
        y = Resize<mode = "nearest">(x, sc)
    }"""))
    assert memory_types("", "Resize", 10) == (frozenset({1}), frozenset())
    assert list(place(model).to_host) == ["sc"]


def test_if_reads_its_condition_in_cpu_memory():
    # controlflow/if.cc: 'cond' needs to be on the CPU (a row the table lacked): a device bool is copied back
    model = _sorted(_model(HEAD + """
    g (float[N] x) => (float[N] y) {
        zero = Constant<value = float {0}>()
        s = ReduceSum<keepdims = 0>(x)
        c = Greater(s, zero)
        y = If(c) <then_branch = t () => (float[N] a) { a = Identity(x) },
                   else_branch = e () => (float[N] b) { b = Neg(x) }>
    }"""))
    assert memory_types("", "If", 17) == (frozenset({0}), frozenset())
    placed = place(model)
    assert list(placed.to_host) == ["c"] and not placed.copies


def test_pad_takes_axes_in_cpu_memory_from_opset_18_only():
    assert memory_types("", "Pad", 13) == (frozenset({1, 2}), frozenset())
    assert memory_types("", "Pad", 18) == (frozenset({1, 2, 3}), frozenset())
    assert memory_types("com.microsoft", "BitmaskBiasDropout", 1) == (frozenset({3, 4}), frozenset())
