"""The training scripts run (smoke tests, CPU)."""
import json
import subprocess
import sys
from pathlib import Path

from builders import needs_training_build

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _run(*args, cwd):
    done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_validate_training_quick(tmp_path):
    out = _run(SCRIPTS / "validate_training.py", "--quick", "--no-progress", "--json", tmp_path / "v.json",
               "--plot", tmp_path / "v.png", cwd=tmp_path)
    figures = json.loads((tmp_path / "v.json").read_text())
    assert set(figures) >= {"fp32", "amp_dynamic", "amp_scale1", "skipped_steps", "underflow_case"}
    assert set(figures["underflow_case"]) >= {"fp32", "amp_dynamic", "amp_scale1"}
    assert all(0 <= figures[k] <= 1 for k in ("fp32", "amp_dynamic", "amp_scale1"))
    assert (tmp_path / "v.png").stat().st_size > 10_000
    assert "underflow" in out
    transformer = figures["transformer"]
    assert set(transformer) == {"fp32", "amp_dynamic", "amp_scale1"}
    for run in transformer.values():
        assert 0 <= run["accuracy"] <= 1 and run["final_loss"] < run["first_loss"]
    assert "transformer classifier" in out


def test_bench_training_small(tmp_path):
    out = _run(SCRIPTS / "bench_training.py", "--sizes", "16-32-4", "--batch-size", "8", "--steps", "5",
               "--warmup", "1", "--json", tmp_path / "b.json", cwd=tmp_path)
    figures = json.loads((tmp_path / "b.json").read_text())
    assert set(figures["results"]) == {"float32", "float16"}
    assert all(r["steps_per_s"] > 0 for r in figures["results"].values())
    assert "steps/s" in out


@needs_training_build  # the native engine
def test_bench_training_engines_one_entry(tmp_path):
    out = _run(SCRIPTS / "bench_training.py", "--engines", "--entries", "resnet.torchscript17-bn", "--steps", "3",
               "--warmup", "1", "--optimizer", "sgd", "--json", tmp_path / "e.json", cwd=tmp_path)
    row = json.loads((tmp_path / "e.json").read_text())["rows"]["resnet.torchscript17-bn"]
    assert row["ratio"] > 0 and row["same_skips_and_scales"] and row["max_rel_loss_diff"] < 1e-4
    assert "resnet.torchscript17-bn" in out and "ratio" in out


@needs_training_build  # both builders, and the native engine
def test_bench_training_builders_one_entry(tmp_path):
    out = _run(SCRIPTS / "bench_training.py", "--builders", "--entries", "resnet.torchscript17", "--steps", "2",
               "--warmup", "1", "--json", tmp_path / "b.json", cwd=tmp_path)
    row = json.loads((tmp_path / "b.json").read_text())["rows"]["resnet.torchscript17"]
    assert row["nodes_ort"] > 0 and row["nodes_onnxmp"] > 0 and row["int64_before"] > row["int64_after"] >= 0
    for variant in ("ort", "onnxmp"):
        for threads in (1, 2):
            assert row[f"{variant}_{threads}"]["seconds"] > 0 and row[f"{variant}_{threads}"]["peak_rss_mib"] > 0
    assert "torch" in row["torch_1"]["error"]  # no --torch-python: the row says so, the others still run
    assert "resnet.torchscript17" in out and "int64 before" in out


def test_bench_distributed_small(tmp_path):
    import shutil

    import pytest

    pytest.importorskip("mpi4py")
    if shutil.which("mpiexec", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("no mpiexec beside this Python")
    out = _run(SCRIPTS / "bench_distributed.py", "--sizes", "16-32-4", "--batch-size", "8", "--steps", "3",
               "--warmup", "1", "--rounds", "1", "--json", tmp_path / "b.json", cwd=tmp_path)
    runs = json.loads((tmp_path / "b.json").read_text())["runs"]
    assert [(r["ranks"], r["k"]) for r in runs] == [(1, 1), (1, 2), (2, 1)]
    assert all(r["updates_per_s"] > 0 for r in runs) and 0 < runs[-1]["comm_share"] < 1
    assert "2 rank(s) x 1 micro-batch" in out and "comm" in out


def test_train_matrix_one_entry(tmp_path):
    out = _run(SCRIPTS / "train_matrix.py", "resnet.torchscript17-bn", "--json", cwd=tmp_path)
    row = json.loads(out)["resnet.torchscript17-bn"]
    for precision in ("float32", "float16", "bfloat16"):
        assert row[precision]["final"] < row[precision]["initial"], precision
    assert row["float32"]["frozen"] == 12  # each BatchNormalization's running mean and variance


@needs_training_build  # the native graphs of ORT's builder, checked beside the portable ones
def test_check_cuda_builds_one_entry(tmp_path):
    out = _run(SCRIPTS / "check_cuda_builds.py", "resnet.torchscript14", "--precisions", "bfloat16", "--json",
               cwd=tmp_path)
    build = json.loads(out)["resnet.torchscript14/bfloat16"]
    graphs = build["graphs"]
    kinds = ("training_model", "eval_model", "optimizer_model")
    assert set(graphs) == {f"{k}.onnx" for k in kinds} | {f"{k}.portable.onnx" for k in kinds}
    assert all(g["ok"] for g in graphs.values())
    # The portable form is what plain onnxruntime's CUDA EP runs: nothing in it may lack a kernel there.
    for kind in kinds:
        assert graphs[f"{kind}.portable.onnx"]["without_cuda_kernel"] == {}, kind
        assert graphs[f"{kind}.portable.onnx"]["not_onnx"] == {}, kind
    assert graphs["training_model.onnx"]["not_onnx"] == {"MaxPoolGrad": 1}  # onnxruntime-training's own
    assert "ConvGrad" in graphs["training_model.onnx"]["without_cuda_kernel"]


def test_train_portable_table_one_entry(tmp_path):
    # Built here, trained by a second interpreter (this one) on the portable engine.
    out = _run(SCRIPTS / "train_portable_table.py", "--entries", "resnet.torchscript17", "--precisions", "float32",
               "float16", cwd=tmp_path)
    rows = [line.split() for line in out.splitlines() if line.startswith("resnet.torchscript17")]
    assert [r[1] for r in rows] == ["float32", "float16"] and all(r[-1] == "ok" for r in rows)
    assert "engine portable" in out
