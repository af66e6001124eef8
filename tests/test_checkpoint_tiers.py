"""Two checkpoint tiers and checkpoint.every=auto.

The fast tier (src/meshwork/run/fast_tier.py) copies the state to host memory and writes it to a
local disk behind the next steps; the persistent tier is Orbax with verified manifests. A restart
takes the newest complete and verified tier; both restore bit-exact. Under checkpoint.every=auto
the interval is Daly's, from this run's measured checkpoint stall and run.mttf_hours.
"""

import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshwork.config import ConfigError, load_config
from meshwork.perf.reliability import daly_interval, young_interval
from meshwork.run.checkpoint import Checkpointer, manifest_problem
from meshwork.run.fast_tier import FastTier
from meshwork.run.metrics import read_metrics
from meshwork.train.loop import train
from meshwork.train.run_dir.resume import newest_tier


def _state(n_devices=8):
    """A small state sharded like fsdp (rows over devices), a replicated scalar and a replicated vector."""
    mesh = jax.make_mesh((n_devices,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n_devices])
    rows, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    key = jax.random.key(0)
    return {
        "w": jax.device_put(jax.random.normal(key, (16, 8)), rows),
        "m": {"v": jax.device_put(jnp.arange(8.0), whole)},
        "step": jax.device_put(jnp.int32(7), whole),
    }


def _on(n_devices, state):
    """`state`'s shapes laid out on the first `n_devices` devices (another mesh than it was saved on)."""
    like = _state(n_devices)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("buffered", [True, False])
def test_fast_tier_restores_bit_exact_from_ram_and_from_disk_onto_another_mesh(tmp_path, buffered):
    state = _state()
    ram = FastTier(5, None, buffered=buffered)
    stall = ram.save(10, state, {"iterator": {"next_index": 10}}, {"run": 1})
    assert stall > 0 and ram.stalls == [stall]
    _equal(ram.restore(ram.latest(), _on(4, state)), state)  # 8 devices -> 4

    disk = FastTier(5, tmp_path, buffered=buffered)
    disk.save(5, state, {"iterator": {"next_index": 5}}, {"run": 1})
    disk.save(10, state, {"iterator": {"next_index": 10}}, {"run": 1})
    disk.close()
    # A new process: nothing in RAM, the disk holds the newest verified snapshot only.
    again = FastTier(5, tmp_path, buffered=buffered)
    assert again.on_disk() == [10]
    snap = again.latest()
    assert snap.step == 10 and snap.progress == {"iterator": {"next_index": 10}}
    _equal(again.restore(snap, _on(2, state)), state)


def test_a_damaged_or_unfinished_fast_snapshot_does_not_count(tmp_path):
    fast = FastTier(5, tmp_path, buffered=False)
    fast.save(5, _state(), {}, {})
    folder = tmp_path / "process_0"
    (folder / ".tmp-10").mkdir()  # a write a kill cut short
    data = folder / "5" / "state.npz"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    reopened = FastTier(5, tmp_path, buffered=False)
    assert reopened.on_disk() == [] and reopened.latest() is None
    reopened.remove_leftovers()  # the trainer's start-up does this
    assert not (folder / ".tmp-10").exists()


def test_restart_takes_the_newest_complete_tier_of_this_run(tmp_path):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", tiny_overrides(tmp_path / "run"))
    other = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path / "run"), "run.seed=1"])
    ckpt = Checkpointer(tmp_path / "checkpoints", every=1, keep=2, use_async=False)
    ckpt.save(10, _state(), {"iterator": {}}, cfg.to_dict(), force=True)
    ckpt.wait()
    fast = FastTier(2, tmp_path / "fast", buffered=False)
    fast.save(12, _state(), {"iterator": {}}, cfg.to_dict())
    reader = lambda: FastTier(2, tmp_path / "fast", buffered=False)  # noqa: E731  (a restarted process)
    step, snap = newest_tier(cfg, ckpt, reader(), say=lambda m: None)
    assert (step, snap.step) == (12, 12)
    step, snap = newest_tier(other, ckpt, reader(), say=lambda m: None)  # another run's snapshot
    assert (step, snap) == (10, None) and reader().on_disk() == []  # ... is dropped
    fast.save(8, _state(), {"iterator": {}}, cfg.to_dict())  # older than the persistent tier
    assert newest_tier(cfg, ckpt, reader(), say=lambda m: None) == (10, None)
    ckpt.close()


