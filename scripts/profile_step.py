#!/usr/bin/env python
"""Where a training step's time goes: onnxruntime's profile of one export's float32 CPU training
graph, by op type and by origin (the forward, each forward op type's gradient, loss, unscale,
accumulate: :func:`autodiff_nodes.origin`), for onnxmp's graph on the portable engine's session
options against ORT's native training graph (Python 3.11, the training build, which runs it).

One intra-op thread, ``--steps`` runs after ``--warmup``, the two graphs' runs in turn; the figures
are microseconds per step summed over the nodes (onnxruntime's ``Node`` events, each node's least
over the steps), so they leave out the session's own overhead.  The nodes inside an ``If`` count once,
in the If.  Profiling inflates an If's branches: MobileNetV2's accumulators' If shows 11 ms in the
profile while its whole training graph runs in 15.5 ms unprofiled (21 ms profiled): read the If's
figure as an upper bound, the other nodes' against each other.

    PYTHONPATH=. python scripts/profile_step.py resnet.torchscript17 [--top 25]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "models" / "exports"))


def prepare(path: Path, artifacts, entry: dict, args, folder: Path):
    """(a profiling session of the graph at ``path``, its feeds)."""
    import onnxruntime

    import tasks
    from onnxmp.training.contract import GRAD_WEIGHT, LAZY_RESET_GRAD, LOSS_SCALE
    from onnxmp.training.run.engines.base import session_options

    options = session_options(artifacts, 1)
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / path.stem)
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    params = artifacts.parameters()
    batch = tasks.batches(entry["arch"], entry["inputs"], 32)[0]
    names = [*entry["inputs"], "labels"]
    feeds = {}
    for i in session.get_inputs():
        if i.name in params:
            feeds[i.name] = params[i.name]
        elif i.name == LAZY_RESET_GRAD:
            feeds[i.name] = np.array([args.reset])
        elif i.name in (LOSS_SCALE, GRAD_WEIGHT):
            feeds[i.name] = np.ones([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
        elif i.name in names:
            feeds[i.name] = batch[names.index(i.name)]
        else:  # an accumulation buffer: its parameter's shape
            feeds[i.name] = np.zeros_like(params[i.name.split("_grad")[0]])
    return session, feeds


def summarize(session, args) -> tuple[Counter, Counter, Counter]:
    """(microseconds per step by op type, by origin, by node name) of ``session``'s profile."""
    from autodiff_nodes import origin
    from bench_builders import EXPORTS, _matrix

    trace = json.loads(Path(session.end_profiling()).read_text())
    if args.dump:
        Path(args.dump).write_text(json.dumps(trace))
    # the warm-up runs are in this trace too: count only the last --steps runs
    runs = [e for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"]
    start = runs[-args.steps]["ts"]
    forward = onnx.load(str(EXPORTS / _matrix()[args.entry]["file"]), load_external_data=False)
    forward_ops = {(n.name or n.output[0]): n.op_type for n in forward.graph.node}
    kernels = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start]
    # a control-flow node's time covers its branches' nodes, which have events of their own:
    # those count once, in the If/Loop/Scan
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if e["args"].get("op_name") in ("If", "Loop", "Scan")]
    durations: dict[tuple[str, str], list[float]] = {}
    for e in kernels:
        if any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans) and e["args"].get("op_name") != "If":
            continue
        durations.setdefault((e["args"].get("op_name", "?"), e["name"][:-len("_kernel_time")]), []).append(e["dur"])
    by_type, by_origin, by_node = Counter(), Counter(), Counter()
    for (op, name), runs in durations.items():
        # each node's least time over the steps: the one other processes disturbed least
        us = float(np.min(runs))
        by_type[op] += us
        by_origin[origin(onnx.helper.make_node(op, [], [], name=name), forward_ops)] += us
        by_node[f"{op} {name}"] += us
    return by_type, by_origin, by_node


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entry")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("--accumulate", dest="reset", action="store_false",
                        help="profile an accumulating micro-step (the reset flag false); by default every step "
                             "resets, as with an update every step (the bench's steps)")
    parser.add_argument("--optimizer", default="adamw")
    args = parser.parse_args(argv)
    from bench_builders import _matrix, build

    entry = _matrix()[args.entry]
    with tempfile.TemporaryDirectory(prefix="onnxmp-profile-") as tmp:
        tmp = Path(tmp)
        sessions = {}
        for builder in ("ort", "onnxmp"):
            artifacts, _ = build(args.entry, builder, "float32", "cpu", args.optimizer, tmp / builder)
            path = artifacts.training_model if builder == "ort" else artifacts.portable_path("training_model")
            sessions[builder] = prepare(path, artifacts, entry, args, tmp)
        for _ in range(args.warmup + args.steps):  # in turn, step by step: the load moves both alike
            for session, feeds in sessions.values():
                session.run(None, feeds)
        results = {builder: summarize(session, args) for builder, (session, _) in sessions.items()}
    for i, what in enumerate(("op type", "origin", "node")):
        print(f"\n{args.entry}: us per step by {what} (ort native | onnxmp portable)")
        keys = sorted(set(results["ort"][i]) | set(results["onnxmp"][i]),
                      key=lambda k: -max(results["ort"][i][k], results["onnxmp"][i][k]))
        if i == 2:
            for b in ("ort", "onnxmp"):
                print(f"  {b}:")
                for k, v in results[b][i].most_common(args.top):
                    print(f"    {v:9.1f}  {k}")
            continue
        for k in keys[:args.top]:
            print(f"  {k:<40}{results['ort'][i][k]:>10.1f}{results['onnxmp'][i][k]:>10.1f}")
        print(f"  {'total':<40}{sum(results['ort'][i].values()):>10.1f}{sum(results['onnxmp'][i].values()):>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
