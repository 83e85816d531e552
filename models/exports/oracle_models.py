"""The small random-init models of the oracle fixtures (models/exports/export_oracle.py): transformers
configs and hand-written zoos, each a factory returning ``(module, one batch of inputs)``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2


class First(nn.Module):
    """A transformers model's first output (logits / last hidden state) from keyword inputs."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args)), return_dict=True)
        return out["logits"] if "logits" in out else out["last_hidden_state"]


def _tokens(vocab: int, seq: int, *extra: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    feeds = {"input_ids": torch.randint(3, vocab, (BATCH, seq), generator=g)}
    if "attention_mask" in extra:
        mask = torch.ones(BATCH, seq, dtype=torch.int64)
        mask[1, seq - 2:] = 0
        feeds["attention_mask"] = mask
    if "token_type_ids" in extra:
        feeds["token_type_ids"] = torch.cat([torch.zeros(BATCH, seq // 2), torch.ones(BATCH, seq - seq // 2)],
                                            1).long()
    if "decoder_input_ids" in extra:
        feeds["decoder_input_ids"] = torch.randint(3, vocab, (BATCH, seq - 2), generator=g)
    return feeds


def _image(channels: int, size: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=torch.Generator().manual_seed(1))}


def mobilebert():
    from transformers import MobileBertConfig, MobileBertForSequenceClassification

    config = MobileBertConfig(vocab_size=64, hidden_size=32, embedding_size=16, true_hidden_size=16,
                              intra_bottleneck_size=16, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, num_feedforward_networks=2, max_position_embeddings=32,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
                              num_labels=3, attn_implementation="eager")
    names = ["input_ids", "attention_mask", "token_type_ids"]
    return First(MobileBertForSequenceClassification(config), names), _tokens(64, 8, *names)


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=48, num_labels=3, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, qkv_bias=True, attn_implementation="eager")
    return First(ViTForImageClassification(config), ["pixel_values"]), _image(3, 16)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    return First(LlamaForCausalLM(config), names), _tokens(64, 8, *names)


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
    names = ["input_ids", "attention_mask"]
    return First(Qwen2ForCausalLM(config), names), _tokens(64, 8, *names)


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                            num_labels=3, drop_path_rate=0.0, image_size=16)
    return First(ConvNextForImageClassification(config), ["pixel_values"]), _image(3, 16)


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
    names = ["input_ids", "attention_mask", "decoder_input_ids"]
    return First(BartForConditionalGeneration(config), names), _tokens(64, 8, *names)


class CnnZoo(nn.Module):
    """Convolutions and pooling with their attributes, normalizations, the activation zoo."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 8, 3, groups=4, dilation=2, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.depthwise = nn.Conv2d(8, 8, 3, groups=8, padding=1, stride=(1, 2))
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.pointwise = nn.Conv2d(16, 12, 1, bias=False)
        self.prelu = nn.PReLU(12)
        self.fc = nn.Linear(12, 5)

    def forward(self, pixel_values):
        x = F.hardswish(self.bn(self.stem(pixel_values)))
        x = F.pad(x, (1, 1, 1, 1), mode="reflect")
        x = F.silu(self.gn(self.grouped(x)))
        x = F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True)
        y = F.mish(self.inorm(self.depthwise(x)))
        y = F.avg_pool2d(y, 3, stride=1, padding=1, count_include_pad=False)
        z = F.max_pool2d(x, 2, stride=(1, 2), dilation=2, padding=1)
        z = F.avg_pool2d(F.softplus(z), 3, stride=1, padding=1, count_include_pad=True)
        z = F.interpolate(z, size=y.shape[2:], mode="nearest") if z.shape[2:] != y.shape[2:] else z
        x = self.prelu(self.pointwise(torch.cat([y, F.hardsigmoid(z) * z], 1)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.log_softmax(self.fc(x), -1)


def cnn_zoo():
    return CnnZoo(), _image(3, 16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class OpsZoo(nn.Module):
    """Sequence ops: Einsum, CumSum, ScatterND, GatherElements, Where, Expand, Tile, Max/Min, ReduceMax, Clip,
    Abs, Reciprocal, GELU both forms, LayerNorm, an RMSNorm pattern, Gemm with transB, LogSoftmax."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.ln = nn.LayerNorm(16)
        self.rms = RMSNorm(16)
        self.mix = nn.Parameter(torch.randn(16, 4, 16) * 0.2)
        self.proj = nn.Linear(16, 16)
        self.gate = nn.Parameter(torch.randn(1, 1, 16))
        self.row = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(16, 6)

    def forward(self, input_ids):
        x = self.ln(self.embed(input_ids))                                  # Gather, LayerNormalization
        h = torch.einsum("bsd,dke->bske", x, self.mix).mean(2)              # Einsum
        h = F.gelu(self.proj(h), approximate="tanh") + F.gelu(h)             # GELU both forms
        h = self.rms(h + torch.cumsum(h, 1) * 0.1)                         # CumSum, RMSNorm
        g = self.gate.expand(h.shape[0], h.shape[1], 16)                    # Expand
        h = torch.where(h > 0, h * g, torch.maximum(h, g) - torch.minimum(h, 0.5 * g))
        h = torch.clamp(h, -1.5, 1.5) + torch.abs(h) * 0.1                 # Clip, Abs
        h = h * torch.reciprocal(1.5 + h.abs())                             # Reciprocal
        idx = torch.argsort(input_ids % 5, dim=1).unsqueeze(-1).expand(-1, -1, 16)
        h = h + torch.gather(h, 1, idx) * 0.5                               # GatherElements
        t = torch.tile(h[..., :4] * self.row, (1, 1, 4))                    # Tile (of an activation: a
        h = h.clone()                                                       # parameter's Tile is folded)
        h[:, 0] = h[:, 0] * 2.0 + t[:, 0]                                   # ScatterND
        pooled = torch.amax(h, 1) + h.mean(1)                               # ReduceMax
        return F.log_softmax(self.head(pooled), -1)                         # Gemm transB, LogSoftmax


