"""onnxmp.runtime: the one module that makes onnxruntime sessions, and its one error translation."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxmp import runtime
from onnxmp.errors import OnnxMPError

PACKAGE = Path(__file__).resolve().parent.parent / "onnxmp"

# Folders whose modules may still make an InferenceSession (or SessionOptions), with the reason: none.
EXCEPTIONS: tuple[str, ...] = ()

MADE_HERE = ("InferenceSession", "SessionOptions")


def _sessions_made(path: Path) -> list[int]:
    """Lines of ``path`` that construct an InferenceSession (``ort.InferenceSession(...)``,
    ``InferenceSession(...)``, ``_pybind_state.InferenceSession(...)``) or its SessionOptions, or
    import either name."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in MADE_HERE:
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name in MADE_HERE for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_runtime_makes_sessions():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "runtime.py" or relative.startswith(EXCEPTIONS):
            continue
        lines = _sessions_made(path)
        if lines:
            found[relative] = lines
    assert not found, (f"InferenceSession or SessionOptions made outside onnxmp/runtime.py (use runtime.session, "
                       f"runtime.session_options): {found}")


def test_the_session_check_sees_a_session(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import onnxruntime as ort\ns = ort.InferenceSession(b'')\n")
    assert _sessions_made(module) == [2]
    module.write_text("from onnxruntime import InferenceSession\n")
    assert _sessions_made(module) == [1]
    module.write_text("import onnxruntime\n\noptions = onnxruntime.SessionOptions()\n")
    assert _sessions_made(module) == [3]
    module.write_text("from onnxmp import runtime\ns = runtime.session(b'', what='model')\n")
    assert _sessions_made(module) == []


def _model(nodes, inputs, outputs, opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _add(x_type=TensorProto.FLOAT, y_type=TensorProto.FLOAT) -> onnx.ModelProto:
    return _model([helper.make_node("Add", ["x", "y"], ["z"])],
                  [helper.make_tensor_value_info("x", x_type, [2]), helper.make_tensor_value_info("y", y_type, [2])],
                  [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])


def _one_line(error: OnnxMPError) -> str:
    assert "\n" not in error.message
    assert "onnxruntime_src" not in error.message and "Traceback" not in error.message
    assert "[ONNXRuntimeError]" not in error.message
    assert error.hint
    return error.message


def test_a_session_runs():
    session = runtime.session(_add(), what="sum model")
    x = np.array([1, 2], dtype=np.float32)
    (z,) = runtime.run(session, {"x": x, "y": x}, "sum model")
    np.testing.assert_array_equal(z, [2, 4])


def test_a_session_from_bytes_and_a_path(tmp_path):
    path = tmp_path / "add.onnx"
    onnx.save(_add(), path)
    for source in (path, str(path), _add().SerializeToString()):
        assert [i.name for i in runtime.session(source, what="sum model").get_inputs()] == ["x", "y"]


def test_a_model_onnxruntime_refuses_is_one_line_with_a_hint():
    broken = _add(y_type=TensorProto.FLOAT16)  # Add's T bound to float and float16
    with pytest.raises(OnnxMPError) as caught:
        runtime.session(broken, what="candidate model")
    message = _one_line(caught.value)
    assert message.startswith(f"onnxruntime {ort.__version__} cannot load the candidate model: ")
    assert "bound to different types" in message
    assert "inconsistent" in caught.value.hint  # the hint for this reason, not the default one
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_an_unknown_op_gets_the_load_hint():
    broken = _model([helper.make_node("NoSuchOp", ["x"], ["z"])], [helper.make_tensor_value_info("x", 1, [2])],
                    [helper.make_tensor_value_info("z", 1, [2])])
    with pytest.raises(OnnxMPError) as caught:
        runtime.session(broken, what="model", hint=None)
    assert "NoSuchOp" in _one_line(caught.value)
    assert "check_model" in caught.value.hint


def test_a_given_hint_wins():
    with pytest.raises(OnnxMPError) as caught:
        runtime.session(_add(y_type=TensorProto.FLOAT16), what="optimizer graph", hint="rebuild the artifacts")
    assert caught.value.hint == "rebuild the artifacts"


def test_a_bad_feed_is_a_run_error_with_the_inputs_hint():
    session = runtime.session(_add(), what="sum model")
    x = np.ones(2, dtype=np.float32)
    with pytest.raises(OnnxMPError) as caught:
        runtime.run(session, {"x": x, "y": x.astype(np.float64)}, "sum model")
    message = _one_line(caught.value)
    assert message.startswith(f"onnxruntime {ort.__version__} cannot run the sum model: ")
    assert "inputs" in caught.value.hint
    with pytest.raises(OnnxMPError, match="cannot run the sum model") as caught:
        runtime.run(session, {"x": x, "w": x}, "sum model")
    assert "inputs" in caught.value.hint


def test_a_failing_node_is_a_run_error():
    # Reshape to a shape of another size fails inside the node, after the feeds were accepted.
    model = _model([helper.make_node("Reshape", ["x", "s"], ["z"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None]),
                    helper.make_tensor_value_info("s", TensorProto.INT64, [1])],
                   [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None])])
    session = runtime.session(model, what="model")
    with pytest.raises(OnnxMPError) as caught:
        runtime.run(session, {"x": np.ones(4, np.float32), "s": np.array([3])}, "model")
    message = _one_line(caught.value)
    assert message.startswith(f"onnxruntime {ort.__version__} cannot run the model: a Reshape node: The input tensor cannot be ")


