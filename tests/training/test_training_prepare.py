"""Preparing exported forward graphs for onnxruntime-training 1.19's gradient builder."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnxmp.errors import OnnxMPError
from onnxmp.training import build_artifacts
from onnxmp.training.build.gradient import gradient_error
from onnxmp.training.build.prepare import prepare_for_gradient


def _model(body: str, *, opset: int = 17, out: str = "[2,4]", extra: str = "") -> onnx.ModelProto:
    text = f"""<ir_version: 8, opset_import: ["" : {opset}]>
g (float[2,4] x{extra}) => (float{out} y) {{
  h = MatMul(x, W)
  {body}
}}"""
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    model.graph.initializer.append(numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "W"))
    model.graph.initializer.append(numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "V"))
    return model


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


ONES = "{" + ",".join(["1"] * 4) + "}"
ZEROS = "{" + ",".join(["0"] * 4) + "}"
REWRITTEN = {
    "LayerNormalization": (f"g1 = Constant<value=float[4] {ONES}>()\n b1 = Constant<value=float[4] {ZEROS}>()\n"
                           " y = LayerNormalization<axis=-1>(h, g1, b1)", 17),
    "Dropout": ("r = Constant<value=float {0.1}>()\n y = Dropout(h, r)", 17),
    "BatchNormalization": (f"g1 = Constant<value=float[4] {{1,2,3,4}}>()\n b1 = Constant<value=float[4] {ONES}>()\n"
                           " mu = Constant<value=float[4] {0.5,0,-1,2}>()\n"
                           " var = Constant<value=float[4] {4,0.25,1,9}>()\n"
                           " y = BatchNormalization<epsilon=0.01>(h, g1, b1, mu, var)", 17),
    "Transpose": ("t = Transpose(h)\n y = Transpose(t)", 17),
    "Gelu": ("y = Gelu(h)", 20),
    "Gelu_tanh": ('y = Gelu<approximate="tanh">(h)', 20),
    "Elu": ("y = Elu<alpha=0.7>(h)", 17),
    "Selu": ("y = Selu(h)", 17),
    "Celu": ("y = Celu<alpha=2.0>(h)", 17),
    "Softplus": ("y = Softplus(h)", 17),
    "Softsign": ("y = Softsign(h)", 17),
    "Mish": ("y = Mish(h)", 18),
    "HardSigmoid": ("y = HardSigmoid(h)", 17),
    "HardSwish": ("y = HardSwish(h)", 17),
    "PRelu": ("s = MatMul(x, V)\n y = PRelu(h, s)", 17),
    "Sum": ("s = MatMul(x, V)\n y = Sum(h, s, x)", 17),
    "Mean": ("s = MatMul(x, V)\n y = Mean(h, s, x)", 17),
}


@pytest.mark.parametrize("case", sorted(REWRITTEN))
def test_rewrites_keep_the_forward_values(case):
    body, opset = REWRITTEN[case]
    model = _model(body, opset=opset)
    prepared, done = prepare_for_gradient(model, ["W"])
    assert [p.op_type for p in done] == [case.split("_")[0]] * len(done) and done
    x = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32) * 3
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-6)
    assert len(model.graph.node) == body.count("\n") + 2  # the original is untouched


@pytest.mark.parametrize("case", ["LayerNormalization", "Dropout", "Transpose", "Elu", "Softplus", "Mean"])
def test_ort_builds_the_gradient_only_after_preparation(case, tmp_path, monkeypatch):
    from onnxmp.training import _ort

    if not _ort.available():
        pytest.skip("ORT's builder needs onnxruntime-training (Python 3.11)")
    body, opset = REWRITTEN[case]
    model = _model(body, opset=opset)
    build_artifacts(model, requires_grad=["W", "V"] if "MatMul(x, V)" in body else ["W"], loss="mse",
                    precision="float32", out_dir=tmp_path / "ok")
    # The same model without preparation is what ORT refused.
    import onnxmp.training.build.pipeline as build

    monkeypatch.setattr(build, "prepare_for_gradient", lambda m, r, **_: (m, []))
    with pytest.raises(OnnxMPError):
        build_artifacts(model, requires_grad=["W", "V"] if "MatMul(x, V)" in body else ["W"], loss="mse",
                        precision="float32", out_dir=tmp_path / "raw")


@pytest.mark.parametrize("case", sorted(REWRITTEN))
def test_onnxmp_builder_skips_the_rewrites_only_ort_needs(case):
    """onnxmp's builder has a rule for each op ORT's needs rewritten: it gets the graph as exported
    (fewer nodes); BatchNormalization alone is rewritten for both (it trains as exported)."""
    body, opset = REWRITTEN[case]
    model = _model(body, opset=opset)
    prepared, done = prepare_for_gradient(model, ["W"], ort_builder=False)
    if case == "BatchNormalization":
        assert [p.op_type for p in done] == ["BatchNormalization"]
    else:
        assert done == [] and prepared.graph == model.graph


def test_onnxmp_builder_trains_the_unprepared_ops_as_ort_does(tmp_path):
    """Elu, Softplus, a broadcast Where branch and a hidden broadcast, differentiated by onnxmp's
    builder from the graph as exported: the same gradients as ORT's from the prepared one."""
    from onnxmp.training import _ort

    if not _ort.available():
        pytest.skip("needs onnxruntime-training (Python 3.11), ORT's builder being the oracle")
    from onnxmp.training.build import autodiff
    from onnxmp.training.build.gradient import gradient_graph
    from onnxmp.training.losses import table_loss

    text = """<ir_version: 8, opset_import: ["" : 17]>
g (float[N,4] x, bool[N,4] m) => (float[N,4] y) {
  h = MatMul(x, W)
  e = Elu<alpha=0.7>(h)
  s = Softplus(e)
  w = Where(m, s, B)
  y = Add(w, C)
}"""
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    for name, shape in (("W", (4, 4)), ("B", ()), ("C", (1, 4))):
        model.graph.initializer.append(numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name))
    params = ["W", "B", "C"]
    ours, _ = prepare_for_gradient(model, params, ort_builder=False)
    theirs, done = prepare_for_gradient(model, params)
    assert {p.op_type for p in done} >= {"Elu", "Softplus", "Where"}
    loss = table_loss("mse")
    feeds = {"x": rng.normal(size=(3, 4)).astype(np.float32), "m": rng.normal(size=(3, 4)) > 0,
             "target": rng.normal(size=(3, 4)).astype(np.float32)}
    grads = ["W_grad", "B_grad", "C_grad"]
    results = []
    for build, forward in ((autodiff.gradient_graph, ours), (gradient_graph, theirs)):
        training, _, parameters = build(forward, loss, "target", params, [])
        training.graph.output.extend(helper.make_empty_tensor_value_info(g) for g in grads)
        inputs = {**feeds, **{t.name: numpy_helper.to_array(t) for t in parameters[0]},
                  "loss_scale": np.array(1.0, np.float32), "lazy_reset_grad": np.array([True])}
        inputs.update({f"{p}_grad.accumulation.buffer": np.zeros_like(inputs[p]) for p in params})
        session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
        results.append(session.run(grads, {v.name: inputs[v.name] for v in training.graph.input}))
    assert len(ours.graph.node) < len(theirs.graph.node)
    for mine, want in zip(*results):
        np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-6)


