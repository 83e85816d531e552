"""Causal-LM fine-tuning of a Hugging Face GPT-2 LM head: onnxmp's ``causal_lm`` loss against torch, step for step.

A random-init ``GPT2LMHeadModel`` (hidden 32, 2 layers, vocabulary 64) is exported by TorchScript and
trained for a few plain-SGD steps on one batch with ``-100`` labels (a prompt and padding without
loss), by torch (``model(input_ids, labels=...).loss``, Hugging Face's own causal-LM loss) and by
onnxmp (``loss="causal_lm"``) in float32, float16 and bfloat16 (emulated on the CPU).  The
TorchScript export unties ``lm_head`` from ``wte`` (a transposed copy), so the torch side unties
them too.  torch is no dependency of onnxmp: the reference half runs in an environment with torch
and transformers::

    python scripts/check_causal_lm.py --torch-python /path/to/torch-env/bin/python [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH, SEQUENCE, VOCAB = 3, 12, 64


def reference(out: Path, steps: int, lr: float) -> None:
    """(torch side) Export the model to ``out/gpt2lm.onnx`` and write torch's losses to ``out/torch.json``."""
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # random init leaves equal constants the exporter would store once
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQUENCE))
    labels = ids.copy()
    labels[0, :4] = -100  # a prompt without loss
    labels[2, 9:] = -100  # padding
    mask = np.ones_like(ids)
    axes = {0: "batch", 1: "sequence"}
    torch.onnx.export(Logits(), (torch.tensor(ids), torch.tensor(mask)), str(out / "gpt2lm.onnx"), dynamo=False,
                      input_names=["input_ids", "attention_mask"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes})
    model.eval()  # the exporter leaves the model in training mode (dropout on)
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels),
                     use_cache=False).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    np.savez(out / "batch.npz", input_ids=ids, attention_mask=mask, labels=labels)
    (out / "torch.json").write_text(json.dumps({"losses": losses, "torch": torch.__version__,
                                                "transformers": transformers.__version__}))


def compare(out: Path, lr: float) -> int:
    """(onnxmp side) Train the export with the causal_lm loss; print the losses against torch's."""
    import numpy as np
    import onnx

    from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts
    from onnxmp.training.build.prepare import without_gradient

    expected = json.loads((out / "torch.json").read_text())["losses"]
    batch = np.load(out / "batch.npz")
    model = onnx.load(str(out / "gpt2lm.onnx"))
    names = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    frozen = without_gradient(model, names)
    print(f"{'precision':>10}  " + "  ".join(f"{'step ' + str(i):>10}" for i in range(len(expected))) + "  max rel")
    print(f"{'torch':>10}  " + "  ".join(f"{v:10.6f}" for v in expected))
    for precision in ("float32", "float16", "bfloat16"):
        artifacts = build_artifacts(model, requires_grad=[n for n in names if n not in frozen], frozen=list(frozen),
                                    loss="causal_lm", optimizer="sgd", precision=precision,
                                    out_dir=out / f"artifacts-{precision}")
        trainer = Trainer(artifacts, lr=lr, scaler=DynamicLossScaler.static(1.0) if precision == "float32" else None)
        losses = [trainer.train_step(batch["input_ids"], batch["attention_mask"], batch["labels"]).loss
                  for _ in expected]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        print(f"{precision:>10}  " + "  ".join(f"{v:10.6f}" for v in losses) + f"  {worst:.1e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-python", help="a Python with torch and transformers (for the reference)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # the torch half, run by --torch-python
    args = parser.parse_args(argv)
    if args.reference:
        reference(Path(args.reference), args.steps, args.lr)
        return 0
    if not args.torch_python:
        parser.error("--torch-python is required (torch is no dependency of onnxmp)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([args.torch_python, __file__, "--reference", tmp, "--steps", str(args.steps),
                        "--lr", str(args.lr)], check=True)
        return compare(Path(tmp), args.lr)


if __name__ == "__main__":
    sys.exit(main())
