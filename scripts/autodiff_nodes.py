"""Training-graph sizes after onnxruntime's optimizations: onnxmp's gradient builder vs onnxruntime-
training's, on export-matrix entries (float32, dynamic axes; run on Python 3.11).

For each entry the training graph (gradient, loss scaling) is built three ways:

- ``native``: onnxruntime-training 1.19.2's builder (what the native engine runs);
- ``native-lowered``: the same graph lowered to standard ops (what the portable engine runs today);
- ``onnxmp``: onnxmp's builder (:mod:`onnxmp.training.build.autodiff`), with ORT's gradient accumulators;
- ``onnxmp-lowered``: the same, its accumulators lowered (what the portable engine would run).

Each is saved as onnxruntime's CPU EP optimizes it at ORT_ENABLE_ALL (``optimized_model_filepath``)
and its nodes counted, with the nodes producing int64 tensors.  ``--plain PYTHON`` also optimizes
the two portable graphs with another interpreter's plain onnxruntime (e.g. 1.32 on Python 3.12).
``--by-origin`` also splits each optimized graph's nodes by where they come from: the forward pass,
the gradient of one forward op type (the ``<node>_Grad`` scope both builders name their nodes with),
the loss, the unscale / finite check (``onnxmp/``) and the accumulators: where to cut.

    python scripts/autodiff_nodes.py [--entries bert2.torchscript17 ...] [--plain /path/to/python3.12] [--by-origin]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

DEFAULT = ["bert2.torchscript17", "gpt2.torchscript17", "vit.torchscript17", "resnet.torchscript17"]


def origin(node: onnx.NodeProto, forward_ops: dict[str, str]) -> str:
    """Where an optimized graph's node comes from, by its name (onnxruntime keeps the names of the
    nodes it does not fuse): ``grad:<forward op type>``, ``unscale``, ``accumulate``, ``loss`` or
    ``forward``; a node onnxruntime made (fused or folded) that fits none is ``forward``."""
    name = node.name
    if "_Grad/" in name or name.endswith("_Grad"):
        scope = name.split("_Grad")[0]
        return f"grad:{forward_ops.get(scope, '?')}"
    if name.startswith("onnxmp/loss"):
        return "loss"
    if name.startswith("onnxmp/") or "unscale" in name:
        return "unscale"
    if "ccumulat" in name or node.op_type in ("InPlaceAccumulatorV2",):
        return "accumulate"
    if "_grad" in name:
        return "grad:sum"  # the Sum of several consumers' contributions
    if name.startswith("onnxmp_loss") or "loss" in name.lower():
        return "loss"
    return "forward"


def by_origin(path: str, forward: onnx.ModelProto) -> Counter:
    """The optimized graph of ``path`` (saved by :func:`optimized_counts`): nodes per origin."""
    forward_ops = {(n.name or n.output[0]): n.op_type for n in forward.graph.node}
    return Counter(origin(n, forward_ops) for n in onnx.load(path + ".optimized.onnx").graph.node)


def optimized_counts(path: str) -> dict:
    """Nodes, and nodes with an int64 output, of ``path`` once onnxruntime's CPU EP optimized it."""
    import onnxruntime as ort

    from onnxmp.training.build.autodiff.info import GraphInfo

    out = path + ".optimized.onnx"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = out
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    model = onnx.load(out)
    types = GraphInfo(model).types
    int64 = sum(any(types.get(o) == onnx.TensorProto.INT64 for o in n.output if o) for n in model.graph.node)
    return {"nodes": len(model.graph.node), "int64": int64, "ort": ort.__version__}


def build(entry: str, folder: Path, target: str = "cpu") -> tuple[dict[str, str], onnx.ModelProto]:
    """The four graphs' paths, and the forward each builder read (for ``--by-origin``)."""
    import check_autodiff

    from onnxmp.training.build.unscale import add_loss_scaling, proven_gradients
    from onnxmp.training.build.lower import lower_model

    forward, _, ours, theirs, _ = check_autodiff.both(entry, "float32", target=target)
    paths = {}
    for name, model in (("native", theirs[0]), ("onnxmp", ours[0])):
        add_loss_scaling(model, proven_gradients(model) if name == "onnxmp" else ())  # as the build does
        for suffix, proto in (("", model), ("-lowered", lower_model(model))):
            paths[name + suffix] = str(folder / f"{entry}.{name}{suffix}.onnx")
            onnx.save(proto, paths[name + suffix])
    return paths, forward


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", nargs="*", default=DEFAULT)
    parser.add_argument("--plain", help="a Python with plain onnxruntime, to optimize the portable graphs too")
    parser.add_argument("--by-origin", action="store_true",
                        help="split each optimized graph's nodes by origin (forward, each op's gradient...)")
    parser.add_argument("--target", default="cpu", choices=["cpu", "cuda"],
                        help="the target onnxmp's builder builds for (its gradient forms differ: the CPU's Conv "
                             "weight gradient by patches); ORT's builder has one form")
    parser.add_argument("--count", help=argparse.SUPPRESS)  # internal: count one file, print JSON
    args = parser.parse_args(argv)
    if args.count:
        print(json.dumps(optimized_counts(args.count)))
        return 0
    print(f"{'entry':22} {'graph':15} {'raw':>6} {'nodes':>6} {'int64':>6}  onnxruntime")
    with tempfile.TemporaryDirectory() as tmp:
        for entry in args.entries:
            paths, forward = build(entry, Path(tmp), args.target)
            for name, path in paths.items():
                raw = len(onnx.load(path, load_external_data=False).graph.node)
                runs = [optimized_counts(path)]
                if args.plain and name.endswith("lowered"):
                    done = subprocess.run([args.plain, __file__, "--count", path], capture_output=True, text=True,
                                          env={"PYTHONPATH": str(ROOT)}, check=True)
                    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                for r in runs:
                    print(f"{entry:22} {name:15} {raw:6d} {r['nodes']:6d} {r['int64']:6d}  {r['ort']}", flush=True)
                if args.by_origin:
                    counts = by_origin(path, forward)
                    print("    " + ", ".join(f"{k} {v}" for k, v in counts.most_common()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