def test_nothing_to_prepare_leaves_the_graph_alone():
    model = _model("y = Relu(h)")
    prepared, done = prepare_for_gradient(model, ["W"])
    assert done == [] and prepared.graph == model.graph


def test_op_without_gradient_is_named_with_its_node(tmp_path):
    model = _model("y = ReduceMax<axes=[-1]>(h)", out="[2,1]")
    model.graph.node[1].name = "head/ReduceMax"
    with pytest.raises(OnnxMPError) as info:
        build_artifacts(model, requires_grad=["W"], loss="mse", precision="float32", out_dir=tmp_path)
    assert "ReduceMax" in str(info.value) and "head/ReduceMax" in str(info.value)
    assert "check that every op" not in str(info.value)
    assert "W" in info.value.hint and "freeze" in info.value.hint


def test_op_without_gradient_before_frozen_parameters_only_is_fine(tmp_path):
    # ReduceMax reads only x and the frozen V: it is not on W's path to the loss.
    model = _model("m = ReduceMax<axes=[-1]>(x)\n v = MatMul(x, V)\n s = Mul(v, m)\n y = Add(h, s)")
    build_artifacts(model, requires_grad=["W"], frozen=["V"], loss="mse", precision="float32", out_dir=tmp_path)


def test_parameter_the_loss_does_not_use_is_named(tmp_path):
    model = _model("y = Relu(h)")
    with pytest.raises(OnnxMPError, match="does not depend on.*'?V"):
        build_artifacts(model, requires_grad=["W", "V"], loss="mse", precision="float32", out_dir=tmp_path)


