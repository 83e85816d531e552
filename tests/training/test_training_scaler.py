import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training import DynamicLossScaler


def test_keras_defaults():
    s = DynamicLossScaler()
    assert (s.scale, s.growth_steps, s.growth_factor, s.backoff_factor) == (2.0**15, 2000, 2.0, 0.5)
    assert s.dynamic


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
                                    {"initial_scale": 2.0**30}])
def test_invalid_settings(kwargs):
    with pytest.raises(OnnxMPError):
        DynamicLossScaler(**kwargs)
