"""Package metadata: the core installs on Python 3.10+; only the training builds stay <= 3.11, and every
training extra brings a runtime."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import onnxmp

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
specifiers = pytest.importorskip("packaging.specifiers")
requirements = pytest.importorskip("packaging.requirements")

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
TRAINING_BUILDS = {"onnxruntime-training", "onnxruntime-training-cpu"}


def _installs_on(requirement: str, python: str) -> bool:
    req = requirements.Requirement(requirement)
    return req.marker is None or req.marker.evaluate({"python_version": python, "extra": ""})


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_requires_python_admits_the_supported_versions(python):
    assert specifiers.SpecifierSet(PROJECT["requires-python"]).contains(f"{python}.0")


@pytest.mark.parametrize("extra", ["train-cpu", "train-gpu"])
def test_training_builds_are_limited_to_python_3_11_by_markers(extra):
    builds = [r for r in PROJECT["optional-dependencies"][extra] if requirements.Requirement(r).name in TRAINING_BUILDS]
    assert builds
    for build in builds:
        assert _installs_on(build, "3.11") and not _installs_on(build, "3.12") and not _installs_on(build, "3.13")


@pytest.mark.parametrize("extra,runtime", [("train-cpu", "onnxruntime"), ("train-gpu", "onnxruntime-gpu")])
@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_training_extras_bring_a_runtime_on_every_python(extra, runtime, python):
    # The README's demo validates with onnxruntime: on 3.12+ the plain runtime stands in for the
    # training build (which is also the inference runtime where it installs).
    names = {requirements.Requirement(r).name for r in PROJECT["optional-dependencies"][extra]
             if _installs_on(r, python)}
    assert names & {runtime, *TRAINING_BUILDS}, (extra, python)
    assert len(names & {"onnxruntime", "onnxruntime-gpu", *TRAINING_BUILDS}) == 1  # one `onnxruntime` package


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_core_cpu_and_gpu_have_no_python_limit(python):
    for requirement in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["cpu"] + \
            PROJECT["optional-dependencies"]["gpu"]:
        assert _installs_on(requirement, python), requirement


def test_training_on_python_3_12_says_it_needs_3_11(monkeypatch):
    from onnxmp.training import _ort

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(sys, "version_info", (3, 12, 1, "final", 0))
    monkeypatch.delitem(sys.modules, "onnxruntime.training", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime.training" else real_find_spec(name, *a))
    with pytest.raises(onnxmp.OnnxMPError,
                       match=r"building training artifacts with ORT.s gradient builder .*no wheels for Python 3\.12") \
            as caught:
        _ort.onnxblock()
    assert "python3.11" in caught.value.hint and "--artifacts" in caught.value.hint
    assert "--builder onnxmp" in caught.value.hint  # what builds there without the training build


def test_a_missing_runtime_is_one_line_naming_the_extra(capsys):
    from onnxmp.cli import report_exception

    code = report_exception("onnxmp validate", ModuleNotFoundError("No module named 'onnxruntime'",
                                                                   name="onnxruntime"), verbose=False)
    err = capsys.readouterr().err
    assert code == 1 and "please report" not in err
    assert err.splitlines() == ["onnxmp validate: error: onnxruntime is not installed",
                                '  hint: install a runtime: pip install "onnxmp[cpu]" (or "onnxmp[gpu]" for CUDA; '
                                '"onnxmp[train-cpu]" also brings one, with the training build on Python <= 3.11)']