def ops_zoo():
    return OpsZoo(), {"input_ids": torch.randint(0, 32, (BATCH, 7), generator=torch.Generator().manual_seed(1))}


class TinyUNet(nn.Module):
    """A UNet's pieces: GroupNorm + SiLU blocks, a strided down conv, nearest and bilinear upsampling (Resize),
    skip Concat."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(3, 8, 3, padding=1)
        self.n1, self.c1 = nn.GroupNorm(4, 8), nn.Conv2d(8, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.n2, self.c2 = nn.GroupNorm(4, 16), nn.Conv2d(16, 16, 3, padding=1)
        self.up = nn.Conv2d(16, 8, 3, padding=1)
        self.n3, self.out = nn.GroupNorm(4, 16), nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, pixel_values):
        a = self.inp(pixel_values)
        a = a + self.c1(F.silu(self.n1(a)))
        b = self.down(a)
        b = b + self.c2(F.silu(self.n2(b)))
        u = self.up(F.interpolate(b, scale_factor=2.0, mode="nearest"))
        u = u + F.interpolate(b[:, :8], scale_factor=2.0, mode="bilinear", align_corners=False)
        return self.out(F.silu(self.n3(torch.cat([u, a], 1))))


def tiny_unet():
    return TinyUNet(), _image(3, 8)


class DropoutNet(nn.Module):
    """Dropout in training mode between two Linear layers.  With ``mask`` set, the dropout is that fixed
    mask (scaled by 1 / (1 - p)) instead of a random one: how the oracle's basis gradients are taken."""

    P = 0.5

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.mask: torch.Tensor | None = None

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = F.dropout(h, self.P, training=True) if self.mask is None else h * self.mask / (1 - self.P)
        return self.fc2(h)


def dropout_net():
    return DropoutNet(), {"x": torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(1))}


class BnNet(nn.Module):
    """BatchNormalization in training mode (batch statistics) after plain and strided convs."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, pixel_values):
        x = F.relu(self.b1(self.c1(pixel_values)))
        x = F.relu6(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def bn_net():
    return BnNet(), _image(3, 8)


class PadModes(nn.Module):
    """Pad's modes on a trainable path, at static shapes (one rule each, isolated)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, pixel_values):
        x = self.conv(pixel_values)
        return torch.cat([F.pad(x, (1, 2, 2, 1), mode="reflect"), F.pad(x, (1, 2, 2, 1), mode="replicate"),
                          F.pad(x, (1, 2, 2, 1), mode="constant", value=0.5)], 1)


