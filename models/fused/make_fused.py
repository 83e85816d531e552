"""Build the committed matrix of onnxruntime transformer-optimizer outputs (issue 30, item 6).

Not part of onnxmp and never imported by it or by the tests: it needs torch, transformers and diffusers,
and two onnxruntime releases, so it runs in scratch virtual environments:

    /work/scratch/torchenv/bin/python models/fused/make_fused.py \
        [--ort119-python /work/scratch/ort119/bin/python] [--only bert2,gpt2] [--out models/fused]

Steps, per entry:

1. a tiny random-init model (fixed seed, hidden 32-64, 2 layers, vocab ~100) is exported with the
   TorchScript exporter (``torch.onnx.export(..., dynamo=False)``, opset 17, dynamic batch/sequence axes);
2. ``onnxruntime.transformers.optimizer.optimize_model`` rewrites it, once with the onnxruntime of this
   interpreter (the current release) and once with onnxruntime 1.19.2 in a child interpreter
   (``--ort119-python``; the child runs this same file with ``--optimize``, which imports no torch);
3. the optimized model is run by the onnxruntime that wrote it on the entry's sample inputs, and its
   outputs are compared with the unoptimized export's (a fusion that changes the function is an error);
4. ``<entry>.onnx``, ``<entry>.inputs.npz`` and a line of ``manifest.json`` are written: the source, the
   onnxruntime version, the com.microsoft ops present (what that optimizer fused), the inputs and outputs.

Entry names are ``<model>.ort<major><minor>`` (``bert3.ort119``, ``bert3.ort132``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
BATCH, SEQ = 2, 8


# ---------------------------------------------------------------------------------------------------
# The optimize step: runs in either interpreter; imports onnxruntime and onnx only.

def optimize(raw: str, out: str, model_type: str, num_heads: int, hidden: int, disable: list[str]) -> dict:
    import onnx
    import onnxruntime
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions(model_type)
    for flag in disable:
        setattr(options, flag, False)
    opt = optimize_model(raw, model_type=model_type, num_heads=num_heads, hidden_size=hidden,
                         optimization_options=options, use_gpu=False)
    opt.save_model_to_file(out)
    model = onnx.load(out)
    ops = Counter(f"{n.domain}:{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                  for n in model.graph.node)
    return {"ort": onnxruntime.__version__, "ops": dict(sorted(ops.items())),
            "fused": sorted({k.split(":", 1)[1] for k in ops if k.startswith("com.microsoft:")}),
            "nodes": len(model.graph.node), "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import}}


def run_outputs(path: str, feeds_npz: str) -> list:
    import numpy as np
    import onnxruntime

    feeds = dict(np.load(feeds_npz))
    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _optimize_and_compare(raw, out, model_type, num_heads, hidden, disable, feeds_npz) -> dict:
    import numpy as np

    info = optimize(raw, out, model_type, num_heads, hidden, disable)
    try:
        ref, got = run_outputs(raw, feeds_npz), run_outputs(out, feeds_npz)
    except Exception as exc:  # noqa: BLE001 - CUDA-only contrib ops (NhwcConv, GroupNorm, BiasSplitGelu)
        if "NOT_IMPLEMENTED" not in str(exc):
            raise
        info["cpu_runs"], info["fusion_rel_err"] = False, None
        info["cpu_error"] = str(exc).splitlines()[0][-300:]
        return info
    info["cpu_runs"] = True
    err = max(float(np.max(np.abs(r.astype(np.float64) - g.astype(np.float64))) / (1e-6 + float(np.max(np.abs(r)))))
              for r, g in zip(ref, got))
    info["fusion_rel_err"] = err
    return info


# ---------------------------------------------------------------------------------------------------
# The export step: torch, transformers, diffusers (the current-release interpreter only).

def _ids(rng, vocab, batch=BATCH, seq=SEQ):
    import numpy as np

    return rng.integers(1, vocab, size=(batch, seq), dtype=np.int64)


def _mask(batch=BATCH, seq=SEQ):
    import numpy as np

    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, seq - 3:] = 0  # padding in the second row, so the mask path matters
    return mask


def _text_axes(names, outputs):
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    axes.update({o: {0: "batch"} for o in outputs})
    return axes


def _classic_attention(self, hidden_states, attention_mask=None, cache=None, **kwargs):
    """BertSelfAttention as transformers 4.x wrote it (view/permute heads, scores + additive mask)."""
    import math

    import torch

    def heads(x):
        return x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)).permute(0, 2, 1, 3)

    q, k, v = heads(self.query(hidden_states)), heads(self.key(hidden_states)), heads(self.value(hidden_states))
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
    if attention_mask is not None:
        scores = scores + attention_mask
    context = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
    return context.view(context.size()[:-2] + (self.all_head_size,)), None


def _classic_bert(model):
    """``model`` exported the way transformers 4.x exported BERT: the additive mask
    ``(1 - mask[:, None, None, :]) * -10000`` and the 4.x attention.  1.19's optimizer matches only this
    shape of graph; transformers 5's attention and mask fuse at the current release only."""
    import types

    import torch

    for layer in model.encoder.layer:
        layer.attention.self.forward = types.MethodType(_classic_attention, layer.attention.self)

    class ClassicMaskBert(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids, return_dict=True):
            extended = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * -10000.0
            return self.inner(input_ids=input_ids, attention_mask=extended, token_type_ids=token_type_ids,
                              return_dict=return_dict)

    return ClassicMaskBert(model)


