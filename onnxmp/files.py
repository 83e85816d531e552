"""Output safety: the one output-path guard and the one atomic writer.

A user's file is sacred.  Every command and API that writes calls
:func:`guard_outputs` before any work, so a destination that would overwrite an
input (or another output of the same run), or that lies in a missing or
read-only folder, fails at once with one clear line instead of after minutes of
work.  Every write then goes through :func:`atomic_write` (or
:func:`atomic_directory` for a folder): the data fills a temporary file beside
the destination and is renamed into place, so readers see the old file or the
new one, never half of one, and an error leaves nothing behind.  Files get the
mode the user's umask gives (0644 under umask 022), not ``mkstemp``'s 0600.

A folder cannot be renamed over a non-empty one.  On Linux the finished folder
and the old one swap names in one step (``renameat2`` with ``RENAME_EXCHANGE``);
elsewhere the old one is moved aside first, and a run killed between those two
renames leaves no folder at the destination: :func:`recover_folder`, run by the
guard and the writer before any work, puts the one that run completed in place.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import functools
import logging
import mmap
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Union

from onnxmp.errors import OnnxMPError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks (see _in_use)
    fcntl = None

log = logging.getLogger("onnxmp.files")

PathLike = Union[str, os.PathLike]
# An input may be one path or several (``--calibrate a.npz b.npz``).
Inputs = Mapping[str, Union[PathLike, Iterable[PathLike], None]]

_UMASK_LOCK = threading.Lock()
# Inside all_or_nothing(): (temporary, destination) pairs whose rename waits for the end of the block.
_PENDING: contextvars.ContextVar[list[tuple[Path, Path]] | None] = contextvars.ContextVar("onnxmp_pending",
                                                                                          default=None)
# Inside atomic_directory(): (temporary folder, destination) pairs, innermost last, for destination().
_FOLDERS: contextvars.ContextVar[tuple[tuple[Path, Path], ...]] = contextvars.ContextVar("onnxmp_folders",
                                                                                          default=())


def umask() -> int:
    """The process umask, read without a window where another thread could create a 0o000-masked file.

    Linux reports it in /proc; elsewhere the set-and-restore dance runs under a lock.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from the umask (0644 under 022)."""
    return 0o666 & ~umask()


def _folder(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def _paths(value) -> list[Path]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [Path(value)]
    return [Path(v) for v in value if v is not None]


def _external_data_files(path: Path) -> list[Path]:
    """The files an ``.onnx`` input keeps its weights in: writing one destroys the model as surely.

    Anything that does not parse as a model has none (loading it reports the problem).
    """
    if path.suffix.lower() != ".onnx" or not path.is_file() or not _mentions_location(path):
        return []
    import onnx

    from onnxmp.external import locations

    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 (protobuf's decode errors share no base class)
        return []
    return [path.parent / location for location in sorted(locations(model))]


def _mentions_location(path: Path) -> bool:
    """Whether the file holds the bytes of an external-data ``location`` key at all: a scan of the
    mapped file, so a 2 GB model with its weights inside is never parsed (or held) a second time."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(b"location") != -1
    except (OSError, ValueError):  # unreadable, or empty (mmap refuses length 0)
        return False


