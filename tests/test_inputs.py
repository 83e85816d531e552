"""Tests for onnxmp.inputs: loading, generating and checking sample inputs."""
from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from onnxmp.errors import OnnxMPError
from onnxmp.inputs import as_samples, check_inputs, generate_inputs, load_npz, model_inputs


def model_with_inputs(*inputs: onnx.ValueInfoProto, initializers=()) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", [v.name], [f"{v.name}_out"]) for v in inputs]
    outputs = [helper.make_value_info(f"{v.name}_out", v.type) for v in inputs]
    graph = helper.make_graph(nodes, "g", list(inputs), outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


FLOAT_MODEL = model_with_inputs(helper.make_tensor_value_info("x", TP.FLOAT, ["batch", 3, "seq"]),
                                helper.make_tensor_value_info("m", TP.BOOL, ["batch", "seq"]),
                                helper.make_tensor_value_info("h", TP.FLOAT16, [2]))


# --- generate_inputs --------------------------------------------------------------


def test_generate_floats_and_bools_with_dims():
    sample = generate_inputs(FLOAT_MODEL, {"seq": 5, "batch": 4})
    assert sample["x"].shape == (4, 3, 5) and sample["x"].dtype == np.float32
    assert sample["m"].shape == (4, 5) and sample["m"].dtype == np.bool_
    assert sample["h"].dtype == np.float16
    assert 0.5 < sample["x"].std() < 1.5  # standard normal
    assert sample["m"].any() and not sample["m"].all()


def test_generate_is_deterministic_per_seed():
    a = generate_inputs(FLOAT_MODEL, {"seq": 5}, seed=7)
    b = generate_inputs(FLOAT_MODEL, {"seq": 5}, seed=7)
    c = generate_inputs(FLOAT_MODEL, {"seq": 5}, seed=8)
    np.testing.assert_array_equal(a["x"], b["x"])
    assert not np.array_equal(a["x"], c["x"])


def test_batch_like_dims_default_quietly_others_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="onnxmp"):
        sample = generate_inputs(FLOAT_MODEL, batch_default=3)
    assert sample["x"].shape == (3, 3, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("seq" in w for w in warnings)  # once per input using it


def test_unnamed_dim_defaults_to_one_with_warning(caplog):
    value = helper.make_tensor_value_info("x", TP.FLOAT, [None, 2])
    with caplog.at_level(logging.WARNING, logger="onnxmp"):
        assert generate_inputs(model_with_inputs(value))["x"].shape == (1, 2)
    assert "axis 0" in caplog.text


def test_generate_bfloat16_input():
    model = model_with_inputs(helper.make_tensor_value_info("b", TP.BFLOAT16, [4]))
    assert generate_inputs(model)["b"].dtype == ml_dtypes.bfloat16


def test_int_inputs_are_refused_with_hint():
    model = model_with_inputs(helper.make_tensor_value_info("x", TP.FLOAT, [2]),
                              helper.make_tensor_value_info("token_ids", TP.INT64, [1, 8]))
    with pytest.raises(OnnxMPError) as err:
        generate_inputs(model)
    assert "token_ids" in err.value.message and "int64" in err.value.message
    assert "--inputs" in err.value.hint


def test_unknown_dim_name_is_an_error():
    with pytest.raises(OnnxMPError, match="Seq") as err:
        generate_inputs(FLOAT_MODEL, {"Seq": 4})
    assert "batch" in err.value.hint and "seq" in err.value.hint


def test_initializers_listed_as_inputs_are_not_fed():
    weight = helper.make_tensor("w", TP.INT64, [1], [3])
    model = model_with_inputs(helper.make_tensor_value_info("x", TP.FLOAT, [2]),
                              helper.make_tensor_value_info("w", TP.INT64, [1]), initializers=[weight])
    assert [v.name for v in model_inputs(model)] == ["x"]
    assert list(generate_inputs(model)) == ["x"]  # no error for the int "input"


# --- load_npz ---------------------------------------------------------------------


def test_load_several_files_one_sample_each(tmp_path):
    for i in range(3):
        np.savez(tmp_path / f"s{i}.npz", x=np.full((2,), i, np.float32), m=np.array([True, False]))
    samples = load_npz(sorted(tmp_path.glob("*.npz")))
    assert len(samples) == 3
    assert [s["x"][0] for s in samples] == [0, 1, 2]
    assert load_npz(tmp_path / "s1.npz")[0]["x"][0] == 1


def test_a_model_given_as_inputs_is_named_not_an_npz(tmp_path):
    """numpy takes any non-zip file for a pickle and talked about allow_pickle."""
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [])), tmp_path / "m.onnx")
    with pytest.raises(OnnxMPError, match=r"m\.onnx is not an \.npz file") as info:
        load_npz(tmp_path / "m.onnx")
    assert "pickle" not in str(info.value)