def build(name: str):
    """(torch module, sample feeds dict, output names, dynamic axes, model_type, heads, hidden, disabled fusions)."""
    import numpy as np
    import torch
    import transformers as tf

    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    vocab = 100
    if name in ("bert2", "bert3", "bert3_classic"):
        cfg = tf.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                            attn_implementation="eager")
        model = tf.BertModel(cfg)
        feeds = {"input_ids": _ids(rng, vocab), "attention_mask": _mask()}
        if name in ("bert3", "bert3_classic"):
            feeds["token_type_ids"] = np.concatenate(
                [np.zeros((BATCH, SEQ // 2), np.int64), np.ones((BATCH, SEQ - SEQ // 2), np.int64)], axis=1)
        outs = ["last_hidden_state", "pooler_output"]
        if name == "bert3_classic":
            model = _classic_bert(model)
        return model, feeds, outs, "bert", 4, 32, []
    if name in ("gpt2", "gpt2_noattn"):
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                            attn_implementation="eager")
        model = tf.GPT2LMHeadModel(cfg)
        # with the mask: transformers 5 exports input_ids alone through aten::diff, which opset 17 lacks
        feeds = {"input_ids": _ids(rng, vocab), "attention_mask": _mask()}
        disable = ["enable_attention"] if name == "gpt2_noattn" else []
        return model, feeds, ["logits"], "gpt2", 4, 32, disable
    if name == "vit":
        cfg = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8, num_channels=3, attn_implementation="eager")
        model = tf.ViTModel(cfg)
        feeds = {"pixel_values": rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)}
        return model, feeds, ["last_hidden_state", "pooler_output"], "vit", 4, 32, []
    if name == "t5enc":
        cfg = tf.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          relative_attention_num_buckets=8, attn_implementation="eager")
        model = tf.T5EncoderModel(cfg)
        feeds = {"input_ids": _ids(rng, vocab), "attention_mask": _mask()}
        return model, feeds, ["last_hidden_state"], "t5", 4, 32, []
    if name == "bartenc":
        cfg = tf.BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=64, attn_implementation="eager")
        model = tf.BartModel(cfg).get_encoder()
        feeds = {"input_ids": _ids(rng, vocab), "attention_mask": _mask()}
        return model, feeds, ["last_hidden_state"], "bart", 4, 32, []
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             use_cache=False, attn_implementation="eager")
        model = tf.LlamaForCausalLM(cfg)
        feeds = {"input_ids": _ids(rng, vocab), "attention_mask": _mask()}
        return model, feeds, ["logits"], "gpt2", 4, 32, []
    if name in ("unet", "unet_cpu"):
        from diffusers import UNet2DConditionModel

        model = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 32),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
            norm_num_groups=32)
        feeds = {"sample": rng.standard_normal((BATCH, 4, 8, 8)).astype(np.float32),
                 "timestep": np.array([10.0, 500.0], np.float32),
                 "encoder_hidden_states": rng.standard_normal((BATCH, 4, 32)).astype(np.float32)}
        # unet_cpu: the fusions whose ops have CUDA kernels only turned off, so the CPU can judge parity
        cuda_only = ["enable_nhwc_conv", "enable_group_norm", "enable_skip_group_norm", "enable_bias_splitgelu",
                     "enable_bias_add"]
        return model, feeds, ["out_sample"], "unet", 4, 32, cuda_only if name == "unet_cpu" else []
    raise SystemExit(f"unknown entry {name!r}")