def _same(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:  # hard links, bind mounts, case-insensitive file systems
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(inner: Path, folder: Path) -> bool:
    """``inner`` lies under ``folder`` (an output folder that is replaced would take it along)."""
    real_inner, real_folder = os.path.realpath(inner), os.path.realpath(folder)
    return real_inner.startswith(real_folder.rstrip(os.sep) + os.sep)


def guard_outputs(outputs: Mapping[str, PathLike | None], inputs: Inputs = {},  # noqa: B006 (read only)
                  *, folders: Iterable[str] = ()) -> None:
    """Refuse, before any work, destinations that are unsafe to write.

    ``outputs`` and ``inputs`` map a human label (``"-o"``, ``"--report"``,
    ``"model"``) to a path; ``None`` entries are skipped and an input may be a
    list of paths.  Raises :class:`OnnxMPError` when an output resolves
    (symlinks followed, hard links recognised) to an input, to the external
    data file of an ``.onnx`` input, or to another output, would take an
    input with it (an output folder holding one), is a device or pipe, or
    its folder is missing or not writable.  An existing folder is refused as a
    destination unless its label is in ``folders`` (outputs written with
    :func:`atomic_directory`, which replaces a folder whole); such a folder is
    first recovered from what a killed run left beside it (:func:`recover_folder`).
    """
    folders = set(folders)
    given_inputs = [(label, path) for label, value in inputs.items() for path in _paths(value)]
    # Only an existing path can be (or hold) an input's external data: the model is parsed only then.
    if any(Path(v).exists() for v in outputs.values() if v is not None):
        given_inputs += [(f"external data of the {label}", data) for label, path in list(given_inputs)
                         for data in _external_data_files(path)]
    seen: list[tuple[str, Path]] = []
    for label, value in outputs.items():
        if value is None:
            continue
        path = Path(value)
        for in_label, in_path in given_inputs:
            if _same(path, in_path):
                raise OnnxMPError(f"{label} {path} is the {in_label} {in_path}; onnxmp never writes over its input",
                                  hint=f"choose another {label} path")
            if _inside(in_path, path):
                raise OnnxMPError(f"{label} {path} holds the {in_label} {in_path}; writing it would remove the input",
                                  hint=f"choose another {label} path")
        for out_label, out_path in seen:
            if _same(path, out_path):
                raise OnnxMPError(f"{label} and {out_label} both name {path}; one would overwrite the other",
                                  hint="give each output its own path")
        seen.append((label, path))
        if label in folders:
            recover_folder(path)  # a killed run's folder is put back before anything reads or replaces it
            if path.exists() and not path.is_dir():
                raise OnnxMPError(f"{label} {path} exists and is not a folder", hint=f"choose another {label}")
        elif path.is_dir():
            raise OnnxMPError(f"{label} {path} is an existing folder", hint=f"give {label} a file name")
        elif path.exists() and not path.is_file():
            # The rename that makes a write atomic would replace the device or pipe itself.
            raise OnnxMPError(f"{label} {path} is not a regular file (a device, pipe or socket)",
                              hint=f"give {label} the path of a file")
        folder = _folder(path)
        if not folder.is_dir():
            raise OnnxMPError(f"the folder of {label} {path} does not exist: {folder}",
                              hint=f"create it first (mkdir -p {folder}) or choose another {label}")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OnnxMPError(f"cannot write {label} {path}: folder {folder} is not writable",
                              hint=f"check the folder's permissions or choose another {label}")


def guard_arguments(parser, outputs: Mapping[str, PathLike | None], inputs: Inputs = {},  # noqa: B006
                    *, folders: Iterable[str] = ()) -> None:
    """:func:`guard_outputs` for a script's ``argparse`` parser: an unsafe destination is a usage error.

    ``parser.error`` prints one line and exits 2 before any work, as every
    script does for its other argument errors; never a traceback.
    """
    try:
        guard_outputs(outputs, inputs, folders=folders)
    except OnnxMPError as exc:
        parser.error(exc.one_line())


def _temp_name_error(path: Path, exc: OSError) -> OnnxMPError:
    return OnnxMPError(f"cannot write {path}: {exc.strerror or exc}",
                       hint="check that the folder exists, is writable and has free space")


def atomic_write(path: PathLike, write: Callable[[Path], None]) -> Path:
    """Fill a temporary file beside ``path`` with ``write(tmp_path)``, then rename it into place.

    The file gets the umask's mode.  On any error the temporary file is removed
    and ``path`` is left as it was; an OSError becomes an :class:`OnnxMPError`.
    Inside :func:`all_or_nothing` the rename waits for the end of that block.
    """
    path = Path(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=_folder(path))
        os.close(fd)
    except OSError as exc:
        raise _temp_name_error(path, exc) from None
    tmp: Path | None = Path(name)
    pending = _PENDING.get()
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        if pending is not None:
            pending.append((tmp, path))
            tmp = None  # all_or_nothing() renames or removes it
        else:
            os.replace(tmp, path)
    except OSError as exc:
        raise _temp_name_error(path, exc) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def all_or_nothing() -> Iterator[None]:
    """The files written with :func:`atomic_write` inside the block land together, when it succeeds.

    A command with several outputs (a model and its report, a report and a
    plot) would otherwise leave the first ones behind when a later step fails
    or is interrupted.  Each file is still filled beside its destination; only
    the renames wait, so the window where some outputs are new and others not
    is a few renames long.  Nested blocks join the outermost one.
    """
    if _PENDING.get() is not None:
        yield
        return
    pending: list[tuple[Path, Path]] = []
    token = _PENDING.set(pending)
    try:
        yield
        _PENDING.reset(token)
        token = None
        while pending:
            tmp, path = pending[0]
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise _temp_name_error(path, exc) from None
            pending.pop(0)
    finally:
        if token is not None:
            _PENDING.reset(token)
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)


