"""Inputs and a small learnable task for each architecture of the export matrix.

Needs only numpy, so the tests (which have no torch) and ``export.py`` (which
traces with a batch of it) make the same data.  Each task can be learned by the
architecture it feeds in a few dozen steps, so "the loss falls" is a real check:

* text: the tokens of label 0 come from the lower half of the vocabulary, those
  of label 1 from the upper half, after a fixed first token; right-padded (a
  random length per row, ``attention_mask`` 0 on padding);
* vision: noise images whose first channel is shifted up (label 1) or down;
* audio: a sine wave, low (label 0) or high (label 1) in pitch, in noise.
"""
from __future__ import annotations

import numpy as np

VOCAB, LABELS, SEQ, IMAGE, SAMPLES = 96, 2, 12, 32, 800
FIRST = 4  # token ids below FIRST are special (pad, [CLS]...)

_TEXT2 = {"inputs": ["input_ids", "attention_mask"],
          "axes": {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}}
_TEXT3 = {"inputs": ["input_ids", "attention_mask", "token_type_ids"],
          "axes": {**_TEXT2["axes"], "token_type_ids": ["batch", "sequence"]}}
_IMAGE = {"inputs": ["pixel_values"], "axes": {"pixel_values": ["batch"]}}
_AUDIO = {"inputs": ["input_values"], "axes": {"input_values": ["batch", "samples"]}}

SPECS = {
    "bert2": {**_TEXT2, "kind": "text", "pad": 0},
    "bert3": {**_TEXT3, "kind": "text", "pad": 0},
    "distilbert": {**_TEXT2, "kind": "text", "pad": 0},
    "roberta": {**_TEXT2, "kind": "text", "pad": 1},
    "albert": {**_TEXT3, "kind": "text", "pad": 0},
    "electra": {**_TEXT3, "kind": "text", "pad": 0},
    "deberta_v2": {**_TEXT2, "kind": "text", "pad": 0},  # type_vocab_size 0: no token types
    "mpnet": {**_TEXT2, "kind": "text", "pad": 1},
    "xlm_roberta": {**_TEXT2, "kind": "text", "pad": 1},
    "gpt2": {**_TEXT2, "kind": "text", "pad": 0},
    "t5_encoder": {**_TEXT2, "kind": "text", "pad": 0},
    "vit": {**_IMAGE, "kind": "image"},
    "swin": {**_IMAGE, "kind": "image"},
    "resnet": {**_IMAGE, "kind": "image"},
    "mobilenetv2": {**_IMAGE, "kind": "image"},
    "wav2vec2": {**_AUDIO, "kind": "audio"},
    # Attention masks filled with -1e9 instead of float32.min: added (BERT given a 4-D float mask)
    # and by masked_fill (a plain-torch BERT-like encoder), see export.py.
    "bert_m1e9": {**_TEXT2, "kind": "text", "pad": 0},
    "bert_masked_fill": {**_TEXT2, "kind": "text", "pad": 0},
}


# The learning rate the matrix trains each architecture with (AdamW), and its batch size.
LR = {"mobilenetv2": 1e-3}  # deep and narrow: 5e-3 overshoots in float32 too
DEFAULT_LR, BATCH = 5e-3, 8


def batches(arch: str, inputs: list[str], rows: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """``make(arch, rows, seed)`` as batches of ``BATCH`` rows: ``inputs`` in order, then the labels."""
    data = make(arch, rows, seed)
    order = [*inputs, "labels"]
    return [tuple(data[k][i:i + BATCH] for k in order) for i in range(0, rows, BATCH)]


def make(arch: str, rows: int, seed: int) -> dict[str, np.ndarray]:
    """The inputs of ``arch`` (named as its export names them) and ``labels``, ``rows`` rows."""
    spec = SPECS[arch]
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, LABELS, rows).astype(np.int64)
    if spec["kind"] == "text":
        half = (VOCAB - FIRST) // 2
        ids = FIRST + labels[:, None] * half + rng.integers(0, half, (rows, SEQ))
        ids[:, 0] = 2  # a fixed first token, as [CLS] / <s>
        lengths = rng.integers(4, SEQ + 1, rows)
        mask = np.arange(SEQ)[None] < lengths[:, None]
        out = {"input_ids": np.where(mask, ids, spec["pad"]).astype(np.int64),
               "attention_mask": mask.astype(np.int64)}
        if "token_type_ids" in spec["inputs"]:
            out["token_type_ids"] = (mask & (np.arange(SEQ)[None] >= lengths[:, None] // 2)).astype(np.int64)
    elif spec["kind"] == "image":
        x = rng.normal(size=(rows, 3, IMAGE, IMAGE)).astype(np.float32)
        x[:, 0] += np.where(labels, 0.5, -0.5)[:, None, None].astype(np.float32)
        out = {"pixel_values": x}
    else:
        t = np.arange(SAMPLES) / 8000.0
        freq = np.where(labels, 1500.0, 300.0)[:, None] * rng.uniform(0.9, 1.1, (rows, 1))
        wave = np.sin(2 * np.pi * freq * t + rng.uniform(0, 2 * np.pi, (rows, 1)))
        out = {"input_values": (wave + 0.1 * rng.normal(size=wave.shape)).astype(np.float32)}
    return {k: out[k] for k in spec["inputs"]} | {"labels": labels}
