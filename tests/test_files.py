"""Tests for onnxmp.files: the output-path guard and the atomic writers."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.files import (all_or_nothing, atomic_directory, atomic_write, destination, file_mode, guard_outputs,
                          umask, write_bytes_atomic, write_text_atomic)


@contextmanager
def process_umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_umask_is_read_without_changing_it():
    with process_umask(0o027):
        assert umask() == 0o027
        assert file_mode() == 0o640
        assert os.umask(0o027) == 0o027


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_umask_mode_not_mkstemps_0600(tmp_path, mask, expected):
    with process_umask(mask):
        write_text_atomic(tmp_path / "r.json", "{}")
        write_bytes_atomic(tmp_path / "p.png", b"\x89PNG")
    assert mode(tmp_path / "r.json") == expected and mode(tmp_path / "p.png") == expected
    assert (tmp_path / "r.json").read_text() == "{}"


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        atomic_write(target, fail)
    assert target.read_text() == "old" and leftovers(tmp_path) == []


def test_os_error_while_writing_is_one_line(tmp_path):
    def fail(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(OnnxMPError, match="cannot write .*No space left"):
        atomic_write(tmp_path / "x.bin", fail)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_replaces_a_symlink_not_its_target(tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("keep")
    link = tmp_path / "link.txt"
    link.symlink_to(other)
    write_text_atomic(link, "new")
    assert other.read_text() == "keep" and link.read_text() == "new" and not link.is_symlink()


def test_all_or_nothing_lands_every_file_together(tmp_path):
    (tmp_path / "b.txt").write_text("old")
    with all_or_nothing():
        write_text_atomic(tmp_path / "a.txt", "a")
        with all_or_nothing():  # joins the outer block
            write_text_atomic(tmp_path / "b.txt", "b")
        assert not (tmp_path / "a.txt").exists() and (tmp_path / "b.txt").read_text() == "old"
    assert (tmp_path / "a.txt").read_text() == "a" and (tmp_path / "b.txt").read_text() == "b"
    assert leftovers(tmp_path) == [] and mode(tmp_path / "a.txt") == file_mode()


@pytest.mark.parametrize("failure", [KeyboardInterrupt, ValueError])
def test_all_or_nothing_failure_leaves_no_new_file_and_the_old_ones(tmp_path, failure):
    (tmp_path / "b.txt").write_text("old")
    with pytest.raises(failure):
        with all_or_nothing():
            write_text_atomic(tmp_path / "a.txt", "a")
            write_text_atomic(tmp_path / "b.txt", "b")
            raise failure()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"] and (tmp_path / "b.txt").read_text() == "old"
    write_text_atomic(tmp_path / "c.txt", "c")  # outside the block, writes land at once again
    assert (tmp_path / "c.txt").read_text() == "c"


def test_all_or_nothing_takes_a_models_external_data_with_it(tmp_path):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from onnxmp.save import save

    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], [weight])
    model = helper.make_model(graph)
    with pytest.raises(KeyboardInterrupt):
        with all_or_nothing():
            save(model, tmp_path / "m.onnx", external_data=True)
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with all_or_nothing():
        save(model, tmp_path / "m.onnx", external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    loaded = onnx.load(tmp_path / "m.onnx")
    assert numpy_helper.to_array(loaded.graph.initializer[0]).sum() == 16


# --- guard -------------------------------------------------------------------------


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"model")
    return path


def test_guard_accepts_fresh_and_existing_outputs(tmp_path, model):
    (tmp_path / "old.json").write_text("x")
    guard_outputs({"-o": tmp_path / "out.onnx", "--report": tmp_path / "old.json", "--plot": None},
                  {"model": model, "--inputs": None})


@pytest.mark.parametrize("how", ["same", "relative", "symlink", "hardlink"])
def test_guard_refuses_an_input_however_it_is_named(tmp_path, model, monkeypatch, how):
    if how == "same":
        out = model
    elif how == "relative":
        monkeypatch.chdir(tmp_path)
        (tmp_path / "sub").mkdir()
        out = "sub/../m.onnx"
    elif how == "symlink":
        out = tmp_path / "link.onnx"
        out.symlink_to(model)
    else:
        out = tmp_path / "hard.onnx"
        os.link(model, out)
    with pytest.raises(OnnxMPError, match="is the model") as info:
        guard_outputs({"-o": out}, {"model": model})
    assert "choose another -o" in info.value.hint
    assert model.read_bytes() == b"model"


def test_guard_refuses_one_of_several_inputs(tmp_path, model):
    npz = [tmp_path / "a.npz", tmp_path / "b.npz"]
    for p in npz:
        p.write_bytes(b"npz")
    with pytest.raises(OnnxMPError, match=r"--report .*b\.npz is the --calibrate"):
        guard_outputs({"--report": npz[1]}, {"model": model, "--calibrate": npz})


def test_guard_refuses_two_outputs_on_one_path(tmp_path, model):
    out = tmp_path / "out.onnx"
    with pytest.raises(OnnxMPError, match="--report and -o both name"):
        guard_outputs({"-o": out, "--report": tmp_path / "." / "out.onnx"}, {"model": model})


def _model_with_external_data(folder, location="weights.bin"):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], [weight])
    path = folder / "ext.onnx"
    onnx.save(helper.make_model(graph), path, save_as_external_data=True, location=location, size_threshold=0)
    return path


@pytest.mark.parametrize("location", ["weights.bin", "out.onnx.data"])
def test_guard_refuses_the_external_data_of_an_input(tmp_path, location):
    """`convert ext.onnx -o weights.bin` wrote the converted model over the input's weights."""
    model = _model_with_external_data(tmp_path, location)
    data = (tmp_path / location).read_bytes()
    with pytest.raises(OnnxMPError, match=rf"{location.replace('.', '.')} is the external data of the model"):
        guard_outputs({"-o": tmp_path / location}, {"model": model})
    with pytest.raises(OnnxMPError, match="is the external data of the model"):  # through the output's own data
        guard_outputs({"-o": tmp_path / "out.onnx", "external data": tmp_path / location}, {"model": model})
    guard_outputs({"-o": tmp_path / "other.bin"}, {"model": model})
    assert (tmp_path / location).read_bytes() == data


