"""The emitter writes what an onnx-graphsurgeon import/cleanup/export round trip writes.

onnxmp's converted models used to go through GS; :mod:`onnxmp.emit` now writes them
from the proto.  On a graph the rewrite leaves alone the two must agree byte for byte,
including GS's conventions (doc strings dropped, dead nodes removed, unnamed tensors
named "", value_info in GS's tensor order, outer initializers listed in bodies).
``scripts/check_identity.py`` checks whole conversions against an earlier revision.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx_graphsurgeon.logger import G_LOGGER

from models import zoo
from onnxmp.emit import emit
from onnxmp.graphs import ModelGraph
from onnxmp.normalize import normalize
from onnxmp.rewrite import Edits
from tests.graphs import header


def gs_graph(model: onnx.ModelProto) -> bytes:
    with G_LOGGER.suppress(G_LOGGER.ERROR):
        graph = gs.import_onnx(model)
        graph.cleanup(remove_unused_graph_inputs=False, remove_unused_node_outputs=False, recurse_subgraphs=True)
        return gs.export_onnx(graph, do_type_check=False).graph.SerializeToString()


def emitted_graph(model: onnx.ModelProto) -> bytes:
    graph = ModelGraph(model)
    return emit(graph, Edits.unchanged(graph), model).graph.SerializeToString()


def odd_model() -> onnx.ModelProto:
    """Doc strings, a dead node and an unused initializer, an unnamed Constant tensor, a
    value_info with a dim denotation, an If body reading an outer initializer and variable."""
    model = onnx.parser.parse_model(header() + """
    g (float[2,4] x, bool c) => (float[2,4] y) {
        k = Constant <value = float[1] {2.0}> ()
        a = Mul(x, k)
        dead = Relu(x)
        y = If(c) <then_branch = t () => (float[2,4] yt) { yt = Add(a, w) },
                   else_branch = e () => (float[2,4] ye) { ye = Sub(a, w) }>
    }""")
    model.graph.initializer.extend([onnx.numpy_helper.from_array(np.ones((2, 4), np.float32), "w"),
                                    onnx.numpy_helper.from_array(np.ones((3,), np.float32), "unused")])
    onnx.checker.check_model(model, full_check=True)
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
        node.doc_string = "exported from somewhere"
    model.graph.node[0].attribute[0].t.ClearField("name")
    vi = onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2, 4])
    vi.type.tensor_type.shape.dim[0].denotation = "BATCH"
    model.graph.value_info.append(vi)
    return model


@pytest.mark.parametrize("build", [odd_model, zoo.mlp, zoo.loop_if, zoo.transformer_block, zoo.cnn_bn])
def test_untouched_graph_is_written_as_gs_wrote_it(build):
    model = build()
    normalize(model)  # types from inference, unique names, as the pipeline sees it
    assert emitted_graph(model) == gs_graph(model)


def test_dead_nodes_and_unused_initializers_are_dropped_and_doc_strings_go():
    model = odd_model()
    normalize(model)
    out = onnx.GraphProto()
    out.ParseFromString(emitted_graph(model))
    assert "n2" not in {n.name for n in out.node}  # `dead` feeds no output
    assert "unused" not in {t.name for t in out.initializer}
    assert not any(n.doc_string for n in out.node)
    assert out.node[0].attribute[0].t.HasField("name")  # GS names every tensor it writes


def listed_graph_model(held_type: int, kept: bool) -> onnx.ModelProto:
    """`s` is a float sequence; a custom op holds a graph (a GRAPHS attribute, which GS does not
    import) that declares `s` with element type ``held_type``.  The custom op's output is a graph
    output when ``kept``, else the node is dead."""
    from onnx import helper
    held = helper.make_graph([], "held", [], [helper.make_tensor_sequence_value_info("s", held_type, [2])])
    nodes = [helper.make_node("SequenceConstruct", ["x"], ["s"], name="n0"),
             helper.make_node("Op", ["x"], ["z"], name="n1", domain="custom", bodies=[held])]
    outputs = [helper.make_tensor_sequence_value_info("s", onnx.TensorProto.FLOAT, [2])]
    if kept:
        outputs.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])


@pytest.mark.parametrize("kept", [True, False])
def test_a_sequence_declared_twice_with_different_types_is_written_untyped(kept):
    # The second declaration sits in a graph only a GRAPHS attribute holds, of a kept or a dead node.
    out = emit_model(listed_graph_model(onnx.TensorProto.INT64, kept))
    assert not out.graph.output[0].HasField("type")
    same = emit_model(listed_graph_model(onnx.TensorProto.FLOAT, kept))
    assert same.graph.output[0].type.sequence_type.elem_type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [n.name for n in out.graph.node] == (["n0", "n1"] if kept else ["n0"])


def emit_model(model: onnx.ModelProto, convert: bool = False) -> onnx.ModelProto:
    graph = ModelGraph(model)
    edits = Edits.unchanged(graph)
    if convert:  # every float32 initializer to float16, as the rewrite records it
        for name, info in graph.tensors.items():
            if info.init is not None and info.dtype == onnx.TensorProto.FLOAT:
                edits.converted[name] = (np.dtype(np.float16), onnx.TensorProto.FLOAT16)
                edits.dtypes[name] = onnx.TensorProto.FLOAT16
    return emit(graph, edits, model)


def test_converted_initializers_keep_their_order_and_values_across_conversion_batches():
    # More small initializers than one batch holds, with int64 ones and a large one among them.
    from onnx import helper
    rng = np.random.default_rng(0)
    count = 2 * 2048 + 7
    nodes, inits, prev = [], [], "x"
    for i in range(count):
        if i % 1000 == 500:
            inits.append(onnx.numpy_helper.from_array(np.array([1, 4], np.int64), f"shape{i}"))
            nodes.append(helper.make_node("Reshape", [prev, f"shape{i}"], [f"r{i}"], name=f"r{i}"))
            prev = f"r{i}"
        size = 20000 if i == 3000 else 4
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal((1, size)).astype(np.float32), f"b{i}"))
        nodes.append(helper.make_node("Add", [prev, f"b{i}"], [f"a{i}"], name=f"a{i}"))
        prev = f"a{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info(prev, onnx.TensorProto.FLOAT, None)], list(reversed(inits)))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = emit_model(model, convert=True)
    # GS's order: first use, not the order the model lists them in.
    assert [t.name for t in out.graph.initializer] == [n.input[1] for n in nodes]
    originals = {t.name: t for t in inits}
    for tensor in out.graph.initializer:
        source = onnx.numpy_helper.to_array(originals[tensor.name])
        expected = source.astype(np.float16) if source.dtype == np.float32 else source
        assert tensor.data_type == onnx.helper.np_dtype_to_tensor_dtype(expected.dtype)
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor), expected)


def test_casts_are_placed_after_their_producers_following_chains():
    from onnx import helper

    from onnxmp.rewrite import GraphNodes, NewCast, place_after_producers
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["a"], name="A"),
                           helper.make_node("Split", ["a"], ["b", "c"], name="B", num_outputs=2),
                           helper.make_node("Add", ["b", "c"], ["d"], name="C")], "g", [], [])
    casts = [NewCast("c_on_c", "c", "c16", 10), NewCast("x_in", "x", "x16", 10), NewCast("b_on_b", "b", "b16", 10),
             NewCast("again", "c16", "c32", 1), NewCast("d_out", "d", "d16", 10)]
    scope = ModelGraph(helper.make_model(g)).scopes[0]
    placed = place_after_producers(GraphNodes.of(scope), casts)
    # Graph inputs first; then each node's followers by output, each Cast followed by those reading it.
    assert placed.names == ["x_in", "A", "B", "b_on_b", "c_on_c", "again", "C", "d_out"]
    assert placed.inputs[placed.names.index("again")] == ["c16"]
    assert place_after_producers(GraphNodes.of(scope), []).names == ["A", "B", "C"]


def _attr(name: str, value=None, **fields) -> onnx.AttributeProto:
    attr = onnx.helper.make_attribute(name, value) if value is not None else onnx.AttributeProto(name=name)
    for key, field_value in fields.items():
        setattr(attr, key, field_value)
    return attr


def _node_variants() -> dict[str, onnx.NodeProto]:
    """A node of each kind _clean tells apart: the clean ones first, then one per reason it rejects."""
    from onnx import helper
    A = onnx.AttributeProto
    tensor = onnx.numpy_helper.from_array(np.ones(3, np.float32), "w")
    unnamed = onnx.numpy_helper.from_array(np.ones(3, np.float32))
    unnamed.ClearField("name")
    named_empty = onnx.numpy_helper.from_array(np.ones(3, np.float32))
    named_empty.name = ""  # set, although empty
    empty_ints = _attr("axes", type=A.INTS)
    graph = helper.make_graph([], "b", [], [])
    stray = _attr("axes", type=A.INTS)
    stray.t.CopyFrom(tensor)
    plain = {
        "no attributes": helper.make_node("Relu", ["x"], ["y"], name="n"),
        "every simple and list kind": helper.make_node(
            "Op", ["x"], ["y"], name="n", domain="custom", i=-3, f=0.5, s="text", t=tensor, ints=[1, -2],
            floats=[0.5], strings=["a", "b"]),
        "a tensor named empty": helper.make_node("Constant", [], ["y"], name="n", value=named_empty),
        "a reference attribute": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "a list with a stray tensor": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
    }
    plain["a reference attribute"].attribute.append(_attr("alpha", type=A.FLOAT, ref_attr_name="beta"))
    stray_full = _attr("axes", [1, 2])
    stray_full.t.CopyFrom(tensor)
    plain["a list with a stray tensor"].attribute.append(stray_full)
    dirty = {
        "a doc string": helper.make_node("Relu", ["x"], ["y"], name="n", doc_string="d"),
        "an empty doc string": helper.make_node("Relu", ["x"], ["y"], name="n"),
        "an overload": helper.make_node("Relu", ["x"], ["y"], name="n", overload="o"),
        "metadata": helper.make_node("Relu", ["x"], ["y"], name="n"),
        "a device configuration": helper.make_node("Relu", ["x"], ["y"], name="n"),
        "an attribute doc string": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "a list attribute doc string": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "an unnamed tensor": helper.make_node("Constant", [], ["y"], name="n", value=unnamed),
        "a tensor type without a tensor": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "an empty ints": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "an empty floats": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "an empty strings": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "an empty list with a stray tensor": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "a graph": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom", body=graph),
        "graphs": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom", bodies=[graph]),
        "tensors": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom", ts=[tensor]),
        "a type proto": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom",
                                         tp=helper.make_tensor_type_proto(1, [2])),
        "an undefined type": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
        "no type": helper.make_node("Op", ["x"], ["y"], name="n", domain="custom"),
    }
    dirty["an empty doc string"].doc_string = ""
    dirty["metadata"].metadata_props.add(key="k", value="v")
    dirty["a device configuration"].device_configurations.add(configuration_id="c")
    dirty["an attribute doc string"].attribute.append(_attr("alpha", 1.0, doc_string="d"))
    dirty["a list attribute doc string"].attribute.append(_attr("axes", [1], doc_string="d"))
    dirty["a tensor type without a tensor"].attribute.append(_attr("value", type=A.TENSOR))
    dirty["an empty ints"].attribute.append(empty_ints)
    dirty["an empty floats"].attribute.append(_attr("scales", type=A.FLOATS))
    dirty["an empty strings"].attribute.append(_attr("names", type=A.STRINGS))
    dirty["an empty list with a stray tensor"].attribute.append(stray)
    dirty["an undefined type"].attribute.append(_attr("alpha", type=A.UNDEFINED, i=1))
    dirty["no type"].attribute.append(_attr("alpha", i=1))
    return {**{f"clean: {k}": v for k, v in plain.items()}, **{f"dirty: {k}": v for k, v in dirty.items()}}


@pytest.mark.parametrize("case", list(_node_variants()))
def test_the_bulk_check_rejects_every_node_clean_rejects(case):
    from onnxmp.emit import _all_clean, _clean, _wire
    node = _node_variants()[case]
    assert _clean(node) == case.startswith("clean")
    others = [v.SerializeToString() for k, v in _node_variants().items() if k.startswith("clean")]
    # Among clean nodes, at either end or in the middle: the check's reading of the bytes is positional.
    for position in (0, 1, len(others)):
        nodes = others[:position] + [node.SerializeToString()] + others[position:]
        assert _all_clean(_wire(nodes=nodes)) == _clean(node)


def test_a_node_with_many_attributes_is_checked_one_by_one():
    from onnxmp.emit import _all_clean, _clean, _wire
    node = onnx.helper.make_node("Op", ["x"], ["y"], name="n", domain="custom", **{f"a{i}": i for i in range(70)})
    assert _clean(node)
    assert not _all_clean(_wire(nodes=[node.SerializeToString()]))  # a false alarm: only slower


def variants_model() -> onnx.ModelProto:
    """A chain of clean nodes with one node of each kind _clean tells apart that GS can export (a stray
    tensor on a list attribute and a TENSORS attribute are kept, where GS drops them)."""
    from onnx import helper
    nodes, prev = [], "x"
    variants = [v for k, v in _node_variants().items()
                if not any(word in k for word in ("empty ints", "empty floats", "empty strings", "empty list",
                                                  "graph", "without a tensor", "type", "reference",
                                                  "stray", "tensors"))]
    for i, variant in enumerate(variants):
        nodes.append(helper.make_node("Relu", [prev], [f"r{i}"], name=f"r{i}"))
        node = onnx.NodeProto()
        node.CopyFrom(variant)
        node.name = f"v{i}"
        del node.input[:], node.output[:]
        node.input.extend([] if node.op_type == "Constant" else [f"r{i}"])
        node.output.append(f"v{i}")
        nodes.append(node)
        prev = f"v{i}" if node.op_type != "Constant" else f"r{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])])
    outputs = [n.output[0] for n in nodes]
    graph.output.extend(helper.make_empty_tensor_value_info(t) for t in outputs if t != "y")
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])


def test_nodes_checked_in_bulk_are_written_as_gs_writes_them():
    model = variants_model()
    assert emitted_graph(model) == gs_graph(model)


def dead_chains_model() -> onnx.ModelProto:
    """Dead nodes before, between and after used ones; a dead node reading a used one; two outputs."""
    return onnx.parser.parse_model(header() + """
    g (float[2] x) => (float[2] y, float[2] z) {
        d0 = Relu(x)
        a = Abs(x)
        d1 = Neg(d0)
        b = Exp(a)
        d2 = Sin(b)
        y = Identity(b)
        z = Cos(a)
        d3 = Tan(z)
    }""")


def initializer_io_model() -> onnx.ModelProto:
    """An initializer that is also a graph input, one that is a graph output nothing reads, and one
    read by two nodes before an output of theirs is."""
    return onnx.parser.parse_model(header() + """
    g (float[2] x, float[2] w_in) => (float[2] y, float[2] w_out, float[2] a)
      <float[2] w_in = {1.0, 2.0}, float[2] w_out = {3.0, 4.0}, float[2] w = {5.0, 6.0}> {
        a = Add(x, w_in)
        b = Mul(x, w)
        c = Mul(a, w)
        y = Add(b, c)
    }""")


@pytest.mark.parametrize("build", [variants_model, odd_model, zoo.loop_if, zoo.cnn_bn, zoo.mlp, dead_chains_model,
                                   initializer_io_model,
                                   zoo.transformer_block])
def test_the_bulk_check_and_batches_change_no_byte(build, monkeypatch):
    import onnxmp.emit as emit_module
    model = build()
    normalize(model)
    expected = emitted_graph(model)
    monkeypatch.setattr(emit_module, "_all_clean", lambda data: False)  # every node checked one by one
    assert emitted_graph(model) == expected
    # GS's walk from the outputs, and its tensor order over every mention
    monkeypatch.setattr(emit_module._Emitter, "_single_writers", lambda *args: False)
    assert emitted_graph(model) == expected
    monkeypatch.undo()
    monkeypatch.setattr(emit_module, "_BATCH_BYTES", 100)  # a few nodes per batch, big ones alone
    assert emitted_graph(model) == expected
    monkeypatch.setattr(emit_module, "_CHECK_IN_BULK_BELOW", 1)  # as for nodes holding big tensors
    assert emitted_graph(model) == expected


def test_an_empty_list_attribute_still_fails_as_gs_export_does():
    from onnx import helper
    node = helper.make_node("Op", ["x"], ["y"], name="n", domain="custom")
    node.attribute.append(_attr("axes", type=onnx.AttributeProto.INTS))
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="r"), node], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])
    with pytest.raises(ValueError, match="empty"):
        emitted_graph(model)


def _main_used(model: onnx.ModelProto):
    from onnxmp.emit import _Emitter
    graph = ModelGraph(model)
    edits = Edits.unchanged(graph)
    emitter = _Emitter(graph, edits)
    nodes = edits.graphs[graph.scopes[0].gid]
    in_order = emitter._used_in_order(nodes, model.graph, {}) if emitter._single_writers(nodes) else None
    return in_order, emitter._used_in_any_order(nodes, model.graph, {})


@pytest.mark.parametrize("build", [dead_chains_model, odd_model, zoo.mlp, zoo.loop_if, zoo.cnn_bn])
def test_the_pass_from_the_last_node_finds_the_nodes_gs_keeps(build):
    model = build()
    normalize(model)
    in_order, walked = _main_used(model)
    assert in_order == walked
    if build is dead_chains_model:
        assert list(walked) == [0, 1, 0, 1, 0, 1, 1, 0]


@pytest.mark.parametrize("case", ["written twice", "an empty output name", "writes a graph input",
                                  "writes an initializer"])
def test_the_pass_from_the_last_node_leaves_odd_writers_to_gs_walk(case):
    # GS's walk takes each tensor's last writer, wherever it stands: the one pass could not.
    writer = {"written twice": "a = Neg(x)", "an empty output name": "c, = Split(x)",
              "writes a graph input": "x = Neg(a)", "writes an initializer": "w = Neg(a)"}[case]
    model = onnx.parser.parse_model(header() + f"""
    g (float[2] x) => (float[2] y) <float[2] w = {{1.0, 2.0}}> {{
        a = Abs(x)
        b = Add(a, w)
        {writer}
        y = Identity(b)
    }}""")
    if case == "an empty output name":
        model.graph.node[2].output.append("")
    assert _main_used(model)[0] is None
