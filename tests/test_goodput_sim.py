"""The failure-trace simulator (meshwork.perf.goodput_sim): exact without failures, Daly's closed form
over a long trace, the fast tier and elasticity helping when their recovery is cheaper, seeds reproducible.
The agreement with a real run killed by kill -9 is measured by benchmarks/goodput_sim.py."""

import doctest
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from meshwork.config import ConfigError
from meshwork.perf import goodput_sim
from meshwork.perf.goodput_sim import (
    Scenario,
    failure_trace,
    interval_steps,
    scenario,
    simulate,
)
from meshwork.perf.reliability import cluster_mttf, daly_interval, goodput

NO_FAILURES = np.array([])

# The benchmark's large-scale defaults, at 10,000 devices of 100-day MTTF.
COSTS = {
    "device_mttf": 100 * 86400,
    "step_time": 10.0,
    "persistent_cost": 60.0,
    "fast_cost": 2.0,
    "startup": 60.0,
    "compile_": 30.0,
    "restore_persistent": 60.0,
    "restore_fast": 5.0,
    "reshard": 10.0,
    "recompile": 30.0,
    "rejoin": 10.0,
    "replacement_time": 600.0,
    "group": 8,
    "fast_loss_prob": 0.01,
    "rollback": 1.0,
}


def test_docstrings():
    assert doctest.testmod(goodput_sim).failed == 0


@pytest.mark.parametrize("every", [1, 7, 50])
def test_no_failures_goodput_is_step_over_step_plus_checkpoint_share(every):
    step, ckpt = 0.3, 2.0
    s = Scenario.persistent(step_time=step, checkpoint_cost=ckpt, every=every, recovery_cost=100.0)
    r = simulate(s, NO_FAILURES, total_steps=every * 40)
    assert r.failures == 0 and r.steps == every * 40
    assert r.goodput == pytest.approx(step / (step + ckpt / every), rel=1e-12)
    assert r.breakdown["checkpoint"] == pytest.approx(40 * ckpt)


@pytest.mark.parametrize("c, m, r", [(60, 864, 120), (5, 3600, 300), (300, 86400, 600)])
def test_long_trace_matches_dalys_closed_form(c, m, r):
    tau = daly_interval(c, m)
    s = Scenario.persistent(step_time=tau / 20, checkpoint_cost=c, every=20, recovery_cost=r)
    horizon = 4000 * m
    sims = [simulate(s, failure_trace(m, horizon, seed=k), horizon=horizon).goodput for k in range(3)]
    assert np.mean(sims) == pytest.approx(goodput(tau, c, m, r), rel=0.02)


def test_the_account_adds_up_to_the_wall_time():
    for mode in goodput_sim.MODES:
        s = scenario(mode, n_devices=10_000, **COSTS)
        trace = failure_trace(cluster_mttf(COSTS["device_mttf"], 10_000), 86400, seed=4)
        r = simulate(s, trace, horizon=86400)
        assert r.failures == len(trace) > 50
        assert sum(r.breakdown.values()) == pytest.approx(r.wall, rel=1e-9) and r.wall == 86400
        assert 0 < r.goodput < 1


def test_a_failure_loses_the_work_since_the_checkpoint_and_pays_the_restart():
    # Checkpoint every 10 steps of 1 s at a cost of 1 s: the one at step 10 ends at 11 s. A failure
    # at 15 s loses the 4 steps after it, then 20 s of restart, then the 10 remaining steps + 1 checkpoint.
    s = Scenario.persistent(step_time=1.0, checkpoint_cost=1.0, every=10, recovery_cost=20.0)
    r = simulate(s, np.array([15.0]), total_steps=20)
    assert r.wall == pytest.approx(15 + 20 + 10 + 1)
    assert r.breakdown["lost"] == pytest.approx(4) and r.breakdown["recovery"] == pytest.approx(20)
    # A second failure during the restart starts it over: 5 s more.
    r2 = simulate(s, np.array([15.0, 30.0]), total_steps=20)
    assert r2.wall == pytest.approx(r.wall + 15) and r2.failures == 2


def test_fast_tier_and_elastic_beat_restart_when_their_recovery_is_cheaper():
    n = 10_000
    trace = failure_trace(cluster_mttf(COSTS["device_mttf"], n), 3 * 86400, seed=7)
    g = {
        mode: simulate(scenario(mode, n_devices=n, **COSTS), trace, horizon=3 * 86400).goodput
        for mode in goodput_sim.MODES
    }
    assert g["persistent"] < g["fast"] < g["elastic"]
    # Elastic whose recovery costs as much as a restart, with a slow replacement, is no better than "fast".
    slow = {**COSTS, "reshard": 95.0, "recompile": 0.0, "replacement_time": 1e5, "group": 800}
    g_slow = simulate(scenario("elastic", n_devices=n, **slow), trace, horizon=3 * 86400).goodput
    assert g_slow < g["fast"]


