"""Hostile models and sample files (models/hostile.py) through every command: one clear line, no byte
read outside the model's folder, nothing left behind, bounded memory (issue 32)."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from models.hostile import CASES, NPZ_CASES, SECRET, W, write_model_cases, write_npz_cases
from onnxmp.cli import EXIT_ERROR, main
from onnxmp.errors import OnnxMPError

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("convert", "calibrate", "explain", "emulate", "validate", "train", "compat")
# What must never reach a user for a bad model: the boundary's wording for an onnxmp bug, and Python's.
BUG_WORDS = ("please report", "Traceback", "MemoryError", "Unable to allocate")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return root, write_model_cases(root), write_npz_cases(root)


class Watch:
    """inotify on one file: whether anything opened or read it (C code included: onnx, numpy, onnxruntime)."""
    IN_ACCESS, IN_OPEN = 0x1, 0x20

    def __init__(self, path: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or self.libc.inotify_add_watch(self.fd, str(path).encode(), self.IN_ACCESS | self.IN_OPEN) < 0:
            pytest.skip("inotify is not available here")

    def touched(self) -> bool:
        try:
            return bool(os.read(self.fd, 4096))
        except BlockingIOError:
            return False

    def close(self):
        os.close(self.fd)


def test_the_watch_sees_an_open_from_c_code(corpus):
    """The control for the checks below: numpy's C reader opening the secret is seen."""
    root, models, npz = corpus
    watch = Watch(root / "secret.bin")
    try:
        assert not watch.touched()
        np.fromfile(root / "secret.bin", dtype=np.uint8, count=1)
        assert watch.touched()
    finally:
        watch.close()


def argv(command: str, model: Path, out: Path, npz: dict[str, Path], trust: bool = False) -> list[str]:
    extra = ["--trust-external-data"] if trust else []
    return {
        "convert": ["convert", str(model), "-o", str(out / "o.onnx"), "--report", str(out / "r.json")],
        "calibrate": ["convert", str(model), "-o", str(out / "o.onnx"), "--calibrate", str(npz["good_inputs"])],
        "explain": ["explain", str(model), "--json"],
        "emulate": ["emulate", str(model), "-o", str(out / "o.onnx")],
        "validate": ["validate", str(model), str(model), "--inputs", str(npz["good_inputs"]),
                     "--report", str(out / "v.json")],
        "train": ["train", str(model), "--data", str(npz["good_data"]), "--inputs", "x", "--labels", "y",
                  "--loss", "mse", "--epochs", "1", "--batch-size", "2", "--out", str(out / "t"), "--no-progress"],
    }[command] + extra


def run_command(command: str, model: Path, out: Path, npz, capsys, trust: bool = False) -> tuple[int, str]:
    """(exit status, everything printed) of one command; ``compat`` runs the onnxconverter-common
    functions that take a path, and reports an OnnxMPError as the CLI would (status 1, its line)."""
    out.mkdir()
    if command == "compat":
        from onnxmp.compat.auto_mixed_precision_model_path import auto_convert_mixed_precision_model_path
        from onnxmp.compat.float16 import convert_float_to_float16_model_path
        from onnxmp.tensordata import trust_external_data

        try:
            with trust_external_data(trust):
                convert_float_to_float16_model_path(model)
                feed = {"x": np.ones((2, 4), np.float32)}
                auto_convert_mixed_precision_model_path(model, feed, out / "o.onnx", ["CPUExecutionProvider"],
                                                        rtol=10, atol=10)
            code, text = 0, ""
        except OnnxMPError as exc:
            code, text = EXIT_ERROR, f"compat: error: {exc.one_line()}"
        captured = capsys.readouterr()
        return code, text + captured.out + captured.err
    code = main(argv(command, model, out, npz, trust))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if ": error: " in line]
    assert len(lines) == 1, text
    return lines[0].split(": error: ", 1)[1]


def written(out: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and not p.is_symlink())


TABLE: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_model_gets_one_line_and_nothing_outside_its_folder_is_read(corpus, case, command, tmp_path,
                                                                              capsys):
    root, models, npz = corpus
    watch = Watch(root / "secret.bin")
    try:
        code, text = run_command(command, models[case], tmp_path / "out", npz, capsys)
        assert not watch.touched(), f"{case}/{command} opened the secret file outside the model's folder"
    finally:
        watch.close()
    assert not any(word in text for word in BUG_WORDS), text
    assert SECRET not in text.encode() and SECRET[::-1] not in text.encode()
    output = written(tmp_path / "out")
    assert SECRET not in output and SECRET[::-1] not in output  # the oversized file's tail is never copied
    if CASES[case] == "refused":
        assert code == EXIT_ERROR, text
        TABLE[case, command] = error_line(text)
        assert not any((tmp_path / "out").iterdir()), "a refused model left an output behind"
    else:  # train included: onnxmp's gradient builder builds it where onnxruntime-training is absent
        assert code == 0, text
        TABLE[case, command] = "ok"