def test_parameter_reaching_the_loss_only_through_integers_is_named(tmp_path):
    model = _model("s = Shape(V)\n f = Cast<to=1>(s)\n y = Mul(h, f)", out="[2,4]")
    with pytest.raises(OnnxMPError, match="'V'.*integer"):
        build_artifacts(model, requires_grad=["W", "V"], loss="mse", precision="float32", out_dir=tmp_path)


def test_a_string_requires_grad_is_one_name(tmp_path):
    model = _model("y = MatMul(h, V)")
    artifacts = build_artifacts(model, requires_grad="W", frozen="V", loss="mse", precision="float32",
                                out_dir=tmp_path)
    assert artifacts.manifest["requires_grad"] == ["W"] and artifacts.manifest["frozen"] == ["V"]


def test_ort_builder_errors_are_translated():
    missing = RuntimeError("/src/gradient_builder_registry.cc:29 GetGradientForOp(...) gradient_builder != nullptr "
                           "was false. The gradient builder has not been registered: Einsum for node einsum_3")
    error = gradient_error(missing)
    assert "Einsum" in str(error) and "einsum_3" in str(error) and "differentiable ops" in error.hint
    output = gradient_error(RuntimeError("gradient_builder_base.h:123 ArgDef O(size_t, bool) const "
                                          "i < node_->OutputDefs().size() was false."))
    assert "optional output" in str(output)
    consumer = gradient_error(RuntimeError("couldn't find the consumer node"))
    assert "requires_grad" in consumer.hint
    arg = gradient_error(RuntimeError("graph_augmenter.cc:23 AddToExistingNodeArgs add graph outputs - "
                                       "failed to find NodeArg by name: val_343_grad"))
    assert "'val_343'" in str(arg) and "frozen" in arg.hint


def test_tanh_gelu_gets_the_tanh_gradient(tmp_path):
    # ORT maps any Gelu to its Erf-form GeluGrad; the decomposition differentiates the tanh form.
    from onnxmp.training import Trainer

    model = _model('y = Gelu<approximate="tanh">(h)', opset=20)
    artifacts = build_artifacts(model, requires_grad=["W"], loss="mse", optimizer="sgd", precision="float32",
                                out_dir=tmp_path)
    trainer = Trainer(artifacts, lr=1.0)
    w = trainer.parameters()["W"].astype(np.float64)
    x = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32) * 2
    trainer.train_step(x, np.zeros((2, 4), np.float32))
    h = x.astype(np.float64) @ w
    k = np.sqrt(2 / np.pi)
    t = np.tanh(k * (h + 0.044715 * h**3))
    y = 0.5 * h * (1 + t)
    dy_dh = 0.5 * (1 + t) + 0.5 * h * (1 - t**2) * k * (1 + 3 * 0.044715 * h**2)
    expected = x.T.astype(np.float64) @ (2 * y / y.size * dy_dh)
    np.testing.assert_allclose(w - trainer.parameters()["W"], expected, rtol=1e-4, atol=1e-6)


def test_constant_node_weights_train_and_export(tmp_path):
    from onnxmp.training import Trainer

    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
