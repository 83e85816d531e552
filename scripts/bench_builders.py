#!/usr/bin/env python
"""onnxmp's gradient builder against onnxruntime-training's, for ``scripts/bench_training.py --builders``.

Per export of the matrix (models/exports/), side by side in one run (Python 3.11 with the training
build, where both builders exist):

- ``nodes``: the float32 CPU training graph's node count after onnxruntime's optimizations (the
  session options the engines use, saved through ``optimized_model_filepath``): onnxmp's graph (what
  the portable engine runs) against ORT's native training graph (what the native engine runs, loaded
  by the training build's session, which has its gradient kernels; ``ratio`` is onnxmp/native) and
  against its lowering to standard ops (``lowered``, what the portable engine ran before);
- ``int64``: the nodes with an int64 output (shape arithmetic) left in the CUDA-target float16
  training graph after onnxruntime's EP-independent (basic) optimizations: before, ORT's builder and
  the lowering to standard ops (the portable graph of its folder); after, onnxmp's builder.  Where
  the CPU has no kernel for one of the graph's float16 ops the session cannot be made, and the raw
  graph is counted (marked ``raw``);
- ``copies``/``feed``: the host-to-device copies inside the step and the CPU shape arithmetic feeding
  them in the same CUDA float16 training graphs, as onnxruntime's CUDA EP would place them
  (:func:`onnxmp.training.build.placement.place`; ``scripts/cuda_placement.py`` shows each builder);
- step time: the median seconds per micro-step (an update every step) of onnxmp's builder on the
  portable engine, ORT's builder on the native engine and PyTorch (``--torch-python``:
  scripts/torch_step_time.py), on 1 and 2 intra-op threads.  Each runs in its own process, the
  three in turn, so that each one's peak RSS is its own; ``--repeat N`` runs each N times and keeps
  the median, ``--alternate`` swaps the builders' order every round (the machine's load drifts);
  ratios, not timed tests;
- CPU time per step on 1 thread (``cpu min``): the process's CPU seconds of its least step (each
  run's ``time.process_time()`` around every step; the median of the runs' least).  One intra-op
  thread computes on the calling thread (the thread's and the process's CPU time agree, both
  recorded), so other processes do not add to it the way they add to wall time; a step they
  interrupt still costs more (caches refilled), which the least step leaves out.  ``med o/ort`` is
  the ratio of the steps' median CPU time.  Wall time stays for 2 threads (the pool's workers
  spin: their CPU time is not the step's cost);
- ``RSS``: each process's peak resident set (MiB), loading and stepping included;
- ``bodies``: onnxmp's node count with the nodes of its If bodies (the accumulators' branches)
  counted too, the honest comparison with ORT's one InPlaceAccumulatorV2 per parameter.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from peak_rss import peak_rss_mib

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "models" / "exports"
DEFAULT = ("bert2.torchscript17", "gpt2.torchscript17", "vit.torchscript17", "resnet.torchscript17")
THREADS = (1, 2)



def _matrix() -> dict:
    return json.loads((EXPORTS / "matrix.json").read_text())


def build(key: str, builder: str, precision: str, target: str, optimizer: str, out: Path):
    import onnx

    from onnxmp.training import build_artifacts
    from onnxmp.training.build.prepare import without_gradient

    model = onnx.load(str(EXPORTS / _matrix()[key]["file"]))
    params = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    frozen = without_gradient(model, params)
    started = time.perf_counter()
    artifacts = build_artifacts(model, requires_grad=[n for n in params if n not in frozen], frozen=list(frozen),
                                precision=precision, target=target, optimizer=optimizer, out_dir=out,
                                builder=builder)
    return artifacts, time.perf_counter() - started


def optimized_model(path: Path, options, folder: Path):
    """The model at ``path`` after onnxruntime's optimizations under ``options`` (CPU EP), as the
    session saves it; None where the session cannot be made."""
    import onnx
    import onnxruntime

    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{path.stem}.optimized.onnx"
    options.optimized_model_filepath = str(target)
    try:
        onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception:  # no CPU kernel for one of a CUDA graph's ops: the caller counts the raw graph
        return None
    return onnx.load(str(target), load_external_data=False)


def int64_nodes(model) -> int:
    """Nodes with an int64 output (shape arithmetic, indices), by onnx's type inference."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    return sum(any(types.get(o) == onnx.TensorProto.INT64 for o in n.output) for n in graph.node)


