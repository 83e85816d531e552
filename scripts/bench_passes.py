"""How the passes any converter depends on grow with graph size, on this machine.

    python scripts/bench_passes.py [--sizes 20k,80k] [--repeat 5]

Times, on ``models.zoo.linear_occ_stack`` (the linear-occ shape of ``bench_convert.py``), onnx's
own C++ shape inference and full checker, a protobuf parse, and two plain Python loops over
the nodes, then prints the growth per 4x nodes.  ``bench_convert.py``'s growth target is only
meaningful where these scale about linearly: on a machine whose caches the bigger graph
outgrows, even a dict build grows well above 4x.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnx  # noqa: E402

from models import zoo  # noqa: E402

NODES_PER_LAYER = 34  # linear_occ_stack


def parse_size(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1000) if text.endswith("k") else int(text)


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(layers: int, repeat: int) -> tuple[int, dict[str, float]]:
    model = zoo.linear_occ_stack(layers)
    data = model.SerializeToString()
    infer = onnx.onnx_cpp2py_export.shape_inference.infer_shapes
    inferred = infer(data, False, False, False)
    nodes = model.graph.node
    return len(nodes), {
        "onnx infer_shapes (C++)": median_seconds(lambda: infer(data, False, False, False), repeat),
        "onnx check_model full_check (C++)": median_seconds(
            lambda: onnx.checker.check_model(inferred, full_check=True), repeat),
        "protobuf parse of the model (C)": median_seconds(lambda: onnx.ModelProto.FromString(inferred), repeat),
        "Python: node.input[:] of every node": median_seconds(lambda: [n.input[:] for n in nodes], repeat),
        "Python: dict of 2 str keys per node": median_seconds(
            lambda: {str(i): i for i in range(2 * len(nodes))}, repeat),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20k,80k", help="two or more node counts, e.g. 20k,80k")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if len(sizes) < 2 or sorted(sizes) != sizes:
        parser.error("--sizes needs two or more increasing sizes")
    gc.disable()  # as onnxmp.convert runs
    results = [measure(max(1, round(n / NODES_PER_LAYER)), args.repeat) for n in sizes]
    header = ["pass"] + [f"{n} nodes" for n, _ in results] + ["growth per 4x"] * (len(results) - 1)
    print(" | ".join(header))
    for name in results[0][1]:
        cells = [name] + [f"{r[name] * 1e3:.1f} ms" for _, r in results]
        for (n0, r0), (n1, r1) in zip(results, results[1:]):
            cells.append(f"{(r1[name] / r0[name]) ** (math.log(4) / math.log(n1 / n0)):.2f}x")
        print(" | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