g (float[N,4] x) => (float[N,4] y) {
  W = Constant<value=float[4,4] {1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1}>()
  y = MatMul(x, W)
}""")
    artifacts = build_artifacts(model, requires_grad=["W"], loss="mse", precision="float32", out_dir=tmp_path / "a")
    assert onnx.load(artifacts.path("forward_model")).graph == model.graph  # still a Constant node
    trainer = Trainer(artifacts, lr=0.1)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    trainer.train_step(x, 2 * x)
    exported = onnx.load(trainer.export_inference(tmp_path / "m.onnx", precision="float32"))
    weight = numpy_helper.to_array(exported.graph.node[0].attribute[0].t)
    np.testing.assert_array_equal(weight, trainer.parameters()["W"])
    assert not np.array_equal(weight, np.eye(4, dtype=np.float32))


@pytest.mark.parametrize("body,slot", [
    ("y = Clip(h, P)", "Clip min"),
    ("a = Abs(h)\n y = Pow(a, P)", "Pow exponent"),
    ("y, m = Dropout(h, P)", "Dropout ratio"),
])
def test_parameter_read_only_where_ort_does_not_differentiate(body, slot, tmp_path):
    # torch's dynamo exporter stores constants such as a clamp's minimum as initializers.
    from onnxmp.training.build.prepare import without_gradient

    model = _model(body)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.1, np.float32), "P"))
    with pytest.raises(OnnxMPError, match=f"'P'.*{slot}"):
        build_artifacts(model, requires_grad=["W", "P"], loss="mse", precision="float32", out_dir=tmp_path / "a")
    assert list(without_gradient(model, ["W", "P"])) == ["P"]
    build_artifacts(model, requires_grad=["W"], frozen=["P"], loss="mse", precision="float32", out_dir=tmp_path / "b")


@pytest.mark.parametrize("opset,expected", [(14, 16), (17, 17)])
def test_embedding_gradient_is_a_scatter_add_at_any_opset(opset, expected, tmp_path):
    from onnxmp.training import Trainer

    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : {opset}]>
g (int64[N,3] ids) => (float[N,3,4] y) {{
  e = Gather(E, ids)
  y = MatMul(e, W)
}}""")
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([numpy_helper.from_array(rng.normal(size=(5, 4)).astype(np.float32), "E"),
                                    numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "W")])
    artifacts = build_artifacts(model, requires_grad=["E", "W"], loss="mse", optimizer="sgd", precision="float32",
                                out_dir=tmp_path)
    training = onnx.load(artifacts.training_model)
    assert "GatherGrad" not in {n.op_type for n in training.graph.node}
    assert [o.version for o in training.opset_import if o.domain == ""] == [expected]
    trainer = Trainer(artifacts, lr=1.0)
    ids = np.array([[0, 2, 2], [4, 0, 2]])
    target = np.zeros((2, 3, 4), np.float32)
    e, w = trainer.parameters()["E"].astype(np.float64), trainer.parameters()["W"].astype(np.float64)
    trainer.train_step(ids, target)
    dy = 2 * (e[ids] @ w) / target.size
    expected_grad = np.zeros_like(e)
    np.add.at(expected_grad, ids.ravel(), (dy @ w.T).reshape(-1, 4))
    np.testing.assert_allclose(e - trainer.parameters()["E"], expected_grad, rtol=1e-5, atol=1e-7)


# torch's dynamo exporter writes an attention mask's 0 and float32-min fill as 0-d initializers.
MASKED_ATTENTION = """<ir_version: 8, opset_import: ["" : 18]>
g (float[N,3,4] x, int64[N,3] mask) => (float[N,2] y) {
  h = MatMul(x, W)
  ht = Transpose<perm=[0,2,1]>(h)
  scores = MatMul(h, ht)
  one = Constant<value=int64[1] {1}>()
  m = Unsqueeze(mask, one)
  keep = Cast<to=9>(m)
  bias = Where(keep, zero, fill)
  masked = Add(scores, bias)
  p = Sigmoid(masked)
  o = MatMul(p, h)
  z = MatMul(o, V)
  y = ReduceMean<keepdims=0>(z, one)
}"""
MASK_FEEDS = {"x": np.random.default_rng(2).normal(size=(3, 3, 4)).astype(np.float32),
              "mask": np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], np.int64)}


def _masked_attention() -> onnx.ModelProto:
    model = onnx.parser.parse_model(MASKED_ATTENTION)
    rng = np.random.default_rng(0)
    for name, value in (("W", rng.normal(size=(4, 4))), ("V", rng.normal(size=(4, 2))), ("zero", 0.0),
                        ("fill", np.finfo(np.float32).min)):
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
    return model


def test_broadcast_where_branch_is_expanded_only_when_trainable():
    model = _masked_attention()
    prepared, done = prepare_for_gradient(model, ["W", "V", "zero", "fill"])
    assert [p.op_type for p in done] == ["Where"]
    assert sum(n.op_type == "Expand" for n in prepared.graph.node) == 4
    session = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, MASK_FEEDS)
    np.testing.assert_array_equal(session.run(None, MASK_FEEDS)[0], want[0])
    assert prepare_for_gradient(model, ["W", "V"])[1] == []  # the fill is frozen: no gradient to sum back
    # Branches that already have the output's shape need nothing.
    full = _model("s = MatMul(x, V)\n c = Greater(h, s)\n y = Where(c, h, s)")
    assert prepare_for_gradient(full, ["W", "V"])[1] == []


