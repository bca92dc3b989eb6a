"""The rounds engine's default deadline for one round: generous, and never none."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from sparknet.spark.trainer import FIRST_ROUND_DEADLINE_S, MIN_ROUND_DEADLINE_S, default_round_deadline  # noqa: E402


def test_the_first_round_gets_a_fixed_generous_deadline():
    assert default_round_deadline(None, 50) == FIRST_ROUND_DEADLINE_S == 1800


def test_later_rounds_get_twenty_times_the_slowest_step_time_and_at_least_ten_minutes():
    assert default_round_deadline(0.05, 50) == MIN_ROUND_DEADLINE_S == 600  # 20 x 2.5 s is under the floor
    assert default_round_deadline(2.0, 100) == pytest.approx(4000.0)  # 20 x 200 s
    # a longer round (automatic tau grew) gets a proportionally longer deadline
    assert default_round_deadline(2.0, 400) == pytest.approx(4 * default_round_deadline(2.0, 100))