def test_accepted_cases_read_exactly_the_declared_bytes(corpus, tmp_path, capsys):
    """Overlapping ranges and a data file longer than the model reads are harmless: each tensor gets its
    own declared bytes (read once per tensor), and nothing past them."""
    root, models, npz = corpus
    assert main(["convert", str(models["overlapping_offsets"]), "-o", str(tmp_path / "o.onnx"),
                 "--precision", "float16", "--keep-io-types"]) == 0
    out = onnx.load(str(tmp_path / "o.onnx"))
    values = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    assert np.array_equal(values["W"].astype(np.float32), W) and np.array_equal(values["V"].astype(np.float32), W)
    assert main(["convert", str(models["oversized_file"]), "-o", str(tmp_path / "p.onnx")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("case", ["absolute", "traversal", "symlink_escape"])
def test_the_opt_in_lets_a_trusted_model_reach_outside_its_folder(corpus, case, tmp_path, capsys):
    root, models, npz = corpus
    assert main(["convert", str(models[case]), "-o", str(tmp_path / "o.onnx"), "--trust-external-data"]) == 0
    out = onnx.load(str(tmp_path / "o.onnx"))
    assert out.graph.initializer[0].name == "W"
    capsys.readouterr()


@pytest.mark.parametrize("case", ["device", "fifo", "huge_dims", "negative_offset", "truncated"])
def test_the_opt_in_never_skips_the_file_and_size_checks(corpus, case, tmp_path, capsys):
    root, models, npz = corpus
    code, text = run_command("convert", models[case], tmp_path / "out", npz, capsys, trust=True)
    assert code == EXIT_ERROR and "please report" not in text
    assert f"tensor `W`" in error_line(text)


@pytest.mark.parametrize("flag", ["--inputs", "--calibrate", "--data"])
@pytest.mark.parametrize("case", sorted(NPZ_CASES))
def test_a_hostile_npz_is_refused_unread(corpus, case, flag, tmp_path, capsys):
    root, models, npz = corpus
    model = tmp_path / "m.onnx"
    model.write_bytes(onnx.load(str(models["overlapping_offsets"])).SerializeToString())
    (tmp_path / "w.bin").write_bytes(W.tobytes())
    bad, out = str(npz[case]), tmp_path / "out"
    out.mkdir()
    command = {
        "--inputs": ["validate", str(model), str(model), "--inputs", bad],
        "--calibrate": ["convert", str(model), "-o", str(out / "o.onnx"), "--calibrate", bad],
        "--data": ["train", str(model), "--data", bad, "--inputs", "x", "--labels", "y", "--loss", "mse",
                   "--epochs", "1", "--batch-size", "2", "--out", str(out / "t")],
    }[flag]
    code = main(command)
    text = "".join(capsys.readouterr())
    assert code == EXIT_ERROR, text
    assert not any(word in text for word in BUG_WORDS), text
    TABLE[case, flag] = error_line(text)
    assert not any(out.iterdir())


def test_an_embedded_tensor_that_declares_more_than_it_holds_is_refused_by_the_api(corpus):
    root, models, npz = corpus
    import onnxmp

    proto = onnx.load(str(models["huge_dims_embedded"]))
    for call in (lambda: onnxmp.convert(proto), lambda: onnxmp.explain(proto), lambda: onnxmp.emulate(proto, "float16")):
        with pytest.raises(OnnxMPError, match=r"tensor `W`: raw_data holds 16 bytes but dims \[1099511627776\]"):
            call()


_MEMORY_SCRIPT = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from onnxmp.cli import main
runs = json.loads(sys.argv[2])
codes = [main(argv) for argv in runs]
print(json.dumps({"codes": codes, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_peak_memory_stays_under_1_gib(corpus, tmp_path):
    """The cases that declare terabytes (and the 512 MiB zip bomb), every command, in one process under
    a 1.5 GiB address-space limit (onnxruntime, training included, runs under it): refused before any
    allocation, the process never above 1 GiB resident."""
    root, models, npz = corpus
    runs = []
    for case in ("huge_dims", "huge_dims_embedded", "overflow_dims", "oversized_length"):
        for command in ("convert", "calibrate", "explain", "emulate", "validate", "train"):
            out = tmp_path / f"{case}-{command}"
            out.mkdir()
            runs.append(argv(command, models[case], out, npz))
    model = models["overlapping_offsets"]
    for bad in ("zip_bomb", "lying_header"):
        runs.append(["validate", str(model), str(model), "--inputs", str(npz[bad])])
        runs.append(["convert", str(model), "-o", str(tmp_path / f"{bad}.onnx"), "--calibrate", str(npz[bad])])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29)); "
    done = subprocess.run([sys.executable, "-c", limit + _MEMORY_SCRIPT, str(ROOT), json.dumps(runs)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["codes"] == [EXIT_ERROR] * len(runs), done.stderr[-3000:]
    assert "please report" not in done.stderr and "MemoryError" not in done.stderr
    assert result["maxrss_kib"] < 1 << 20, result


def test_zz_corpus_table(capsys):
    """Prints the case x command table gathered above (pytest -s shows it; the report quotes it)."""
    with capsys.disabled():
        for (case, command), line in sorted(TABLE.items()):
            print(f"{case:20} {command:10} {line[:150]}")


def test_data_in_a_subfolder_or_behind_a_symlink_that_stays_inside_is_read(tmp_path, capsys):
    """The rules do not fire on what exporters write: a relative path into a subfolder, and a symlink
    whose target is inside the model's folder."""
    from models.hostile import _external, _model

    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "w.bin").write_bytes(W.tobytes())
    os.symlink("weights/w.bin", tmp_path / "link.bin")
    for location in ("weights/w.bin", "./weights/../weights/w.bin", "link.bin"):
        (tmp_path / "m.onnx").write_bytes(_model([_external("W", [4, 4], location)]).SerializeToString())
        assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx")]) == 0, location
        values = onnx.numpy_helper.to_array(onnx.load(str(tmp_path / "o.onnx")).graph.initializer[0])
        assert np.array_equal(values.astype(np.float32), W)
        import onnxmp

        loaded = onnxmp.load(tmp_path / "m.onnx")  # the eager path: the same reader, into raw_data
        assert np.array_equal(onnx.numpy_helper.to_array(loaded.graph.initializer[0]), W)
    capsys.readouterr()