def _gradients(artifacts, model, feeds) -> dict[str, np.ndarray]:
    """Each parameter's gradient from one run of the training graph, as it would be accumulated."""
    training = onnx.load(artifacts.training_model)
    accumulate = [n for n in training.graph.node if n.op_type == "InPlaceAccumulatorV2"]
    param_of = {n.input[1]: n.input[0].split("_grad.accumulation.buffer")[0] for n in accumulate}
    # Left out: an accumulator handed a gradient of the wrong shape writes past its buffer.
    kept = [n for n in training.graph.node if n.op_type != "InPlaceAccumulatorV2"]
    training.graph.ClearField("node")
    training.graph.node.extend(kept)
    training.graph.ClearField("output")
    training.graph.output.extend(helper.make_empty_tensor_value_info(g) for g in param_of)
    weights = {t.name: t for t in model.graph.initializer}
    inputs = [i for i in training.graph.input if i.name not in weights and i.name != "lazy_reset_grad"]
    training.graph.ClearField("input")
    training.graph.input.extend(inputs)
    training.graph.initializer.extend(weights[p] for p in param_of.values())
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    scalars = {"loss_scale": np.array(1.0, np.float32), "grad_weight": np.array(1.0, np.float32)}
    scalars.update({n.input[0]: np.zeros(tuple(weights[p].dims), np.float32)
                    for n, p in zip(accumulate, param_of.values())})
    run = {i.name: {**feeds, **scalars}[i.name] for i in session.get_inputs()}
    return {param_of[g]: value for g, value in zip(param_of, session.run(None, run))}


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_gradient_of_a_broadcast_where_branch_has_the_parameter_shape(precision, tmp_path):
    # ORT 1.19's Where gradient keeps the output's shape: unprepared, the 0-d mask fill got a
    # [N, 1, 3] gradient, which InPlaceAccumulatorV2 wrote past its one-element buffer (a Reshape
    # error, a segfault or wrong weights, depending on the heap).
    model = _masked_attention()
    names = ["W", "V", "zero", "fill"]
    artifacts = build_artifacts(model, requires_grad=names, precision=precision, out_dir=tmp_path / "a")
    labels = np.array([0, 1, 1], np.int64)
    grads = _gradients(artifacts, model, {**MASK_FEEDS, "labels": labels})
    assert {p: g.shape for p, g in grads.items()} == {t.name: tuple(t.dims) for t in model.graph.initializer}
    if precision == "float32":  # the value: a central difference of the cross-entropy in the zero
        def loss(zero: float) -> float:
            changed = onnx.ModelProto()
            changed.CopyFrom(model)
            for t in changed.graph.initializer:
                if t.name == "zero":
                    t.CopyFrom(numpy_helper.from_array(np.array(zero, np.float32), "zero"))
            logits = ort.InferenceSession(changed.SerializeToString(),
                                          providers=["CPUExecutionProvider"]).run(None, MASK_FEEDS)[0]
            logits = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)  # softmax of the loss
            log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            return float(-log_p[np.arange(len(labels)), labels].mean())

        numeric = (loss(1e-2) - loss(-1e-2)) / 2e-2
        assert abs(numeric) > 1e-3
        np.testing.assert_allclose(grads["zero"], numeric, rtol=1e-2)


def test_a_gradient_of_the_wrong_shape_fails_cleanly(tmp_path, monkeypatch):
    # Without the Where preparation ORT hands the 0-d parameters a [N, 1, 3] gradient: the
    # training graph must refuse it, never let InPlaceAccumulatorV2 write it past the buffer.
    import onnxmp.training.build.pipeline as build
    from onnxmp.training import Trainer

    monkeypatch.setattr(build, "prepare_for_gradient", lambda m, r, **_: (m, []))
    built = build_artifacts(_masked_attention(), requires_grad=["W", "V", "zero", "fill"], precision="float32",
                            out_dir=tmp_path)
    with pytest.raises(OnnxMPError, match="wrong shape for parameter '(zero|fill)'") as info:
        Trainer(built).train_step(MASK_FEEDS["x"], MASK_FEEDS["mask"], np.array([0, 1, 1]))
    assert "frozen=" in info.value.hint


def test_dynamo_style_scalar_initializers_all_train_in_float16(tmp_path):
    # The bundled classifier as torch's dynamo exporter writes it: every float constant (the
    # attention scale, GELU's sqrt(2), 1 and 0.5, the mask's 1 and float32.min
    # fill) an initializer, and all of them trainable.
    from models import zoo
    from onnxmp.training import Trainer
    from onnxmp.training.models import trainable
    from onnxmp.training.build.load import promote_constants
    from onnxmp.training.build.prepare import without_gradient

    base = zoo.transformer_classifier(mask_fill="where")
    floats = [n.output[0] for n in base.graph.node
              if n.op_type == "Constant" and n.attribute[0].t.data_type == onnx.TensorProto.FLOAT]
    model, promoted = promote_constants(base, floats)
    scalars = [t.name for t in model.graph.initializer if t.name in promoted and not t.dims]
    assert len(scalars) >= 5
    names = trainable(model)
    frozen = list(without_gradient(model, names))
    requires = [n for n in names if n not in frozen]
    assert set(scalars) - set(frozen)  # 0-d parameters really are trained
    artifacts = build_artifacts(model, requires_grad=requires, frozen=frozen, precision="float16",
                                out_dir=tmp_path / "a")
    data = zoo.classifier_task(8, seed=0)
    feeds = {k: data[k] for k in ("input_ids", "attention_mask", "labels")}
    grads = _gradients(artifacts, model, feeds)
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    assert {p: g.shape for p, g in grads.items()} == {p: shapes[p] for p in requires}
    step = Trainer(artifacts).train_step(*feeds.values())
    assert np.isfinite(step.loss)


