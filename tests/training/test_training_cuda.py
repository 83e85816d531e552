"""Real float16 training on the CUDA EP; skipped where onnxruntime has no CUDA (the CPU wheel)."""
import numpy as np
import onnxruntime
import pytest

from onnxmp.training import DynamicLossScaler, Trainer

pytestmark = pytest.mark.skipif("CUDAExecutionProvider" not in onnxruntime.get_available_providers(),
                                reason="needs onnxruntime-training with the CUDA EP")


def test_cuda_fp16_matches_cpu_emulation_and_skips_non_finite(cuda16_artifacts, fp16_artifacts, batches):
    cuda = Trainer(cuda16_artifacts, device="cuda", scaler=DynamicLossScaler(2.0**10), lr=0.01)
    emulated = Trainer(fp16_artifacts, scaler=DynamicLossScaler(2.0**10), lr=0.01)
    real = [cuda.train_step(*b).loss for b in batches[:8]]
    emu = [emulated.train_step(*b).loss for b in batches[:8]]
    np.testing.assert_allclose(real, emu, rtol=1e-2)

    before = cuda.parameters()
    x, y = batches[8]
    x = x.copy()
    x[0, 0] = np.nan
    result = cuda.train_step(x, y)
    assert result.skipped and not result.all_finite and cuda.scaler.scale == 2.0**9
    after = cuda.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)
