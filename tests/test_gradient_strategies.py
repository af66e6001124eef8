"""Each gradient strategy of train/gradients.py alone, on a toy least-squares objective under jit,
and which strategy `gradient_strategy` picks for each config (nothing compiled there).

The pipelined strategy on a real model is compared with one device in tests/test_pipeline_moe.py
(and tests/test_pipeline_training.py); here only its adapter and its selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT

from meshwork.config import load_config
from meshwork.sharding.mesh import make_mesh
from meshwork.train.comm import check_comm, init_comm_state
from meshwork.train.gradients import (
    Microbatched,
    Pipelined,
    Plain,
    Reduced,
    gradient_strategy,
    local_strategy,
    replica_gradient,
)

B, D_IN, D_OUT = 16, 4, 3


def objective(params, buffers, batch, noise_key):
    """Mean squared error of a linear map; metrics also show which key and which rows it got."""
    err = batch["x"] @ params["w"] - batch["y"]
    loss = jnp.mean(err**2)
    return loss, {"loss": loss, "noise": jax.random.uniform(noise_key), "first_x": batch["x"][0, 0]}


def toy():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(D_IN, D_OUT)), jnp.float32)}
    batch = {
        "x": jnp.asarray(rng.normal(size=(B, D_IN)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(B, D_OUT)), jnp.float32),
    }
    return params, batch, jax.random.key(7)


def reference(params, batch, key):
    (_, metrics), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params, {}, batch, key)
    return metrics, grads


def cfg_with(tmp_path, *overrides):
    return load_config(ROOT / "configs/lm_tiny.yaml", [f"run.dir={tmp_path}", *overrides])


def test_plain_is_value_and_grad_and_passes_comm_through():
    params, batch, key = toy()
    comm = {"anything": jnp.arange(3.0)}
    metrics, grads, comm_out = jax.jit(Plain(objective))(params, {}, batch, key, comm)
    want_metrics, want_grads = reference(params, batch, key)
    np.testing.assert_array_equal(grads["w"], want_grads["w"])
    assert jax.device_get(metrics) == jax.device_get(want_metrics)
    np.testing.assert_array_equal(comm_out["anything"], comm["anything"])
    assert not Plain.stateful
    # The per-replica form train/comm.py and DiLoCo call: (metrics, grads) only.
    assert len(replica_gradient(Plain(objective))(params, {}, batch, key)) == 2


def test_microbatched_equals_plain_with_a_key_per_microbatch():
    params, batch, key = toy()
    M = 4
    metrics, grads, comm = jax.jit(Microbatched(objective, M))(params, {}, batch, key)
    want_metrics, want_grads = reference(params, batch, key)
    # The mean of M equal slices' mean losses is the batch's mean loss: same gradient, same loss.
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-6, atol=1e-7)
    assert grads["w"].dtype == params["w"].dtype
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-6)
    # Each microbatch draws its own key (split from the step's): the averaged draw shows it.
    draws = [float(jax.random.uniform(k)) for k in jax.random.split(key, M)]
    assert len(set(draws)) == M
    np.testing.assert_allclose(metrics["noise"], np.mean(draws), rtol=1e-6)
    # Row r of microbatch m is row r*M + m: the microbatches' first rows are the batch's first M.
    np.testing.assert_allclose(metrics["first_x"], np.mean(batch["x"][:M, 0]), rtol=1e-6)
    assert comm is None and not Microbatched.stateful


def test_pipelined_hands_back_the_schedules_metrics_and_gradients():
    params, batch, key = toy()

    def schedule(params, buffers, batch):  # a stand-in for the pipeline's (loss, metrics, grads)
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params, buffers, batch, key)
        return loss, metrics, grads

    comm_in = {"untouched": jnp.ones(2)}
    metrics, grads, comm = jax.jit(Pipelined(schedule))(params, {}, batch, jax.random.key(99), comm_in)
    want_metrics, want_grads = reference(params, batch, key)
    np.testing.assert_array_equal(grads["w"], want_grads["w"])
    np.testing.assert_array_equal(metrics["loss"], want_metrics["loss"])
    np.testing.assert_array_equal(comm["untouched"], comm_in["untouched"])
    assert not Pipelined.stateful


# What one encoding may change a value by: bf16 keeps 8 significant bits, so rounding to nearest
# moves a value by at most 2^-8 of itself; int8 rounds to a step of 1/127 of its block's largest
# magnitude, so by at most half a step.
ENCODING_ERROR = {"bf16": 2.0**-8, "int8": 0.5 / 127}


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_reduced_compressed_mean_is_close_to_plain(tmp_path, compression):
    n = jax.device_count()  # conftest's 8 fake CPU devices, all on the data axis
    mesh = make_mesh({"data": n})
    cfg = cfg_with(tmp_path, f"comm.compression={compression}", "rules.preset=dp", f"mesh.data={n}")
    check_comm(cfg, dict(mesh.shape))  # a config the trainer accepts
    params, batch, key = toy()
    strategy = gradient_strategy(cfg, None, objective, mesh)
    assert isinstance(strategy, Reduced) and strategy.stateful and isinstance(strategy.replica, Plain)
    comm = init_comm_state(cfg, params, n, None)
    with jax.set_mesh(mesh):
        metrics, grads, new_comm = jax.jit(strategy)(params, {}, batch, key, comm)
    want_metrics, want = reference(params, batch, key)
    # Each replica's gradient on its B/n rows, encoded once on the way in; their mean encoded once more.
    rows = B // n  # replica i holds rows [i*rows, (i+1)*rows): the batch is split over `data`
    shards = [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(n)]
    per_replica = np.stack([reference(params, shard, key)[1]["w"] for shard in shards])
    eps, exact = ENCODING_ERROR[compression], np.abs(np.asarray(want["w"]))
    if compression == "bf16":  # relative to each value: the replicas' errors averaged, then the mean's
        bound = eps * (np.abs(per_replica).mean(axis=0) + exact)
    else:  # relative to the block's largest value (all 12 values fit one block of 256)
        bound = eps * (np.abs(per_replica).max(axis=(1, 2)).mean() + exact.max())
    err = np.abs(np.asarray(grads["w"]) - np.asarray(want["w"]))
    assert np.all(err <= 1.01 * bound + 1e-7), (err.max(), bound.min())
    assert err.max() > 0  # it did compress
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-6)  # replicas' mean
    # The comm state comes back as it went in: one error-feedback buffer per replica, which together
    # hold exactly what the compression took away from the mean.
    assert jax.tree.structure(new_comm) == jax.tree.structure(comm) and set(comm) == {"error"}
    assert new_comm["error"]["w"].shape == (n, D_IN, D_OUT) and new_comm["error"]["w"].dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(new_comm["error"]["w"]).mean(axis=0), per_replica.mean(axis=0) - np.asarray(grads["w"]), atol=1e-6
    )


def test_gradient_strategy_picks_one_per_config(tmp_path):
    mesh = make_mesh({"data": jax.device_count()})

    def pick(*overrides):
        return gradient_strategy(cfg_with(tmp_path, *overrides), None, objective, mesh)

    assert type(pick()) is Plain
    micro = pick("train.microbatches=4")
    assert type(micro) is Microbatched and micro.microbatches == 4
    for comm in ("comm.compression=int8", "comm.compression=powersgd", "comm.stale_gradients=true"):
        reduced = pick(comm, "rules.preset=dp")
        assert type(reduced) is Reduced and type(reduced.replica) is Plain, comm
    reduced = pick("comm.compression=bf16", "rules.preset=dp", "train.microbatches=2")
    assert type(reduced.replica) is Microbatched and reduced.replica.microbatches == 2
    # The pipeline's value_and_grad only closes over the graphdef until traced: None is enough here.
    assert type(pick("train.pipeline=gpipe", "mesh.stage=2", "train.microbatches=4")) is Pipelined
    # DiLoCo (comm.local_steps) is another update, not a strategy: each replica takes the local one.
    diloco = cfg_with(tmp_path, "comm.local_steps=4", "rules.preset=dp", "train.microbatches=2")
    assert type(gradient_strategy(diloco, None, objective, mesh)) is Microbatched
    assert type(local_strategy(diloco, objective)) is Microbatched
    assert type(local_strategy(cfg_with(tmp_path), objective)) is Plain