def test_translate_keeps_onnxmp_errors_and_strips_the_location():
    own = OnnxMPError("mine", "hint")
    assert runtime.translate(own, "model") is own
    text = ("[ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/onnxruntime/core/graph/model.cc:180 "
            "onnxruntime::Model::Model(onnx::ModelProto&&, const PathString&, const IOnnxRuntimeOpSchemaRegistryList*, "
            "const onnxruntime::logging::Logger&, const onnxruntime::ModelOptions&) Unsupported model IR version: 99")
    error = runtime.translate(RuntimeError(text), "model")
    assert error.message.endswith("cannot load the model: Unsupported model IR version: 99")
    enforce = RuntimeError("/onnxruntime_src/a.cc:1 void f() x == y was false. the shapes differ\n  at line two")
    assert runtime.reason(enforce) == "the shapes differ at line two"


def test_devices():
    assert runtime.providers("cpu") == ["CPUExecutionProvider"]
    assert runtime.providers("cuda:1") == [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    assert runtime.placement("cuda") == ("cuda", 0) and runtime.placement("cpu") == ("cpu", 0)
    assert runtime.check_device("cpu").name == "cpu"
    with pytest.raises(OnnxMPError, match="unknown device 'tpu'"):
        runtime.check_device("tpu")
    with pytest.raises(OnnxMPError, match="bad device 'cuda:x'"):
        runtime.check_device("cuda:x")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(OnnxMPError, match="has no CUDAExecutionProvider") as caught:
            runtime.session(_add(), what="model", device="cuda")
        assert "onnxruntime-gpu" in caught.value.hint


def test_session_options():
    options = runtime.session_options()
    assert options.log_severity_level == 3
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # onnxruntime's default
    emulated = runtime.session_options(emulated=True, quiet=False, threads=2, deterministic=True)
    assert emulated.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert emulated.log_severity_level != 3
    assert emulated.intra_op_num_threads == 2 and emulated.use_deterministic_compute
    disabled = runtime.session_options(optimization="disable", emulated=True)
    assert disabled.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL


def test_ortvalues_and_binding():
    where = runtime.placement("cpu")
    x = runtime.to_ortvalue(np.array([1, 2], dtype=np.float32), where)
    into = runtime.empty_like(x, where)
    session = runtime.session(_add(), what="sum model")
    binding = runtime.bind(session, {"x": x, "y": np.array([10, 20], dtype=np.float32)}, [("z", into)])
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(into.numpy(), [11, 22])
    binding = runtime.bind(session, {"x": x, "y": x}, [("z", "cpu")])
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], [2, 4])


def test_resolve():
    assert runtime.resolve(_add()) is None
    assert "bound to different types" in runtime.resolve(_add(y_type=TensorProto.FLOAT16))
    # Initialized on the CPU EP: a missing kernel is no fault of the graph (bfloat16 MatMul).
    bf16 = _model([helper.make_node("MatMul", ["a", "b"], ["c"])],
                  [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [2, 2]) for n in "ab"],
                  [helper.make_tensor_value_info("c", TensorProto.BFLOAT16, [2, 2])])
    assert runtime.resolve(bf16, initialize=True) is None
    assert runtime.resolve(_add(y_type=TensorProto.FLOAT16), initialize=True) is not None


def test_reason_names_the_node_unless_the_caller_does():
    text = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Gemm node. "
            "Name:'head/Gemm' Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/math/gemm_helper.h:14 "
            "onnxruntime::GemmHelper::GemmHelper(const onnxruntime::TensorShape&, bool, const onnxruntime::TensorShape&, "
            "bool, const onnxruntime::TensorShape&) left.NumDimensions() == 2 || left.NumDimensions() == 1 was false. "
            "Gemm: Invalid A shape")
    assert runtime.reason(text) == "Gemm node 'head/Gemm': Gemm: Invalid A shape"
    assert runtime.reason(text, node=False) == "Gemm: Invalid A shape"
    assert runtime.reason("") == "" and runtime.reason(RuntimeError()) == "RuntimeError"
