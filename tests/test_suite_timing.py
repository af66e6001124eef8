"""The suite's own meter (suite_timing.py) counts what it claims to: programs, and the ones done twice."""

import uuid

import jax
import jax.numpy as jnp
import suite_timing


def test_a_program_lowered_again_by_a_new_function_is_counted_as_repeated():
    meter = suite_timing._METER
    meter.listen_to_jax()  # already listening in a suite run; a no-op then
    x = jnp.arange(5.0)
    shift = uuid.uuid4().int % 10_000 / 7.0  # a constant no other program of this process holds
    before = meter.snapshot()
    jax.jit(lambda v: jnp.sin(v) + shift)(x).block_until_ready()
    jax.jit(lambda v: jnp.sin(v) + shift)(x).block_until_ready()  # a new function: traced and lowered again
    jax.jit(lambda v: jnp.cos(v) + shift)(x).block_until_ready()  # another program
    after = suite_timing._delta(before, meter.snapshot())
    assert after["programs"] == 3
    assert after["repeated_programs"] == 1 and after["repeated"] == ["jit__lambda"]
    assert 0.0 < after["repeated_s"] < after["compile_s"]


def test_the_compile_floor_is_the_compile_paths_even_share_among_the_processes():
    def record(process, compile_s):
        zero = dict.fromkeys(("cpu_s", "child_cpu_s", "subprocesses", "shared_fixture_s", "programs"), 0)
        return {**zero, "test": f"t{compile_s}", "wall_s": compile_s + 1.0, "compile_s": compile_s,
                "repeated_programs": 0, "repeated_s": 0.0, "process": process}  # fmt: skip

    records = [record("gw0", 30.0), record("gw1", 50.0), record("gw1", 20.0)]
    floor = next(line for line in suite_timing._table(records, 80.0) if line.startswith("compile floor"))
    assert (
        floor
        == "compile floor: 100 s of jax's compile path over 2 processes (busiest 70 s): no split of these tests ends in under 50 s"
    )
