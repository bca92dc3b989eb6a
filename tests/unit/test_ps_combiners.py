"""Combiners: each built-in rule on small arrays, the registry, user-defined combiners."""

from __future__ import annotations

import numpy as np
import pytest

from sparknet.ps import combiners as C


def _f(*v):
    return np.array(v, dtype=np.float32)


def test_mean_is_the_mean_of_server_and_push():
    s = _f(0, 2, 4)
    assert C.MeanCombiner().combine(s, _f(2, 2, 0), staleness=5, num_workers=2) is None
    np.testing.assert_array_equal(s, _f(1, 2, 2))
    assert not C.MeanCombiner.sends_delta


def test_delta_adds_the_change_scaled():
    s = _f(1, 1)
    C.DeltaCombiner().combine(s, _f(0.5, -1), staleness=3, num_workers=2)
    np.testing.assert_array_equal(s, _f(1.5, 0))
    C.DeltaCombiner(scale=0.5).combine(s, _f(1, 2), staleness=0, num_workers=2)
    np.testing.assert_array_equal(s, _f(2, 1))
    assert C.DeltaCombiner.sends_delta
    with pytest.raises(ValueError):
        C.DeltaCombiner(scale=0)


@pytest.mark.parametrize("staleness, expected", [(0, 4.0), (1, 2.0), (3, 1.0)])
def test_staleness_aware_delta_divides_by_one_plus_staleness(staleness, expected):
    s = _f(0)
    C.StalenessAwareDeltaCombiner().combine(s, _f(4), staleness=staleness, num_workers=2)
    assert s[0] == expected


def test_elastic_moves_center_and_tells_worker_to_move_by_alpha():
    c = C.ElasticCombiner(alpha=0.25)
    s = _f(0, 0)
    c.combine(s, _f(4, -8), staleness=0, num_workers=2)
    np.testing.assert_array_equal(s, _f(1, -2))
    assert c.reply_mix(num_workers=2) == 0.25 and c.reply_before_combine
    assert C.ElasticCombiner().reply_mix(num_workers=3) == pytest.approx(0.3)  # beta / K
    with pytest.raises(ValueError):
        C.ElasticCombiner(alpha=1.5)


def test_registry_by_name_and_user_defined():
    assert {"mean", "delta", "staleness", "elastic"} <= set(C.COMBINERS)
    assert isinstance(C.make_combiner("Delta"), C.DeltaCombiner)
    assert C.make_combiner("elastic", alpha=0.1).alpha == 0.1
    with pytest.raises(ValueError, match="unknown combiner"):
        C.make_combiner("median")

    class Keep(C.Combiner):
        name = "keep"

        def combine(self, server, pushed, *, staleness, num_workers):
            return np.maximum(server, pushed)

    C.register_combiner("keep", Keep)
    try:
        k = C.make_combiner("keep")
        np.testing.assert_array_equal(k.combine(_f(1, 5), _f(3, 2), staleness=0, num_workers=1), _f(3, 5))
        with pytest.raises(ValueError, match="already registered"):
            C.register_combiner("keep", C.MeanCombiner)
    finally:
        del C.COMBINERS["keep"]
    with pytest.raises(TypeError):
        C.register_combiner("x", object)
    with pytest.raises(TypeError):
        C.Combiner()  # abstract
