"""atomic_directory killed (SIGKILL) at every step of replacing a folder: the folder is the whole old
or the whole new one, and the next run puts back what the kill took away, removes the rest and says so."""
from __future__ import annotations

import logging
import os
import platform
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onnxmp import files
from onnxmp.files import atomic_directory, guard_outputs, recover_folder

ROOT = Path(__file__).resolve().parents[1]

# The child writes TARGET with atomic_directory and SIGKILLs itself at one named step (files._reached),
# or, for "cleanup", after the first file of the replaced folder is removed.  "fallback" takes away the
# one-step swap, as a file system without RENAME_EXCHANGE does.  "block" waits at the step instead.
CHILD = textwrap.dedent("""
    import os, shutil, signal, sys, time
    from pathlib import Path
    from onnxmp import files

    point, swap, action, target, content = sys.argv[1:]
    if swap == "fallback":
        files._exchange = lambda new, path: False

    def stop():
        if action == "block":
            print("ready", flush=True)
            time.sleep(600)
        os.kill(os.getpid(), signal.SIGKILL)

    def reached(name, path):
        if name == point and path == Path(target):
            stop()

    files._reached = reached
    if point == "cleanup":
        def rmtree(folder, *args, **kwargs):
            next(p for p in sorted(Path(folder).rglob("*")) if p.is_file()).unlink()
            stop()
        files.shutil.rmtree = rmtree
    with files.atomic_directory(target) as tmp:
        for i in range(4):
            (tmp / f"part{i}.txt").write_text(content)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "deep.txt").write_text(content)
""")
NAMES = ["part0.txt", "part1.txt", "part2.txt", "part3.txt", "sub", "sub/deep.txt"]


def child(point: str, swap: str, target: Path, content: str, action: str = "kill") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", CHILD, point, swap, action, str(target), content], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_child(point: str, swap: str, target: Path, content: str) -> int:
    process = child(point, swap, target, content)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode in (0, -signal.SIGKILL), stderr
    return process.returncode


def whole(folder: Path) -> str:
    """The one content every file of ``folder`` holds; fails on a mixed or partial folder."""
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == NAMES
    contents = {p.read_text() for p in folder.rglob("*.txt")}
    assert len(contents) == 1, contents
    return contents.pop()


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onnxmp.files" and r.levelno == logging.WARNING]


@pytest.fixture()
def can_exchange(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    if not files._exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("the test folder's system or file system cannot swap two folders in one step")
    (tmp_path / "a").rmdir()
    (tmp_path / "b").rmdir()


# What DIR holds right after the kill at each step, and from where the next run restores it.
AFTER_KILL = {"filled": "old", "complete": "old", "aside": None, "swapped": "new", "cleanup": "new"}


@pytest.mark.parametrize("swap, point", [("exchange", p) for p in ("filled", "complete", "swapped", "cleanup")]
                         + [("fallback", p) for p in AFTER_KILL])
def test_a_kill_at_every_step_leaves_the_old_or_the_new_folder_and_the_next_run_recovers(
        tmp_path, caplog, swap, point, request):
    if swap == "exchange":
        request.getfixturevalue("can_exchange")
    target = tmp_path / "out"
    target.mkdir()
    (target / "sub").mkdir()
    for name in NAMES:
        if name != "sub":
            (target / name).write_text("old")
    assert run_child(point, swap, target, "new") == -signal.SIGKILL
    expected = AFTER_KILL[point]
    if expected is None:  # only the fallback, between its two renames
        assert not target.exists()
    else:
        assert whole(target) == expected
    assert hidden(tmp_path)  # what the killed run left beside DIR

    caplog.set_level(logging.WARNING, logger="onnxmp.files")
    guard_outputs({"--out": target}, folders=["--out"])  # the next run's guard, before any work
    assert whole(target) == (expected or "new") and hidden(tmp_path) == []
    said = warnings(caplog)
    if expected is None:
        assert len(said) == 2 and f"{target} was missing" in said[0] and "restored the new (complete) folder" \
            in said[0] and f"{tmp_path}/.out." in said[0] and said[0].endswith(".new")
    assert f"{target} is the last complete state" in said[-1] and "left beside" in said[-1]

    with atomic_directory(target) as folder:  # and the next write is whole, with nothing left over
        for name in NAMES:
            (folder / name).mkdir() if name == "sub" else (folder / name).write_text("third")
    assert whole(target) == "third" and hidden(tmp_path) == []


@pytest.mark.parametrize("point", ["filled", "complete"])
def test_a_run_killed_before_its_first_folder_was_in_place_leaves_none_and_no_false_one(tmp_path, caplog, point):
    target = tmp_path / "out"
    assert run_child(point, "fallback", target, "new") == -signal.SIGKILL
    assert not target.exists() and len(hidden(tmp_path)) == 1
    caplog.set_level(logging.WARNING, logger="onnxmp.files")
    assert recover_folder(target) is None  # a folder nothing replaced is not restored, even complete
    assert not target.exists() and hidden(tmp_path) == []
    [said] = warnings(caplog)
    assert said.startswith("removed .out.") and said.endswith(f", left beside {target} by an interrupted run; "
                                                              f"there is no {target}")


def test_the_exchange_path_never_moves_the_old_folder_aside(tmp_path, can_exchange):
    target = tmp_path / "out"
    target.mkdir()
    assert run_child("aside", "exchange", target, "new") == 0  # the step never comes
    assert whole(target) == "new" and hidden(tmp_path) == []


def test_the_fallback_replaces_a_folder_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda new, path: False)
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.bin").write_text("old")
    with atomic_directory(target) as folder:
        (folder / "model.onnx").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["model.onnx"] and hidden(tmp_path) == []


