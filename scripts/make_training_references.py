"""Reference values for the training losses, schedules and loss scaler, computed by torch and transformers.

torch is no dependency of onnxmp: run this in a scratch environment that has torch and transformers,
and commit what it writes (tests/training/data/), which the tests compare onnxmp with:

    /path/to/torch-env/bin/python scripts/make_training_references.py

- ``loss_references.npz``: per case ``CASE/x, CASE/W, CASE/b, CASE/labels`` (the tiny model
  ``output = x @ W + b`` and its labels), ``CASE/loss``, ``CASE/grad_W``, ``CASE/grad_b`` (torch
  autograd), and ``CASE/pos_weight`` where the case has one.  The loss of each case is its name's
  prefix (``cross_entropy``, ``causal_lm``, ``bce_with_logits``, ``mse``, ``l1``).
- ``schedule_references.json``: the learning rate each update used under
  ``transformers.get_*_schedule(_with_warmup)`` (a LambdaLR stepped after every optimizer step),
  base lr 1.
- ``scaler_references.json``: ``torch.amp.GradScaler``'s scale and whether the optimizer stepped,
  for a given sequence of steps with and without inf gradients.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers.loss.loss_utils import ForCausalLMLoss

OUT = Path(__file__).resolve().parent.parent / "tests" / "training" / "data"


def _case(rng, x_shape, classes, *, weight_scale=1.0, bias=None):
    hidden = x_shape[-1]
    x = rng.normal(size=x_shape).astype(np.float32)
    w = (rng.normal(size=(hidden, classes)) * weight_scale).astype(np.float32)
    b = (rng.normal(size=classes) if bias is None else np.broadcast_to(bias, (classes,))).astype(np.float32)
    return x, w, b


def _run(loss_fn, x, w, b, labels):
    tw = torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    out = torch.tensor(x) @ tw + tb
    loss = loss_fn(out, torch.tensor(labels))
    loss.backward()
    return loss.detach().numpy(), tw.grad.numpy(), tb.grad.numpy()


def loss_references() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(29)
    ce = torch.nn.CrossEntropyLoss()  # reduction='mean', ignore_index=-100

    def ce_last_axis(out, labels):  # Hugging Face heads: flatten the positions, classes last
        return ce(out.reshape(-1, out.shape[-1]), labels.reshape(-1))

    def clm(out, labels):
        return ForCausalLMLoss(out, labels, vocab_size=out.shape[-1])

    def bce(pos_weight=None):
        fn = torch.nn.BCEWithLogitsLoss(pos_weight=None if pos_weight is None else torch.tensor(pos_weight))
        return fn

    cases = {}

    def add(name, fn, x, w, b, labels, **extra):
        loss, gw, gb = _run(fn, x, w, b, labels)
        cases.update({f"{name}/x": x, f"{name}/W": w, f"{name}/b": b, f"{name}/labels": labels,
                      f"{name}/loss": loss, f"{name}/grad_W": gw, f"{name}/grad_b": gb})
        cases.update({f"{name}/{k}": np.asarray(v, np.float32) for k, v in extra.items()})

    x, w, b = _case(rng, (6, 3), 4)
    labels = rng.integers(0, 4, size=6)
    add("cross_entropy_rows", ce_last_axis, x, w, b, labels)
    add("cross_entropy_rows_ignored", ce_last_axis, x, w, b, np.where([1, 0, 0, 1, 0, 0], -100, labels))
    # S == V: ORT's SoftmaxCrossEntropyLoss (classes on axis 1) gave a wrong loss here without an error.
    x, w, b = _case(rng, (2, 5, 3), 5)
    labels = rng.integers(0, 5, size=(2, 5))
    add("cross_entropy_tokens", ce_last_axis, x, w, b, labels)
    ignored = labels.copy()
    ignored[0, 3:] = -100
    ignored[1, 0] = -100
    add("cross_entropy_tokens_ignored", ce_last_axis, x, w, b, ignored)
    add("cross_entropy_all_ignored", ce_last_axis, x, w, b, np.full_like(labels, -100))

    x, w, b = _case(rng, (2, 6, 4), 7)
    labels = rng.integers(0, 7, size=(2, 6))
    add("causal_lm_tokens", clm, x, w, b, labels)
    padded = labels.copy()
    padded[0, :2] = -100  # a prompt without loss
    padded[1, 4:] = -100  # padding
    add("causal_lm_tokens_ignored", clm, x, w, b, padded)

    x, w, b = _case(rng, (4, 3), 3)
    targets = rng.integers(0, 2, size=(4, 3)).astype(np.float32)
    add("bce_with_logits_plain", bce(), x, w, b, targets)
    # Confident logits: +-20 (W = 0, b = +-20); ORT's log(sigmoid) block gave NaN here.
    x, w, b = _case(rng, (4, 3), 3, weight_scale=0.0, bias=np.array([20.0, -20.0, 20.0]))
    confident = np.array([[0, 1, 1], [1, 0, 0], [0, 0, 1], [1, 1, 0]], np.float32)
    add("bce_with_logits_confident", bce(), x, w, b, confident)
    # Logits exactly 0: the gradient is sigmoid(0) - y, not what Abs/Relu's gradients at 0 give.
    x, w, b = _case(rng, (4, 3), 3, weight_scale=0.0, bias=np.zeros(3))
    unbalanced = np.array([[0, 1, 1], [0, 0, 0], [0, 0, 1], [1, 1, 1]], np.float32)  # columns not half ones
    add("bce_with_logits_zero_logits", bce(), x, w, b, unbalanced)
    x, w, b = _case(rng, (4, 3), 3)
    pos_weight = np.array([0.5, 2.0, 3.0], np.float32)
    add("bce_with_logits_pos_weight", bce(pos_weight), x, w, b, targets, pos_weight=pos_weight)

    # docs/examples/token_loss.py, the worked custom loss: label smoothing 0.1 over tokens, -100 ignored.
    x, w, b = _case(rng, (2, 5, 3), 6)
    labels = rng.integers(0, 6, size=(2, 5))
    labels[1, 3:] = -100
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    add("custom_token_loss", lambda out, y: smoothed(out.reshape(-1, out.shape[-1]), y.reshape(-1)), x, w, b, labels)

    x, w, b = _case(rng, (5, 3), 2)
    targets = rng.normal(size=(5, 2)).astype(np.float32)
    add("mse_plain", torch.nn.MSELoss(), x, w, b, targets)
    add("l1_plain", torch.nn.L1Loss(), x, w, b, targets)
    return cases


SCHEDULES = [("constant", 0, 8), ("constant", 3, 8), ("linear", 0, 10), ("linear", 3, 10), ("linear", 6, 4),
             ("cosine", 3, 10), ("cosine", 0, 7), ("cosine", 1, 1)]


def schedule_references() -> list[dict]:
    result = []
    for name, warmup, total in SCHEDULES:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        if name == "constant":
            scheduler = (transformers.get_constant_schedule(optimizer) if warmup == 0 else
                         transformers.get_constant_schedule_with_warmup(optimizer, warmup))
        elif name == "linear":
            scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, total)
        else:
            scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, warmup, total)
        lrs = []
        for _ in range(total + 4):  # past the end too
            lrs.append(optimizer.param_groups[0]["lr"])  # the lr this update uses
            optimizer.step()
            scheduler.step()
        result.append({"name": name, "warmup_steps": warmup, "total_steps": total, "lr": lrs})
    return result


def scaler_references() -> list[dict]:
    result = []
    runs = [({"init_scale": 2.0**16}, [False] * 5 + [True] + [False] * 3),
            ({"init_scale": 8.0, "growth_interval": 2}, [False, False, False, True, True, False, False, False]),
            ({"init_scale": 4.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 1},
             [False, True, False, False, True, True, False])]
    for settings, infs in runs:
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([param], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", **settings)
        scales, stepped = [], []
        for inf in infs:
            optimizer.zero_grad()
            before = param.detach().clone()
            scaler.scale((param * 2).sum()).backward()
            if inf:
                param.grad.fill_(float("inf"))
            scales.append(scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
            stepped.append(not torch.equal(before, param.detach()))
        result.append({"settings": settings, "inf": infs, "scale_used": scales, "stepped": stepped,
                       "final_scale": scaler.get_scale()})
    return result


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(OUT / "loss_references.npz", **loss_references())
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    (OUT / "schedule_references.json").write_text(json.dumps(
        {"versions": versions, "schedules": schedule_references()}, indent=1) + "\n")
    (OUT / "scaler_references.json").write_text(json.dumps(
        {"versions": versions, "runs": scaler_references()}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