def test_guard_does_not_parse_a_model_that_keeps_its_weights_inside(tmp_path, monkeypatch):
    """Re-running a conversion over its old output must not load a 2 GB input model once more."""
    import onnx

    (tmp_path / "old.onnx").write_bytes(b"old output")
    model = _model_with_external_data(tmp_path)
    inside = tmp_path / "inside.onnx"
    onnx.save(onnx.load(model), inside, save_as_external_data=False)
    monkeypatch.setattr(onnx, "load_model", lambda *a, **k: pytest.fail("parsed a model without external data"))
    guard_outputs({"-o": tmp_path / "old.onnx"}, {"model": inside})


def test_guard_refuses_a_missing_folder(tmp_path):
    with pytest.raises(OnnxMPError, match="folder of --report .* does not exist") as info:
        guard_outputs({"--report": tmp_path / "nodir" / "r.json"})
    assert "mkdir -p" in info.value.hint


@pytest.fixture
def read_only_folder():
    """A folder with mode 0555 in a folder anyone may write (the unprivileged user must reach both)."""
    base = Path(tempfile.mkdtemp())
    base.chmod(0o777)  # writable for the unprivileged user too: only "ro" is read-only
    folder = base / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)
    shutil.rmtree(base)


@contextmanager
def unprivileged():
    """Run the block as a user the file modes apply to.

    Root writes anywhere, and CI runs as root, so there the real and effective
    uid become 65534 (nobody) for the block: the folder is really read-only to
    the process, nothing is simulated.  The saved uid stays 0, which is what
    allows the switch back.
    """
    if not hasattr(os, "setresuid") or os.geteuid() != 0:
        yield
        return
    os.setresuid(65534, 65534, 0)
    try:
        yield
    finally:
        os.setresuid(0, 0, 0)


def test_guard_refuses_a_read_only_folder(read_only_folder):
    with unprivileged():
        assert not os.access(read_only_folder, os.W_OK)  # the premise: this user really cannot write there
        with pytest.raises(OnnxMPError, match="not writable"):
            guard_outputs({"--plot": read_only_folder / "p.png"})
        guard_outputs({"--plot": read_only_folder.parent / "p.png"})  # its writable parent is fine
    assert os.geteuid() == os.getuid()  # back to the test's own user
    assert list(read_only_folder.iterdir()) == []


