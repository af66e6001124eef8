"""The attention tuning cache, the autotuner's static measure, and both attention benchmarks end to end.

The benchmarks run as subprocesses in their --quick CPU mode (Pallas interpret
mode, tiny shapes): that proves the scripts a GPU machine will run get through
every step here, not that their GPU numbers are right.
"""

import doctest
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshwork.kernels import flash_attention as fa
from meshwork.kernels import pallas_backend as pb
from meshwork.kernels import tuning
from meshwork.kernels.tuning import lookup, record, shape_key, tuned_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import autotune_cost_model as cm  # noqa: E402
import autotune_kernel_counts as kc  # noqa: E402
import autotune_search as search  # noqa: E402
from attention import attention_flops, step  # noqa: E402

DEV = "NVIDIA H100 80GB HBM3"


def spec(B, L, H, K, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((B, L, H, K), dtype)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache file, also named by the environment variable so the defaults find it."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    return path


# --------------------------------------------------------------------------
# tuning.py
# --------------------------------------------------------------------------


def test_key_buckets_lengths_and_keeps_what_changes_the_best_tile():
    key = shape_key(L=4000, S=4096, K=128, dtype=jnp.bfloat16, causal=True)
    assert key == "L4096-S4096-K128-bfloat16-causal"
    assert shape_key(L=3, S=100, K=64, dtype="float32", causal=False) == "L128-S128-K64-float32-full"
    assert (
        shape_key(L=4097, S=4096, K=128, dtype=jnp.dtype("bfloat16"), causal=True) == "L8192-S4096-K128-bfloat16-causal"
    )
    assert {
        shape_key(L=1, S=1, K=8, dtype=d, causal=True)
        for d in (np.float32, np.dtype("float32"), jnp.float32, "float32")
    } == {"L128-S128-K8-float32-causal"}
    variants = {
        shape_key(L=4096, S=4096, K=K, dtype=d, causal=c)
        for K in (64, 128)
        for d in ("bfloat16", "float32")
        for c in (False, True)
    }
    assert len(variants) == 8
    with pytest.raises(ValueError, match="positive"):
        shape_key(L=0, S=1, K=64, dtype="float32", causal=True)


def test_record_lookup_round_trip(cache):
    key = shape_key(L=4096, S=4096, K=128, dtype="bfloat16", causal=True)
    assert lookup(DEV, key) is None
    record(DEV, key, {"num_stages": 3, "block_q": 128, "block_kv": 64, "num_warps": 8}, measured={"ms": 1.5})
    record("cpu", key, {"block_q": 32})
    assert lookup(DEV, key) == {"block_q": 128, "block_kv": 64, "num_warps": 8, "num_stages": 3}
    assert list(lookup(DEV, key)) == list(tuning.CONFIG_FIELDS)  # stored in a fixed order
    assert lookup("cpu", key) == {"block_q": 32}
    record(DEV, key, {"block_q": 64})  # the last writer wins; other entries survive
    assert lookup(DEV, key) == {"block_q": 64} and lookup("cpu", key) == {"block_q": 32}
    data = json.loads(cache.read_text())
    assert data["format"] == tuning.FORMAT and data["entries"]["cpu"][key]["config"] == {"block_q": 32}
    assert not list(cache.parent.glob("*.tmp")), "the atomic write leaves no temporary file"


def test_empty_config_means_the_defaults_won(cache):
    key = shape_key(L=1024, S=1024, K=64, dtype="bfloat16", causal=False)
    record(DEV, key, {})
    assert lookup(DEV, key) == {}


def test_nearest_bucket_fallback(cache):
    key = shape_key(L=4096, S=4096, K=128, dtype="bfloat16", causal=True)
    record(DEV, key, {"block_q": 128})
    near = shape_key(L=8192, S=8192, K=128, dtype="bfloat16", causal=True)  # log2 distance 1 + 1
    far = shape_key(L=16384, S=16384, K=128, dtype="bfloat16", causal=True)  # 2 + 2
    other = shape_key(L=4096, S=4096, K=64, dtype="bfloat16", causal=True)
    assert lookup(DEV, near) is None, "exact by default"
    assert lookup(DEV, near, nearest=True) == {"block_q": 128}
    assert lookup(DEV, far, nearest=True) is None
    assert lookup(DEV, other, nearest=True) is None, "head dim, dtype and causality never fall back"
    record(DEV, shape_key(L=16384, S=16384, K=128, dtype="bfloat16", causal=True), {"block_q": 64})
    assert lookup(DEV, shape_key(L=8192, S=8192, K=128, dtype="bfloat16", causal=True), nearest=True) == {
        "block_q": 64
    }, "equal distance: the longer bucket wins"


def test_missing_or_disabled_cache_gives_the_kernel_defaults(tmp_path, monkeypatch):
    q = spec(2, 512, 4, 64)
    monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "absent.json"))
    assert tuned_blocks(q, q, True, "cpu") == {}
    monkeypatch.setenv(tuning.ENV_VAR, "off")
    assert tuning.cache_path() is None and tuned_blocks(q, q, True, "cpu") == {}
    with pytest.raises(ValueError, match="disabled"):
        record("cpu", "L128-S128-K64-float32-full", {"block_q": 32})