def test_tier_and_auto_settings_that_cannot_work_are_refused():
    cases = {
        "checkpoint.every: auto picks the Young/Daly interval": ["checkpoint.every=auto"],
        "checkpoint.fast_path: /tmp/f is the fast tier's folder, but no fast tier": ["checkpoint.fast_path=/tmp/f"],
        "checkpoint.fast_every: a fast tier in host RAM dies with the process": ["checkpoint.fast_every=5"],
        "checkpoint.every: must be a positive number of steps or auto": ["checkpoint.every=0"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(ROOT / "configs/lm_tiny.yaml", overrides)


def test_auto_interval_is_dalys_interval_of_the_measured_cost(tmp_path):
    mttf_hours = 0.0002  # 0.72 s: tiny steps, so the interval comes out at a few steps
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [
            *tiny_overrides(tmp_path),
            "train.steps=16",
            "log.every=1",
            "log.eval_every=16",
            "mesh.data=1",
            "checkpoint.every=auto",
            f"run.mttf_hours={mttf_hours}",
            "checkpoint.keep=20",
        ],
    )
    done = train(cfg, devices=jax.devices()[:1])
    stalls = done["checkpoint_stalls"]["persistent"]
    rows = [r for r in read_metrics(tmp_path) if "checkpoint_every" in r]
    assert rows and rows[0]["step"] == 1  # the first save measures the cost
    for r in rows:
        n = r["checkpoint_saves"]
        assert r["checkpoint_cost_s"] == pytest.approx(np.mean(stalls[:n]), rel=1e-9)  # this run's measured stalls
        assert r["checkpoint_interval_s"] == pytest.approx(daly_interval(r["checkpoint_cost_s"], mttf_hours * 3600))
        assert r["checkpoint_young_s"] == pytest.approx(young_interval(r["checkpoint_cost_s"], mttf_hours * 3600))
        assert r["checkpoint_every"] == max(1, round(r["checkpoint_interval_s"] / r["checkpoint_step_time_s"]))
    # The saves followed the logged intervals: each one `every` steps after the one before.
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    every_at = {r["step"]: r["checkpoint_every"] for r in rows}
    interval = None
    for a, b in zip(saved, saved[1:]):
        interval = every_at.get(a, interval)
        assert b - a == interval or b == 16  # the last step always saves


# ---------------------------------------------------------------- slow: kill -9 of a real process


@pytest.mark.slow
def test_disk_fast_tier_survives_kill_9_and_both_tiers_restore_bit_exact(tmp_path, compile_cache):
    from reliability.harness import assert_same_final_state, launch, run

    long = ["train.steps=400", "checkpoint.every=10"]  # long enough to be killed mid-way; the schedule spans 400
    reference = tmp_path / "reference"
    assert run(reference, compile_cache, *long, "train.stop_after=30").returncode == 0

    fast_dir = tmp_path / "fast"
    tier = ["checkpoint.fast_every=3", f"checkpoint.fast_path={fast_dir}"]
    proc = launch(tmp_path / "killed", compile_cache, *long, *tier)
    deadline = time.time() + 120
    # Kill once step 10's persistent checkpoint is verified and a fast snapshot is newer.
    while time.time() < deadline and proc.poll() is None:
        verified = manifest_problem(tmp_path / "killed" / "checkpoints" / "10") is None
        if verified and (FastTier(3, fast_dir, buffered=False).on_disk() or [0])[-1] > 10:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    fast_step = FastTier(3, fast_dir, buffered=False).on_disk()[-1]
    assert fast_step > 10

    # The same killed run resumed twice: from its fast tier, and with the fast tier gone (persistent).
    shutil.copytree(tmp_path / "killed", tmp_path / "persistent")
    recovery = {}
    for name, extra in (("killed", tier), ("persistent", [])):
        done = run(tmp_path / name, compile_cache, *long, *extra, "train.stop_after=30")
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("the fast tier holds step" in done.stdout) == (name == "killed")
        assert f"restoring the checkpoint of step {fast_step if name == 'killed' else 10}" in done.stdout
        assert_same_final_state(tmp_path / name, reference)
        last = read_metrics(tmp_path / name)[-1]
        recovery[name] = last["time_restore_s"]
    print(
        f"\nkilled after fast step {fast_step}: restore {recovery['killed']:.3f} s from the fast tier, "
        f"{recovery['persistent']:.3f} s from the persistent tier (step 10)"
    )


def test_each_checkpoint_is_crc_checked_once_and_again_only_when_its_files_change(tmp_path, monkeypatch):
    import meshwork.run.checkpoint as checkpoint

    reads = []
    crc32 = checkpoint._crc32
    monkeypatch.setattr(checkpoint, "_crc32", lambda path: reads.append(path) or crc32(path))
    ckpt = Checkpointer(tmp_path, every=1, keep=3, use_async=False)
    for step in (1, 2):
        ckpt.save(step, _state(), {"iterator": {}}, {}, force=True)
    ckpt.wait()
    files = len(checkpoint._files(tmp_path / "2"))
    both = files + len(checkpoint._files(tmp_path / "1"))
    reads.clear()
    assert [ckpt.latest_step() for _ in range(3)] == [2, 2, 2] and reads == []  # verified when its manifest was written
    ckpt.close()

    restarted = Checkpointer(tmp_path, every=1, keep=3, use_async=False)
    assert restarted.latest_step() == 2 and len(reads) == both  # every file of both steps, once
    assert restarted.latest_step() == 2 and restarted.verified_steps() == [1, 2] and len(reads) == both
    data = max(checkpoint._files(tmp_path / "2"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))  # same size; a new modification time
    reads.clear()
    assert restarted.latest_step() == 1 and "fails its CRC-32 check" in restarted.problem(2)
    assert 0 < len(reads) <= files  # step 2 read again (up to its bad file), step 1 not
    restarted.close()
