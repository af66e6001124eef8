"""What compiling for compile speed costs and saves (train/state.py's RUN_ONCE_OPTIONS: XLA's
backend at optimization level 0, LLVM's expensive passes off; and the test session's flags,
tests/compile_flags.py's FAST_COMPILE_FLAGS: those plus XLA:CPU's older fusion emitters), measured in
one run.

    python benchmarks/compile_options.py      # ~3 min on 2 cores

For each program: the backend compile in seconds and one execution in milliseconds, with XLA's
defaults, with RUN_ONCE_OPTIONS and with the test session's options, and the ratios of the first
to the other two. The programs: the trainer's init (it runs once per run, so only its compile
counts) and its train step (it runs every step) of unet_digits on 8 simulated CPU devices under
data parallelism and of lm_tiny under data parallelism and under fsdp. Each compile is fresh
(no persistent cache).
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from meshwork.config import load_config  # noqa: E402
from meshwork.partitioning import abstract_with_shardings  # noqa: E402
from meshwork.train.state import RUN_ONCE_OPTIONS, _fresh_state  # noqa: E402
from meshwork.train.trainer import Trainer, build_trainer, check_runtime  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {
    "unet_digits": ("unet_digits", ["train.global_batch=16", "mesh.data=8"]),
    "lm_tiny": ("lm_tiny", ["mesh.data=8"]),
    "lm_tiny fsdp": ("lm_tiny", ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp"]),
}
# The test session's options (tests/compile_flags.py's FAST_COMPILE_FLAGS, as compile options); jaxlib
# 0.12's XLA has only the MLIR fusion emitters, so there the session's options are RUN_ONCE_OPTIONS.
TEST_SESSION_OPTIONS = {
    **RUN_ONCE_OPTIONS,
    **({"xla_cpu_use_fusion_emitters": False} if jax.__version_info__ < (0, 11) else {}),
}


def timed(lower: Callable[[], jax.stages.Lowered], options: dict, *args, runs: int = 5) -> tuple[float, float]:
    """(compile s, mean execution ms over `runs`, after one warm-up) of a fresh `lower()` under `options`
    (a fresh lowering: jax keeps compiled programs in memory, keyed by the lowered module)."""
    lowered = lower()
    t = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(*args))
    t = time.perf_counter()
    for _ in range(runs):
        out = compiled(*args)
    jax.block_until_ready(out)
    return compile_s, (time.perf_counter() - t) / runs * 1000


def programs(trainer: Trainer) -> dict[str, tuple[Callable[[], jax.stages.Lowered], tuple]]:
    """name -> (a function lowering the program anew, its arguments)."""
    cfg = trainer.cfg
    state = trainer.init_state()
    batch = trainer.to_device(next(trainer.task.train_iterator()))
    batch_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)

    def init():
        with trainer.context():
            return jax.jit(lambda: _fresh_state(cfg, trainer.tx), out_shardings=trainer.shardings).lower()

    def step():  # not donated: the same state feeds every timed call
        with trainer.context():
            return jax.jit(
                trainer.make_step(trainer.grad_shardings), in_shardings=(trainer.shardings, trainer.batch_sharding)
            ).lower(abstract_with_shardings(trainer.abstract, trainer.shardings), batch_abstract)

    return {"init": (init, ()), "step": (step, (state, batch))}


def main() -> None:
    print(
        f"jax {jax.__version__}, {jax.device_count()} CPU devices, options {RUN_ONCE_OPTIONS}, "
        f"test session {TEST_SESSION_OPTIONS}"
    )
    print(
        "| model | program | compile s (default / fast / tests) | run ms (default / fast / tests) | "
        "compile x (fast, tests) | run x (fast, tests) |"
    )
    print("|---|---|---|---|---|---|")
    for name, (config, overrides) in CONFIGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(ROOT / f"configs/{config}.yaml", [f"run.dir={tmp}", "log.progress=false", *overrides])
            trainer = build_trainer(cfg, check_runtime(cfg), jax.devices()).compile()
            for program, (lower, args) in programs(trainer).items():
                with trainer.context():
                    (c0, r0), (c1, r1), (c2, r2) = (
                        timed(lower, options, *args) for options in ({}, RUN_ONCE_OPTIONS, TEST_SESSION_OPTIONS)
                    )
                print(
                    f"| {name} | {program} | {c0:.2f} / {c1:.2f} / {c2:.2f} | {r0:.1f} / {r1:.1f} / {r2:.1f} | "
                    f"{c0 / c1:.2f}, {c0 / c2:.2f} | {r0 / r1:.2f}, {r0 / r2:.2f} |",
                    flush=True,
                )
    print("(x: default / the other; above 1 the other compiles or runs quicker, below 1 slower)")


if __name__ == "__main__":
    main()