def test_corrupt_cache_warns_and_falls_back(cache):
    cache.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring attention tuning cache"):
        assert lookup("cpu", "L128-S128-K64-float32-full") is None


def test_record_rejects_bad_configs(cache):
    with pytest.raises(ValueError, match="unknown tuning field 'blockq'"):
        record("cpu", "k", {"blockq": 64})
    for bad in (0, 64.0, True):
        with pytest.raises(ValueError, match="positive int"):
            record("cpu", "k", {"block_q": bad})


def test_tuned_blocks_keys_on_device_and_shape_not_batch_or_heads(cache):
    kind = jax.devices("cpu")[0].device_kind
    key = shape_key(L=256, S=256, K=32, dtype="float32", causal=True)
    record(kind, key, {"block_q": 64, "block_kv": 32, "num_warps": 8, "num_stages": 3})
    for B, H in ((1, 2), (8, 16)):
        q = spec(B, 200, H, 32, jnp.float32)
        assert tuned_blocks(q, spec(B, 256, 1, 32, jnp.float32), True, "cpu") == {
            "block_q": 64,
            "block_kv": 32,
            "num_warps": 8,
            "num_stages": 3,
        }
    assert tuned_blocks(spec(1, 256, 2, 32, jnp.float32), spec(1, 256, 2, 32, jnp.float32), False, "cpu") == {}
    # No GPU on this host: a kernel lowered for one (as test_flash_attention does) finds no entry.
    assert tuned_blocks(spec(1, 256, 2, 32, jnp.float32), spec(1, 256, 2, 32, jnp.float32), True, "gpu") == {}


def test_tuned_blocks_feed_flash_attention(cache):
    q = jax.random.normal(jax.random.key(0), (1, 96, 2, 32))
    record(
        jax.devices("cpu")[0].device_kind,
        shape_key(L=96, S=96, K=32, dtype=q.dtype, causal=True),
        {"block_q": 32, "block_kv": 64, "num_warps": 8, "num_stages": 3},
    )
    kwargs = tuned_blocks(q, q, True)
    assert kwargs == {"block_q": 32, "block_kv": 64, "num_warps": 8, "num_stages": 3}  # warps/stages: ignored on CPU
    np.testing.assert_allclose(
        fa.flash_attention(q, q, q, causal=True, **kwargs),
        fa.flash_attention_reference(q, q, q, causal=True),
        atol=1e-5,
    )


def test_importing_the_cache_does_not_import_jax():
    code = "import sys, meshwork.kernels.tuning; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_doctests():
    assert doctest.testmod(tuning, optionflags=doctest.ELLIPSIS).failed == 0


# --------------------------------------------------------------------------
# The autotuner's static measure and search statistics
# --------------------------------------------------------------------------


def _kernels(shape, cand, backend, backward=True):
    B, L, S, H, G, K = (shape[k] for k in "BLSHGK")

    def attn(q, k, v):
        return fa.flash_attention(
            q,
            k,
            v,
            causal=shape["causal"],
            block_q=cand.block_q,
            block_kv=cand.block_kv,
            num_warps=cand.num_warps,
            num_stages=cand.num_stages,
            backend=backend,
        )

    specs = (spec(B, L, H, K), spec(B, S, G, K), spec(B, S, G, K), spec(B, L, H, K))
    traced = jax.jit(step(attn, backward)).trace(*specs)
    return traced, kc.kernels_of(traced, shape, cand, backend)


