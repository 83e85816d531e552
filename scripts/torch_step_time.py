#!/usr/bin/env python
"""PyTorch's training step time on the matrix's models, for ``scripts/bench_training.py --torch-python``.

Runs in a scratch environment with torch and transformers (not onnxmp dependencies): builds each
entry's architecture as ``models/exports/export.py`` does (same config, seed and weight noise, eval
mode as exported: no dropout), and times forward, cross-entropy, backward, ``torch.optim.AdamW`` /
``SGD`` step and ``zero_grad`` on the same batches the ONNX engines train on.  Prints one JSON
line per entry: ``{"entry", "torch_s", "peak_rss_mib"}`` (median seconds per step; the process's peak
resident set so far; ``cpu_s``/``thread_cpu_s``: the median CPU seconds per step of the process and of
the calling thread, ``cpu_min_s`` the process's least, the figure the machine's load moves least),
or ``{"entry", "error"}``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from peak_rss import peak_rss_mib

EXPORTS = Path(__file__).resolve().parents[1] / "models" / "exports"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="+")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(EXPORTS))
    import torch

    import export
    import tasks

    if args.threads:
        torch.set_num_threads(args.threads)
    matrix = json.loads((EXPORTS / "matrix.json").read_text())
    for key in args.entries:
        entry = matrix[key]
        try:
            torch.manual_seed(0)
            model = export.builders()[entry["arch"]]()
            if hasattr(model, "config"):
                model.config._attn_implementation = "eager"
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            wrapped = export._Logits(model, entry["inputs"]).eval()
            lr = tasks.LR.get(entry["arch"], tasks.DEFAULT_LR)
            params = [p for p in wrapped.parameters() if p.requires_grad]
            optimizer = (torch.optim.AdamW(params, lr=lr) if args.optimizer == "adamw"
                         else torch.optim.SGD(params, lr=lr))
            batches = [[torch.from_numpy(a) for a in batch]
                       for batch in tasks.batches(entry["arch"], entry["inputs"], 32)]
            times, thread_cpu, process_cpu = [], [], []
            for i in range(args.warmup + args.steps):
                *inputs, labels = batches[i % len(batches)]
                start, start_thread, start_process = time.perf_counter(), time.thread_time(), time.process_time()
                loss = torch.nn.functional.cross_entropy(wrapped(*inputs), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
                    thread_cpu.append(time.thread_time() - start_thread)
                    process_cpu.append(time.process_time() - start_process)
            print(json.dumps({"entry": key, "torch_s": statistics.median(times),
                              "cpu_s": statistics.median(process_cpu), "cpu_min_s": min(process_cpu),
                              "thread_cpu_s": statistics.median(thread_cpu),
                              # the process's peak so far: run one entry per process for each one's own
                              "peak_rss_mib": peak_rss_mib()}), flush=True)
        except Exception as exc:  # one entry's failure is reported in its row, the others still run
            print(json.dumps({"entry": key, "error": f"{type(exc).__name__}: {exc}"[:200]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
