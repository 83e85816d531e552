"""`onnxmp train` stopped by a real signal keeps the last completed epoch's state at the logged path."""
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onnxmp.cli import main
from onnxmp.training import Trainer
from mlp_cli import train_args, write_mlp_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def files(tmp_path):
    return write_mlp_job(tmp_path, rows=64)


@pytest.fixture()
def start():
    started = []

    def run(files, out):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        # Enough epochs that the run is still going when the signal comes.
        started.append(subprocess.Popen([sys.executable, "-m", "onnxmp", *train_args(files, out, 100000)], cwd=files,
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return started[-1]

    yield run
    for process in started:  # a failed test leaves no run behind
        if process.poll() is None:
            process.kill()
            process.communicate()


def _wait_for_epochs(process, state: Path, epochs: int = 2, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((state / "trainer_state.json").read_text())["epoch"] >= epochs:
                return
        except (OSError, ValueError):
            pass  # not there yet (or being replaced)
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"no state after {epochs} epochs in {timeout} s")


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_and_keeps_the_last_state(files, start, signum, code):
    out = files / "out"
    process = start(files, out)
    _wait_for_epochs(process, out / "state")
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and f"is in {out / 'state'}" in lines[0] and f"--resume {out / 'state'}" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["state"]  # nothing else of the run, no temporary folder
    assert not [p for p in files.iterdir() if p.name.startswith(".out.")]

    saved = json.loads((out / "state" / "trainer_state.json").read_text())["epoch"]
    trainer = Trainer.resume(out / "state")
    assert trainer.epoch == saved >= 2
    # The log named this path: the CLI continues from it, into the same folder.
    assert main(train_args(files, out, saved + 1, "--resume", str(out / "state"))) == 0
    history = json.loads((out / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [saved + 1]


def test_sigkill_leaves_the_last_state_at_the_logged_path(files, start):
    out = files / "out"
    process = start(files, out)
    _wait_for_epochs(process, out / "state")
    process.kill()
    process.communicate(timeout=60)
    trainer = Trainer.resume(out / "state")
    assert trainer.epoch >= 2 and trainer.optimizer_steps == 4 * trainer.epoch


def test_a_signal_during_a_save_waits_for_its_end():
    from onnxmp.cli import interrupts

    previous = signal.getsignal(signal.SIGTERM)
    done = []
    with pytest.raises(interrupts.Interrupted) as info:
        with interrupts.stop_on_signals():
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)  # the handler has run: it only noted the signal
                done.append("saved")
            pytest.fail("the signal must be raised when the deferred block ends")
    assert done == ["saved"] and info.value.exit_code == 143 and info.value.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored
    with interrupts.stop_on_signals():  # no signal: nothing raised, a started Deferral included
        with interrupts.Deferral() as hold:
            hold.start()


# `onnxmp train` SIGKILLed at one step of the first save that replaces DIR/state (epoch 2's; epoch 1's
# creates it) (onnxmp.files._reached);
# "fallback" takes the one-step swap away, as a file system without RENAME_EXCHANGE does.
KILLED_SAVE = """
import os, signal, sys
from onnxmp import files
from onnxmp.cli import main

point, swap, *argv = sys.argv[1:]
if swap == "fallback":
    files._exchange = lambda new, path: False

def reached(name, path):
    if name == point and path.name == "state":
        os.kill(os.getpid(), signal.SIGKILL)

files._reached = reached
sys.exit(main(argv))
"""


@pytest.mark.parametrize("swap, point", [("fallback", "aside"), ("exchange", "swapped")])
def test_a_run_killed_while_replacing_its_state_resumes_from_it(files, caplog, swap, point):
    """Between the fallback's two renames DIR/state is missing: the resume puts it back, and says so."""
    out = files / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.run([sys.executable, "-c", KILLED_SAVE, point, swap, *train_args(files, out, 100000)],
                             cwd=files, env=env, capture_output=True, text=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr
    assert (out / "state").is_dir() == (swap == "exchange")

    caplog.set_level(logging.WARNING, logger="onnxmp.files")
    assert main(train_args(files, out, 3, "--resume", str(out / "state"))) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "onnxmp.files"]
    if swap == "fallback":
        assert f"{out / 'state'} was missing" in said[0] and "restored the new (complete) folder" in said[0]
    assert any(f"left beside {out / 'state'}" in line for line in said)
    history = json.loads((out / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [3]  # the state the kill was putting in place: epoch 2
    assert not [p for p in [*files.iterdir(), *out.iterdir()] if p.name.startswith(".")]
