"""The rounds engine's default deadline for one round: generous, never none, and always armed."""

from __future__ import annotations

import threading

import pytest

from sparknet.spark.backend import FIRST_ROUND_DEADLINE_S, MIN_ROUND_DEADLINE_S, Watchdog, default_round_deadline
from sparknet.loop import StopRule


def test_the_first_round_gets_a_fixed_generous_deadline():
    assert default_round_deadline(None, 50) == FIRST_ROUND_DEADLINE_S == 1800


def test_later_rounds_get_twenty_times_the_slowest_step_time_and_at_least_ten_minutes():
    assert default_round_deadline(0.05, 50) == MIN_ROUND_DEADLINE_S == 600  # 20 x 2.5 s is under the floor
    assert default_round_deadline(2.0, 100) == pytest.approx(4000.0)  # 20 x 200 s
    # a longer round (automatic tau grew) gets a proportionally longer deadline
    assert default_round_deadline(2.0, 400) == pytest.approx(4 * default_round_deadline(2.0, 100))


def test_a_time_budgeted_round_is_bounded_by_its_seconds_not_by_an_unbounded_step_count():
    # tau=None: the round asks for 2**40 steps and ends on round_seconds
    assert default_round_deadline(None, StopRule.UNBOUNDED_STEPS, 30.0) == FIRST_ROUND_DEADLINE_S
    later = default_round_deadline(0.5, StopRule.UNBOUNDED_STEPS, 300.0)  # about 600 steps fit in the budget
    assert later == pytest.approx(20 * 300.0)
    assert default_round_deadline(0.5, 100, 300.0) == default_round_deadline(0.5, 100)  # tau ends it first


def test_the_watchdog_of_a_time_budgeted_round_arms_without_error():
    """Before, 20 x step time x 2**40 overflowed the timer thread from round 2 on: no hang protection."""
    errors = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        with Watchdog(None, "sparknet-test", default_round_deadline(0.01, StopRule.UNBOUNDED_STEPS, 2.0)) as dog:
            assert dog._timer is not None and dog._timer.is_alive()
    finally:
        threading.excepthook = previous
    assert errors == []
    assert not dog.fired
