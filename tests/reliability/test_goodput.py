"""The goodput account: what a restart and a rollback cost is booked as lost time."""

import time

import pytest

from meshwork.run.goodput_clock import GoodputClock


def test_restart_gap_and_rollback_are_lost_time():
    now = time.time()
    # A checkpoint's snapshot: the run began 100 s ago; its account stopped 40 s ago after 50 s of steps.
    saved = {"origin": now - 100, "elapsed": 60, "totals": {"productive": 50.0, "compile": 5.0}}
    clock = GoodputClock(now=now)
    clock.totals["compile"] = 2.0  # this process's own compile, before it restored
    clock.resume(saved)
    assert clock.origin == now - 100
    assert clock.totals["lost"] == pytest.approx(40, abs=1e-6)  # crash to restart: steps redone + downtime
    assert clock.totals["compile"] == 7.0 and clock.totals["productive"] == 50.0

    with clock.phase("productive"):
        time.sleep(0.02)
    spent = clock.since_checkpoint
    assert spent >= 0.02
    clock.rollback()  # those steps are thrown away
    assert clock.totals["productive"] == pytest.approx(50.0)
    assert clock.totals["lost"] == pytest.approx(40 + spent)

    account = clock.breakdown()
    assert account["goodput"] == pytest.approx(50 / account["wall_s"], rel=1e-3)
    assert sum(v for k, v in account.items() if k not in ("wall_s", "goodput")) == pytest.approx(
        account["wall_s"], abs=0.01
    )
