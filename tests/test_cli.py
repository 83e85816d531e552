"""The CLI's one error contract and its output guards (every command that writes)."""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import onnxmp
from onnxmp.cli import EXIT_ERROR, EXIT_USAGE, main

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder holding a float32 model and its sample inputs, as the user's cwd."""
    shutil.copy(MODELS / "mlp.onnx", tmp_path / "m.onnx")
    shutil.copy(MODELS / "mlp.inputs.npz", tmp_path / "s.npz")
    shutil.copy(MODELS / "mlp.onnx", tmp_path / "b.onnx")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.is_symlink()}


def one_error(err: str, command: str) -> str:
    """The error line, after checking the contract: one `error:` line, at most one hint, no traceback."""
    lines = [line for line in err.splitlines() if not line.startswith("[")]  # log lines
    assert "Traceback" not in err
    assert 1 <= len(lines) <= 2, err
    assert lines[0].startswith(f"onnxmp {command}: error: " if command else "onnxmp: error: "), err
    if len(lines) == 2:
        assert lines[1].startswith("  hint: "), err
    return lines[0]


# --- outputs never land on inputs, and are refused before any work -----------------------


@pytest.mark.parametrize("argv, clash", [
    (["convert", "m.onnx", "-o", "out.onnx", "--report", "m.onnx"], "--report m.onnx is the input model"),
    (["convert", "m.onnx", "-o", "out.onnx", "--report", "out.onnx"], "--report and -o both name"),
    (["convert", "m.onnx", "-o", "m.onnx"], "-o m.onnx is the input model"),
    (["convert", "m.onnx", "-o", "out.onnx", "--calibrate", "s.npz", "--report", "s.npz"],
     "--report s.npz is the --calibrate"),
    (["convert", "m.onnx", "-o", "s.npz", "--calibrate", "s.npz"], "-o s.npz is the --calibrate"),
    (["validate", "m.onnx", "b.onnx", "--plot", "m.onnx"], "--plot m.onnx is the reference model"),
    (["validate", "m.onnx", "b.onnx", "--inputs", "s.npz", "--plot", "s.npz"], "--plot s.npz is the --inputs"),
    (["validate", "m.onnx", "b.onnx", "--report", "b.onnx"], "--report b.onnx is the candidate model"),
    (["validate", "m.onnx", "b.onnx", "--report", "r.json", "--plot", "r.json"], "--plot and --report both"),
    (["emulate", "m.onnx", "-o", "m.onnx"], "-o m.onnx is the input model"),
    (["emulate", "m.onnx", "-o", "link.onnx"], "-o link.onnx is the input model"),
    (["emulate", "m.onnx", "-o", "hard.onnx"], "-o hard.onnx is the input model"),
    (["convert", "link.onnx", "-o", "m.onnx"], "-o m.onnx is the input model link.onnx"),
])
def test_an_output_on_an_input_is_refused_and_nothing_is_touched(work, capsys, argv, clash):
    (work / "link.onnx").symlink_to(work / "m.onnx")
    os.link(work / "m.onnx", work / "hard.onnx")
    before = snapshot(work)
    assert main(argv) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert clash in one_error(err, argv[0])
    assert out == ""  # refused before any work: no summary
    assert snapshot(work) == before and (work / "link.onnx").is_symlink()


@pytest.mark.parametrize("argv, flag", [
    (["convert", "m.onnx", "-o", "out.onnx", "--report", "nodir/r.json"], "--report"),
    (["convert", "m.onnx", "-o", "nodir/out.onnx"], "-o"),
    (["validate", "m.onnx", "b.onnx", "--plot", "nodir/p.png"], "--plot"),
    (["validate", "m.onnx", "b.onnx", "--report", "nodir/r.json"], "--report"),
    (["emulate", "m.onnx", "-o", "nodir/e.onnx"], "-o"),
])
def test_a_missing_output_folder_fails_before_the_work(work, capsys, argv, flag):
    before = snapshot(work)
    assert main(argv) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert f"the folder of {flag} nodir/" in one_error(err, argv[0]) and "does not exist" in err
    assert "mkdir -p nodir" in err
    assert out == "" and snapshot(work) == before  # no model written, no PASSED printed


