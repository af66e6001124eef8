"""Host offload through JAX memory kinds (train.offload, train.remat=offload_dots).

Each option must train lm_tiny to the same losses as without it, on one
device and on eight (fsdp), and put its state where it says.

What the CPU backend (jax 0.10.2) can show: arrays really live in the
`pinned_host` memory kind, and the compiled step's entry layout marks those
arguments and outputs with memory space `S(5)`; but `memory_analysis()` counts
them inside `argument_size_in_bytes` and reports every `host_*_size_in_bytes`
as 0, and a `device_put` to a memory kind inside jit lowers to nothing on CPU
(jax lowers it only for TPU and GPU). So the bytes moved off the device are
read from the entry layout, and what the step streams (layers, moments,
offloaded activations) from the step lowered for GPU, which needs no GPU.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides

from meshwork.config import ConfigError, load_config
from meshwork.partitioning import abstract_with_shardings
from meshwork.sharding.hlo_parse import host_memory_bytes
from meshwork.sharding.report import state_bytes
from meshwork.train.trainer import Trainer, build_trainer, check_runtime

STEPS = 3
MESHES = {1: ["mesh.data=1"], 8: ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]}
OPTIONS = {
    "none": [],
    "optimizer": ["train.offload.optimizer=true"],
    "params_dots": ["train.offload.params=true", "train.remat=offload_dots"],
    "all": ["train.offload.optimizer=true", "train.offload.params=true", "train.remat=offload_dots"],
}
# Compiles dominate the test's time (2 CPU cores: ~10 s each at XLA's default optimization), so options are grouped: optimizer
# offload alone and parameter + activation offload together on one device, all three on eight.
CASES = [(1, "optimizer"), (1, "params_dots"), (8, "all")]


def _train(n_devices: int, option: str, tmp_path_factory) -> tuple[Trainer, dict, list[float]]:
    run_dir = tmp_path_factory.mktemp(f"offload_{n_devices}_{option}")
    # No warmup: a first step at lr 0 would hide a wrong update.
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [*tiny_overrides(run_dir), "optimizer.warmup_steps=0", *MESHES[n_devices], *OPTIONS[option]],
    )
    devices = jax.devices()[:n_devices]
    trainer = build_trainer(cfg, check_runtime(cfg, devices), devices).compile()
    state, batches, losses = trainer.init_state(), trainer.task.train_iterator(), []
    for _ in range(STEPS):
        with trainer.context():
            state, metrics = trainer.step_fn(state, trainer.to_device(next(batches)))
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[tuple[int, str], tuple] = {}

    def get(n_devices: int, option: str):
        if (n_devices, option) not in cache:
            cache[n_devices, option] = _train(n_devices, option, tmp_path_factory)
        return cache[n_devices, option]

    return get


def host_bytes(compiled) -> tuple[int, int]:
    """(argument, output) bytes per device in host memory of the compiled step's entry layout."""
    return host_memory_bytes(compiled.as_text())


@pytest.mark.parametrize("n_devices,option", CASES)
def test_same_losses(runs, n_devices, option):
    ref = runs(n_devices, "none")[2]
    losses = runs(n_devices, option)[2]
    # Offloading moves bytes, not math; remat may reassociate (fp32: ~1e-7).
    np.testing.assert_allclose(losses, ref, rtol=1e-6, atol=1e-6)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("n_devices,option", CASES)
def test_memory_kinds(runs, n_devices, option):
    trainer, state, _ = runs(n_devices, option)
    offload = trainer.cfg.train.offload
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}  # noqa: E731
    assert kinds(state.opt_state) == {"pinned_host" if offload.optimizer else "device"}
    assert kinds(state.params["blocks"]) == {"pinned_host" if offload.params else "device"}
    assert kinds(state.params["embed"]) | kinds(state.params["head"]) == {"device"}
    # Only the memory kind changes: same partition specs as without offload (here fsdp on 8).
    ref = runs(n_devices, "none")[1]
    specs = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]  # noqa: E731
    assert specs(state) == specs(ref)