def cuda_int64(artifacts, folder: Path) -> tuple[int, bool]:
    """(int64 nodes of the CUDA-target portable training graph after basic optimizations, whether the
    graph was counted raw)."""
    import onnx
    import onnxruntime

    path = artifacts.portable_path("training_model")
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    optimized = optimized_model(path, options, folder)
    return (int64_nodes(optimized), False) if optimized is not None else (int64_nodes(onnx.load(str(path))), True)


def cuda_copies(artifacts) -> tuple[int, int]:
    """(host-to-device copies, CPU nodes feeding them) of the CUDA-target portable training graph."""
    import onnx

    from onnxmp.training.build.placement import place

    placed = place(onnx.load(str(artifacts.portable_path("training_model"))))
    return len(placed.copies), len(placed.feed)


def child(argv) -> int:
    """One engine's step time and peak RSS on one folder: a process of its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", type=Path, required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--entry", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(EXPORTS))
    import tasks

    from onnxmp.training import DynamicLossScaler, Trainer
    from onnxmp.training.artifacts import Artifacts

    entry = _matrix()[args.entry]
    artifacts = Artifacts.load(args.child)
    scaler = DynamicLossScaler(2.0**16, growth_steps=5) if artifacts.precision == "float16" else None
    trainer = Trainer(artifacts, engine=args.engine, threads=args.threads,
                      lr=tasks.LR.get(entry["arch"], tasks.DEFAULT_LR), scaler=scaler)
    batches = tasks.batches(entry["arch"], entry["inputs"], 32)
    times, thread_cpu, process_cpu, losses = [], [], [], []
    for i in range(args.warmup + args.steps):
        start, start_thread, start_process = time.perf_counter(), time.thread_time(), time.process_time()
        result = trainer.train_step(*batches[i % len(batches)])
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            # CPU time moves less with the machine's load than wall time; on one intra-op thread
            # onnxruntime computes on this thread, so thread and process time agree (the process's
            # covers any work on other threads, and is the one the table shows).  A step that other
            # processes interrupt still costs more CPU time (its caches refilled): the least over
            # the steps is the figure the load moves least
            thread_cpu.append(time.thread_time() - start_thread)
            process_cpu.append(time.process_time() - start_process)
            losses.append(result.loss)
    print(json.dumps({"seconds": statistics.median(times), "cpu_s": statistics.median(process_cpu),
                      "cpu_min_s": min(process_cpu), "thread_cpu_s": statistics.median(thread_cpu), "losses": losses,
                      "peak_rss_mib": peak_rss_mib()}))
    return 0


def _run_child(folder: Path, engine: str, key: str, threads: int, args) -> dict:
    command = [sys.executable, str(Path(__file__)), "--child", str(folder), "--engine", engine, "--entry", key,
               "--threads", str(threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not rows:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:120]}
    return rows[-1]


def _run_torch(key: str, threads: int, args) -> dict:
    if not args.torch_python:
        return {"error": "no --torch-python"}
    command = [args.torch_python, str(ROOT / "scripts" / "torch_step_time.py"), key, "--optimizer", args.optimizer,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows or "torch_s" not in rows[-1]:
        return {"error": (rows[-1].get("error") if rows else (done.stderr.strip().splitlines() or ["?"])[-1])[:120]}
    return {"seconds": rows[-1]["torch_s"], "cpu_s": rows[-1].get("cpu_s"), "cpu_min_s": rows[-1].get("cpu_min_s"),
            "thread_cpu_s": rows[-1].get("thread_cpu_s"), "peak_rss_mib": rows[-1].get("peak_rss_mib")}


def bench_builders(args) -> int:
    from onnxmp.errors import OnnxMPError
    from onnxmp.training.run.engines.base import session_options
    from onnxmp.files import write_text_atomic

    matrix = _matrix()
    wanted = args.entries or DEFAULT  # a whole name means that entry; a part, every entry holding it
    names = list(matrix) if args.all else [n for n in matrix if any(w == n if w in matrix else w in n for w in wanted)]
    print(f"{args.optimizer}, float32 steps on the CPU (median of {args.steps} after {args.warmup} of warm-up, an "
          f"update every step, one process per variant, in turn); nodes after onnxruntime's optimizations "
          f"(the engines' session options); int64: the CUDA float16 graph after basic optimizations")
    head = (f"{'export':<22}{'nodes ort':>10}{'lowered':>8}{'onnxmp':>8}{'bodies':>7}{'ratio':>7}{'int64 before':>13}{'after':>7}"
            f"{'copies':>7}{'after':>6}{'feed':>5}{'after':>6}"
            + f"{'cpu min ort/1':>14}{'onnxmp/1':>9}{'torch/1':>8}{'o/ort':>7}{'o/torch':>8}{'med o/ort':>10}"
            + "".join(f"{f'ms ort/{t}':>11}{f'onnxmp/{t}':>10}{f'torch/{t}':>9}{f'o/ort':>7}{f'o/torch':>8}"
                      for t in THREADS)
            + f"{'RSS MiB ort':>12}{'onnxmp':>8}{'torch':>7}{'max rel loss':>14}{'build s ort':>12}{'onnxmp':>8}")
    print(head)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="onnxmp-bench-builders-") as tmp:
        tmp = Path(tmp)
        for key in names:
            row: dict = {}
            try:
                cpu = {}
                for builder in ("ort", "onnxmp"):
                    cpu[builder], row[f"build_s_{builder}"] = build(key, builder, "float32", "cpu", args.optimizer,
                                                                   tmp / f"{key}.{builder}.cpu")
                ort_graph = optimized_model(cpu["ort"].training_model, session_options(cpu["ort"]), tmp / "ort")
                ours_graph = optimized_model(cpu["onnxmp"].portable_path("training_model"),
                                             session_options(cpu["onnxmp"]), tmp / "onnxmp")
                lowered = optimized_model(cpu["ort"].portable_path("training_model"), session_options(cpu["ort"]),
                                          tmp / "ort-lowered")
                row["nodes_ort"] = len(ort_graph.graph.node) if ort_graph is not None else None
                row["nodes_ort_lowered"] = len(lowered.graph.node) if lowered is not None else None
                row["nodes_onnxmp"] = len(ours_graph.graph.node) if ours_graph is not None else None
                row["nodes_onnxmp_bodies"] = all_nodes(ours_graph) if ours_graph is not None else None
                for builder, when in (() if args.no_cuda else (("ort", "before"), ("onnxmp", "after"))):
                    cuda, _ = build(key, builder, "float16", "cuda", args.optimizer, tmp / f"{key}.{builder}.cuda")
                    row[f"int64_{when}"], row[f"int64_{when}_raw"] = cuda_int64(cuda, tmp / f"{builder}-cuda")
                    row[f"copies_{when}"], row[f"feed_{when}"] = cuda_copies(cuda)
            except OnnxMPError as exc:
                print(f"{key:<22}refused: {str(exc).splitlines()[0][:150]}", flush=True)
                rows[key] = {**row, "refused": str(exc).splitlines()[0]}
                continue
            for threads in THREADS:
                samples: dict[str, list] = {"ort": [], "onnxmp": [], "torch": []}
                for round_ in range(args.repeat):  # in turn: the machine's load moves all alike
                    order = ["ort", "onnxmp"] if not (args.alternate and round_ % 2) else ["onnxmp", "ort"]
                    for variant in [*order, "torch"]:
                        samples[variant].append(
                            _run_torch(key, threads, args) if variant == "torch" else
                            _run_child(cpu[variant].directory, "native" if variant == "ort" else "portable", key,
                                       threads, args))
                for variant, runs in samples.items():
                    row[f"{variant}_{threads}"] = _median(runs)
            rows[key] = row
            print(_line(key, row), flush=True)
    if args.json:
        write_text_atomic(args.json, json.dumps({"steps": args.steps, "optimizer": args.optimizer, "rows": rows},
                                                indent=2) + "\n")
    return 0


def all_nodes(model) -> int:
    """Nodes of ``model``'s graph and of every subgraph (If/Loop/Scan bodies)."""
    from onnxmp.subgraphs import iter_proto_graphs

    return sum(len(g.node) for g in iter_proto_graphs(model.graph))