def test_convert_does_not_run_when_an_output_is_refused(work, monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise AssertionError("convert ran")

    monkeypatch.setattr(onnxmp, "convert", boom)
    assert main(["convert", "m.onnx", "-o", "out.onnx", "--report", "nodir/r.json"]) == EXIT_ERROR


def test_outputs_get_the_umask_mode(work, capsys):
    old = os.umask(0o022)
    try:
        assert main(["convert", "m.onnx", "-o", "out.onnx", "--report", "r.json"]) == 0
        assert main(["validate", "m.onnx", "out.onnx", "--inputs", "s.npz", "--report", "v.json",
                     "--plot", "p.png"]) == 0
        assert main(["emulate", "out.onnx", "-o", "e.onnx"]) == 0
    finally:
        os.umask(old)
    for name in ("out.onnx", "r.json", "v.json", "p.png", "e.onnx"):
        assert stat.S_IMODE(os.stat(work / name).st_mode) == 0o644, name
    assert not [p.name for p in work.iterdir() if p.name.startswith(".")]  # no temporaries left


# --- usage errors: exit 2, one line, one hint ----------------------------------------------


@pytest.mark.parametrize("argv, message, hint", [
    (["conver", "m.onnx"], "unknown command 'conver'", "did you mean convert?"),
    (["frobnicate"], "unknown command 'frobnicate'", "commands: convert, explain, lists"),
    ([], "the following arguments are required: COMMAND", "see `onnxmp --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--precision", "fp16"], "argument --precision: invalid choice 'fp16'",
     "did you mean float16? choose from: float16, bfloat16"),
    (["convert", "m.onnx", "-o", "x.onnx", "--target", "tensorrt"], "argument --target: invalid choice 'tensorrt'",
     "choose from: cuda, cpu"),
    (["convert", "m.onnx"], "the following arguments are required: -o/--output", "see `onnxmp convert --help`"),
    (["emulate", "m.onnx", "-o", "x.onnx", "--precision", "fp8"], "argument --precision: invalid choice 'fp8'",
     "choose from: float16, bfloat16"),
    (["validate", "m.onnx", "b.onnx", "--seed", "x"], "argument --seed: expected an integer, got 'x'",
     "see `onnxmp validate --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--tolerance", "0.1"], "--tolerance needs --calibrate",
     "pass sample inputs"),
    (["lists", "--nope"], "unrecognized arguments: --nope", "see `onnxmp lists --help`"),
    # Out-of-range numbers are usage errors too, found before any work (--seed -1 was an internal error).
    (["validate", "m.onnx", "b.onnx", "--seed", "-1"], "argument --seed: must be at least 0, got -1",
     "see `onnxmp validate --help`"),
    (["lists", "--opset", "-3"], "argument --opset: must be at least 1, got -3", "see `onnxmp lists --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--calibrate", "s.npz", "--max-runs", "0"],
     "argument --max-runs: must be at least 1, got 0", "see `onnxmp convert --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--calibrate", "s.npz", "--holdout", "-1"],
     "argument --holdout: must be at least 0, got -1", "see `onnxmp convert --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--calibrate", "s.npz", "--tolerance", "-0.1"],
     "argument --tolerance: must be a positive number, got -0.1", "see `onnxmp convert --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--calibrate", "s.npz", "--tolerance", "nan"],
     "argument --tolerance: must be a positive number, got nan", "see `onnxmp convert --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--calibrate", "s.npz", "--time-budget", "0"],
     "argument --time-budget: must be a positive number, got 0", "see `onnxmp convert --help`"),
    (["convert", "m.onnx", "-o", "x.onnx", "--time-budget", "60"], "--time-budget needs --calibrate",
     "pass sample inputs"),
])
def test_usage_errors_exit_2_with_one_line_and_a_hint(work, capsys, argv, message, hint):
    assert main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    command = argv[0] if argv and argv[0] in ("convert", "emulate", "validate", "lists") else ""
    line = one_error(err, command)
    assert message in line and err.splitlines()[1].startswith(f"  hint: {hint}"), err
    assert out == "" and not (work / "x.onnx").exists()


