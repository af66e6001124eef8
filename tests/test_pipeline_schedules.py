"""Pipeline schedule tables (no devices): interleaved 1F1B and zero-bubble
ZB-H1 are valid, idle exactly as their papers say, and stash what 1F1B does."""

import numpy as np
import pytest

from meshwork.sharding.pipeline_schedules import (
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    FWD,
    IDLE,
    SCHEDULES,
    _stage_order,
    check_schedule,
    cotangent_stash_size,
    idle_fraction,
    schedule_table,
    stash_size,
)

P = 4
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def test_schedules_lists_every_kind():
    assert set(SCHEDULES) == {kind for kind, _ in KINDS}


@pytest.mark.parametrize("kind,v", [*KINDS, ("interleaved", 3)])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("per_stage", [1, 2, 4])
def test_every_kind_is_valid(kind, v, n_stages, per_stage):
    n_micro = n_stages * per_stage
    table = schedule_table(kind, n_stages, n_micro, virtual_stages=v)
    check_schedule(table)
    # Every virtual stage runs each microbatch's F and B once (and W once, for zb-h1).
    n_ops = (3 if kind == "zb-h1" else 2) * n_stages * v * n_micro
    assert (table.op != IDLE).sum() == n_ops


@pytest.mark.parametrize("n_micro", [4, 8, 16])
def test_interleaved_idles_as_megatron_says(n_micro):
    # One step = one chunk's forward or backward: v*M of each per device, and
    # the fill and drain take P-1 steps each (Megatron: bubble (P-1)/v of a
    # whole stage's forward plus backward).
    v = 2
    table = schedule_table("interleaved", P, n_micro, virtual_stages=v)
    assert table.n_steps == 2 * v * n_micro + 2 * (P - 1)
    assert idle_fraction(table) == pytest.approx((P - 1) / (v * n_micro + P - 1), abs=1e-12)
    # Device s holds chunks s and s+P: its busy cells name chunks 0 and 1 only.
    assert set(np.unique(table.chunk[table.op != IDLE])) == {0, 1}


