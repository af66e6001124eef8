"""Eight fake CPU devices, set before jax is imported anywhere."""

import os

# XLA compiles for compile speed in the whole session (compile_flags.py says why and what it saves);
# a test that counts the compiled program's fusions or reads the shapes of its ops compiles with
# XLA's own emitters (`XLA_EMITTERS`), since the fusion pass plans for the emitters it has.
from compile_flags import FAST_COMPILE_FLAGS, OLDER_EMITTERS, with_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_flags(
    os.environ.get("XLA_FLAGS", ""), ["--xla_force_host_platform_device_count=8", *FAST_COMPILE_FLAGS]
)  # a flag set by the caller wins
os.environ["JAX_PLATFORMS"] = "cpu"
# One persistent compilation cache for the tests, the processes they start and every later run of the
# suite on this machine (`cache_dirs.py`): the slow tier and the next run load what the quick tier
# compiled instead of compiling it again.
import cache_dirs  # noqa: E402

cache_dirs.use_persistent_compilation_cache()
if "PYTEST_XDIST_WORKER" not in os.environ:  # the session's first process: before any worker compiles
    cache_dirs.prune(cache_dirs.compilation_cache_dir())

import gc  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402

# Python's cyclic GC at its default thresholds (700, 10, 10) ran ~4,800 young collections and 22
# full ones in a minute of serving and sharded-step tests: 9.5-10 s, 13% of the process's CPU, spent
# walking what jax's tracing allocates. At (10,000, 20, 100): 2.2-2.7 s and 10-12% less CPU, for
# ~20% more peak memory (1.7 -> 2.1 GB) in that process (benchmarks/RESULTS.md, 2026-12-07).
gc.set_threshold(10_000, 20, 100)

# A suite started in the background of a script inherits SIGINT ignored, and so would every trainer
# the tests start; the signal tests need what a terminal gives: Ctrl-C at its default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import suite_timing  # noqa: E402

pytest_plugins = ["suite_timing"]

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


# XLA's own defaults (xla/debug_options_flags.cc), which FAST_COMPILE_FLAGS changed for the session.
XLA_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if OLDER_EMITTERS else {}
OPTIMIZED_OPTIONS = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False, **XLA_EMITTERS}


def xla_options_override(options: dict) -> str:
    """A config override (`comm.xla_options`) compiling the train step with `options`."""
    return "comm.xla_options={" + ", ".join(f"{k}: {str(v).lower()}" for k, v in options.items()) + "}"


def optimized_override() -> str:
    """A config override that compiles the train step with XLA's default optimization: for runs of
    dozens of steps, where the step's speed outweighs its compile."""
    return xla_options_override(OPTIMIZED_OPTIONS)


# Two tiers. `pytest` runs the quick one (one test per claim: ~13 min on 2 cores cold, ~7 warm); tests marked
# `slow` (more layouts and signals, longer learning runs, the bigger notebooks) run with
# `--tier slow`, and everything with `--tier all`. CI runs both tiers.
def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=("quick", "slow", "all"),
        default="quick",
        help="quick (default): the tests not marked slow; slow: only those; all: every test",
    )


def pytest_collection_modifyitems(config, items):
    tier = config.getoption("--tier")
    if tier == "all":
        return
    in_tier = {id(item): (item.get_closest_marker("slow") is not None) == (tier == "slow") for item in items}
    config.hook.pytest_deselected(items=[item for item in items if not in_tier[id(item)]])
    items[:] = [item for item in items if in_tier[id(item)]]


