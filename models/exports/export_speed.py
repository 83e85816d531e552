#!/usr/bin/env python
"""Export base-size random-init models for a local speed benchmark (not committed: hundreds of MB each).

Run in the same scratch environment as ``export.py`` (torch and transformers; nothing is
downloaded, every model is built from a config with a fixed seed):

    /tmp/exportvenv/bin/python models/exports/export_speed.py                      # into /work/scratch/speed-models
    /tmp/exportvenv/bin/python models/exports/export_speed.py OUT bert_base resnet50

Each model is exported by TorchScript (``dynamo=False``) in eval mode (BatchNormalization
folded into the Conv before it), eager attention, with a dynamic batch axis and, for text, a
dynamic sequence axis, as ``<name>.torchscript<opset>.onnx``.  The Whisper encoder's time
axis is fixed (it takes exactly 3000 frames, its position table has 1500 rows), so only
its batch is dynamic; the CNNs take 224x224 images with a dynamic batch.

``speed.json`` beside the models lists, per file, its inputs with the shapes to benchmark
throughput at (text: batch 32 x sequence 128; audio: batch 8; CNN: batch 64), its
outputs, and how its attention mask is filled.  ``feeds(entry)`` makes those inputs
(needs only numpy): text ids at random, an attention mask of ones but for right padding.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DEFAULT_OUT = Path("/work/scratch/speed-models")
TEXT_BATCH, TEXT_SEQ, AUDIO_BATCH, IMAGE_BATCH, IMAGE = 32, 128, 8, 64, 224
MEL_BINS, FRAMES = 80, 3000
FILL_MIN = "float32.min by transformers (Where on the padding, then Add to the scores)"
FILL_1E9 = "-1e9 additive: (1 - mask) * -1e9 in the wrapper, passed as a 4-D float mask and added to the scores"

_TEXT_AXES = {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
              "token_type_ids": ["batch", "sequence"]}

# name: (opsets, kind, inputs, pad id, vocabulary, mask fill)
MODELS = {
    "bert_base": ((14, 17), "text", ["input_ids", "attention_mask", "token_type_ids"], 0, 30522, FILL_MIN),
    "bert_base_m1e9": ((14, 17), "text", ["input_ids", "attention_mask", "token_type_ids"], 0, 30522, FILL_1E9),
    "mpnet_base": ((14, 17), "text", ["input_ids", "attention_mask"], 1, 30527, FILL_MIN),
    "distilbert_base": ((14,), "text", ["input_ids", "attention_mask"], 0, 30522, FILL_MIN),
    "whisper_tiny_encoder": ((17,), "audio", ["input_features"], None, None, None),
    "resnet50": ((17,), "image", ["pixel_values"], None, None, None),
    "mobilenetv2": ((17,), "image", ["pixel_values"], None, None, None),
}


def build(name: str):
    """The torch module of ``name``, random init from its config (transformers' defaults are base size)."""
    import torch
    import transformers as T

    import export

    text = dict(num_labels=2, attn_implementation="eager")
    if name in ("bert_base", "bert_base_m1e9"):
        # bert-base-uncased: hidden 768, 12 layers, 12 heads, intermediate 3072 (BertConfig's defaults)
        model = T.BertForSequenceClassification(T.BertConfig(hidden_size=768, num_hidden_layers=12,
                                                             num_attention_heads=12, intermediate_size=3072,
                                                             **text))
        return export._AdditiveMask(model) if name == "bert_base_m1e9" else model
    if name == "mpnet_base":
        return T.MPNetForSequenceClassification(T.MPNetConfig(hidden_size=768, num_hidden_layers=12,
                                                              num_attention_heads=12, pad_token_id=1, **text))
    if name == "distilbert_base":
        return T.DistilBertForSequenceClassification(T.DistilBertConfig(dim=768, n_layers=6, n_heads=12,
                                                                        hidden_dim=3072, **text))
    if name == "whisper_tiny_encoder":
        # openai/whisper-tiny's encoder: d_model 384, 4 layers, 6 heads, FFN 1536, 80 mel bins
        cfg = T.WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                              decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536,
                              num_mel_bins=MEL_BINS, max_source_positions=FRAMES // 2,
                              attn_implementation="eager")
        return T.WhisperModel(cfg).get_encoder()
    if name == "resnet50":
        cfg = T.ResNetConfig(num_channels=3, embedding_size=64, hidden_sizes=[256, 512, 1024, 2048],
                             depths=[3, 4, 6, 3], layer_type="bottleneck", num_labels=1000)
        return T.ResNetForImageClassification(cfg)
    if name == "mobilenetv2":
        # google/mobilenet_v2_1.0_224: depth multiplier 1.0, TensorFlow padding
        cfg = T.MobileNetV2Config(num_channels=3, image_size=IMAGE, depth_multiplier=1.0, num_labels=1000)
        return T.MobileNetV2ForImageClassification(cfg)
    raise KeyError(name)


