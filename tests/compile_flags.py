"""XLA flags that compile for compile speed, for the test session and the doc-command check.

Jax-free (read before jax is imported): `conftest.py` puts them in the session's `XLA_FLAGS`, and
`tools/check_doc_commands.py` gives them to every command its small mode runs.

XLA's LLVM passes cost about a third of most tests' time and change how fast a program runs, not
what it computes; runs that train for many steps ask for XLA's default optimization back per
compile (`conftest.optimized_override()`). benchmarks/compile_options.py measures both sides.
XLA:CPU's MLIR fusion emitters are off too where jaxlib still has the older ones (0.10; 0.12's XLA
knows only the MLIR ones and aborts on the flag): with the older ones lm_tiny's 8-device step
compiled in 0.80 s instead of 2.07 s (fsdp: 1.07 s instead of 2.04 s) and ran 1.5x slower, and the
quick tier took 14 min 26 s instead of 21 min 41 s on 2 cores (RESULTS.md, 2026-12-04).
"""

import importlib.metadata

OLDER_EMITTERS = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)
FAST_COMPILE_FLAGS = [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    *(["--xla_cpu_use_fusion_emitters=false"] if OLDER_EMITTERS else []),
]


def with_flags(xla_flags: str, flags: list[str]) -> str:
    """`xla_flags` with each of `flags` appended whose name it does not already set (its own value wins)."""
    given = xla_flags.split()
    names = {f.split("=")[0] for f in given}
    return " ".join([*given, *(f for f in flags if f.split("=")[0] not in names)])


if __name__ == "__main__":  # `XLA_FLAGS="$(python3 tests/compile_flags.py "$XLA_FLAGS")"`
    import sys

    print(with_flags(" ".join(sys.argv[1:]), FAST_COMPILE_FLAGS))
