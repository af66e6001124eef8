"""Eight fake CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import pathlib  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


def tiny_overrides(run_dir) -> list[str]:
    """A model small enough that a compile plus a few dozen steps take seconds."""
    return [f"run.dir={run_dir}", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.d_ff=128", "data.seq_len=32", "train.global_batch=8",
            "log.progress=false", "log.tensorboard=false", "log.eval_batches=2"]