def test_interleaved_needs_a_multiple_of_the_stages():
    with pytest.raises(ValueError, match=r"multiple of n_stages=4.*got 6") as err:
        schedule_table("interleaved", P, 6, virtual_stages=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs the 'interleaved' schedule"):
        schedule_table("1f1b", P, 8, virtual_stages=2)


def _makespan(kind, n_micro, steps):
    """Length of `kind`'s pipeline when each op takes steps[op] time units:
    every stage runs its order, each op as soon as its inputs are there (a
    fused backward hands its cotangent on only when it ends)."""
    orders = [_stage_order(kind, s, P, n_micro) for s in range(P)]
    end, free, nxt = {}, [0] * P, [0] * P
    while any(nxt[s] < len(orders[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while nxt[s] < len(orders[s]):
                op, m, _ = orders[s][nxt[s]]
                deps = {FWD: [("F", s - 1, m)] if s > 0 else [], BWD_WEIGHT: [("B", s, m)]}.get(
                    op, [("F", s, m)] + ([("B", s + 1, m)] if s < P - 1 else [])
                )
                if any(d not in end for d in deps):
                    break
                key = ("F" if op == FWD else "W" if op == BWD_WEIGHT else "B", s, m)
                end[key] = free[s] = max([free[s]] + [end[d] for d in deps]) + steps[op]
                nxt[s] += 1
                moved = True
        assert moved
    return max(free)


@pytest.mark.parametrize("n_micro", [4, 8, 16])
def test_zb_h1_idles_as_the_paper_says(n_micro):
    # Qi et al. 2023, F = B = W = one unit: ZB-H1's bubble is (P-1)(F+B-W) =
    # P-1 units per stage against 1F1B's (P-1)(F+B+W) = 3(P-1), 1F1B's fused
    # backward (B+W) taking two units. ZB-H1's table counts exactly that unit.
    table = schedule_table("zb-h1", P, n_micro)
    assert table.n_steps == _makespan("zb-h1", n_micro, {FWD: 1, BWD_INPUT: 1, BWD_WEIGHT: 1})
    assert table.n_steps == 3 * n_micro + P - 1
    assert list((table.op == IDLE).sum(axis=0)) == [P - 1] * P
    assert idle_fraction(table) == pytest.approx((P - 1) / (3 * n_micro + P - 1), abs=1e-12)
    span_1f1b = _makespan("1f1b", n_micro, {FWD: 1, BWD: 2})
    assert span_1f1b - 3 * n_micro == 3 * (P - 1) == 3 * (table.n_steps - 3 * n_micro)
    # 1F1B's idle share is the same whether its backward takes one unit or two.
    assert (span_1f1b - 3 * n_micro) / span_1f1b == pytest.approx(idle_fraction(schedule_table("1f1b", P, n_micro)))


@pytest.mark.parametrize("n_micro", [1, 2, 4, 8, 16])
def test_zb_h1_keeps_1f1b_peak_stash(n_micro):
    # The paper's ZB-H1 keeps 1F1B's peak activation memory: here the stage
    # inputs a deferred W still needs stay within 1F1B's min(P, M); the
    # output cotangents that wait for their W are at most P-1 more.
    zb, one = schedule_table("zb-h1", P, n_micro), schedule_table("1f1b", P, n_micro)
    assert stash_size(zb) == stash_size(one) == min(P, n_micro)
    assert cotangent_stash_size(zb) <= min(P - 1, n_micro)


def test_zb_h1_defers_w_by_the_stage_index():
    table = schedule_table("zb-h1", P, 8)
    for s in range(P):
        seq = [(int(o), int(m)) for o, m in zip(table.op[:, s], table.mb[:, s]) if o != IDLE]
        for i, (o, m) in enumerate(seq):
            if o == BWD_WEIGHT and m + s < 8:  # right after the B of microbatch m+s
                assert seq[i - 1] == (BWD_INPUT, m + s)
    assert not (table.op == BWD).any()


def test_stash_sizes():
    # (kind, v) -> stash_size for M = 4, 8, 16 on 4 stages; printed in the report.
    got = {(kind, v): [stash_size(schedule_table(kind, P, m, v)) for m in (4, 8, 16)] for kind, v in KINDS}
    assert got == {
        ("gpipe", 1): [4, 8, 16],
        ("1f1b", 1): [4, 4, 4],
        ("interleaved", 2): [8, 10, 10],
        ("zb-h1", 1): [4, 4, 4],
    }


def test_str_shows_chunks_and_weight_passes():
    inter = str(schedule_table("interleaved", 2, 2, virtual_stages=2))
    assert inter.splitlines()[0].split()[2:6] == ["F0.0", "F1.0", "F0.1", "F1.1"]
    zb = str(schedule_table("zb-h1", 2, 2))
    assert zb.splitlines()[1].split()[2:] == [".", "F0", "B0", "F1", "B1", "W0", "W1"]


def test_check_schedule_rejects_a_w_before_its_b():
    good = schedule_table("zb-h1", 2, 2)
    op = good.op.copy()
    b, w = (
        np.argwhere((op[:, 0] == BWD_INPUT) & (good.mb[:, 0] == 0))[0, 0],
        np.argwhere((op[:, 0] == BWD_WEIGHT) & (good.mb[:, 0] == 0))[0, 0],
    )
    op[[b, w], 0] = op[[w, b], 0]
    with pytest.raises(ValueError, match="weight backward of microbatch 0 on stage 0 runs before"):
        check_schedule(type(good)("x", 2, 2, op, good.mb))
    mixed = good.op.copy()
    mixed[mixed == BWD_INPUT] = BWD
    with pytest.raises(ValueError, match="mixes fused"):
        check_schedule(type(good)("x", 2, 2, mixed, good.mb))
