"""Schedules against the learning rates transformers' get_*_schedule(_with_warmup) give each update
(tests/training/data/schedule_references.json, scripts/make_training_references.py)."""
import json
import math
from pathlib import Path

import pytest

from onnxmp.errors import OnnxMPError
from onnxmp.training.run.schedules import Schedule

REFERENCES = json.loads((Path(__file__).parent / "data" / "schedule_references.json").read_text())["schedules"]


@pytest.mark.parametrize("reference", REFERENCES, ids=lambda r: f"{r['name']}-w{r['warmup_steps']}-t{r['total_steps']}")
def test_learning_rate_of_every_update_equals_transformers(reference):
    schedule = Schedule(reference["name"], reference["warmup_steps"], reference["total_steps"])
    for step, expected in enumerate(reference["lr"]):
        assert schedule.lr_at(step, 3e-4) == pytest.approx(3e-4 * expected, rel=1e-12, abs=1e-18), step
        assert schedule.multiplier(step) == expected  # the same float expressions: bit-equal


def test_the_references_cover_warmup_decay_and_past_the_end():
    by_name = {(r["name"], r["warmup_steps"], r["total_steps"]): r["lr"] for r in REFERENCES}
    assert by_name[("linear", 3, 10)][:4] == [0.0, 1 / 3, 2 / 3, 1.0]  # warmup: the first update uses lr 0
    assert by_name[("linear", 3, 10)][10:] == [0.0] * 4
    cosine = by_name[("cosine", 3, 10)]
    assert cosine[10] == 0.0 and cosine[12] > 0  # past total_steps Hugging Face's cosine rises again
    assert by_name[("constant", 0, 8)] == [1.0] * 12


def test_settings_are_checked_and_round_trip():
    with pytest.raises(OnnxMPError, match="unknown schedule 'step'"):
        Schedule("step")
    with pytest.raises(OnnxMPError, match="needs total_steps"):
        Schedule("linear", 10)
    with pytest.raises(OnnxMPError, match="warmup_steps must be a non-negative integer"):
        Schedule("constant", -1)
    with pytest.raises(OnnxMPError, match="total_steps must be a positive integer"):
        Schedule("cosine", 0, 0)
    with pytest.raises(OnnxMPError, match="counts updates from 0"):
        Schedule().multiplier(-1)
    schedule = Schedule("cosine", 5, 100, num_cycles=1.5)
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    assert Schedule().lr_at(123, 0.1) == 0.1 and math.isclose(schedule.multiplier(5), 1.0)
