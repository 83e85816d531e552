"""Fresh names."""
from __future__ import annotations

from onnxmp.naming import FreshNames


def test_fresh_names_avoid_the_used_names_the_taken_containers_and_each_other():
    names = FreshNames({"a"}, {"b": 1}, ["c"])
    assert [names("a"), names("b"), names("c"), names("d"), names("d")] == ["a_1", "b_1", "c_1", "d", "d_1"]
