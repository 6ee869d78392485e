"""Layer pairing rules (transports/layers.py): pure functions, no transport."""

from __future__ import annotations

import pytest

from transports.base import TransportError
from transports.layers import LayerError, check_layers, coverage_problem, local_positions


def test_check_layers() -> None:
    assert check_layers(None, 3) == (0, 1, 2)
    assert check_layers(range(4, 6), 2) == (4, 5)
    for bad, match in (([0, 0], "repeat"), ([0], "1 layer ids for 2"), ([0, -1], "ints in"), ([0, True], "ints in")):
        with pytest.raises(LayerError, match=match):
            check_layers(bad, 2)
    assert issubclass(LayerError, TransportError) and issubclass(LayerError, ValueError)


def test_local_positions() -> None:
    local = {x: i for i, x in enumerate([6, 7, 0, 1, 2, 3, 4, 5])}
    assert local_positions(local, [4, 5, 6, 7]) == (6, 7, 0, 1)
    with pytest.raises(LayerError, match="holds layers 8-9, 11 that this rank does not"):
        local_positions(local, [7, 8, 9, 11])


def test_coverage() -> None:
    assert coverage_problem(range(4), {0: [0, 1], 1: [2, 3]}) is None
    assert coverage_problem(range(2), {0: [1, 0]}) is None
    assert "held by remote PP ranks 0 and 1" in (coverage_problem(range(4), {0: [0, 1], 1: [1, 2, 3]}) or "")
    assert "holds local layers 2-3" in (coverage_problem(range(4), {0: [0, 1]}) or "")
    assert "that this rank does not" in (coverage_problem(range(2), {0: [0, 1, 2]}) or "")