def _median(runs: list[dict]) -> dict:
    """The run of median step time among ``runs`` (an error where none ran); ``samples`` lists them all,
    ``cpu_s`` is the median of the runs' CPU seconds per step (``cpu_samples``) on its own."""
    timed = sorted((r for r in runs if "seconds" in r), key=lambda r: r["seconds"])
    if not timed:
        return runs[0]
    def middle(key):
        values = sorted(r[key] for r in timed if r.get(key) is not None)
        return (values[(len(values) - 1) // 2] if values else None), values

    (cpu, cpu_samples), (least, least_samples) = middle("cpu_s"), middle("cpu_min_s")
    return {**timed[(len(timed) - 1) // 2], "samples": [r["seconds"] for r in timed],
            "cpu_s": cpu, "cpu_samples": cpu_samples, "cpu_min_s": least, "cpu_min_samples": least_samples,
            "thread_cpu_s": middle("thread_cpu_s")[0]}


def _line(key: str, row: dict) -> str:
    def ms(run):
        return f"{run['seconds'] * 1e3:.1f}" if "seconds" in run else "err"

    def ratio(a, b, key="seconds"):
        return f"{a[key] / b[key]:.2f}" if a.get(key) and b.get(key) else "-"

    def cpu_ms(run):
        return f"{run['cpu_min_s'] * 1e3:.2f}" if run.get("cpu_min_s") else "err"

    def count(name):
        value = row.get(name)
        return "-" if value is None else f"{value}{' raw' if row.get(name + '_raw') else ''}"

    nodes = (f"{count('nodes_ort'):>10}{count('nodes_ort_lowered'):>8}{count('nodes_onnxmp'):>8}"
             f"{count('nodes_onnxmp_bodies'):>7}"
             f"{(row['nodes_onnxmp'] / row['nodes_ort']) if row.get('nodes_ort') and row.get('nodes_onnxmp') else 0:>7.2f}")
    text = (f"{key:<22}{nodes}{count('int64_before'):>13}{count('int64_after'):>7}{count('copies_before'):>7}"
            f"{count('copies_after'):>6}{count('feed_before'):>5}{count('feed_after'):>6}")
    ort, ours, torch = row["ort_1"], row["onnxmp_1"], row["torch_1"]
    text += (f"{cpu_ms(ort):>14}{cpu_ms(ours):>9}{cpu_ms(torch):>8}{ratio(ours, ort, 'cpu_min_s'):>7}"
             f"{ratio(ours, torch, 'cpu_min_s'):>8}{ratio(ours, ort, 'cpu_s'):>10}")
    for t in THREADS:
        ort, ours, torch = row[f"ort_{t}"], row[f"onnxmp_{t}"], row[f"torch_{t}"]
        text += f"{ms(ort):>11}{ms(ours):>10}{ms(torch):>9}{ratio(ours, ort):>7}{ratio(ours, torch):>8}"
    rss = [row[f"{v}_{THREADS[-1]}"].get("peak_rss_mib") for v in ("ort", "onnxmp", "torch")]
    text += "".join(f"{(f'{r:.0f}' if r else '-'):>{w}}" for r, w in zip(rss, (12, 8, 7)))
    a, b = row[f"ort_{THREADS[0]}"].get("losses"), row[f"onnxmp_{THREADS[0]}"].get("losses")
    diff = (max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b) if np.isfinite(x) and np.isfinite(y))
            if a and b else float("nan"))
    text += f"{diff:>14.2e}{row['build_s_ort']:>12.1f}{row['build_s_onnxmp']:>8.1f}"
    errors = [f"{name}: {run['error']}" for name, run in row.items() if isinstance(run, dict) and "error" in run]
    return text + (f"\n    {'; '.join(errors)}" if errors else "")


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.exit(child(sys.argv[1:]))
    sys.exit("run it through scripts/bench_training.py --builders")
