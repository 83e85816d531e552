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


def test_training_demo_trains_as_written(tmp_path):
    """The README's one-command training demo, run as written after its install step (in a folder of
    its own that sees the bundled models): the same commands as docs/training.md's first screen; the
    loss falls every epoch."""
    import subprocess
    import sys

    demo = _commands()[2]
    install = 'pip install -e ".[cpu]" && '
    assert install in demo  # plain onnxruntime: no training build needed
    commands = demo[demo.index(install) + len(install):]
    assert commands in (ROOT / "docs" / "training.md").read_text()
    for path in re.findall(r"models/[\w.]+", commands):
        assert (ROOT / path).exists(), path
    (tmp_path / "models").symlink_to(ROOT / "models")
    script = re.sub(r"(^|&& )onnxmp ", lambda m: f"{m.group(1)}{sys.executable} -m onnxmp ", commands)
    done = subprocess.run(["bash", "-c", script + " --no-progress"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    table = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    losses = [float(row[1]) for row in table]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], done.stdout
    assert (tmp_path / "out" / "train" / "model.float16.onnx").is_file()
