import json
import logging
import math
from pathlib import Path

import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training import DynamicLossScaler

REFERENCES = json.loads((Path(__file__).parent / "data" / "scaler_references.json").read_text())["runs"]


def test_gradscaler_defaults():
    # torch.amp.GradScaler's (onnxmp had Keras' initial scale, 2**15, before GradScaler parity).
    s = DynamicLossScaler()
    assert (s.scale, s.growth_interval, s.growth_factor, s.backoff_factor) == (2.0**16, 2000, 2.0, 0.5)
    assert s.dynamic and s.enabled
    assert (s.initial_scale, s.growth_steps) == (s.init_scale, s.growth_interval)  # the Keras-style names


@pytest.mark.parametrize("run", REFERENCES, ids=lambda r: json.dumps(r["settings"]))
def test_scale_trajectory_equals_torch_gradscaler(run):
    s = DynamicLossScaler(**run["settings"])
    used, stepped = [], []
    for inf in run["inf"]:
        used.append(s.scale)
        stepped.append(s.update(not inf))
    assert used == run["scale_used"] and stepped == run["stepped"] and s.scale == run["final_scale"]


def test_keras_names_are_aliases():
    assert (DynamicLossScaler(initial_scale=8.0, growth_steps=3).state_dict()
            == DynamicLossScaler(init_scale=8.0, growth_interval=3).state_dict()
            == DynamicLossScaler(8.0, growth_steps=3).state_dict())
    with pytest.raises(OnnxMPError, match="name the same setting"):
        DynamicLossScaler(init_scale=8.0, initial_scale=4.0)


def test_disabled_is_a_static_scale_of_one_that_still_skips():
    s = DynamicLossScaler(init_scale=1024.0, enabled=False)
    assert s.scale == 1.0 and not s.dynamic and not s.enabled
    assert s.update(False) is False and s.update(True) is True and s.scale == 1.0


def test_grows_after_growth_steps_good_steps():
    s = DynamicLossScaler(8.0, growth_steps=3)
    assert [s.update(True) for _ in range(2)] == [True, True]
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 16.0 and s.good_steps == 0
    for _ in range(3):
        s.update(True)
    assert s.scale == 32.0


def test_backoff_halves_and_resets_the_count():
    s = DynamicLossScaler(8.0, growth_steps=3)
    s.update(True)
    s.update(True)
    assert s.update(False) is False
    assert s.scale == 4.0 and s.good_steps == 0
    s.update(True)
    s.update(True)
    assert s.scale == 4.0  # the count restarted after the backoff


def test_bounds():
    s = DynamicLossScaler(2.0, growth_steps=1, min_scale=1.0, max_scale=4.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 4.0
    for _ in range(5):
        s.update(False)
    assert s.scale == 1.0


def test_static_never_changes_but_still_skips():
    s = DynamicLossScaler.static(1.0)
    assert s.update(False) is False
    assert s.update(True) is True
    assert s.scale == 1.0
    assert DynamicLossScaler(1.0, dynamic=False).state_dict() == s.state_dict()


def test_state_dict_round_trip():
    s = DynamicLossScaler(1024.0, growth_steps=7, min_scale=0.5, max_scale=2.0**20)
    s.update(True)
    s.update(False)
    s.update(True)
    restored = DynamicLossScaler.from_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()
    assert restored.scale == 512.0 and restored.good_steps == 1


@pytest.mark.parametrize("kwargs", [{"initial_scale": 0}, {"initial_scale": float("inf")}, {"growth_steps": 0},
                                    {"backoff_factor": 1.5}, {"growth_factor": 0.5},
                                    {"init_scale": 2.0**30, "max_scale": 2.0**24}, {"warn_after_skips": -1}])
def test_invalid_settings(kwargs):
    with pytest.raises(OnnxMPError):
        DynamicLossScaler(**kwargs)


def test_a_large_initial_scale_is_accepted_as_torch_does():
    # The cap follows the initial scale (torch has none); before GradScaler parity 2**30 was refused.
    s = DynamicLossScaler(2.0**30, growth_interval=1)
    s.update(True)
    assert s.scale == 2.0**30 == s.max_scale


def test_warning_after_n_skipped_updates_in_a_row(caplog):
    s = DynamicLossScaler(2.0**10, warn_after_skips=3)
    with caplog.at_level(logging.WARNING, logger="onnxmp.training.run.loss_scaler"):
        s.update(False)
        s.update(False)
        s.update(True)  # the streak restarts
        s.update(False)
        s.update(False)
        assert not caplog.records
        s.update(False)
        assert len(caplog.records) == 1 and "3 updates in a row skipped" in caplog.records[0].getMessage()
        for _ in range(3):
            s.update(False)
        assert len(caplog.records) == 2 and "6 updates in a row" in caplog.records[1].getMessage()
    never = DynamicLossScaler(2.0**10, warn_after_skips=0)
    with caplog.at_level(logging.WARNING, logger="onnxmp.training.run.loss_scaler"):
        for _ in range(30):
            never.update(False)
    assert len(caplog.records) == 2


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_non_finite_loss_without_float16_overflow_is_an_error(precision, loss):
    s = DynamicLossScaler.static(1.0)
    s.update(False)
    with pytest.raises(OnnxMPError, match=f"the loss is {loss} in {precision}.*no loss scale can help"):
        s.check_progress([1.5, loss, None], precision=precision)


def test_when_the_loss_check_stays_quiet():
    s = DynamicLossScaler.static(1.0)
    s.update(True)  # finite gradients: a NaN loss (every label ignored) still trains, as in torch
    s.check_progress([math.nan], precision="float32")
    s.update(False)  # skipped, but the loss is finite: one bad batch, not a stuck run
    s.check_progress(2.0, precision="float32")
    fp16 = DynamicLossScaler(2.0**16)
    fp16.update(False)  # float16 with a dynamic scale: overflow is the scaler's business
    fp16.check_progress([math.inf], precision="float16")
    static16 = DynamicLossScaler.static(128.0)
    static16.update(False)
    with pytest.raises(OnnxMPError, match="static loss scale of 128"):
        static16.check_progress([math.nan], precision="float16")


def test_overflow_at_the_floor_is_an_error():
    s = DynamicLossScaler(4.0, min_scale=1.0)
    s.update(False)
    s.update(False)  # 4 -> 2 -> 1: reaching the floor is no error yet
    s.check_progress([1.0], precision="float16")
    assert s.scale == 1.0
    s.update(False)  # still not finite at the floor
    with pytest.raises(OnnxMPError, match="loss scale at its floor \\(min_scale=1\\)"):
        s.check_progress([1.0], precision="float16")
    s.update(True)
    s.check_progress([1.0], precision="float16")


def test_the_skip_streak_is_saved():
    s = DynamicLossScaler(2.0**8)
    s.update(False)
    s.update(False)
    restored = DynamicLossScaler.from_state_dict(s.state_dict())
    assert restored.skipped_in_row == 2 and restored.state_dict() == s.state_dict()
    old = {k: v for k, v in s.state_dict().items() if k not in ("skipped_in_row", "warn_after_skips")}
    assert DynamicLossScaler.from_state_dict(old).skipped_in_row == 0  # a state saved before