def write_text_atomic(path: PathLike, text: str, encoding: str = "utf-8") -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding=encoding))


def write_bytes_atomic(path: PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


@contextlib.contextmanager
def atomic_directory(path: PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path``, on error it is removed.

    An existing ``path`` folder is replaced whole, only once the new one is
    complete, so a failed run never leaves a partial output folder and a
    rerun never mixes old and new files.  What a killed run left beside
    ``path`` is recovered or removed first (:func:`recover_folder`).
    """
    path = Path(path)
    folder = _folder(path)
    recover_folder(path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=_FILLING, dir=folder))
        os.chmod(tmp, 0o777 & ~umask())
    except OSError as exc:
        raise _temp_name_error(path, exc) from None
    lock = _lock(tmp)
    token = _FOLDERS.set((*_FOLDERS.get(), (tmp, path)))
    try:
        yield tmp
        _reached("filled", path)
        try:
            # The name says the folder is complete: only such a folder may take the place of ``path``
            # when a killed run's leftovers are recovered.
            done = tmp.with_name(tmp.name[:-len(_FILLING)] + _COMPLETE)
            os.rename(tmp, done)
            tmp = done
            _reached("complete", path)
            _replace_folder(tmp, path)
        except OSError as exc:
            raise _temp_name_error(path, exc) from None
    finally:
        _FOLDERS.reset(token)
        if lock is not None:
            os.close(lock)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def destination(path: PathLike) -> Path:
    """Where ``path`` will be once the open :func:`atomic_directory` folders are renamed into place.

    Logs name this: a temporary folder's name means nothing to the user and is gone after the run.
    """
    path = Path(path)
    for tmp, final in reversed(_FOLDERS.get()):  # innermost first: its destination lies in the outer folder
        try:
            path = final / Path(os.path.abspath(path)).relative_to(os.path.abspath(tmp))
        except ValueError:
            continue
    return path


def _replace_folder(new: Path, path: Path) -> None:
    """Put the complete folder ``new`` at ``path`` and remove the folder it replaces."""
    if not (path.is_dir() and not path.is_symlink()):
        os.replace(new, path)
        return
    if _exchange(new, path):
        _reached("swapped", path)
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now names the old folder
        return
    # rename() cannot replace a non-empty folder: move the old one aside first, and back on failure.
    # A kill between the two renames leaves no ``path``; the next recover_folder() puts ``new`` there.
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}{_ASIDE}", dir=_folder(path)))
    os.replace(path, aside / path.name)
    _reached("aside", path)
    try:
        os.replace(new, path)
    except OSError:
        os.replace(aside / path.name, path)
        os.rmdir(aside)
        raise
    _reached("swapped", path)
    shutil.rmtree(aside, ignore_errors=True)


def _reached(point: str, path: Path) -> None:
    """A named step of writing ``path``: ``filled``, ``complete``, ``aside``, ``swapped``.

    Does nothing.  The crash tests (tests/test_files_crash.py) replace it in a child process that
    SIGKILLs itself at one step, to show that every step leaves a state the next run recovers.
    """


# A writer's temporary folder is ``.NAME.<random>.tmp`` while it fills, ``.NAME.<random>.new`` once
# complete; the fallback moves the old folder to ``.NAME.old.<random>/NAME``.
_FILLING, _COMPLETE, _ASIDE = ".tmp", ".new", ".old."
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# renameat2's number where glibc (before 2.28) has no wrapper: x86_64's own table, aarch64's the generic one.
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}
# What renameat2 answers where the kernel (ENOSYS), the file system (EINVAL, EOPNOTSUPP) or a
# container's seccomp filter (EPERM, ENOSYS) cannot exchange: the two-rename fallback then runs,
# and reports a real permission error itself.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


def _libc_renameat2() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _syscall_renameat2() -> Callable[..., int] | None:
    number = _SYS_RENAMEAT2.get(platform.machine().lower())
    if number is None or ctypes.sizeof(ctypes.c_void_p) != 8:  # a 32-bit process has other numbers
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    def renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        return syscall(ctypes.c_long(number), ctypes.c_long(olddirfd), ctypes.c_char_p(old),
                       ctypes.c_long(newdirfd), ctypes.c_char_p(new), ctypes.c_ulong(flags))

    return renameat2


@functools.lru_cache(maxsize=None)
def _renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return _libc_renameat2() or _syscall_renameat2()


def _exchange(new: Path, path: Path) -> bool:
    """Swap the two folders' names in one step; False where this system or file system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(path), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        log.debug("cannot swap %s and %s in one step (%s): moving the old folder aside", new, path,
                  os.strerror(code))
        return False
    raise OSError(code, os.strerror(code), str(path))


def _lock(folder: Path) -> int | None:
    """Hold an advisory lock on the writer's temporary folder while it lives: another run's
    :func:`recover_folder` then leaves it alone.  The kernel drops it when the writer dies."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: the folder is still written, only unguarded
        pass
    return fd


def _in_use(folder: Path) -> bool:
    """Whether a live writer holds ``folder``'s lock (on a system without locks: assumed not)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return True  # gone or unreadable: not ours to touch
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _leftovers(path: Path) -> list[Path]:
    """The folders writers of ``path`` left beside it (temporary folders and aside folders)."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:old\.[^.]+|[^.]+\.(?:tmp|new))")
    try:
        entries = list(os.scandir(_folder(path)))
    except OSError:  # no folder, so nothing beside path
        return []
    return sorted(_folder(path) / e.name for e in entries
                  if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False))


def recover_folder(path: PathLike) -> Path | None:
    """Put back a folder that a killed :func:`atomic_directory` run was replacing, and remove what
    killed runs left beside it; returns the folder ``path`` was restored from (None: none was).

    ``path`` is missing only where a run was killed between moving the old folder aside and
    renaming the new one in (systems without a one-step swap).  The new folder, complete (its name
    ends in ``.new``), is then put in place; the old one where there is no such folder.  Any other
    leftover (a half-filled ``.tmp`` folder, a complete one whose run died before the swap, an old
    folder the swap had replaced) is removed: ``path`` is the last complete state, and the log says
    so.  Folders a live writer holds are left alone, and then nothing is done.
    """
    path = Path(path)
    if path.name in ("", ".", ".."):
        return None
    leftovers = _leftovers(path)
    if not leftovers or any(_in_use(folder) for folder in leftovers):
        return None
    restored = None
    if not os.path.lexists(path):
        asides = [folder / path.name for folder in leftovers
                  if folder.name.startswith(f".{path.name}{_ASIDE}") and (folder / path.name).is_dir()]
        complete = [folder for folder in leftovers if folder.name.endswith(_COMPLETE)]
        if asides:  # the swap was under way: its new folder was complete, else the old one stays
            restored = complete[0] if len(complete) == 1 else max(asides, key=lambda p: p.parent.stat().st_mtime)
            os.rename(restored, path)
            log.warning("%s was missing: a run was killed while replacing it; restored the %s folder from %s",
                        path, "new (complete)" if restored in complete else "previous", restored)
    removed = [folder for folder in leftovers if folder != restored]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    if removed:
        state = f"{path} is the last complete state" if os.path.isdir(path) else f"there is no {path}"
        log.warning("removed %s, left beside %s by an interrupted run; %s",
                    ", ".join(folder.name for folder in removed), path, state)
    return restored
