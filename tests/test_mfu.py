"""The logged `mfu` against a hand computation from the same metrics rows.

MFU = model FLOPs per step (6N + attention, `meshwork.perf.flops`) / step time
/ (devices of the run x peak FLOP/s per device). The rows are those of the suite's
lm_tiny run on 1 of the 8 visible devices (conftest's `lm_tiny_runs["1dev"]`, trained
once per session for other tests too), so a formula that counted every visible
device (a bug once fixed without a test) would log an eighth of the right figure.
"""

import pathlib
import types

import jax
import pytest

from meshwork.config import load_config
from meshwork.perf.flops import train_flops_per_token
from meshwork.perf.hardware import measure_cpu_peak
from meshwork.run.metrics import read_metrics


def test_logged_mfu_is_model_flops_over_the_runs_devices_peak(lm_tiny_runs):
    run_dir = pathlib.Path(lm_tiny_runs["1dev"]["run_dir"])
    cfg = load_config(run_dir / "config.yaml")
    n_run = 1
    assert jax.device_count() == 8
    rows = [r for r in read_metrics(run_dir) if "mfu" in r]
    assert len(rows) >= 10

    tokens = cfg.train.global_batch * cfg.data.seq_len
    flops_per_step = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    peaks = []
    for r in rows:
        t = r["step_time_s"]
        assert r["tokens_per_s"] == pytest.approx(tokens / t, rel=1e-9)
        assert r["tflops_per_device"] == pytest.approx(flops_per_step / t / n_run / 1e12, rel=1e-9)
        peaks.append(flops_per_step / (t * n_run * r["mfu"]))  # the peak per device each row implies
    # One peak for the whole run: the matmul rate measured at start-up, shared by the visible
    # devices (XLA's CPU devices share one thread pool), so per device it is the rate / 8.
    # A measurement here on the same (shared) host agrees within timing noise.
    assert max(peaks) == pytest.approx(min(peaks), rel=1e-9)
    here = measure_cpu_peak(cfg.train.compute_dtype) / jax.local_device_count()
    assert here / 3 < peaks[0] < here * 3, (peaks[0], here)


def test_a_device_kind_without_a_peak_logs_no_mfu_and_trains(capsys):
    """A GPU or TPU that src/meshwork/perf/hardware.py has no row for (Colab's T4, a TPU v2) gets
    mfu null and one line saying why, not a KeyError at the first logged step."""
    from meshwork.train.logger import _peak_flops

    t4 = types.SimpleNamespace(platform="gpu", device_kind="Tesla T4")
    assert _peak_flops("bfloat16", True, t4) is None
    assert capsys.readouterr().out.strip() == (
        "mfu: not logged (no peak FLOP/s for device kind 'Tesla T4'; add it to meshwork/perf/hardware.py)"
    )
    h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert _peak_flops("bfloat16", True, h100) > 1e14