# --- gradients summed back over broadcasts ORT cannot see -------------------------------------
# ``buf`` holds positions 0..7 as a [1, 8] buffer, as BERT's position_ids; slicing it to the input's
# length gives a [1, S] tensor that onnx's shape inference calls [unk__0, unk__1].  Whatever reads
# it broadcasts over the batch, and ORT 1.19's gradient builders take two different symbolic dims
# for equal, so without unprove_symbolic_dims the gradient was never summed over the batch.
_SLICED = """
  shape = Shape(x)
  one = Constant<value=int64[1] {1}>()
  two = Constant<value=int64[1] {2}>()
  zero = Constant<value=int64[1] {0}>()
  s = Slice(shape, one, two)
"""
BROADCASTS = {  # op -> (body, numpy forward of x, h = x @ W [N,S,4] and b [1,S,4])
    "Add": ("y = Add(h, b)", lambda x, h, b: h + b),
    "Sub": ("y = Sub(b, h)", lambda x, h, b: b - h),
    "Mul": ("y = Mul(h, b)", lambda x, h, b: h * b),
    "Div": ("y = Div(h, b)", lambda x, h, b: h / b),
    # ORT differentiates the base only; the exponent is what b broadcasts against.
    "Pow": ("a = Abs(x)\n p = Pow(b, a)\n y = Add(p, h)", lambda x, h, b: b ** np.abs(x) + h),
    "Where": ("c = Greater(h, b)\n y = Where(c, h, b)", lambda x, h, b: np.where(h > b, h, b)),
    "Expand": ("hs = Shape(h)\n e = Expand(b, hs)\n y = Mul(e, h)", lambda x, h, b: h * b),
    "Max": ("y = Max(h, b)", lambda x, h, b: np.maximum(h, b)),
    "Min": ("y = Min(b, h)", lambda x, h, b: np.minimum(h, b)),
}


