"""A metrics JSONL line as numbers and a step; what cannot be recorded is a bad line."""

from __future__ import annotations

import pytest

from hybridtrain.server.metric_lines import BadMetricLine, parse_json_line


def test_parse_json_line() -> None:
    assert parse_json_line('{"step": 3, "loss": 2.91, "lr": 0.001, "tag": "x"}') == (
        {"loss": 2.91, "lr": 0.001}, 3)
    assert parse_json_line("{not json") == ({}, None)
    assert parse_json_line("[1, 2]") == ({}, None)
    assert parse_json_line('{"ok": true, "loss": "nan"}') == ({}, None)


def test_a_line_that_cannot_be_recorded_says_why() -> None:
    with pytest.raises(BadMetricLine, match="outside 0..2"):
        parse_json_line('{"step": -1, "loss": 1.0}')
    with pytest.raises(BadMetricLine, match="too large for a float"):
        parse_json_line('{"step": 1, "loss": ' + "9" * 400 + "}")
    assert parse_json_line('{"step": Infinity, "loss": 1.0}') == ({"loss": 1.0}, None)