@pytest.mark.parametrize("n_devices,option", CASES)
def test_bytes_off_device(runs, n_devices, option):
    """The compiled step's host-resident arguments (and outputs) are exactly the offloaded state's bytes."""
    trainer, _, _ = runs(n_devices, option)
    ref_trainer = runs(n_devices, "none")[0]
    offload = trainer.cfg.train.offload
    shardings, abstract = trainer.shardings, trainer.abstract
    expected = 0
    if offload.optimizer:
        expected += state_bytes(abstract.parts(), shardings.parts())["opt_state"]
    if offload.params:
        expected += state_bytes(
            {"params": abstract.params["blocks"], "opt_state": {}},
            {"params": shardings.params["blocks"], "opt_state": {}},
        )["params"]
    assert host_bytes(trainer.step_fn) == (expected, expected)
    assert host_bytes(ref_trainer.step_fn) == (0, 0)
    if (n_devices, option) == (1, "optimizer"):
        assert expected == 854_536  # the docs' figure: the Adam state of the 106,816-parameter test model
    # CPU's memory_analysis cannot tell host from device: the host_* fields stay 0 and
    # argument_size_in_bytes counts both, so the device share is argument - host.
    mem, ref_mem = trainer.step_fn.memory_analysis(), ref_trainer.step_fn.memory_analysis()
    assert mem.host_argument_size_in_bytes == 0
    assert mem.argument_size_in_bytes == ref_mem.argument_size_in_bytes
    device_args = mem.argument_size_in_bytes - host_bytes(trainer.step_fn)[0]
    assert ref_mem.argument_size_in_bytes - device_args == pytest.approx(expected, rel=0.1)


def _placements(trainer: Trainer) -> dict[str, int]:
    """Memory-space annotations in the step lowered for GPU: {"pinned_host": n, "device": m}.

    XLA:CPU has no separate host memory: jax lowers a `device_put` to a memory kind inside
    jit to nothing on CPU (only TPU and GPU lower it to `annotate_device_placement`), so
    what the step streams shows up only in a GPU lowering; lowering needs no GPU.
    """
    step = jax.jit(
        trainer.make_step(trainer.grad_shardings),
        in_shardings=(trainer.shardings, trainer.batch_sharding),
        out_shardings=(trainer.shardings, None),
        donate_argnums=0,
    )
    batch = trainer.batch_abstract()
    with trainer.context():
        text = (
            step.trace(abstract_with_shardings(trainer.abstract, trainer.shardings), batch)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    found = re.findall(r'annotate_device_placement.*?_xla_buffer_placement = "(\w+)"', text)
    return {kind: found.count(kind) for kind in ("pinned_host", "device")}


def test_what_the_gpu_program_streams(runs):
    """Lowered for GPU, each offloaded array is written back to pinned host memory once (its
    out_sharding) and read into device memory inside the step; offload_dots adds activations
    sent to the host in the forward pass (more host placements than offloaded state arrays)."""
    assert _placements(runs(1, "none")[0]) == {"pinned_host": 0, "device": 0}
    trainer = runs(1, "optimizer")[0]
    n_moments = len(jax.tree.leaves(trainer.abstract.opt_state))
    opt = _placements(trainer)
    assert opt["pinned_host"] == n_moments and opt["device"] >= n_moments
    # The figures the docs quote (jax 0.10.2; benchmarks/offload_figures.py): 26 copies to host
    # (one per optimizer-state array) and 39 to device on this model.
    assert (n_moments, opt["pinned_host"], opt["device"]) == (26, 26, 39), (n_moments, opt)
    trainer = runs(1, "params_dots")[0]
    n_layer_params = len(jax.tree.leaves(trainer.abstract.params["blocks"]))
    both = _placements(trainer)
    assert both["pinned_host"] > n_layer_params and both["device"] > 2 * n_layer_params  # forward and backward scans


@pytest.mark.parametrize(
    "override,key",
    [
        (["model.kind=moe", "train.offload.params=true"], "train.offload.params"),
        (["train.offload.optimizer=true", "comm.compression=bf16"], "train.offload"),
        (["model.kind=unet", "train.remat=offload_dots", "data.source=digits"], "train.remat"),
    ],
)
def test_bad_combinations(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(ROOT / "configs/lm_tiny.yaml", override)
