#!/usr/bin/env python
"""Training step time on the GPU: onnxmp's portable engine on the CUDA EP (fp32, fp16, bf16)
beside PyTorch AMP (autocast + GradScaler) on the same model and batch.

Two models, defined once in torch here and exported to ONNX, so both sides train the same
weights on the same batch: a BERT-base-sized encoder (12 layers, hidden 768, 12 heads, FFN
3072, GELU, batch 32 x 128 tokens) and a ResNet-50-sized CNN (bottlenecks 3-4-6-3, batch 64,
224x224).  The phases run in the interpreters that have what each needs (``scripts/gpu_check.sh``
passes them):

* ``--torch-python``: torch (and onnx) -- exports the models, times PyTorch fp32 / AMP fp16 / AMP bf16;
* ``--build-python``: onnxruntime-training (Python <= 3.11) -- builds ``target="cuda"`` artifacts
  (real float16/bfloat16 ops) for each precision;
* ``--train-python``: plain onnxruntime-gpu -- times ``Trainer(engine="portable", device="cuda")``.

``--dry-run`` does it all on the CPU with tiny sizes (CPU EP, ``target="cpu"``: emulated low
precision; torch autocast on the CPU): it proves the phases run, its times mean nothing.
Prints one table (ms per step, steps/s) and exits 1 if a phase failed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("float32", "float16", "bfloat16")
SIZES = {  # name: (full, tiny)
    "bert_base": ({"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "vocab": 30522, "batch": 32, "seq": 128},
                  {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 100, "batch": 4, "seq": 16}),
    "resnet50": ({"width": 64, "blocks": (3, 4, 6, 3), "batch": 64, "image": 224},
                 {"width": 8, "blocks": (1, 1, 1, 1), "batch": 4, "image": 32}),
}
CLASSES = 2


# --- torch side --------------------------------------------------------------------------


def torch_model(name: str, size: dict):
    import torch
    from torch import nn

    class Layer(nn.Module):  # BERT's post-norm layer, attention written out (no fused fast path)
        def __init__(self, h, heads, ffn):
            super().__init__()
            self.heads, self.qkv, self.out = heads, nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.ff1, self.ff2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            attention = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, dim=-1) @ v
            x = self.norm1(x + self.out(attention.transpose(1, 2).reshape(b, s, h)))
            return self.norm2(x + self.ff2(nn.functional.gelu(self.ff1(x))))

    class Encoder(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.embed = nn.Embedding(s["vocab"], s["hidden"])
            self.position = nn.Parameter(0.02 * torch.randn(s["seq"], s["hidden"]))
            self.layers = nn.ModuleList(Layer(s["hidden"], s["heads"], s["ffn"]) for _ in range(s["layers"]))
            self.head = nn.Linear(s["hidden"], CLASSES)

        def forward(self, ids):
            x = self.embed(ids) + self.position
            for layer in self.layers:
                x = layer(x)
            return self.head(x.mean(dim=1))

    class Bottleneck(nn.Module):
        def __init__(self, cin, planes, stride):
            super().__init__()
            cout = planes * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(),
                nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(),
                nn.Conv2d(planes, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                          if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.short(x))

    def resnet(s):
        w, layers, cin = s["width"], [], s["width"]
        for stage, blocks in enumerate(s["blocks"]):
            for b in range(blocks):
                layers.append(Bottleneck(cin, w * 2 ** stage, 2 if b == 0 and stage > 0 else 1))
                cin = w * 2 ** stage * 4
        return nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                             nn.MaxPool2d(3, 2, 1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(cin, CLASSES))

    torch.manual_seed(0)
    return (Encoder(size) if name == "bert_base" else resnet(size)).eval()  # eval: BN as exported


def batch(name: str, size: dict):
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "bert_base":
        x = rng.integers(0, size["vocab"], (size["batch"], size["seq"]), dtype=np.int64)
    else:
        x = rng.standard_normal((size["batch"], 3, size["image"], size["image"])).astype(np.float32)
    return x, rng.integers(0, CLASSES, size["batch"], dtype=np.int64)


def torch_phase(args) -> None:
    """Exports the models into args.work and times PyTorch; one JSON line per (model, precision)."""
    import torch

    device = "cpu" if args.dry_run else "cuda"
    for name in args.models:
        size = SIZES[name][args.dry_run]
        x, y = batch(name, size)
        model = torch_model(name, size)
        torch.onnx.export(model, (torch.from_numpy(x),), str(args.work / f"{name}.onnx"), input_names=["x"],
                          output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
        model = model.to(device)
        xs, ys = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        for precision in PRECISIONS:
            dtype = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[precision]
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            scaler = torch.amp.GradScaler(device, enabled=precision == "float16")
            times = []
            for i in range(args.warmup + args.iters):
                start = time.perf_counter()
                with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = torch.nn.functional.cross_entropy(model(xs), ys)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            print(json.dumps({"side": "torch", "model": name, "precision": precision,
                              "s": statistics.median(times), "loss": float(loss)}), flush=True)


# --- onnxmp side -------------------------------------------------------------------------


def build_phase(args) -> None:
    import onnx

    from onnxmp.training import build_artifacts

    target = "cpu" if args.dry_run else "cuda"
    for name in args.models:
        model = onnx.load(str(args.work / f"{name}.onnx"))
        params = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        for precision in PRECISIONS:
            build_artifacts(model, requires_grad=params, loss="cross_entropy", optimizer="adamw", precision=precision,
                            target=target, out_dir=args.work / f"{name}.{precision}")
            print(json.dumps({"side": "build", "model": name, "precision": precision}), flush=True)


def train_phase(args) -> None:
    from onnxmp.training import DynamicLossScaler, Trainer

    device = "cpu" if args.dry_run else "cuda"
    for name in args.models:
        x, y = batch(name, SIZES[name][args.dry_run])
        for precision in PRECISIONS:
            scaler = DynamicLossScaler() if precision == "float16" else None
            trainer = Trainer(args.work / f"{name}.{precision}", engine="portable", device=device, lr=1e-5,
                              scaler=scaler)
            times = []
            for i in range(args.warmup + args.iters):
                start = time.perf_counter()
                result = trainer.train_step(x, y)  # loss and all_finite come to the host: synchronised
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            print(json.dumps({"side": "onnxmp", "model": name, "precision": precision,
                              "s": statistics.median(times), "loss": result.loss,
                              "skipped": trainer.skipped_steps}), flush=True)


# --- driver ------------------------------------------------------------------------------


def run_phase(python: str, phase: str, args) -> tuple[list[dict], str | None]:
    command = [python, __file__, "--phase", phase, "--work", str(args.work), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--models", *args.models, *(["--dry-run"] if args.dry_run else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(command, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    error = None if child.returncode == 0 else (child.stderr.strip().splitlines() or [f"exit {child.returncode}"])[-1]
    return rows, error


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-python", default=sys.executable)
    parser.add_argument("--build-python", default=sys.executable)
    parser.add_argument("--train-python", default=sys.executable)
    parser.add_argument("--models", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 20; 2 with --dry-run)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 1 with --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: only proves the phases run")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--phase", choices=["torch", "build", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.iters = args.iters if args.iters is not None else (2 if args.dry_run else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
    if args.phase:
        {"torch": torch_phase, "build": build_phase, "train": train_phase}[args.phase](args)
        return 0
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="onnxmp-gpu-train-") as work:
        args.work = Path(work)
        for phase, python in (("torch", args.torch_python), ("build", args.build_python), ("train", args.train_python)):
            got, error = run_phase(python, phase, args)
            rows += got
            if error:
                failures.append(f"{phase} ({python}): {error}")
                break
    where = "CPU, tiny sizes (dry run: times mean nothing)" if args.dry_run else "CUDA EP / torch on cuda"
    print(f"training step time, {where}: median of {args.iters} steps after {args.warmup}")
    print(f"{'model':<12}{'precision':>10}{'onnxmp ms':>11}{'torch AMP ms':>14}{'onnxmp/torch steps/s':>22}")
    by = {(r["side"], r["model"], r["precision"]): r for r in rows}
    for name in args.models:
        for precision in PRECISIONS:
            ours, theirs = by.get(("onnxmp", name, precision)), by.get(("torch", name, precision))
            cells = [f"{ours['s'] * 1e3:>11.1f}" if ours else f"{'-':>11}",
                     f"{theirs['s'] * 1e3:>14.1f}" if theirs else f"{'-':>14}",
                     f"{theirs['s'] / ours['s']:>22.2f}" if ours and theirs else f"{'-':>22}"]
            print(f"{name:<12}{precision:>10}{''.join(cells)}")
    for line in failures:
        print(f"FAILED: {line}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "failures": failures, "dry_run": args.dry_run}, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