# Entries whose fusions are the same at both releases and whose files are large: current release only.
CURRENT_ONLY = {"unet_cpu"}
ENTRIES = ("bert2", "bert3", "bert3_classic", "gpt2", "gpt2_noattn", "vit", "t5enc", "bartenc", "llama", "unet", "unet_cpu")


def export(name: str, raw: Path, npz: Path) -> dict:
    import numpy as np
    import torch

    model, feeds, outs, model_type, heads, hidden, disable = build(name)
    model.eval()
    base = getattr(model, "inner", model)
    names = list(feeds)

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            kwargs = dict(zip(names, args))
            if name.startswith("unet"):
                return (self.inner(**kwargs, return_dict=False)[0],)
            result = self.inner(**kwargs, return_dict=True)
            return tuple(result[o] for o in outs)

    args = tuple(torch.from_numpy(feeds[n]) for n in names)
    if name.startswith("unet"):
        axes = {"sample": {0: "batch"}, "timestep": {0: "batch"}, "encoder_hidden_states": {0: "batch"},
                "out_sample": {0: "batch"}}
    elif name == "vit":
        axes = {"pixel_values": {0: "batch"}, **{o: {0: "batch"} for o in outs}}
    else:
        axes = _text_axes(names, outs)
    with torch.no_grad():
        torch.onnx.export(Wrapped(model), args, str(raw), input_names=names, output_names=outs,
                          dynamic_axes=axes, opset_version=17, do_constant_folding=True, dynamo=False)
    np.savez(npz, **feeds)
    return {"model_type": model_type, "num_heads": heads, "hidden_size": hidden, "disable": disable,
            "inputs": {k: [str(v.dtype), list(v.shape)] for k, v in feeds.items()}, "outputs": outs,
            "source": f"{type(base).__module__}.{type(base).__name__}{' (transformers 4.x attention and mask)' if base is not model else ''} (random init, seed {SEED}) via "
                      f"torch {torch.__version__} torch.onnx.export(dynamo=False, opset 17)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--only", default=",".join(ENTRIES))
    ap.add_argument("--ort119-python", default="/work/scratch/ort119tf/bin/python",
                    help="an interpreter with onnxruntime 1.19.2 and torch (1.19's optimizer imports torch); "
                         "'' skips it")
    ap.add_argument("--optimize", nargs=7, metavar=("RAW", "OUT", "TYPE", "HEADS", "HIDDEN", "DISABLE", "NPZ"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.optimize:
        raw, out, mtype, heads, hidden, disable, npz = a.optimize
        info = _optimize_and_compare(raw, out, mtype, int(heads), int(hidden), json.loads(disable), npz)
        print("RESULT " + json.dumps(info))
        return

    import onnxruntime

    a.out.mkdir(parents=True, exist_ok=True)
    manifest_path = a.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"entries": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.only.split(","):
            raw = Path(tmp) / f"{name}.raw.onnx"
            npz_tmp = Path(tmp) / f"{name}.inputs.npz"
            meta = export(name, raw, npz_tmp)
            args = [str(raw), None, meta["model_type"], str(meta["num_heads"]), str(meta["hidden_size"]),
                    json.dumps(meta["disable"]), str(npz_tmp)]
            pythons = (sys.executable,) if name in CURRENT_ONLY else (a.ort119_python, sys.executable)
            for python in filter(None, pythons):
                tag = "ort" + "".join(
                    subprocess.check_output([python, "-c", "import onnxruntime as o; print(o.__version__)"],
                                            text=True).strip().split(".")[:2])
                entry = f"{name}.{tag}"
                out = a.out / f"{entry}.onnx"
                args[1] = str(out)
                proc = subprocess.run([python, __file__, "--optimize", *args], capture_output=True, text=True,
                                      env={**os.environ, "PYTHONWARNINGS": "ignore"})
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not lines:
                    print(f"{entry}: optimizer failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                    continue
                info = json.loads(lines[-1][len("RESULT "):])
                (a.out / f"{entry}.inputs.npz").write_bytes(npz_tmp.read_bytes())
                manifest["entries"][entry] = {**meta, **info, "file": out.name, "inputs_file": f"{entry}.inputs.npz",
                                              "bytes": out.stat().st_size}
                print(f"{entry:22s} ort {info['ort']:7s} nodes {info['nodes']:4d} "
                      f"fused {','.join(info['fused']) or '-'}  fusion err {info['fusion_rel_err']}")
    manifest["generator"] = f"models/fused/make_fused.py (current onnxruntime {onnxruntime.__version__})"
    manifest["entries"] = dict(sorted(manifest["entries"].items()))
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
