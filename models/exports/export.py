#!/usr/bin/env python
"""Export the training matrix: small random-init Hugging Face models, as users export them.

Run in a scratch environment with torch and transformers (neither is an onnxmp
dependency; nothing is downloaded, every model is built from a small config with
a fixed seed):

    python -m venv /tmp/exportvenv && /tmp/exportvenv/bin/pip install torch==2.13.0 transformers onnx onnxscript
    /tmp/exportvenv/bin/python models/exports/export.py            # all entries, into models/exports/
    /tmp/exportvenv/bin/python models/exports/export.py bert2 vit   # some of them

Each architecture is exported with TorchScript (``dynamo=False``) at opset 14 and
17, and a few with the dynamo exporter at opset 18, in eval mode, with dynamic
batch and sequence (or time) axes, as ``<arch>.<exporter><opset>.onnx``.
``matrix.json`` records, per file, the inputs it takes and the task its data comes
from (``models/exports/tasks.py`` makes the data; it needs only numpy).

Transformers fills every attention mask with float32.min; ``bert_m1e9`` (BERT given
``(1 - mask) * -1e9`` as a 4-D float mask, which it adds to the scores as it is) and
``bert_masked_fill`` (a BERT-like encoder in plain torch, ``masked_fill(mask == 0, -1e9)``:
a ``Where`` into ``Softmax``) fill it with -1e9.  ``export_speed.py`` exports base-size
models for a speed benchmark, outside the repository.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tasks  # noqa: E402  (the same task definitions the tests use)

HIDDEN, HEADS, LAYERS, INTER = 32, 2, 2, 64
TEXT = dict(vocab_size=tasks.VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
            intermediate_size=INTER, max_position_embeddings=64, num_labels=tasks.LABELS)
DYNAMO = {"bert2", "gpt2", "vit"}
# Eval-mode TorchScript export folds BatchNormalization into the Conv before it; with
# TrainingMode.PRESERVE (the model still in eval mode) the BatchNormalization nodes stay.
KEEP_BN = {"resnet", "mobilenetv2"}


def _text(cfg_cls, model_cls, **extra):
    def build():
        return model_cls(cfg_cls(**{**TEXT, **extra}))
    return build


def builders():
    import transformers as T

    def gpt2():
        cfg = T.GPT2Config(vocab_size=tasks.VOCAB, n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=64,
                           n_inner=INTER, num_labels=tasks.LABELS, pad_token_id=0)
        return T.GPT2ForSequenceClassification(cfg)

    def distilbert():
        cfg = T.DistilBertConfig(vocab_size=tasks.VOCAB, dim=HIDDEN, n_heads=HEADS, n_layers=LAYERS,
                                 hidden_dim=INTER, max_position_embeddings=64, num_labels=tasks.LABELS)
        return T.DistilBertForSequenceClassification(cfg)

    def albert():
        return T.AlbertForSequenceClassification(T.AlbertConfig(**TEXT, embedding_size=16))

    def deberta():
        return T.DebertaV2ForSequenceClassification(T.DebertaV2Config(**TEXT, relative_attention=True,
                                                                      position_buckets=16, max_relative_positions=32,
                                                                      pos_att_type=["p2c", "c2p"]))

    def t5():
        cfg = T.T5Config(vocab_size=tasks.VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTER,
                         num_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8)
        return _Pooled(T.T5EncoderModel(cfg), HIDDEN, "mean")

    def vit():
        cfg = T.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_size=INTER, image_size=tasks.IMAGE, patch_size=8, num_labels=tasks.LABELS)
        return T.ViTForImageClassification(cfg)

    def swin():
        cfg = T.SwinConfig(image_size=tasks.IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                           window_size=4, mlp_ratio=2.0, num_labels=tasks.LABELS)
        return T.SwinForImageClassification(cfg)

    def resnet():
        cfg = T.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                             layer_type="basic", num_labels=tasks.LABELS)
        return T.ResNetForImageClassification(cfg)

    def mobilenetv2():
        cfg = T.MobileNetV2Config(num_channels=3, image_size=tasks.IMAGE, depth_multiplier=0.35, tf_padding=False,
                                  num_labels=tasks.LABELS)
        return T.MobileNetV2ForImageClassification(cfg)

    def wav2vec2():
        cfg = T.Wav2Vec2Config(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               intermediate_size=INTER, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8),
                               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=tasks.LABELS,
                               do_stable_layer_norm=True, feat_extract_norm="layer", classifier_proj_size=16)
        return T.Wav2Vec2ForSequenceClassification(cfg)

    def bert_m1e9():
        bert = T.BertForSequenceClassification(T.BertConfig(**TEXT))
        bert.config._attn_implementation = "eager"
        return _AdditiveMask(bert)

    return {
        "bert2": _text(T.BertConfig, T.BertForSequenceClassification),
        "bert3": _text(T.BertConfig, T.BertForSequenceClassification),
        "distilbert": distilbert,
        "roberta": _text(T.RobertaConfig, T.RobertaForSequenceClassification, pad_token_id=1),
        "albert": albert,
        "electra": _text(T.ElectraConfig, T.ElectraForSequenceClassification, embedding_size=16),
        "deberta_v2": deberta,
        "mpnet": _text(T.MPNetConfig, T.MPNetForSequenceClassification, pad_token_id=1),
        "xlm_roberta": _text(T.XLMRobertaConfig, T.XLMRobertaForSequenceClassification, pad_token_id=1),
        "gpt2": gpt2,
        "t5_encoder": t5,
        "vit": vit,
        "swin": swin,
        "resnet": resnet,
        "mobilenetv2": mobilenetv2,
        "wav2vec2": wav2vec2,
        "bert_m1e9": bert_m1e9,
        "bert_masked_fill": _MaskedFillBert,
    }


def _Pooled(encoder, hidden, how):
    import torch

    class Pooled(torch.nn.Module):
        """An encoder with a mean-pool head and a linear layer (sentence-transformers style)."""

        def __init__(self):
            super().__init__()
            self.encoder, self.head = encoder, torch.nn.Linear(hidden, tasks.LABELS)

        def forward(self, input_ids, attention_mask):
            h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1).clamp(min=1e-9))

    return Pooled()


def _AdditiveMask(model):
    import torch

    class AdditiveMask(torch.nn.Module):
        """A HF classifier given its additive mask as 4-D floats made the old way: 0 kept, -1e9 padding.

        Transformers uses a 4-D mask as it is (no float32.min fill of its own) and adds it to the
        attention scores before Softmax; the -1e9 is a Mul constant of the exported graph.
        """

        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            additive = (1 - attention_mask[:, None, None, :].float()) * -1e9
            extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            return self.m(input_ids=input_ids, attention_mask=additive, **extra).logits

    return AdditiveMask()


def _MaskedFillBert():
    """A BERT-like classifier in plain torch whose attention fills padding with ``masked_fill(mask == 0, -1e9)``.

    Token and position embeddings, LayerNorm, ``LAYERS`` post-LN layers of self-attention and a GELU
    MLP, a tanh pooler on the first token and a linear classifier: the export's mask is a ``Where``
    whose -1e9 replaces the scores of padded keys (no ``Add``), as hand-written encoders do it.
    """
    import math

    import torch
    from torch import nn

    head = HIDDEN // HEADS

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.up, self.down = nn.Linear(HIDDEN, INTER), nn.Linear(INTER, HIDDEN)

        def forward(self, h, mask):
            b, s = h.shape[0], h.shape[1]
            q, k, v = (f(h).view(b, s, HEADS, head).transpose(1, 2) for f in (self.q, self.k, self.v))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(head)
            scores = scores.masked_fill(mask == 0, -1e9)
            context = torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, s, HIDDEN)
            h = self.ln1(h + self.o(context))
            return self.ln2(h + self.down(nn.functional.gelu(self.up(h))))

    class MaskedFillBert(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(tasks.VOCAB, HIDDEN), nn.Embedding(64, HIDDEN)
            self.ln = nn.LayerNorm(HIDDEN)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            self.pooler, self.classifier = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, tasks.LABELS)

        def forward(self, input_ids, attention_mask):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            h = self.ln(self.tokens(input_ids) + self.positions(positions)[None])
            mask = attention_mask[:, None, None, :]
            for layer in self.layers:
                h = layer(h, mask)
            return self.classifier(torch.tanh(self.pooler(h[:, 0])))

    return MaskedFillBert()


class _Logits:
    """Wraps a HF model so the export has positional inputs and one ``logits`` output."""

    def __new__(cls, model, names):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, *args):
                out = self.m(**dict(zip(names, args)))
                return out if isinstance(out, torch.Tensor) else out.logits

        return Wrapped()


def export(name: str, exporter: str, opset: int, out: Path, keep_bn: bool = False) -> dict:
    import numpy as np
    import torch

    torch.manual_seed(0)
    model = builders()[name]()
    if hasattr(model, "config"):
        model.config._attn_implementation = "eager"
    with torch.no_grad():
        # Random init leaves every bias 0 and every norm weight 1, and the exporter stores equal
        # constants once: one initializer would stand for many weights.  Trained weights differ.
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.eval()
    spec = tasks.SPECS[name]
    names = list(spec["inputs"])
    wrapped = _Logits(model, names)
    data = tasks.make(name, rows=2, seed=0)
    dummy = tuple(torch.from_numpy(data[k]) for k in names)
    path = out / f"{name}.{exporter}{opset}{'-bn' if keep_bn else ''}.onnx"
    axes = {k: dict(enumerate(spec["axes"][k])) for k in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            dims = {}
            shapes = {k: {i: dims.setdefault(a, torch.export.Dim(a, min=2 if a == "batch" else 4, max=1024))
                          for i, a in axes[k].items()} for k in names}
            torch.onnx.export(wrapped, dummy, str(path), opset_version=opset, dynamo=True, input_names=names,
                              output_names=["logits"], dynamic_shapes=(tuple(shapes[k] for k in names),),
                              external_data=False, optimize=True)
        else:
            torch.onnx.export(wrapped, dummy, str(path), opset_version=opset, dynamo=False, input_names=names,
                              output_names=["logits"], dynamic_axes={**axes, "logits": {0: "batch"}},
                              do_constant_folding=True,
                              training=torch.onnx.TrainingMode.PRESERVE if keep_bn else torch.onnx.TrainingMode.EVAL)
    import onnx
    m = onnx.load(str(path))
    if m.ir_version > 10:  # onnxruntime-training 1.19 loads IR <= 10
        m.ir_version = 10
        onnx.save(m, str(path))
    # The wrapper is a new module, in training mode: an EVAL export puts it back in that mode
    # afterwards, recursively, and check_logits would be taken with dropout and BatchNorm batch
    # statistics.  (Set only now: under PRESERVE the wrapper's mode changes what is exported.)
    ref = wrapped.eval()(*dummy).detach().numpy()
    return {"file": path.name, "arch": name, "exporter": exporter, "opset": opset,
            "inputs": [i.name for i in m.graph.input if i.name not in {t.name for t in m.graph.initializer}],
            "nodes": len(m.graph.node), "bytes": path.stat().st_size,
            "ops": sorted({n.op_type for n in m.graph.node}), "check_logits": np.asarray(ref).round(5).tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="architectures (default: all)")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    names = args.names or list(tasks.SPECS)
    manifest_path = args.out / "matrix.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name in names:
        variants = [("torchscript", 14, False), ("torchscript", 17, False)]
        variants += [("dynamo", 18, False)] if name in DYNAMO else []
        variants += [("torchscript", 17, True)] if name in KEEP_BN else []
        for exporter, opset, keep_bn in variants:
            key = f"{name}.{exporter}{opset}{'-bn' if keep_bn else ''}"
            try:
                manifest[key] = export(name, exporter, opset, args.out, keep_bn)
                print(f"{key}: {manifest[key]['nodes']} nodes, {manifest[key]['bytes'] / 1e3:.0f} kB")
            except Exception as exc:  # an exporter failure is a finding: record it, go on
                manifest[key] = {"arch": name, "exporter": exporter, "opset": opset,
                                 "export_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                print(f"{key}: EXPORT FAILED {manifest[key]['export_error']}")
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