def test_counted_flops_match_the_attention_flop_count():
    """Non-causal, blocks dividing the lengths: the jaxpr count is exactly 4BHLSK forward, 2x that dQ, 2x dK/dV."""
    shape = dict(B=2, L=256, S=128, H=4, G=2, K=32, causal=False)
    _, kernels = _kernels(shape, search.Candidate(block_q=64, block_kv=32), "cpu")
    flops = {kn.kind: sum(kc.level_runs(kn, d) * lv.flops for d, lv in kn.levels.items()) for kn in kernels}
    fwd = attention_flops(2, 4, 256, 128, 32, causal=False, backward=False)
    assert flops == {"fwd": fwd, "dq": 1.5 * fwd, "dkdv": 2 * fwd}  # dQ: QK^T, dO V^T, dS K; dK/dV: four
    causal = dict(shape, L=256, S=256, causal=True)
    _, kernels = _kernels(causal, search.Candidate(block_q=64, block_kv=64), "cpu", backward=False)
    (fwd_kernel,) = kernels
    counted = sum(kc.level_runs(fwd_kernel, d) * lv.flops for d, lv in fwd_kernel.levels.items())
    useful = attention_flops(2, 4, 256, 256, 32, causal=True, backward=False)
    assert useful < counted <= useful * (1 + 64 / 256) + 1, "block skipping: only the diagonal blocks are waste"


def test_gpu_candidate_reaches_the_lowered_triton_calls():
    shape = dict(B=1, L=256, S=256, H=2, G=2, K=64, causal=True)
    cand = search.Candidate(block_q=64, block_kv=32, num_warps=8, num_stages=3)
    with pb.lowering_target("cuda"):  # the trace carries the abstract GPU into the lowering
        traced, kernels = _kernels(shape, cand, "gpu")
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert {(kn.num_warps, kn.num_stages) for kn in kernels} == {(8, 3)}
    assert kc.triton_launches(text) == [(8, 3)] * 3
    assert pb.compiler_params("gpu", 3, 64).num_warps == 4, "the defaults are unchanged"
    cost, facts = cm.gpu_cost(kernels, "NVIDIA H100", "bfloat16")
    assert 0 < cost < math.inf and facts["smem_kib"] > 0
    _, big = _kernels(
        dict(shape, L=4096, S=4096, K=256),
        search.Candidate(block_q=256, block_kv=256, num_stages=4),
        "gpu",
        backward=False,
    )
    cost, facts = cm.gpu_cost(big, "NVIDIA H100", "bfloat16")
    assert cost == math.inf and "shared memory" in facts["infeasible"]


def test_search_statistics():
    times = [5.0, 3.0, 1.0, 1.04, 2.0]
    assert search.trials_to_reach([0, 1, 2, 3, 4], times) == 3
    assert search.trials_to_reach([3, 2], times, tol=0.05) == 1
    assert abs(search.random_trials(times, 0.0, 2000, seed=0) - 3.0) < 0.15  # (n + 1) / 2
    assert search.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)


# --------------------------------------------------------------------------
# Both scripts end to end (--quick, CPU)
# --------------------------------------------------------------------------


def _run_script(args, tmp_path, limit_s=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", MESHWORK_TUNING_CACHE=str(tmp_path / "env-cache.json"))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, time.perf_counter() - t0


@pytest.mark.slow
def test_attention_benchmark_quick(tmp_path):
    stdout, seconds = _run_script(["benchmarks/attention.py", "--quick", "--json", str(tmp_path / "a.json")], tmp_path)
    assert "cudnn: skipped" in stdout and "pallas/xla" in stdout and "temp per sequence" in stdout
    cells = json.loads((tmp_path / "a.json").read_text())["cells"]
    assert {(c["impl"], c["passes"], c["causal"]) for c in cells} == {
        (i, p, c) for i in ("pallas", "xla") for p in ("fwd", "fwd+bwd") for c in (False, True)
    }
    assert all(c["seconds"] > 0 and c["temp"] is not None for c in cells)
    print(f"attention.py --quick: {seconds:.0f} s")


@pytest.mark.slow
def test_autotune_quick(tmp_path):
    cache_file = tmp_path / "tuned.json"
    stdout, seconds = _run_script(
        ["benchmarks/autotune_attention.py", "--quick", "--cache", str(cache_file), "--json", str(tmp_path / "t.json")],
        tmp_path,
    )
    assert "trials to reach best: static order" in stdout and "backend gpu (static only)" in stdout
    entries = json.loads(cache_file.read_text())["entries"]
    assert list(entries) == [jax.devices("cpu")[0].device_kind]
    (entry,) = entries[jax.devices("cpu")[0].device_kind].values()
    assert set(entry["config"]) <= {"block_q", "block_kv"} and entry["measured"]["objective"] == "fwd+bwd"
    timed, static_gpu = json.loads((tmp_path / "t.json").read_text())
    assert 1 <= timed["stats"]["static_best"] <= timed["stats"]["n"]
    assert all(c["seconds"] is not None for c in timed["candidates"])
    assert any("num_warps" in c["config"] for c in static_gpu["candidates"])
    print(f"autotune_attention.py --quick: {seconds:.0f} s")
