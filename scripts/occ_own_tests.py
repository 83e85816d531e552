"""onnxconverter-common's own float16 tests, run against onnxmp.compat (docs/compat.md, issue 30).

    python scripts/occ_own_tests.py CHECKOUT [--keep DIR]

CHECKOUT is a clone of github.com/microsoft/onnxconverter-common.  Its ``tests/test_float16.py``,
``test_auto_mixed_precision.py`` and ``test_auto_mixed_precision_model_path.py`` (9 test cases) are
copied with their data to a temporary folder, and in each the converters it imports
(``convert_float_to_float16``, ``auto_convert_mixed_precision``, ``auto_convert_mixed_precision_model_path``)
are rebound to onnxmp.compat's right after the file's own imports; nothing else changes (its helpers,
``remove_identity_node_from_model`` and ``convert_np_to_float16``, stay the original's).  pytest runs them and
the script prints each case's outcome and the count.  The tests need onnxconverter-common and onnxmltools
installed (they are not onnxmp dependencies).

Exit status 0 when every failure is a documented difference (DOCUMENTED below), 1 otherwise.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("test_float16.py", "test_auto_mixed_precision.py", "test_auto_mixed_precision_model_path.py")
SWAPS = {
    "convert_float_to_float16": "onnxmp.compat.float16",
    "convert_float_to_float16_model_path": "onnxmp.compat.float16",
    "auto_convert_mixed_precision": "onnxmp.compat.auto_mixed_precision",
    "auto_convert_mixed_precision_model_path": "onnxmp.compat.auto_mixed_precision_model_path",
}
DOCUMENTED = {
    "test_auto_mixed_precision_rtol_atol": "rtol=0.01 sets atol=1e-8 on outputs near 1e-3: the original passes "
                                           "only because ORT CPU computes its fp16 Gemm in float32 (docs/compat.md)",
}


def swapped(source: str) -> str:
    """``source`` with the converters it imports from onnxconverter_common rebound to onnxmp.compat's."""
    tree = ast.parse(source)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.asname or a.name for n in imports if isinstance(n, ast.ImportFrom)
             and (n.module or "").startswith("onnxconverter_common") for a in n.names}
    lines = source.splitlines(keepends=True)
    end = max(n.end_lineno for n in imports)
    rebinds = "".join(f"from {SWAPS[name]} import {name}  # swapped by scripts/occ_own_tests.py\n"
                      for name in sorted(names & set(SWAPS)))
    if not rebinds:
        raise SystemExit("no converter import found to swap: has the test file changed?")
    return "".join(lines[:end]) + rebinds + "".join(lines[end:])


def first_error(output: str, case: str) -> str:
    """The first ``E   `` line naming an exception in ``case``'s section of pytest's report."""
    sections = re.split(r"^_{3,} (?:\w+\.)?(\w+) _{3,}$", output, flags=re.M)
    for title, body in zip(sections[1::2], sections[2::2]):
        if title == case:
            errors = [ln[1:].strip() for ln in body.splitlines() if re.match(r"E\s+\w[\w.]*(Error|Exception)\b", ln)]
            return errors[0][:200] if errors else ""
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path, help="a clone of microsoft/onnxconverter-common")
    ap.add_argument("--keep", type=Path, help="copy the swapped tests here instead of a temporary folder")
    a = ap.parse_args()
    tests = a.checkout / "tests"
    missing = [f for f in FILES if not (tests / f).is_file()]
    if missing:
        print(f"error: {tests} lacks {', '.join(missing)}: not an onnxconverter-common checkout", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="occ-tests-")) if a.keep is None else a.keep
    (work / "tests").mkdir(parents=True, exist_ok=True)
    if (tests / "data").is_dir():
        shutil.copytree(tests / "data", work / "tests" / "data", dirs_exist_ok=True)
    for name in FILES:
        (work / "tests" / name).write_text(swapped((tests / name).read_text()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-rA", "-p", "no:cacheprovider"],
                          cwd=work, env=env, capture_output=True, text=True)
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR) tests/(\S+?)::(?:\w+::)?(\w+)", done.stdout, re.M)
    if not outcomes:
        print(done.stdout[-3000:] + done.stderr[-2000:])
        return 2
    unexplained = 0
    for outcome, _, case in outcomes:
        note = ""
        if outcome != "PASSED":
            note = DOCUMENTED.get(case, "")
            unexplained += not note
            note = note or first_error(done.stdout, case)
        print(f"{outcome:7} {case:60} {note}")
    passed = sum(o == "PASSED" for o, _, _ in outcomes)
    print(f"{passed}/{len(outcomes)} passed; {unexplained} failure(s) not a documented difference")
    if a.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