def feeds(entry: dict, seed: int = 0, shapes: str = "benchmark") -> dict:
    """The inputs of a ``speed.json`` entry as numpy arrays, at its benchmark shapes (or ``"trace"``: small).

    Text: ids uniform in [5, vocabulary), a fixed first token, right padding with the pad id where
    the attention mask (ones, int64) is 0; the first row is full, the others keep between half and
    all of the sequence.  Audio and images: standard normal float32.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for spec in entry["inputs"]:
        shape = spec["shape"] if shapes == "benchmark" else spec["trace_shape"]
        if spec["dtype"] == "float32":
            out[spec["name"]] = rng.standard_normal(shape, dtype=np.float32)
    if entry["kind"] == "text":
        batch, seq = (entry["inputs"][0]["shape"] if shapes == "benchmark" else entry["inputs"][0]["trace_shape"])
        lengths = rng.integers(seq // 2, seq + 1, batch)
        lengths[0] = seq
        mask = np.arange(seq)[None] < lengths[:, None]
        ids = rng.integers(5, entry["vocab_size"], (batch, seq))
        ids[:, 0] = 2
        out["input_ids"] = np.where(mask, ids, entry["pad_token_id"]).astype(np.int64)
        out["attention_mask"] = mask.astype(np.int64)
        if "token_type_ids" in entry["input_names"]:
            out["token_type_ids"] = np.zeros((batch, seq), np.int64)
    return {k: out[k] for k in entry["input_names"]}


def _entry(name: str, opset: int) -> dict:
    opsets, kind, inputs, pad, vocab, fill = MODELS[name]
    if kind == "text":
        specs = [{"name": n, "dtype": "int64", "shape": [TEXT_BATCH, TEXT_SEQ], "trace_shape": [2, 16],
                  "dynamic_axes": _TEXT_AXES[n]} for n in inputs]
        output = "logits"
    elif kind == "audio":
        specs = [{"name": "input_features", "dtype": "float32", "shape": [AUDIO_BATCH, MEL_BINS, FRAMES],
                  "trace_shape": [2, MEL_BINS, FRAMES], "dynamic_axes": ["batch", None, None]}]
        output = "last_hidden_state"
    else:
        specs = [{"name": "pixel_values", "dtype": "float32", "shape": [IMAGE_BATCH, 3, IMAGE, IMAGE],
                  "trace_shape": [2, 3, IMAGE, IMAGE], "dynamic_axes": ["batch", None, None, None]}]
        output = "logits"
    entry = {"file": f"{name}.torchscript{opset}.onnx", "arch": name, "kind": kind, "exporter": "torchscript",
             "opset": opset, "input_names": inputs, "inputs": specs, "outputs": [output]}
    if kind == "text":
        entry.update(pad_token_id=pad, vocab_size=vocab, mask_fill=fill)
    return entry


def export(name: str, opset: int, out: Path) -> dict:
    import numpy as np
    import onnx
    import torch

    import export as small

    entry = _entry(name, opset)
    torch.manual_seed(0)
    model = build(name)
    with torch.no_grad():
        # As export.py: random init leaves equal biases and norm weights, which the exporter would
        # store once; trained weights differ.
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.eval()
    names = entry["input_names"]
    wrapped = small._Logits(model, names).eval()
    if entry["kind"] == "audio":
        class Hidden(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, input_features):
                return self.m(input_features=input_features).last_hidden_state
        wrapped = Hidden().eval()
    dummy = tuple(torch.from_numpy(v) for v in feeds(entry, shapes="trace").values())
    path = out / entry["file"]
    axes = {s["name"]: {i: a for i, a in enumerate(s["dynamic_axes"]) if a} for s in entry["inputs"]}
    start = time.perf_counter()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapped, dummy, str(path), opset_version=opset, dynamo=False, input_names=names,
                          output_names=entry["outputs"], dynamic_axes={**axes, entry["outputs"][0]: {0: "batch"}},
                          do_constant_folding=True, training=torch.onnx.TrainingMode.EVAL)
        ref = wrapped(*dummy).numpy()
    m = onnx.load(str(path))
    if m.ir_version > 10:  # onnxruntime(-training) 1.19 loads IR <= 10
        m.ir_version = 10
        onnx.save(m, str(path))
    ops = sorted({n.op_type for n in m.graph.node})
    entry.update(bytes=path.stat().st_size, nodes=len(m.graph.node), ops=ops,
                 parameters=int(sum(p.numel() for p in model.parameters())),
                 export_seconds=round(time.perf_counter() - start, 1),
                 # torch's output on feeds(entry, shapes="trace"): a few values, and their mean absolute value
                 check={"shape": list(ref.shape), "first": np.asarray(ref).ravel()[:4].round(5).tolist(),
                        "mean_abs": round(float(np.abs(ref).mean()), 6)})
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help=f"folder (default {DEFAULT_OUT})")
    ap.add_argument("names", nargs="*", help=f"models (default all: {', '.join(MODELS)})")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "speed.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name in args.names or list(MODELS):
        for opset in MODELS[name][0]:
            key = f"{name}.torchscript{opset}"
            try:
                manifest[key] = export(name, opset, args.out)
                print(f"{key}: {manifest[key]['nodes']} nodes, {manifest[key]['bytes'] / 1e6:.1f} MB, "
                      f"{manifest[key]['export_seconds']} s", flush=True)
            except Exception as exc:  # a failure is a finding: record it, go on
                manifest[key] = {**_entry(name, opset),
                                 "export_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                print(f"{key}: EXPORT FAILED {manifest[key]['export_error']}", flush=True)
            manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
