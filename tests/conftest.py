"""Eight fake CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# One persistent compilation cache for the session (and the processes tests start): many tests
# build the same tiny step in a new Trainer, which would otherwise compile it again each time.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshwork-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pathlib  # noqa: E402
import signal  # noqa: E402

# A suite started in the background of a script inherits SIGINT ignored, and so would every trainer
# the tests start; the signal tests need what a terminal gives: Ctrl-C at its default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


def compile_fast_override() -> str:
    """A config override that compiles the train step for compile speed (RUN_ONCE_OPTIONS, as the
    init is): for tests that run a step a handful of times, where XLA's LLVM passes cost seconds
    and change how fast the step runs, not what it computes."""
    from meshwork.train.state import RUN_ONCE_OPTIONS

    return "comm.xla_options={" + ", ".join(f"{k}: {str(v).lower()}" for k, v in RUN_ONCE_OPTIONS.items()) + "}"


def tiny_overrides(run_dir) -> list[str]:
    """A model small enough that a compile plus a few dozen steps take seconds."""
    return [f"run.dir={run_dir}", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.d_ff=128", "data.seq_len=32", "train.global_batch=8",
            "log.progress=false", "log.tensorboard=false", "log.eval_batches=2"]


# lm_tiny trained for 100 steps under three layouts: trained once per session,
# each layout only when a test first asks for it (tests/test_training.py checks
# the learning; inference and fine-tuning tests reuse the trained weights).
LM_TINY_STEPS = 100
LM_TINY_LAYOUTS = {
    "1dev": dict(devices=1, overrides=["mesh.data=1"]),
    "8dev_dp": dict(devices=8, overrides=["mesh.data=8", "rules.preset=dp"]),
    "8dev_fsdp": dict(devices=8, overrides=["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]),
}


class _LazyRuns(dict):
    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name):
        import jax

        from meshwork.config import load_config
        from meshwork.train.loop import train

        layout = LM_TINY_LAYOUTS[name]
        run_dir = self.tmp_path_factory.mktemp(f"lm_tiny_{name}")
        cfg = load_config(ROOT / "configs/lm_tiny.yaml", [
            f"run.dir={run_dir}", f"train.steps={LM_TINY_STEPS}", "log.eval_every=100", "log.progress=false",
            *layout["overrides"]])
        self[name] = train(cfg, devices=jax.devices()[: layout["devices"]])
        return self[name]


@pytest.fixture(scope="session")
def lm_tiny_runs(tmp_path_factory):
    """name -> train() summary (with "run_dir", "state", "val_loss") of lm_tiny after LM_TINY_STEPS steps."""
    return _LazyRuns(tmp_path_factory)