def test_guard_refuses_a_device_or_pipe_it_would_replace(tmp_path):
    """`-o /dev/null` passed the guard, and as root the rename would have replaced the device node."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "to-pipe"
    link.symlink_to(fifo)
    for path in (fifo, link, "/dev/null"):
        with pytest.raises(OnnxMPError, match="is not a regular file") as info:
            guard_outputs({"--report": path})
        assert "regular file" in info.value.message and info.value.hint
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.path.exists("/dev/null")


def test_guard_refuses_an_existing_folder_as_a_file_output(tmp_path):
    (tmp_path / "dir.onnx").mkdir()
    with pytest.raises(OnnxMPError, match="is an existing folder"):
        guard_outputs({"-o": tmp_path / "dir.onnx"})


def test_output_folders_may_exist_but_not_hold_an_input(tmp_path, model):
    out = tmp_path / "run"
    out.mkdir()
    guard_outputs({"--out": out}, {"model": model}, folders=["--out"])
    with pytest.raises(OnnxMPError, match="holds the model"):
        guard_outputs({"--out": tmp_path}, {"model": model}, folders=["--out"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(OnnxMPError, match="not a folder"):
        guard_outputs({"--out": tmp_path / "file"}, folders=["--out"])


# --- folders ------------------------------------------------------------------------


def test_atomic_directory_appears_whole_and_replaces_the_old_one(tmp_path):
    target = tmp_path / "artifacts"
    target.mkdir()
    (target / "stale.bin").write_text("old")
    with process_umask(0o022), atomic_directory(target) as tmp:
        assert not (tmp / "stale.bin").exists() and tmp.parent == tmp_path
        (tmp / "model.onnx").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["model.onnx"]
    assert mode(target) == 0o755 and leftovers(tmp_path) == []


def test_atomic_directory_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "artifacts"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "half.onnx").write_text("x")
            raise RuntimeError("label key missing")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_keeps_the_old_folder_on_error(tmp_path):
    target = tmp_path / "artifacts"
    target.mkdir()
    (target / "keep.bin").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(target):
            raise RuntimeError("boom")
    assert (target / "keep.bin").read_text() == "old" and leftovers(tmp_path) == []


def test_destination_names_the_final_path_inside_nested_atomic_directories(tmp_path, monkeypatch):
    """Logs named `.run.x1y2.tmp/.artifacts.z3.tmp/model.onnx`, a folder gone after the run."""
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "other" / "file.onnx"
    assert destination("run/model.onnx") == Path("run/model.onnx")  # no folder open: unchanged
    with atomic_directory("run") as outer:
        assert destination(outer / "state") == Path("run/state")
        with atomic_directory(outer / "artifacts") as inner:
            assert destination(inner / "model.onnx") == Path("run/artifacts/model.onnx")
            assert destination(tmp_path / inner / "model.onnx") == Path("run/artifacts/model.onnx")
            assert destination(elsewhere) == elsewhere
        assert destination(inner / "model.onnx") == Path("run", inner.name, "model.onnx")  # inner closed
    with atomic_directory(tmp_path / "abs") as folder:
        assert destination(folder / "x.json") == tmp_path / "abs" / "x.json"
    assert destination(folder / "x.json") == folder / "x.json"


# --- save goes through the same guard and writer -------------------------------------


def test_save_refuses_its_source_and_writes_the_umask_mode(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    import onnxmp

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), src)
    before = src.read_bytes()
    link = tmp_path / "link.onnx"
    link.symlink_to(src)
    with pytest.raises(OnnxMPError, match="is the source model"):
        onnxmp.save(onnx.load(src), link, source=src)
    assert src.read_bytes() == before and link.is_symlink()
    with process_umask(0o022):
        onnxmp.save(onnx.load(src), tmp_path / "out.onnx", source=src)
    assert mode(tmp_path / "out.onnx") == 0o644 and leftovers(tmp_path) == []


def test_save_refuses_the_weights_file_the_model_reads_without_being_told_the_source(tmp_path):
    """onnxmp.save(convert('ext.onnx').model, 'weights.bin') overwrote the input's weights (no source= given)."""
    import onnx

    import onnxmp

    import numpy as np
    from onnx import helper, numpy_helper

    weights = [numpy_helper.from_array(np.ones((4, 4), np.float32), "w"),
               numpy_helper.from_array(np.full(4, 2.0, np.float32), "e")]  # Pow is denied: e stays float32
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Pow", ["m", "e"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], weights)
    model_path = tmp_path / "ext.onnx"
    onnx.save(helper.make_model(graph), model_path, save_as_external_data=True, location="new.onnx.data",
              size_threshold=0)
    data = (tmp_path / "new.onnx.data").read_bytes()
    result = onnxmp.convert(str(model_path))  # e is still read lazily from new.onnx.data
    with pytest.raises(OnnxMPError, match="new.onnx.data is the weights file the model reads"):
        onnxmp.save(result.model, tmp_path / "new.onnx.data")
    with pytest.raises(OnnxMPError, match="weights file the model reads"):  # nor through the output's .data
        onnxmp.save(result.model, tmp_path / "new.onnx", external_data=True)
    assert (tmp_path / "new.onnx.data").read_bytes() == data
    onnxmp.save(result.model, tmp_path / "out.onnx")
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=True)
