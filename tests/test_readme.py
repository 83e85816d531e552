"""The README's first screen and .ci/run must stay true to each other."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_has_demo_and_test_commands_first():
    demo, tests = _commands()[:2]
    setup = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[train-cpu,dev]"'
    assert demo.startswith(setup) and "onnxmp convert models/" in demo and "onnxmp validate" in demo
    assert tests.startswith(setup) and tests.endswith("python -m pytest")


def test_ci_runs_the_readme_setup_and_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    tests = _commands()[1]
    setup, _, test_cmd = tests.rpartition(" && ")
    assert setup in ci
    assert test_cmd in ci
    assert "-eq 5" in ci  # "no tests collected" must fail CI


def test_demo_model_and_inputs_are_bundled():
    demo = _commands()[0]
    for path in re.findall(r"models/[\w.]+", demo):
        assert (ROOT / path).exists(), path