def _broadcast_model(body: str, dims: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
g (float[{dims},4] x) => (float[{dims},4] y) {{
  h = MatMul(x, W)
{_SLICED}
  b = Slice(B, zero, s, one)
  {body}
}}""")
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "W"),
                                    numpy_helper.from_array((1.5 + 0.3 * rng.normal(size=(1, 8, 4))).astype(
                                        np.float32), "B")])
    return model


def _numeric_gradient(loss, value: np.ndarray, step: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(value)
    for i in np.ndindex(value.shape):
        plus, minus = value.copy(), value.copy()
        plus[i] += step
        minus[i] -= step
        grad[i] = (loss(plus) - loss(minus)) / (2 * step)
    return grad


def _one_step_gradients(model, names, arrays, tmp_path, **kwargs):
    from onnxmp.training import DynamicLossScaler, Trainer

    artifacts = build_artifacts(model, requires_grad=names, loss="mse", optimizer="sgd", out_dir=tmp_path / "a",
                                **{"precision": "float32", **kwargs})
    trainer = Trainer(artifacts, lr=0.0, scaler=DynamicLossScaler.static(1.0))
    trainer.train_step(*arrays)
    return trainer.gradients(), trainer.parameters()


@pytest.mark.parametrize("dims", ["N,S", "3,5"], ids=["symbolic", "static"])
@pytest.mark.parametrize("op", sorted(BROADCASTS))
def test_gradient_through_a_hidden_broadcast_is_summed_back(op, dims, tmp_path):
    body, forward = BROADCASTS[op]
    model = _broadcast_model(body, dims)
    x = np.random.default_rng(1).normal(size=(3, 5, 4)).astype(np.float32)
    target = np.zeros((3, 5, 4), np.float32)
    grads, params = _one_step_gradients(model, ["W", "B"], (x, target), tmp_path)
    w, bias = params["W"].astype(np.float64), params["B"].astype(np.float64)

    def loss(b_full):
        return np.mean((forward(x.astype(np.float64), x.astype(np.float64) @ w, b_full[:, :5]) - target) ** 2)

    assert grads["B"].shape == (1, 8, 4)
    np.testing.assert_allclose(grads["B"], _numeric_gradient(loss, bias), rtol=1e-3, atol=1e-6)


POSITION_EMBEDDING = f"""<ir_version: 8, opset_import: ["" : 17]>
g (int64[N,S] x) => (float[N,S,4] y) {{
  e = Gather(E, x)
{_SLICED}
  pos = Slice(buf, zero, s, one)
  p = Gather(P, pos)
  h = Add(e, p)
  y = MatMul(h, W)
}}"""


def _position_embedding_model() -> onnx.ModelProto:
    model = onnx.parser.parse_model(POSITION_EMBEDDING)
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([
        numpy_helper.from_array(rng.normal(size=(6, 4)).astype(np.float32), "E"),
        numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "P"),
        numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(np.arange(8, dtype=np.int64)[None], "buf")])
    return model


def _position_embedding_reference(params, ids):
    e, p, w = (params[k].astype(np.float64) for k in ("E", "P", "W"))
    seq = ids.shape[1]
    dy = 2 * ((e[ids] + p[None, :seq]) @ w) / (ids.size * 4)
    dh = dy @ w.T
    expected = {"P": np.zeros_like(p), "E": np.zeros_like(e)}
    expected["P"][:seq] = dh.sum(axis=0)
    np.add.at(expected["E"], ids.ravel(), dh.reshape(-1, 4))
    return expected


@pytest.mark.parametrize("target", ["cpu", "cuda"])  # cuda: ORT's own GatherGrad, built for the GPU
@pytest.mark.parametrize("batch", [1, 3])
def test_broadcast_position_embedding_gradient(batch, target, tmp_path):
    # The most common BERT export: position embeddings of a [1, S] index buffer added to [N, S, H].
    from onnxmp.training import DynamicLossScaler, Trainer

    model = _position_embedding_model()
    ids = np.random.default_rng(1).integers(0, 6, (batch, 5))
    artifacts = build_artifacts(model, requires_grad=["E", "P", "W"], loss="mse", optimizer="sgd",
                                precision="float32", target=target, out_dir=tmp_path / "a")
    gather_grads = sum(n.op_type == "GatherGrad" for n in onnx.load(artifacts.training_model).graph.node)
    assert gather_grads == (2 if target == "cuda" else 0)
    if target == "cuda":
        return  # ORT's CUDA GatherGrad runs on a GPU only; its CPU twin is checked below
    trainer = Trainer(artifacts, lr=0.0, scaler=DynamicLossScaler.static(1.0))
    trainer.train_step(ids, np.zeros((batch, 5, 4), np.float32))
    expected = _position_embedding_reference(trainer.parameters(), ids)
    for name in ("E", "P"):
        np.testing.assert_allclose(trainer.gradients()[name], expected[name], rtol=1e-5, atol=1e-7)


def test_without_unproving_dims_the_broadcast_gradient_fails(tmp_path, monkeypatch):
    # The failure the rule prevents, kept visible: ORT's builder skips the sum over the batch.
    import onnxmp.training.build.gradient as gradient
    from onnxmp.training import Trainer

    monkeypatch.setattr(gradient, "unprove_symbolic_dims", lambda graph: 0)
    built = build_artifacts(_position_embedding_model(), requires_grad=["E", "P", "W"], loss="mse",
                            precision="float32", out_dir=tmp_path / "a")
    with pytest.raises(OnnxMPError, match="Reshape|shape"):
        Trainer(built).train_step(np.zeros((3, 5), np.int64), np.zeros((3, 5, 4), np.float32))


def test_only_a_hidden_broadcast_is_left_to_runtime_shapes():
    from onnxmp.training.build.gradient import unprove_symbolic_dims
    from onnxmp.training.build.prepare import RUNTIME_SHAPE

    # [N, S, 4] + [unk, unk, 4]: ORT would take unk for N and never sum over the batch.
    prepared, done = prepare_for_gradient(_position_embedding_model(), ["E", "P", "W"])
    assert [p.op_type for p in done] == ["Add"]
    inferred = onnx.shape_inference.infer_shapes(prepared)
    marked = [v for v in inferred.graph.value_info if v.name.startswith(RUNTIME_SHAPE)]
    assert len(marked) == 2 and unprove_symbolic_dims(inferred.graph) > 0
    assert all(not (d.dim_param or d.dim_value) for v in marked for d in v.type.tensor_type.shape.dim)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in inferred.graph.value_info}
    assert dims["e"] == ["N", "S", 4]  # everything else keeps its dims
    # Not fired: equal names, static shapes, a 1 against a name, no trainable input.
    for body, dims in (("y = Add(h, h)", "N,S"), ("y = Add(h, h)", "3,5")):
        model = _broadcast_model(body, dims)
        assert prepare_for_gradient(model, ["W"])[1] == []
    one = _model("c = Constant<value=float[1,4] {1,2,3,4}>()\n y = Add(h, c)")
    assert prepare_for_gradient(one, ["W"])[1] == []
    assert prepare_for_gradient(_position_embedding_model(), ["W"])[1] == []


GATHER_GRAD_CASES = {  # name -> (data shape, indices, axis)
    "rows, repeated": ((6, 4), np.array([[0, 2, 2], [5, 0, 2]]), 0),
    "rows, one index": ((6, 4), np.array(3), 0),
    "rows, 1-d": ((6, 4), np.array([1, 1, 1, 4]), 0),
    "axis 1": ((3, 6, 2), np.array([[0, 5], [5, 5]]), 1),
    "last axis": ((2, 3, 5), np.array([4, 0, 4]), 2),
}


@pytest.mark.parametrize("case", sorted(GATHER_GRAD_CASES))
def test_deterministic_gather_grad_equals_orts_gather_grad(case):
    from onnxmp.training.build.determinism import deterministic_gather_grads

    shape, indices, axis = GATHER_GRAD_CASES[case]
    dy_shape = shape[:axis] + indices.shape + shape[axis + 1:]
    graph = helper.make_graph(
        [helper.make_node("Shape", ["data"], ["shape"]),
         helper.make_node("GatherGrad", ["shape", "indices", "dy"], ["dx"], domain="com.microsoft", axis=axis,
                          name="gather_grad")],
        "g", [helper.make_tensor_value_info("data", onnx.TensorProto.FLOAT, list(shape)),
              helper.make_tensor_value_info("indices", onnx.TensorProto.INT64, list(indices.shape)),
              helper.make_tensor_value_info("dy", onnx.TensorProto.FLOAT, list(dy_shape))],
        [helper.make_tensor_value_info("dx", onnx.TensorProto.FLOAT, list(shape))])
    theirs = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(
        "com.microsoft", 1)], ir_version=8)
    ours = onnx.ModelProto()
    ours.CopyFrom(theirs)
    assert deterministic_gather_grads(ours) == 1
    assert "GatherGrad" not in {n.op_type for n in ours.graph.node}
    rng = np.random.default_rng(0)
    feeds = {"data": np.zeros(shape, np.float32), "indices": indices,
             "dy": rng.normal(size=dy_shape).astype(np.float32)}
    want = ort.InferenceSession(theirs.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(ours.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    again = ort.InferenceSession(ours.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(got, again)


def test_batch_norm_running_statistics_are_not_trained(tmp_path):
    # Eval-mode BatchNormalization trains with its running statistics (ORT would switch it to
    # batch statistics and never write them back); the statistics themselves are no parameters.
    from onnxmp.training.build.prepare import without_gradient

    model = _model("y = BatchNormalization(h, S, B, M, Q)")
    rng = np.random.default_rng(3)
    for name, value in (("S", rng.normal(size=4)), ("B", rng.normal(size=4)), ("M", rng.normal(size=4)),
                        ("Q", rng.uniform(0.5, 2, 4))):
        model.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
    assert set(without_gradient(model, ["W", "S", "B", "M", "Q"])) == {"M", "Q"}
    assert "running mean" in without_gradient(model, ["M"])["M"]
    grads, params = _one_step_gradients(model, ["W", "S", "B"], (np.ones((2, 4), np.float32),
                                                                 np.zeros((2, 4), np.float32)), tmp_path,
                                        frozen=["M", "Q"])
    x = np.ones((2, 4))
    mean, var = (numpy_helper.to_array(t) for t in model.graph.initializer if t.name in ("M", "Q"))
    h = x @ params["W"].astype(np.float64)
    norm = (h - mean) / np.sqrt(var + 1e-5)
    y = norm * params["S"] + params["B"]
    np.testing.assert_allclose(grads["B"], (2 * y / y.size).sum(0), rtol=1e-4)
    np.testing.assert_allclose(grads["S"], (2 * y / y.size * norm).sum(0), rtol=1e-4)
