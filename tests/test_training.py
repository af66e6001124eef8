"""lm_tiny learns the default corpus on 1 device and on 8 devices under dp and fsdp,
and fsdp really stores 1/8 of each parameter and Adam moment per device."""

import pathlib

import jax
import numpy as np
import pytest
from conftest import LM_TINY_LAYOUTS, LM_TINY_STEPS, ROOT

from meshwork.config import load_config
from meshwork.data.text import stdlib_corpus, unigram_entropy
from meshwork.run.metrics import read_metrics
from meshwork.train.plot import plot_run

STEPS = LM_TINY_STEPS


@pytest.fixture(scope="session")
def runs(lm_tiny_runs):
    """The three LM_TINY_STEPS-step lm_tiny runs (conftest), trained once for the whole session."""
    return lm_tiny_runs


# The quick tier trains on 1 device (the run the inference and fine-tuning tests reuse); dp and
# fsdp on 8 are in the slow tier (one fsdp step equals one device's in tests/test_sharded_step.py,
# and fsdp's per-device bytes are read from the shards in tests/test_report.py).
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name != "1dev" else []) for name in LM_TINY_LAYOUTS]
)
def test_lm_tiny_learns_the_corpus(runs, name):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml")
    train_bin, _ = stdlib_corpus(cfg.data.val_fraction, cfg.data.cache_dir)
    entropy = unigram_entropy(train_bin)
    val = runs[name]["val_loss"]
    assert val[0] == pytest.approx(np.log(256), abs=0.1)  # near-uniform predictions at init
    # Below the unigram entropy means the model uses context, not just byte frequencies.
    assert val[STEPS] < entropy - 0.5, (val, entropy)
    assert val[STEPS] < 0.5 * val[0], val


def test_metrics_files_have_the_contract_fields(runs):
    rows = read_metrics(runs["1dev"]["run_dir"])
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == list(range(10, STEPS + 1, 10))
    for field in ("loss", "lr", "tokens_per_s", "step_time_s", "tflops_per_device", "mfu", "grad_norm"):
        assert all(np.isfinite(r[field]) and r[field] >= 0 for r in logged), field
    events = list((pathlib.Path(runs["1dev"]["run_dir"]) / "tensorboard").glob("events.out.tfevents*"))
    assert events and events[0].stat().st_size > 1000
    assert plot_run(runs["1dev"]["run_dir"]).stat().st_size > 10_000


@pytest.mark.slow
def test_fsdp_stores_an_eighth_of_every_divisible_leaf(runs):
    state = runs["8dev_fsdp"]["state"]
    leaves = jax.tree.leaves(state)
    checked = 0
    for leaf in leaves:
        if leaf.ndim == 0:  # step counters: nothing to split
            continue
        shard = leaf.addressable_shards[0].data
        assert len(leaf.addressable_shards) == 8
        assert shard.size * 8 == leaf.size, (leaf.shape, shard.shape)
        assert leaf.sharding.shard_shape(leaf.shape) == shard.shape
        checked += 1
    # params + Adam mu + nu, for every weight of the model
    n_params = len(jax.tree.leaves(state.params))
    assert checked == 3 * n_params and n_params >= 11