def test_samples_from_dicts_paths_or_a_mix(tmp_path):
    """validate refused a list mixing dicts and paths, which calibration's copy of this parser took."""
    np.savez(tmp_path / "a.npz", x=np.ones(2))
    mixed = as_samples([{"x": np.zeros(2)}, tmp_path / "a.npz"])
    assert [s["x"][0] for s in mixed] == [0, 1]
    assert as_samples(str(tmp_path / "a.npz"))[0]["x"][0] == 1 and as_samples({"x": 3})[0]["x"] == 3
    for bad in ([], [1, 2], 7):
        with pytest.raises(OnnxMPError, match="calibration must be a dict of input arrays, an .npz path"):
            as_samples(bad, what="calibration")


def test_load_errors(tmp_path):
    with pytest.raises(OnnxMPError, match="not found"):
        load_npz(tmp_path / "missing.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(OnnxMPError, match="single array"):
        load_npz(tmp_path / "single.npy")
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(OnnxMPError, match="junk.npz is not an .npz file"):
        load_npz(tmp_path / "junk.npz")
    np.savez(tmp_path / "cut.npz", x=np.zeros(1000))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "cut.npz").read_bytes()[:-30])
    with pytest.raises(OnnxMPError, match="cut.npz is not an .npz file|cannot read"):
        load_npz(tmp_path / "cut.npz")
    np.savez(tmp_path / "obj.npz", x=np.array([None, 1], dtype=object))
    with pytest.raises(OnnxMPError, match="obj.npz: array 'x' holds Python objects"):
        load_npz(tmp_path / "obj.npz")
    with pytest.raises(OnnxMPError, match="no input files"):
        load_npz([])


# --- check_inputs -----------------------------------------------------------------


def good_sample(batch=2, seq=4):
    return {"x": np.zeros((batch, 3, seq), np.float64), "m": np.ones((batch, seq), bool),
            "h": np.zeros(2, np.float32)}


def test_check_casts_float_widths():
    checked = check_inputs(FLOAT_MODEL, good_sample())
    assert checked["x"].dtype == np.float32 and checked["h"].dtype == np.float16


def test_bad_npz_names_are_reported_with_expected_names(tmp_path):
    sample = good_sample()
    sample["X"] = sample.pop("x")
    np.savez(tmp_path / "bad.npz", **sample)
    with pytest.raises(OnnxMPError) as err:
        check_inputs(FLOAT_MODEL, load_npz(tmp_path / "bad.npz")[0])
    assert "'X'" in err.value.message and "x, m, h" in err.value.hint


def test_missing_input_is_named():
    sample = good_sample()
    del sample["m"]
    with pytest.raises(OnnxMPError, match="'m'"):
        check_inputs(FLOAT_MODEL, sample)


@pytest.mark.parametrize("name, value, message", [
    ("m", np.ones((2, 4), np.float32), "float32 but the model expects bool"),
    ("x", np.zeros((2, 3), np.float32), "rank 3"),
    ("h", np.zeros(3, np.float32), "axis 0; the model expects 2"),
    ("m", np.ones((2, 5), bool), "dim 'seq' is 4 in input 'x' but 5 in input 'm'"),
])
def test_check_rejects_mismatches(name, value, message):
    sample = good_sample()
    sample[name] = value
    with pytest.raises(OnnxMPError, match=message):
        check_inputs(FLOAT_MODEL, sample)