class Upsampling(nn.Module):
    """Resize on a trainable path, at static shapes: nearest, bilinear, bilinear with align_corners."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, pixel_values):
        x = self.conv(pixel_values)
        return torch.cat([F.interpolate(x, scale_factor=2.0, mode="nearest"),
                          F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False),
                          F.interpolate(x, size=(12, 12), mode="bilinear", align_corners=True)], 1)


def pad_modes():
    return PadModes(), _image(2, 6)


def upsampling():
    return Upsampling(), _image(2, 6)


class PoolConvZoo(nn.Module):
    """1-D, 2-D and 3-D convolutions and pooling with the attributes torch exports: dilation, groups, strides,
    ceil_mode, count_include_pad both ways (static shapes)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3, stride=2, dilation=2, groups=2, padding=2)
        self.c2 = nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0))
        self.c3 = nn.Conv3d(2, 3, 2, stride=1, padding=1)

    def forward(self, signal, pixel_values, volume):
        a = F.silu(self.c1(signal))
        a = torch.cat([F.max_pool1d(a, 3, stride=2, ceil_mode=True).flatten(1),
                       F.avg_pool1d(a, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False).flatten(1)], 1)
        b = torch.tanh(self.c2(pixel_values))
        b = torch.cat([F.avg_pool2d(b, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=True).flatten(1),
                       F.max_pool2d(b, (2, 3), stride=(1, 2), padding=(1, 1), dilation=(2, 1)).flatten(1)], 1)
        c = F.elu(self.c3(volume))
        c = torch.cat([F.max_pool3d(c, 2, stride=2).flatten(1), F.avg_pool3d(c, 2, stride=1).flatten(1)], 1)
        return torch.cat([a, b, c], 1)


def pool_conv_zoo():
    g = torch.Generator().manual_seed(1)
    return PoolConvZoo(), {"signal": torch.randn(BATCH, 4, 11, generator=g),
                           "pixel_values": torch.randn(BATCH, 3, 7, 6, generator=g),
                           "volume": torch.randn(BATCH, 2, 3, 4, 4, generator=g)}


class ConvTranspose(nn.Module):
    """ConvTranspose (a decoder's / GAN's upsampling) with stride, padding, output_padding and groups."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.up1d = nn.ConvTranspose1d(4, 2, 4, stride=3, dilation=2)

    def forward(self, pixel_values):
        return torch.cat([self.up(pixel_values).flatten(1), self.up1d(pixel_values.flatten(2)).flatten(1)], 1)


def conv_transpose():
    return ConvTranspose(), _image(4, 5)


class EffNet(nn.Module):
    """EfficientNet / MobileNetV3 blocks: expand conv, SiLU, depthwise stride-2 conv, squeeze-excite
    (AdaptiveAvgPool, HardSigmoid gate), HardSwish, projection, residual, classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.expand = nn.Conv2d(8, 16, 1)
        self.dw = nn.Conv2d(16, 16, 5, stride=2, padding=2, groups=16)
        self.se1, self.se2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.project = nn.Conv2d(16, 8, 1)
        self.shortcut = nn.Conv2d(8, 8, 1, stride=2)
        self.head = nn.Linear(8, 5)

    def forward(self, pixel_values):
        x = F.hardswish(self.stem(pixel_values))
        y = F.silu(self.dw(F.silu(self.expand(x))))
        gate = F.hardsigmoid(self.se2(F.silu(self.se1(F.adaptive_avg_pool2d(y, 1)))))
        x = self.project(y * gate) + self.shortcut(x)
        return self.head(F.adaptive_avg_pool2d(F.hardswish(x), 1).flatten(1))


def effnet():
    return EffNet(), _image(3, 16)


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_decoder_layers=1, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, use_cache=False,
                      decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
    names = ["input_ids", "attention_mask", "decoder_input_ids"]
    return First(T5ForConditionalGeneration(config), names), _tokens(64, 8, *names)


class Denoiser(nn.Module):
    """diffusers' UNet2DModel (GroupNorm, SiLU, attention blocks, nearest upsampling, the timestep's
    sinusoidal embedding) at a fixed timestep."""

    def __init__(self):
        super().__init__()
        from diffusers import UNet2DModel

        self.unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4,
                                attention_head_dim=8)

    def forward(self, pixel_values, timestep):
        return self.unet(pixel_values, timestep, return_dict=False)[0]


def denoiser():
    return Denoiser(), {**_image(3, 8), "timestep": torch.tensor([3, 11])}