@pytest.mark.parametrize("swap, point", [("fallback", "aside"), ("fallback", "complete"), ("exchange", "filled")])
def test_the_folders_of_a_live_writer_are_not_leftovers(tmp_path, swap, point):
    """Another run's recovery must neither remove the temporary folder a writer is filling nor put
    back a folder the writer is about to rename in itself; once the writer is killed, it does."""
    target = tmp_path / "out"
    target.mkdir()
    process = child(point, swap, target, "new", action="block")
    try:
        assert process.stdout.readline() == "ready\n", process.communicate(timeout=60)
        before = hidden(tmp_path)
        assert recover_folder(target) is None and hidden(tmp_path) == before
        assert target.exists() == (point != "aside")
    finally:
        process.kill()
        process.communicate(timeout=60)
    recover_folder(target)
    assert target.is_dir() and hidden(tmp_path) == []


def test_an_unfinished_folder_is_never_restored(tmp_path, caplog):
    """DIR missing with its old folder aside and a half-filled temporary one: the old one comes back."""
    target = tmp_path / "out"
    (tmp_path / ".out.old.k2x9a0b1" / "out").mkdir(parents=True)
    (tmp_path / ".out.old.k2x9a0b1" / "out" / "state.json").write_text("old")
    (tmp_path / ".out.p3m4n5q6.tmp").mkdir()
    (tmp_path / ".out.p3m4n5q6.tmp" / "state.json").write_text("half")
    (tmp_path / ".outer.z1z1z1z1.tmp").mkdir()  # another folder's: not touched
    caplog.set_level(logging.WARNING, logger="onnxmp.files")
    assert recover_folder(target) == tmp_path / ".out.old.k2x9a0b1" / "out"
    assert (target / "state.json").read_text() == "old" and hidden(tmp_path) == [".outer.z1z1z1z1.tmp"]
    assert "restored the previous folder from" in warnings(caplog)[0]


def test_both_renameat2_calls_swap_two_folders(tmp_path, can_exchange):
    calls = {"libc": files._libc_renameat2()}
    if platform.machine().lower() in files._SYS_RENAMEAT2:
        calls["syscall"] = files._syscall_renameat2()
    assert all(calls.values())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    for name, call in calls.items():
        assert call(files._AT_FDCWD, os.fsencode(tmp_path / "a"), files._AT_FDCWD, os.fsencode(tmp_path / "b"),
                    files._RENAME_EXCHANGE) == 0, name
        assert (tmp_path / "b" / "x").read_text() == "a" and not (tmp_path / "a" / "x").exists()
        (tmp_path / "a").rename(tmp_path / "c")
        (tmp_path / "b").rename(tmp_path / "a")
        (tmp_path / "c").rename(tmp_path / "b")


def test_an_unsupported_exchange_falls_back_and_a_real_error_is_reported(tmp_path, monkeypatch):
    import errno

    seen = []

    def refuse(code):
        def renameat2(*args):
            seen.append(code)
            import ctypes
            ctypes.set_errno(code)
            return -1
        return renameat2

    target = tmp_path / "out"
    target.mkdir()
    monkeypatch.setattr(files, "_renameat2", lambda: refuse(errno.EINVAL))
    with atomic_directory(target) as folder:
        (folder / "new.txt").write_text("new")
    assert seen == [errno.EINVAL] and [p.name for p in target.iterdir()] == ["new.txt"]
    monkeypatch.setattr(files, "_renameat2", lambda: refuse(errno.EIO))
    with pytest.raises(files.OnnxMPError, match="cannot write .*out"):
        with atomic_directory(target) as folder:
            (folder / "newer.txt").write_text("newer")
    assert [p.name for p in target.iterdir()] == ["new.txt"] and hidden(tmp_path) == []
