"""scripts/validate_inference.py end to end, as a user runs it (a subprocess)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "validate_inference.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_script(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--no-default-models", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def test_converts_and_validates_the_given_models(tmp_path):
    out, table = tmp_path / "out", tmp_path / "table.json"
    done = run_script(ROOT / "models" / "mlp.onnx", ROOT / "models" / "cnn_bn_bigvar.onnx",
                      "--out", out, "--json", table, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr

    rows = json.loads(table.read_text())
    assert [r["model"] for r in rows] == ["mlp", "cnn_bn_bigvar"]
    for row in rows:
        assert row["passed"] is True and row["error"] is None and row["failures"] == []
        assert row["inputs"] == "npz"
        assert row["nodes"] == 6 if row["model"] == "mlp" else row["nodes"] == 10
        assert row["share"] == 1.0  # the Convs/Gemm/MatMul all go fp16 ...
        assert 0 < row["max_abs_err"] < 1e-2 and row["cosine"] > 0.999
    bigvar = rows[1]
    # ... while the overflowing BatchNorm stays fp32, behind Casts on both sides.
    assert bigvar["casts"] > rows[0]["casts"]

    report = (out / "report.md").read_text()
    for row in rows:
        assert (out / row["plot"]).read_bytes().startswith(PNG_MAGIC)
        assert f"]({row['model']}.errors.png)" in report
        assert f"## {row['model']}" in report
    assert "Casts inserted" in report  # the conversion summaries
    assert "cosine" in done.stdout.splitlines()[0] and "mlp" in done.stdout
    assert "models:" in done.stderr  # the progress bar


def test_broken_model_is_a_failed_row_not_a_crash(tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes((ROOT / "models" / "mlp.onnx").read_bytes()[:1000])
    table = tmp_path / "table.json"
    done = run_script(broken, ROOT / "models" / "mlp.onnx", "--out", tmp_path / "out", "--json", table,
                      cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr

    rows = {r["model"]: r for r in json.loads(table.read_text())}
    assert rows["mlp"]["passed"] is True
    assert rows["broken"]["passed"] is False
    assert "not a readable ONNX model" in rows["broken"]["error"]
    assert rows["broken"]["plot"] is None
    line = next(line for line in done.stdout.splitlines() if line.startswith("broken"))
    assert "FAIL" in line and "not a readable ONNX model" in line
    assert "not a readable ONNX model" in (tmp_path / "out" / "report.md").read_text()