def test_help_and_version_still_exit_0(capsys):
    for argv in (["--version"], ["convert", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    capsys.readouterr()


# --- no traceback for anything, unless -v ---------------------------------------------------


def test_an_unexpected_error_is_one_line_and_v_shows_the_traceback(work, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(onnxmp, "convert", broken)
    assert main(["convert", "m.onnx", "-o", "out.onnx"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "KeyError: 'boom'" in one_error(err, "convert") and "-v" in err
    assert main(["convert", "m.onnx", "-o", "out.onnx", "-v"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1] == "onnxmp convert: error: KeyError: 'boom'"


def test_an_os_error_is_one_line(work, monkeypatch, capsys):
    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "m.onnx")

    monkeypatch.setattr(onnxmp, "convert", unreadable)
    assert main(["convert", "m.onnx", "-o", "out.onnx"]) == EXIT_ERROR
    assert "Permission denied: m.onnx" in one_error(capsys.readouterr().err, "convert")


def test_bad_input_files_are_one_line_errors(work, capsys):
    (work / "bad.npz").write_bytes(b"not a zip")
    (work / "bad.onnx").write_bytes((work / "m.onnx").read_bytes()[:100])
    assert main(["validate", "m.onnx", "b.onnx", "--inputs", "bad.npz"]) == EXIT_ERROR
    assert "bad.npz is not an .npz file" in one_error(capsys.readouterr().err, "validate")
    assert main(["emulate", "bad.onnx", "-o", "e.onnx"]) == EXIT_ERROR
    assert "not a readable ONNX model" in one_error(capsys.readouterr().err, "emulate")
    assert main(["validate", "m.onnx", "b.onnx", "--inputs", "missing.npz"]) == EXIT_ERROR
    assert "not found" in one_error(capsys.readouterr().err, "validate")


def test_validate_without_matplotlib_fails_before_the_comparison(work, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["validate", "m.onnx", "b.onnx", "--plot", "p.png"]) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert "plotting needs matplotlib" in one_error(err, "validate") and out == ""


# --- a command's outputs land together: a failure in a later step leaves none of them -------------


def test_ctrl_c_while_convert_writes_its_report_leaves_no_model(work, monkeypatch, capsys):
    from onnxmp.report import Report

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Report, "to_json", interrupted)
    (work / "r.json").write_text("old report")
    before = snapshot(work)
    assert main(["convert", "m.onnx", "-o", "out.onnx", "--report", "r.json"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == sorted(before) and snapshot(work) == before


def test_a_failed_plot_leaves_no_validate_report(work, monkeypatch, capsys):
    from matplotlib.figure import Figure

    def no_space(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", no_space)
    before = snapshot(work)
    assert main(["validate", "m.onnx", "b.onnx", "--report", "r.json", "--plot", "p.png"]) == EXIT_ERROR
    assert "No space left" in one_error(capsys.readouterr().err, "validate")
    assert sorted(p.name for p in work.iterdir()) == sorted(before)



def test_an_output_on_the_input_models_external_data_is_refused(work, capsys):
    import onnx

    onnx.save(onnx.load("m.onnx"), "ext.onnx", save_as_external_data=True, location="ext.weights", size_threshold=0)
    # A converted model renamed after its conversion still reads the data file it was saved with.
    onnx.save(onnx.load("m.onnx"), "old.onnx", save_as_external_data=True, location="new.onnx.data",
              size_threshold=0)
    before = snapshot(work)
    for argv, clash in ((["convert", "ext.onnx", "-o", "ext.weights"], "-o ext.weights is the external data"),
                        (["emulate", "ext.onnx", "-o", "ext.weights"], "-o ext.weights is the external data"),
                        (["convert", "old.onnx", "-o", "new.onnx"], "new.onnx.data is the external data")):
        assert main(argv) == EXIT_ERROR
        assert clash in one_error(capsys.readouterr().err, argv[0])
    assert snapshot(work) == before


@pytest.mark.parametrize("flag, op, hint", [
    ("--deny-add", "MatMul", "--allow-remove MatMul"),  # was "--deny-remove MatMul": undo what was asked
    ("--allow-add", "Exp", "--deny-remove Exp"),
    ("--clear-add", "MatMul", "--allow-remove MatMul"),
])
def test_an_op_added_to_a_second_list_hints_removing_it_from_the_other(work, capsys, flag, op, hint):
    assert main(["convert", "m.onnx", "-o", "x.onnx", flag, op]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "is in both the" in one_error(err, "convert") and f"  hint: remove it from one, e.g. {hint} " in err


def test_explain_does_not_point_at_a_report_flag_it_lacks(work, capsys):
    """explain's summary said '… N more (see --report JSON)'; explain has no --report."""
    import onnx
    from onnx import helper

    import numpy as np
    from onnx import numpy_helper

    nodes, outputs, weights = [], [], []
    for i in range(25):  # 25 MatMul -> Exp pairs: 25 denied Exps
        weights.append(numpy_helper.from_array(np.full((3, 3), 0.1, np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Exp", [f"m{i}"], [f"e{i}"], name=f"exp{i}")]
        outputs.append(helper.make_tensor_value_info(f"e{i}", onnx.TensorProto.FLOAT, [4, 3]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 3])],
                              outputs, weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), "exps.onnx")
    capsys.readouterr()
    assert main(["explain", "exps.onnx"]) == 0
    out = capsys.readouterr().out
    assert "  … 5 more (every vertex is listed below)" in out and "--report" not in out


def test_v_is_onnxmp_debug_not_every_librarys(work):
    """`validate --plot -v` printed 2,200 lines, nearly all matplotlib's font-manager debug."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "onnxmp", "validate", "m.onnx", "b.onnx", "--plot", "p.png", "-v"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(Path(onnxmp.__file__).parent.parent)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    debug = [line for line in proc.stderr.splitlines() if line.startswith("[DEBUG]")]
    assert debug and all(line.startswith("[DEBUG] onnxmp") for line in debug), debug[:5]


def test_an_invalid_input_model_is_blamed_on_the_input_not_reported_as_our_bug(work, capsys):
    """It said 'converted model fails onnx.checker ... of node:' (cut at the checker's first newline) and
    'onnxmp produced an invalid model; please report it'."""
    import onnx
    from onnx import helper

    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "nope"], ["y"], name="mm")], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), "bad.onnx")
    assert main(["convert", "bad.onnx", "-o", "out.onnx"]) == EXIT_ERROR
    err = capsys.readouterr().err
    line = one_error(err, "convert")
    assert "the input model is invalid" in line and "'nope'" in line and "is not output of any previous nodes" in line
    assert "please report" not in err and not (work / "out.onnx").exists()


def test_onnxruntime_errors_keep_their_reason_not_the_cpp_signature(work, capsys):
    import onnx
    from onnx import helper

    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=99), "future.onnx")
    assert main(["validate", "future.onnx", "future.onnx"]) == EXIT_ERROR
    line = one_error(capsys.readouterr().err, "validate")
    assert "Unsupported model IR version: 99" in line and "onnxruntime_src" not in line and "::" not in line


_INVALID = {
    "undefined tensor": """
        g (float[2,4] x) => (float[2,4] y) {
          a = MatMul(x, w)
          y = Relu(a)
        }""",
    "mismatched types": """
        g (float[2,4] x, int64[2,4] k) => (float[2,4] y) {
          a = Relu(x)
          y = Add(a, k)
        }""",
}


def _parsed(body: str):
    import onnx.parser

    return onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>' + body)


@pytest.mark.parametrize("case", sorted(_INVALID))
def test_explain_refuses_an_invalid_input_model_as_convert_does(work, capsys, case):
    """explain printed colors for a model onnx.checker rejects and exited 0."""
    import onnx

    onnx.save(_parsed(_INVALID[case]), "bad.onnx")
    assert main(["explain", "bad.onnx"]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert "the input model is invalid" in one_error(captured.err, "explain") and captured.out == ""


def test_explain_takes_a_valid_model_whose_nodes_are_out_of_order(work, capsys):
    """convert sorts the nodes of an unsorted export; explain must not call it invalid."""
    import onnx

    model = _parsed("""
        g (float[2,4] x, float[4,4] w) => (float[2,4] y) {
          a = MatMul(x, w)
          y = Relu(a)
        }""")
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    onnx.save(model, "unsorted.onnx")
    assert main(["explain", "unsorted.onnx"]) == 0
    assert "allow=2" in capsys.readouterr().out


def test_python_explain_refuses_an_invalid_input_model_as_convert_does():
    """onnxmp.explain colored a model onnx.checker rejects; the library applies the CLI's input check."""
    import onnxmp
    from onnxmp.errors import OnnxMPError

    with pytest.raises(OnnxMPError, match="the input model is invalid"):
        onnxmp.explain(_parsed(_INVALID["mismatched types"]))
    valid = _parsed("""
        g (float[2,4] x, float[4,4] w) => (float[2,4] y) {
          a = MatMul(x, w)
          y = Relu(a)
        }""")
    assert onnxmp.explain(valid).changed


# --- --keep-io-types NAME... ----------------------------------------------------------------------


def _io_types(path) -> dict[str, int]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}


def test_keep_io_types_names_keep_those_and_lower_the_rest_then_validate_feeds_fp16(work, capsys):
    import onnx

    shutil.copy(MODELS / "kv_decoder.onnx", work / "dec.onnx")
    shutil.copy(MODELS / "kv_decoder.inputs.npz", work / "dec.npz")
    assert main(["convert", "dec.onnx", "-o", "dec16.onnx", "--keep-io-types", "logits"]) == 0
    types = _io_types(work / "dec16.onnx")
    assert types["logits"] == onnx.TensorProto.FLOAT and types["input_ids"] == onnx.TensorProto.INT64
    assert {t for n, t in types.items() if n.startswith(("past_key_values.", "present."))} == {onnx.TensorProto.FLOAT16}
    assert main(["validate", "dec.onnx", "dec16.onnx", "--inputs", "dec.npz"]) == 0
    # Without names the flag is the default: everything kept.
    assert main(["convert", "m.onnx", "-o", "kept.onnx", "--keep-io-types"]) == 0
    assert set(_io_types(work / "kept.onnx").values()) == {onnx.TensorProto.FLOAT}
    assert main(["convert", "m.onnx", "-o", "low.onnx", "--no-keep-io-types"]) == 0
    assert set(_io_types(work / "low.onnx").values()) == {onnx.TensorProto.FLOAT16}


def test_keep_io_types_name_matching_nothing_is_one_error_line(work, capsys):
    assert main(["convert", "m.onnx", "-o", "out.onnx", "--keep-io-types", "logit"]) == EXIT_ERROR
    line = one_error(capsys.readouterr().err, "convert")
    assert "'logit' matches no graph input or output" in line
    assert not (work / "out.onnx").exists()


def test_keep_io_types_and_no_keep_io_types_together_is_a_usage_error(work, capsys):
    assert main(["convert", "m.onnx", "-o", "out.onnx", "--keep-io-types", "x", "--no-keep-io-types"]) == EXIT_USAGE
