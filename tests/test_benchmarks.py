"""Smoke tests of the benchmark and GPU-check scripts: each runs as a subprocess on
its smallest setting and must exit 0 with the JSON fields its readers rely on."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)  # gpu_check.sh --dry-run uses this interpreter
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_bench_convert_smallest(tmp_path):
    out = tmp_path / "convert.json"
    proc = run([sys.executable, str(SCRIPTS / "bench_convert.py"), "--sizes", "1k", "--repeat", "1",
                "--json", str(out)], timeout=120)
    assert "ours/occ" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["shapes"]) == {"quadratic-occ", "linear-occ"}
    for shape in data["shapes"].values():
        (row,) = shape["rows"]
        assert row["size"] == "1k" and 900 <= row["nodes"] <= 1100
        for thing in ("ours", "occ", "floor"):
            assert row[thing]["total"] > 0 and not row[thing]["timed_out"]
        assert set(row["ours"]["stages"]) == {"load", "normalize", "color", "rewrite", "verify"}
        assert row["ours_over_occ"]["value"] > 0
        assert set(row["growth_per_4x"]) == {"ours", "occ", "floor"}
        assert row["peak_rss_mb"]["ours"] > 0 and row["peak_rss_mb"]["occ"] > 0
        assert {"ours_over_occ_at_largest", "ours_growth_per_4x", "peak_rss_ours_over_occ"} <= set(shape["targets"])


def test_bench_large_runs_every_command_on_a_small_stand_in(tmp_path):
    folder = tmp_path / "large"
    proc = run([sys.executable, str(SCRIPTS / "bench_large.py"), "--layers", "2", "--width", "64",
                "--folder", str(folder)], timeout=300)
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["convert", "convert", "validate", "emulate", "explain"]
    assert all(row[-1] == "0" for row in rows), proc.stdout  # every command exited 0
    assert not folder.exists()  # the generated model and the outputs are deleted


def test_bench_passes_prints_growth_per_pass():
    proc = run([sys.executable, str(SCRIPTS / "bench_passes.py"), "--sizes", "300,1200", "--repeat", "1"],
               timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split(" | ")[-1] == "growth per 4x"
    rows = [line.split(" | ") for line in lines[1:]]
    assert any(row[0].startswith("onnx infer_shapes") for row in rows) and len(rows) == 5
    for row in rows:
        assert float(row[-1].rstrip("x")) > 0


def test_bench_passes_refuses_one_size():
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_passes.py"), "--sizes", "20k"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "two or more increasing sizes" in proc.stderr


def test_bench_models_two_models(tmp_path):
    out = tmp_path / "models.json"
    run([sys.executable, str(SCRIPTS / "bench_models.py"), "--only", "mlp,cnn_bn", "--json", str(out)], timeout=60)
    data = json.loads(out.read_text())
    assert [m["name"] for m in data["models"]] == ["cnn_bn", "mlp"]
    for model in data["models"]:
        for tool in ("ours", "occ"):
            entry = model[tool]
            assert entry["error"] is None
            assert entry["casts"] >= 0 and 0 <= entry["heavy_fp16_share"] <= 1 and entry["size_ratio"] > 0
            assert entry["parity"]["passed"] and entry["parity"]["cosine"] > 0.999
        assert model["parity_vs_occ"] in ("better", "equal", "worse")
        assert model["casts_ok"] in (True, False)
    assert "cast_violations" in data and "parity_worse" in data


def test_bench_speed_three_small_models(tmp_path):
    """The speed proxy on tiny shapes: per converter counts that add up, and a --shape-batch
    extrapolation that gives the very same numbers as the full shape run."""
    models = ["models/cnn_bn.onnx", "models/mlp.onnx", "models/transformer_classifier.onnx"]
    out, scaled = tmp_path / "speed.json", tmp_path / "scaled.json"
    proc = run([sys.executable, str(SCRIPTS / "bench_speed.py"), "--models", *models, "--batch", "4",
                "--json", str(out)], timeout=120)
    assert "PROXY" in proc.stdout and "scripts/gpu_check.sh" in proc.stdout
    assert proc.stdout.splitlines()[-2].startswith("geomean")
    run([sys.executable, str(SCRIPTS / "bench_speed.py"), "--models", *models, "--batch", "4", "--shape-batch", "1",
         "--json", str(scaled)], timeout=120)
    data, extrapolated = json.loads(out.read_text()), json.loads(scaled.read_text())
    assert data["config"]["converters"] == ["fp32", "onnxmp", "occ"]
    launch_ms = data["config"]["launch_us"] / 1e3
    rows = {r["name"]: r for r in data["models"]}
    assert list(rows) == ["cnn_bn", "mlp", "transformer_classifier"]
    assert rows["cnn_bn"]["shapes"] == {"x": [4, 3, 32, 32]}
    assert rows["transformer_classifier"]["shapes"] == {"input_ids": [4, 12], "attention_mask": [4, 12]}
    for row, other in zip(data["models"], extrapolated["models"]):
        assert row["error"] is None
        convs = row["converters"]
        assert set(convs) == {"fp32", "onnxmp", "occ"}
        for tool, c in convs.items():
            assert c["error"] is None and c["n_unknown_shapes"] == 0
            assert 0 < c["kernels"] <= c["nodes"] and 0 <= c["cast_pairs"] <= c["casts"] <= c["kernels"]
            dtypes = {k: v for k, v in c["bytes"].items() if k != "total"}
            assert c["bytes"]["total"] == sum(dtypes.values()) > 0
            assert c["ms"] == pytest.approx(c["launch_ms"] + c["roofline_ms"])
            assert c["launch_ms"] == pytest.approx(c["kernels"] * launch_ms) and c["roofline_ms"] > 0
            assert sum(op["count"] for op in c["by_op"].values()) == c["kernels"]
            assert sum(op["us"] for op in c["by_op"].values()) / 1e3 == pytest.approx(c["ms"])
            assert other["converters"][tool]["bytes"] == c["bytes"]  # --shape-batch: the same shapes
        assert "float16" not in convs["fp32"]["bytes"] and convs["onnxmp"]["bytes"]["float16"] > 0
        for tool in ("onnxmp", "occ"):  # a converter adds Cast kernels, no others
            added = convs[tool]["casts"] - convs["fp32"]["casts"]
            assert added >= 0 and convs[tool]["kernels"] == convs["fp32"]["kernels"] + added
        assert row["speedup_onnxmp"] == pytest.approx(convs["fp32"]["ms"] / convs["onnxmp"]["ms"])
        assert row["onnxmp_over_occ"] == pytest.approx(convs["onnxmp"]["ms"] / convs["occ"]["ms"])
    # Every tensor of these two is float32 or float16: lowering can only shrink the bytes moved.
    for name in ("cnn_bn", "mlp"):
        convs = rows[name]["converters"]
        assert set(convs["fp32"]["bytes"]) == {"float32", "total"}
        assert convs["fp32"]["bytes"]["total"] >= convs["onnxmp"]["bytes"]["total"]
    assert set(data["geomean"]) == {"fp32_ms", "onnxmp_ms", "occ_ms", "onnxmp_over_occ", "speedup_onnxmp",
                                    "speedup_occ"}


def test_bench_speed_flop_counts():
    speed = load_script("bench_speed")
    from onnx import helper

    shapes = {"a": (4, 8, 16), "b": (16, 32), "y": (4, 8, 32), "x": (2, 3, 10, 10), "w": (6, 3, 3, 3),
              "c": (2, 6, 8, 8), "g": (5, 16), "h": (32, 16), "z": (5, 32)}
    assert speed.node_flops(helper.make_node("MatMul", ["a", "b"], ["y"]), shapes) == 2 * 4 * 8 * 32 * 16
    assert speed.node_flops(helper.make_node("Conv", ["x", "w"], ["c"]), shapes) == 2 * 2 * 6 * 8 * 8 * 3 * 3 * 3
    gemm = helper.make_node("Gemm", ["g", "h"], ["z"], transB=1)
    assert speed.node_flops(gemm, shapes) == 2 * 5 * 32 * 16
    assert speed.einsum_flops("bij,jk->bik", [(4, 8, 16), (16, 32)]) == 2 * 4 * 8 * 32 * 16
    assert speed.einsum_flops("...ij,...jk->...ik", [(2, 4, 8, 16), (2, 4, 16, 32)]) == 2 * 2 * 4 * 8 * 32 * 16


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the GPU check trains: onnxruntime-training needs Python <= 3.11")
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run(["bash", str(SCRIPTS / "gpu_check.sh"), "--dry-run", "--json", str(out)], timeout=180)
    assert "PASSED" in proc.stdout
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["passed"]
    names = {p["model"] for p in data["parity"]}
    assert {p.stem for p in (ROOT / "models").glob("*.onnx")} == names
    assert [r["model"].split()[0] for r in data["latency"]] == ["bert_tiny", "resnet_tiny", "mobilenetv2.torchscript17"]
    for row in data["latency"]:
        assert "error" not in row, row
        assert row["fp32_ms"] > 0 and row["ours_ms"] > 0 and row["occ_ms"] > 0
        assert row["parity_ours"]["passed"]
    assert {r["model"] for r in data["exports"]} == {"bert_m1e9.torchscript14", "bert_m1e9.torchscript17"}
    assert all(r["passed"] for r in data["exports"])


def test_gpu_check_exports_pass_emulated_on_every_export():
    """The exports step on the CPU (emulated float16): every export's conversion loads, runs and
    passes (a model ORT refuses, as ViT's emulation once was, is an error row)."""
    gpu_check = load_script("gpu_check")
    rows = gpu_check.check_exports("cpu", "float16", dry_run=False)
    assert len(rows) == len(list((ROOT / "models" / "exports").glob("*.onnx")))
    assert [r["model"] for r in rows if "error" in r or not r["passed"]] == []


def load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # the training build or scikit-learn, where not installed
        sys.modules.pop(spec.name)
        pytest.skip(f"{name}: {exc}")
    return module


@pytest.mark.parametrize("name, argv", [
    ("bench_calibrate", []), ("bench_convert", []), ("bench_models", []), ("bench_speed", []),
    ("bench_training", []),
    ("bench_distributed", []), ("fuzz_convert", []), ("gpu_check", []), ("validate_inference", ["--out", "{tmp}"]),
    ("validate_training", []), ("check_real_export", ["{tmp}"]),
])
def test_scripts_refuse_an_unwritable_json_before_any_work_in_one_line(tmp_path, capsys, monkeypatch, name, argv):
    """Three scripts ended in a traceback, one printed its own format: all are usage errors now."""
    main = load_script(name).main
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / f"{name}.py")])  # argparse names the script by it
    with pytest.raises(SystemExit) as info:
        main([a.format(tmp=tmp_path) for a in argv] + ["--json", str(tmp_path / "nodir" / "x.json")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"{name}.py: error: the folder of --json "), err


@pytest.mark.parametrize("name, argv, message", [
    ("validate_inference", ["--out", "{tmp}/file"], "cannot create --out {tmp}/file: File exists"),
    ("bench_models", ["{tmp}/missing.onnx", "--only", "mlp"], "no such model file: {tmp}/missing.onnx"),
])
def test_scripts_bad_paths_are_usage_errors_not_tracebacks(tmp_path, capsys, monkeypatch, name, argv, message):
    (tmp_path / "file").write_text("a file, not a folder")
    main = load_script(name).main
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / f"{name}.py")])
    with pytest.raises(SystemExit) as info:
        main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == f"{name}.py: error: {message.format(tmp=tmp_path)}", err


@pytest.mark.parametrize("fails", [False, True])
def test_check_real_export_leaves_no_scratch_folder(tmp_path, monkeypatch, fails):
    """Each run built its artifacts in a fresh /tmp/onnxmp-real-* folder and never removed it."""
    import tempfile

    script = load_script("check_real_export")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen = []

    def train_one(folder, precision, args):
        (Path(args.work) / precision).mkdir()
        seen.append(precision)
        if fails:
            raise RuntimeError("training crashed")
        return {"precision": precision}

    monkeypatch.setattr(script, "train_one", train_one)
    if fails:
        with pytest.raises(RuntimeError):
            script.main([str(tmp_path), "--same-process"])
    else:
        assert script.main([str(tmp_path), "--same-process"]) == 0
    assert seen == (["float32"] if fails else ["float32", "float16"])
    assert list(scratch.iterdir()) == []
