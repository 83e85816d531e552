#!/usr/bin/env python
"""Data-parallel throughput: updates/s and samples/s on 1 and W ranks (mpiexec, one host).

Each W ranks × 1 micro-batch run is set beside the one process doing the same
update (``--grad-accum-steps W``, same samples per update: equal results), and
beside one process with one micro-batch.  Runs alternate over ``--rounds`` and
the best of each is kept.  ``comm`` is the share of a rank's step time spent in
the collectives (finite flag, gradient all-reduce; the most of any rank).

Ranks on one host share its cores (each rank's ORT gets cores / ranks threads),
so the ratio on one host says how W single-process shares compare with one
process using every core, and ``comm`` what the collectives cost.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from onnxmp.files import guard_arguments, write_text_atomic


def worker(args) -> None:
    """One rank (or the one process): time ``--steps`` updates after a warm-up."""
    from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts
    from onnxmp.training.run import distributed
    from onnxmp.training.models import mlp, trainable

    comm = distributed.from_environment()
    with distributed.abort_on_error(comm), tempfile.TemporaryDirectory(prefix="onnxmp-bench-dp-") as folder:
        model = mlp(args.sizes, seed=0)
        artifacts = build_artifacts(model, requires_grad=trainable(model), precision=args.precision, target="cpu",
                                    out_dir=Path(folder) / "artifacts")
        trainer = Trainer(artifacts, grad_accum_steps=args.k, communicator=comm, lr=1e-4,
                          scaler=DynamicLossScaler() if args.precision == "float16" else DynamicLossScaler.static())
        rng = np.random.default_rng(0 if comm is None else comm.rank)
        x = rng.normal(size=(args.batch_size, args.sizes[0])).astype(np.float32)
        y = rng.integers(0, args.sizes[-1], args.batch_size)
        for _ in range(args.warmup * args.k):
            trainer.train_step(x, y)
        if comm is not None:
            comm.barrier()
        trainer.sync.communication_seconds = 0.0
        start = time.perf_counter()
        for _ in range(args.steps * args.k):
            trainer.train_step(x, y)
        if comm is not None:
            comm.barrier()
        seconds = time.perf_counter() - start
        share = np.array([trainer.sync.communication_seconds / seconds])
        if comm is not None:
            comm.allreduce_max(share)
        if comm is None or comm.is_root:
            ranks = 1 if comm is None else comm.size
            Path(args.worker).write_text(json.dumps({
                "ranks": ranks, "k": args.k, "updates_per_s": args.steps / seconds,
                "samples_per_s": args.steps * args.k * ranks * args.batch_size / seconds,
                "comm_share": float(share[0]), "skipped": trainer.skipped_steps}))


def _mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                          os.environ.get("PATH", "")]))
    if found is None:
        raise SystemExit('bench_distributed.py: error: no mpiexec\n  hint: pip install "onnxmp[distributed]"')
    return found


def _launch(ranks: int, k: int, args, out: Path) -> dict:
    command = [sys.executable, __file__, "--worker", str(out), "--k", str(k), "--sizes", "-".join(map(str, args.sizes)),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--precision", args.precision]
    if ranks > 1:
        command = [_mpiexec(), "-n", str(ranks), *command]
    import onnxmp

    env = {k: v for k, v in os.environ.items() if k not in ("PMI_RANK", "PMI_SIZE", "PMI_FD")}
    # The ranks import the onnxmp this script imported, installed or not.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(onnxmp.__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode:
        raise SystemExit(f"bench_distributed.py: error: a run on {ranks} rank(s) failed: "
                         f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="rank counts beside 1 (default 2)")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split("-")], default=[256, 1024, 1024, 10],
                        help="MLP layer sizes (default 256-1024-1024-10, 1.3M parameters)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per micro-batch (per rank)")
    parser.add_argument("--steps", type=int, default=30, help="timed updates")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each is kept")
    parser.add_argument("--precision", choices=["float32", "float16"], default="float16")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    guard_arguments(parser, {"--json": args.json})

    runs = [(1, 1)] + [(1, w) for w in args.ranks] + [(w, 1) for w in args.ranks]
    best: dict[tuple[int, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="onnxmp-bench-dp-") as folder:
        for _ in range(args.rounds):
            for ranks, k in runs:
                result = _launch(ranks, k, args, Path(folder) / f"r{ranks}k{k}.json")
                if (ranks, k) not in best or result["updates_per_s"] > best[ranks, k]["updates_per_s"]:
                    best[ranks, k] = result
    params = sum(a * b + b for a, b in zip(args.sizes, args.sizes[1:]))
    print(f"MLP {'-'.join(map(str, args.sizes))} ({params / 1e6:.2f}M parameters), {args.precision} "
          f"(emulated), micro-batch {args.batch_size} rows, {args.steps} timed updates, best of {args.rounds}; "
          f"{os.cpu_count()} cores")
    header = f"{'run':<26}{'updates/s':>10}{'samples/s':>11}{'vs 1 proc, same update':>24}{'comm':>7}"
    print(header)
    for ranks, k in runs:
        r = best[ranks, k]
        same = best[1, ranks * k]
        label = f"{ranks} rank(s) x {k} micro-batch"
        ratio = "" if ranks == 1 else f"{r['updates_per_s'] / same['updates_per_s']:.2f}x"
        comm = "" if ranks == 1 else f"{100 * r['comm_share']:.1f}%"
        print(f"{label:<26}{r['updates_per_s']:>10.2f}{r['samples_per_s']:>11.0f}{ratio:>24}{comm:>7}")
    if args.json:
        write_text_atomic(args.json, json.dumps({"sizes": args.sizes, "batch_size": args.batch_size,
                                                 "precision": args.precision, "cores": os.cpu_count(),
                                                 "runs": [best[key] for key in runs]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