def test_elastic_runs_degraded_until_the_replacement_joins():
    s = Scenario(
        "elastic",
        step_time=1.0,
        checkpoint_cost=0.0,
        every=None,
        recovery_cost=50.0,
        fast_every=5,
        fast_cost=0.0,
        fast_recovery_cost=2.0,
        rollback=0.0,
        degraded_fraction=0.5,
        replacement_time=10.0,
        rejoin_cost=3.0,
    )
    r = simulate(s, np.array([12.5]), total_steps=40)
    # 12.5 steps, 2 s reshard (no rollback), 10 s at half speed from 12.5 s to 22.5 s: the
    # replacement joins (2 s of it spent reshard), 3 s rejoin, then the rest at full speed.
    assert r.breakdown["lost"] == 0 and r.breakdown["rejoin"] == 3.0 and r.breakdown["recovery"] == 2.0
    assert r.breakdown["degraded"] == pytest.approx(4.0)  # 8 s at half speed
    assert r.wall == pytest.approx(40 + 2 + 4 + 3)


def test_elastic_with_replicated_state_needs_no_copy_and_loses_no_work():
    # Rollback 0 (data parallel: the survivors hold every shard): a failure before the first fast copy
    # costs the reshard only; with rollback 1 there is nothing to roll back to but a fresh start.
    kw = {
        "step_time": 1.0,
        "checkpoint_cost": 0.0,
        "every": None,
        "recovery_cost": 50.0,
        "fast_every": 10,
        "fast_cost": 0.0,
        "fast_recovery_cost": 2.0,
        "replacement_time": 5.0,
        "rejoin_cost": 1.0,
        "initial_cost": 4.0,
    }
    r = simulate(Scenario("elastic", rollback=0.0, **kw), np.array([7.0]), total_steps=20)
    assert r.breakdown["lost"] == 0 and r.breakdown["recovery"] == 4 + 2 and r.wall == 4 + 20 + 2 + 1
    r1 = simulate(Scenario("elastic", rollback=1.0, **kw), np.array([7.0]), total_steps=20)
    assert r1.breakdown["lost"] == 3 and r1.breakdown["recovery"] == 4 + 4  # no copy yet: a fresh start


def test_seeds_reproduce_and_differ():
    a, b, c = (failure_trace(100.0, 1e5, seed=k) for k in (1, 1, 2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert len(a) == pytest.approx(1000, rel=0.1) and np.all(np.diff(a) > 0) and a[-1] < 1e5
    assert np.array_equal(failure_trace(100.0, 1e3, seed=1), a[a < 1e3])  # a longer horizon extends the same trace
    s = scenario("fast", n_devices=100_000, **{**COSTS, "fast_loss_prob": 0.3})
    runs = [simulate(s, a, horizon=1e5, seed=k) for k in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]  # the fast-tier losses are drawn from the seed


def test_intervals_follow_daly():
    assert interval_steps(10, 60, 864) == 28
    s = scenario("persistent", n_devices=10_000, **COSTS)
    assert s.every == round(daly_interval(60, 864) / 10) and s.recovery_cost == 150
    f = scenario("fast", n_devices=10_000, **COSTS)
    assert f.fast_every == round(daly_interval(2, 864) / 10) and f.every % f.fast_every == 0
    assert f.every * 10 == pytest.approx(daly_interval(60, 86400), rel=0.15)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"step_time": 0.0}, "step_time must be positive"),
        ({"every": 0}, "every must be a positive number"),
        ({"mode": "fast"}, "needs fast_every"),
        ({"checkpoint_cost": -1.0}, "checkpoint_cost must be >= 0"),
    ],
)
def test_bad_scenarios_name_the_value(bad, message):
    args = {"mode": "persistent", "step_time": 1.0, "checkpoint_cost": 1.0, "every": 10, "recovery_cost": 1.0} | bad
    with pytest.raises(ConfigError, match=message):
        Scenario(**args)
    with pytest.raises(ConfigError, match="exactly one"):
        simulate(Scenario.persistent(step_time=1, checkpoint_cost=1, every=1, recovery_cost=1), NO_FAILURES)


@pytest.mark.parametrize(
    "args",
    [
        ["--devices", "0"],
        ["--devices", "ten"],
        ["--mttf-days", "-1"],
        ["--seed"],
        ["--every", "45"],
        ["--fast-every", "30"],
        ["--rollback", "2"],
    ],
)
def test_benchmark_cli_refuses_bad_input_in_one_line(args):
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/goodput_sim.py"), *args, "--no-real-run"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_benchmark_table_without_the_real_run():
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/goodput_sim.py"), "--no-real-run", "--days", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert "100,000" in p.stdout and "assumption" in p.stdout
    assert not math.isnan(float(p.stdout.split("goodput[persistent,10000]=")[1].split()[0]))