def hf_folder(folder: pathlib.Path, chat_template: str) -> pathlib.Path:
    """The Llama fixture with the tests' tokenizer and `chat_template`, as a downloaded checkpoint has them."""
    import json
    import shutil

    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "tests/fixtures/hf/llama" / name, folder / name)
    shutil.copy(ROOT / "tests/fixtures/text_tokenizer/tokenizer.json", folder / "tokenizer.json")
    config = json.loads((ROOT / "tests/fixtures/text_tokenizer/tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return folder


def tiny_overrides(run_dir) -> list[str]:
    """A model small enough that a compile plus a few dozen steps take seconds."""
    return [
        f"run.dir={run_dir}",
        "model.d_model=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.d_ff=128",
        "data.seq_len=32",
        "train.global_batch=8",
        "log.progress=false",
        "log.tensorboard=false",
        "log.eval_batches=2",
    ]


# lm_tiny trained for 100 steps under three layouts: trained once per session,
# each layout only when a test first asks for it (tests/test_training.py checks
# the learning; inference and fine-tuning tests reuse the trained weights).
LM_TINY_STEPS = 100
LM_TINY_LAYOUTS = {
    "1dev": dict(devices=1, overrides=["mesh.data=1"]),
    "8dev_dp": dict(devices=8, overrides=["mesh.data=8", "rules.preset=dp"]),
    "8dev_fsdp": dict(devices=8, overrides=["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]),
}


# Layouts whose tests need only the run dir and losses, not the final state in memory: shared by
# the xdist workers (a 100-step run costs 30-40 s per worker).
SHARED_LAYOUTS = ("1dev",)


class _LazyRuns(dict):
    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name):
        with suite_timing.shared_work():
            if name in SHARED_LAYOUTS:
                self[name] = self._shared(name)
            else:
                self[name] = self._train(name, self.tmp_path_factory.mktemp(f"lm_tiny_{name}"))
        return self[name]

    @staticmethod
    def _train(name, run_dir):
        import jax

        from meshwork.config import load_config
        from meshwork.train.loop import train

        layout = LM_TINY_LAYOUTS[name]
        cfg = load_config(
            ROOT / "configs/lm_tiny.yaml",
            [
                f"run.dir={run_dir}",
                f"train.steps={LM_TINY_STEPS}",
                "log.eval_every=100",
                "log.progress=false",
                optimized_override(),
                *layout["overrides"],
            ],
        )
        return train(cfg, devices=jax.devices()[: layout["devices"]])

    def _shared(self, name):
        """The run trained once per machine and code version (`cache_dirs.shared_run`), not once per
        tier or pytest-xdist worker: its summary (all but the final state) is kept beside it."""

        def make(run_dir):
            summary = self._train(name, run_dir)
            return {k: summary[k] for k in ("val_loss", "last_step", "resumed_from")}

        layout = LM_TINY_LAYOUTS[name]
        run_dir, summary = cache_dirs.shared_run(
            ROOT, f"lm_tiny_{name}", repr((LM_TINY_STEPS, layout, optimized_override())), make
        )
        summary["run_dir"] = run_dir
        summary["val_loss"] = {int(k): v for k, v in summary["val_loss"].items()}  # JSON keys are strings
        return summary


@pytest.fixture(scope="session")
def lm_tiny_runs(tmp_path_factory):
    """name -> train() summary (with "run_dir", "state", "val_loss") of lm_tiny after LM_TINY_STEPS steps."""
    return _LazyRuns(tmp_path_factory)


# The reliability tests' shared fixtures (tests/reliability/harness.py starts the runs): one
# compilation cache and one reference run per session (per pytest-xdist worker), whichever file asks first.
@pytest.fixture(scope="session")
def compile_cache() -> pathlib.Path:
    return cache_dirs.compilation_cache_dir()


@pytest.fixture(scope="session")
def reference_run(compile_cache) -> pathlib.Path:
    """The uninterrupted tiny run every interrupted one must match bit for bit (trained once per
    machine and code version: `cache_dirs.shared_run`)."""
    from reliability import harness

    def make(run_dir):
        done = harness.run(run_dir, compile_cache)
        assert done.returncode == 0, done.stderr[-2000:]
        return {}

    return cache_dirs.shared_run(ROOT, "reliability_reference", repr(harness.TINY), make)[0]


UNET_DIGITS_STEPS = 200


@pytest.fixture(scope="session")
def unet_digits_run() -> tuple[pathlib.Path, dict]:
    """(run dir, {"val_loss": ...}) of unet_digits trained UNET_DIGITS_STEPS steps on one device, with a
    sample grid and the evaluation at the end: trained once per machine and code version
    (`cache_dirs.shared_run`) for the slow tier's learning, CLI-sampling and DistriFusion-quality tests."""
    steps = UNET_DIGITS_STEPS
    overrides = [
        f"train.steps={steps}",
        f"checkpoint.every={steps}",
        "log.progress=false",
        "log.tensorboard=false",
        "log.every=10",
        f"log.eval_every={steps}",
        f"log.sample_every={steps}",
        "mesh.data=1",
        optimized_override(),
    ]

    def make(run_dir):
        import jax

        from meshwork.config import load_config
        from meshwork.train.loop import train

        summary = train(
            load_config(ROOT / "configs/unet_digits.yaml", [f"run.dir={run_dir}", *overrides]),
            devices=jax.devices()[:1],
        )
        return {"val_loss": summary["val_loss"]}

    run_dir, summary = cache_dirs.shared_run(ROOT, "unet_digits", repr(overrides), make)
    return run_dir, {"val_loss": {int(k): v for k, v in summary["val_loss"].items()}}
