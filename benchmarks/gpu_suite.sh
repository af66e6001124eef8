#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one call on a GPU machine (about 8 minutes).
#
#   bash benchmarks/gpu_suite.sh                 # on the GPU machine, from the repo root; logs under $OUT
#   SMOKE=1 OUT=/tmp/o bash benchmarks/gpu_suite.sh   # CPU dry run: tiny shapes, checks the script itself
#
# On a machine that cannot download, missing Python packages travel as wheels in .whl/
# (ignored by git), and so does the project itself: a
# meshwork wheel built from the last commit (`git archive HEAD`, then `pip wheel
# --no-deps`), which /tmp/site puts ahead of the working tree's namespace
# (laid out under /tmp/mw below), so uncommitted edits travelling with the tree do not enter the
# figures (benchmarks/ and configs/ still come from the tree); grain + array-record + portpicker,
# pydantic + pydantic-core + annotated-types + typing-inspection + typing_extensions,
# tensorboardX; .whl/extra/ holds a protobuf wheel, installed only if grain
# does not import without it. Every step is time-boxed with `timeout` against
# one overall budget (BUDGET seconds, default 500) and its failure does not stop
# the rest; each step's output goes to $OUT/suite.log and /tmp/suite/<step>.txt
# (tarred to $OUT/logs.tgz at the end), and a summary of exit codes is printed last.
# Steps, in priority order: device info; flash-attention correctness on the GPU
# (compiled Triton, not interpret; forward and gradients vs the f32 reference,
# poisoned outputs); attention throughput (Pallas vs cuDNN vs XLA, bf16, K=128);
# training-step MFU; decode throughput vs the bandwidth roofline; the
# flash-attention test file on the GPU; quantized projections; the autotuner.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT" /tmp/suite
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-500}
T0=$(date +%s)
LOG="$OUT/suite.log"
: >"$LOG"
SUMMARY=()

# The device machine runs from the working tree without `pip install`: lay the meshwork
# namespace out as the wheel does (src/meshwork with models/, sharding/, train/ and
# inference/ inside it) under /tmp/mw, and put that on PYTHONPATH.
NS=/tmp/mw
rm -rf "$NS" && mkdir -p "$NS" && cp -r src/meshwork "$NS/meshwork"
for pkg in models sharding train inference; do ln -s "$PWD/$pkg" "$NS/meshwork/$pkg"; done

if [ -n "${SMOKE:-}" ]; then
  export JAX_PLATFORMS=cpu PYTHONPATH="${SMOKE_SITE:+$SMOKE_SITE:}$NS:${PYTHONPATH:-}"
else
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
    export PYTHONPATH="/tmp/site:$NS:${PYTHONPATH:-}"
    if ! python3 -c "import grain" >>"$LOG" 2>&1 && ls .whl/extra/*.whl >/dev/null 2>&1; then
      echo "grain does not import: adding .whl/extra (protobuf)" | tee -a "$LOG"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/extra/*.whl 2>&1 | tail -3 | tee -a "$LOG"
    fi
  else
    export PYTHONPATH="$NS:${PYTHONPATH:-}"
  fi
fi

# step NAME MAX_SECONDS COMMAND...: run COMMAND under the smaller of MAX_SECONDS and the budget left.
step() {
  local name=$1 box=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="kernel_check mfu": a rerun of some steps
  local left=$((BUDGET - ($(date +%s) - T0)))
  local t=$((box < left ? box : left))
  if [ "$t" -lt 15 ]; then
    SUMMARY+=("$name: skipped (budget spent)")
    echo "=== $name: skipped, ${left}s of the budget left" | tee -a "$LOG"
    return
  fi
  echo "=== $name (timeout ${t}s, t=$(($(date +%s) - T0))s): $*" | tee -a "$LOG"
  local s=$(date +%s)
  timeout -k 5 "$t" "$@" 2>&1 | tee "/tmp/suite/$name.txt" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$name: rc=$rc in $(($(date +%s) - s))s")
  echo "=== $name: rc=$rc after $(($(date +%s) - s))s" | tee -a "$LOG"
}

# ---------------------------------------------------------------- 1. the machine
cat >/tmp/suite/info.sh <<'EOF'
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu \
  --format=csv 2>&1 || echo "nvidia-smi failed"
python3 -m pip show jax jaxlib flax optax orbax-checkpoint protobuf 2>/dev/null | grep -E "^(Name|Version)" | paste - - \
  | awk '{print $2, $4}' | tr '\n' ' '; echo
python3 -P -c "
import jax, sys
print('python', sys.version.split()[0], 'jax', jax.__version__, 'backend', jax.default_backend(), 'devices', jax.devices())
import grain, pydantic, tensorboardX, meshwork, train.loop, inference.generate
print('project imports ok: meshwork from', meshwork.__file__, '| train from', train.__file__, '| grain', grain.__file__,
      '| pydantic', pydantic.VERSION)
"
EOF
step info 60 bash /tmp/suite/info.sh

# ---------------------------------------------------------------- 2. kernel correctness on the GPU
cat >/tmp/suite/kernel_check.py <<'EOF'
"""Flash attention / flash-decoding compiled for the default backend vs the float32 reference."""
import dataclasses, os
import jax, jax.numpy as jnp, numpy as np
from meshwork.kernels import decode_attention as da
from meshwork.kernels import flash_attention as fa
from meshwork.kernels import flash_attention_kernels as fk

SMOKE = bool(os.environ.get("SMOKE"))
backend = jax.default_backend()
print(f"backend {backend} ({'interpret' if backend == 'cpu' else 'compiled'}), {jax.devices()[0].device_kind}, "
      f"jax {jax.__version__}")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fwd_grads(fn, q, k, v, do, **kw):
    def run(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
        return (o, *vjp(do))
    return jax.block_until_ready(jax.jit(run)(q, k, v, do))


def packed(lengths):
    return np.repeat(np.arange(len(lengths)), lengths)


bf, f32 = jnp.bfloat16, jnp.float32
s = 1 if not SMOKE else 0
CASES = [  # name, B, L, S, H, G, K, dtype, kwargs
    ("causal MHA K128 bf16 S2048", 2, 2048 if s else 128, 2048 if s else 128, 16, 16, 128, bf, {}),
    ("causal GQA4 K128 bf16 S4096", 1, 4096 if s else 256, 4096 if s else 256, 16, 4, 128, bf, {}),
    ("non-causal MHA K64 bf16 L=S=1000 (ragged)", 2, 1000 if s else 100, 1000 if s else 100, 8, 8, 64, bf,
     dict(causal=False)),
    ("causal window 512 + 2 packed segments, GQA4 K128 bf16 S2048", 2, 2048 if s else 128, 2048 if s else 128, 8, 2,
     128, bf, dict(window=512 if s else 32, segment_ids_q="seg", segment_ids_kv="seg")),
    ("causal MHA K128 f32 S1024", 1, 1024 if s else 128, 1024 if s else 128, 8, 8, 128, f32, {}),
    ("causal GQA2 K96 (padded to 128) f32 L=S=777", 1, 777 if s else 77, 777 if s else 77, 4, 2, 96, f32, {}),
]
bad = 0
print(f"relative error ||x - ref|| / ||ref|| against the reference on float32 copies of the same inputs")
print(f"{'case':<62} {'impl':<7} {'o':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
for i, (name, B, L, S, H, G, K, dtype, kw) in enumerate(CASES):
    if i < int(os.environ.get("KC_FROM", 0)):  # a rerun can skip the cases already reported
        continue
    keys = jax.random.split(jax.random.key(100 + i), 4)
    q = jax.random.normal(keys[0], (B, L, H, K), dtype)
    k = jax.random.normal(keys[1], (B, S, G, K), dtype)
    v = jax.random.normal(keys[2], (B, S, G, K), dtype)
    do = jax.random.normal(keys[3], (B, L, H, K), dtype)
    if kw.get("segment_ids_q") == "seg":
        seg = jnp.asarray(np.stack([packed([L // 2 - 24, L - L // 2 + 24]), packed([L])]))
        kw = {**kw, "segment_ids_q": seg, "segment_ids_kv": seg}
    up = [x.astype(f32) for x in (q, k, v, do)]
    ref = fwd_grads(fa.flash_attention_reference, *up, **kw)
    impls = {"pallas": lambda q, k, v, **kw: fa.flash_attention(q, k, v, **kw)}
    plain = set(kw) <= {"causal"}
    if plain and backend == "gpu" and dtype == bf:
        impls["cudnn"] = lambda q, k, v, causal=True: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                                   implementation="cudnn")
    if plain:
        impls["xla"] = lambda q, k, v, causal=True: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                                 implementation="xla")
    for impl, fn in impls.items():
        try:
            got = fwd_grads(fn, q, k, v, do, **kw)
            errs = [rel(g, r) for g, r in zip(got, ref)]
            nan = any(bool(np.isnan(np.asarray(g, np.float32)).any()) for g in got)
            tol = 2e-2 if dtype == bf else 1e-5
            flag = "" if (not nan and max(errs) <= tol) else ("  NaN!" if nan else f"  > tol {tol:g}")
            bad += impl == "pallas" and bool(flag)
            print(f"{name:<62} {impl:<7} " + " ".join(f"{e:9.2e}" for e in errs) + flag, flush=True)
        except Exception as e:  # noqa: BLE001
            bad += impl == "pallas"
            print(f"{name:<62} {impl:<7} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)

# Every output element written: raw padded kernel outputs start as NaN (aliased poisoned buffers), end NaN-free.
B, L, S, H, G, K = 2, 1000 if s else 96, 900 if s else 80, 8, 2, 96
keys = jax.random.split(jax.random.key(7), 4)
q, do = (jax.random.normal(keys[i], (B, L, H, K), f32) for i in (0, 3))
k, v = (jax.random.normal(keys[i], (B, S, G, K), f32) for i in (1, 2))
seg_q = np.stack([packed([L // 2, L - L // 2])] * B)
seg_kv = np.stack([packed([S // 2, S - S // 2])] * B)
try:
    cfg = dataclasses.replace(fa.plan(q.shape, k.shape, causal=True, scale=None, window=None, segmented=True,
                                      block_q=None, block_kv=None, backend=None, interpret=None), poison=True)
    qp, kp, vp, sq, skv = fa.pad_inputs(q, k, v, seg_q, seg_kv, cfg)
    dop = fa.pad_inputs(do, k, v, seg_q, seg_kv, cfg)[0]
    o, lse = fk.flash_forward(qp, kp, vp, sq, skv, cfg)
    outs = [o, lse, *fk.flash_backward(qp, kp, vp, sq, skv, o, lse, dop, cfg)]
    d = da.DEFAULT_DECODE_BLOCKS[cfg.backend]
    dcfg = da._Config(scale=K ** -0.5, chunk=d.chunk if s else 32, kv=d.kv if s else 16,
                      rows=16 if cfg.backend == "gpu" else H // G, head_dim=cfg.head_dim, backend=cfg.backend,
                      interpret=cfg.interpret, heads_major=False, poison=True)
    outs += da._decode_chunks(q[:, 0], k, v, jnp.array([7, S]), dcfg)
    nans = {n: int(np.isnan(np.asarray(x)).sum()) for n, x in
            zip(["o", "lse", "dq", "dk", "dv", "decode o", "decode lse"], outs)}
    print(f"poisoned outputs (blocks {cfg.blocks}): NaN count per output {nans}", flush=True)
    bad += any(nans.values())
except Exception as e:  # noqa: BLE001
    bad += 1
    print(f"poison check FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")

# Flash-decoding vs its reference at a serving shape.
B, S, H, G, K = 8, 8192 if s else 256, 32, 8, 128
keys = jax.random.split(jax.random.key(3), 3)
for dtype in (bf, f32):
    q = jax.random.normal(keys[0], (B, H, K), dtype)
    k, v = (jax.random.normal(kk, (B, S, G, K), dtype) for kk in keys[1:])
    lengths = jnp.array([0, 1, 100, 511, 512, 4000 if s else 200, S - 1, S])
    got = jax.block_until_ready(jax.jit(da.decode_attention)(q, k, v, lengths))
    ref = da.decode_attention_reference(*(x.astype(f32) for x in (q, k, v)), lengths)
    err = rel(got[1:], ref[1:])
    zero = bool(np.all(np.asarray(got[0], np.float32) == 0))
    tol = 2e-2 if dtype == bf else 1e-5
    ok = err <= tol and zero
    bad += not ok
    print(f"decode_attention {jnp.dtype(dtype).name} B={B} S={S} H={H} G={G} K={K}: rel err {err:.2e}, "
          f"empty sequence -> zeros: {zero}{'' if ok else '  FAIL'}", flush=True)
print(f"kernel check: {'all pass' if not bad else f'{bad} FAILED'}")
raise SystemExit(1 if bad else 0)
EOF
step kernel_check "${KC_BOX:-70}" python3 /tmp/suite/kernel_check.py

# ---------------------------------------------------------------- 3. attention throughput
if [ -n "${SMOKE:-}" ]; then ATT_SEQ="128 256"; ATT_EXTRA="--d-model 128 --batch-tokens 256 --head-dims 64 --repeats 2"
else ATT_SEQ="1024 4096 16384"; ATT_EXTRA="--head-dims 128"; fi
step attention_causal 130 python3 benchmarks/attention.py --seq $ATT_SEQ $ATT_EXTRA --causal true \
  --passes fwd+bwd fwd --max-seconds 100 --json "$OUT/attention_causal.json"

# ---------------------------------------------------------------- 4. training-step MFU
cat >/tmp/suite/mfu.py <<'EOF'
"""One-device training-step MFU on the GPU: model FLOPs (6N + attention) per second over the
H200 table's dense bf16 peak and over a bf16 matmul peak measured in this process."""
import os, statistics, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import train_step as ts  # time_layout: median s/step after 3 warm-up steps, and model FLOPs/step
from meshwork.config import load_config
from meshwork.perf.hardware import accelerator_for_device_kind, get_hardware

SMOKE = bool(os.environ.get("SMOKE"))
dev = jax.devices()[0]
acc = accelerator_for_device_kind(dev.device_kind)
table = acc.peak_flops["bf16"] if acc else float("nan")


def matmul_peak(n, dtype):
    ka, kb = jax.random.split(jax.random.key(1))
    a, b = jax.random.normal(ka, (n, n), dtype), jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(f(a, b))
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            out = f(a, b)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / 10)
    return 2 * n ** 3 / statistics.median(samples)


n = 256 if SMOKE else 8192
p16, p32 = matmul_peak(n, jnp.bfloat16), matmul_peak(n, jnp.float32)
print(f"{dev.device_kind}; jax {jax.__version__}; table bf16 peak {table / 1e12:.0f} TFLOP/s; measured {n}^3 "
      f"matmul (random data, median of 7 x 10): bf16 {p16 / 1e12:.1f} TFLOP/s, f32 (default precision) "
      f"{p32 / 1e12:.1f} TFLOP/s", flush=True)

BIG = ["model.d_model=2048", "model.n_layers=16", "model.n_heads=16", "model.n_kv_heads=8", "model.d_ff=5632",
       "data.seq_len=2048", "train.global_batch=8"]
if SMOKE:
    BIG = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=128",
           "data.seq_len=64", "train.global_batch=2"]
MIX = ["train.compute_dtype=bfloat16"]  # bf16 compute, f32 params and Adam state
BF16 = MIX + ["train.param_dtype=bfloat16"]
ROWS = [  # name, overrides, timed steps
    ("d2048x16 seq2048 b8 | bf16 compute | xla attn", BIG + MIX + ["model.attention=xla"], 10),
    ("d2048x16 seq2048 b8 | bf16 compute | cudnn attn", BIG + MIX + ["model.attention=cudnn"], 10),
    ("d2048x16 seq2048 b8 | bf16 compute | pallas attn", BIG + MIX + ["model.attention=pallas"], 10),
    ("lm_tiny d128x4 seq128 b16 | f32", [], 20),
    ("lm_tiny d128x4 seq128 b16 | bf16 compute", MIX, 20),
    ("d2048x16 seq2048 b8 | bf16 compute | cudnn | full remat", BIG + MIX + ["model.attention=cudnn", "train.remat=full"], 10),
    ("d2048x16 seq2048 b8 | bf16 params+compute | cudnn", BIG + BF16 + ["model.attention=cudnn"], 10),
]
if SMOKE:
    ROWS = [(n_, [o for o in ov if o not in ("model.attention=cudnn", "model.attention=pallas")], 2)
            for n_, ov, _ in ROWS[:1] + ROWS[3:4]]
print("| model | dtype / attention | params | ms/step | model TFLOP/step | achieved TFLOP/s | MFU (table 989) "
      "| MFU (measured bf16) | planner ms (h200, eff 1) | measured / planned |")
print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
for name, ov, steps in ROWS:
    all_ov = ["mesh.data=1", "log.progress=false", "log.tensorboard=false", *ov]
    try:
        t, flops = ts.time_layout(1, all_ov, steps)
    except Exception as e:  # noqa: BLE001
        print(f"| {name} | FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]} |", flush=True)
        continue
    planned, nparams = None, None
    try:
        from meshwork.perf.planner import PlanOptions, plan
        from meshwork.perf.planner_memory import layout_from_config
        from meshwork.perf.flops import param_counts
        cfg = load_config(ts.ROOT / "configs/lm_tiny.yaml", all_ov)
        nparams = param_counts(cfg.model).get("total")
        planned = plan(cfg, layout_from_config(cfg, 1), get_hardware("h200"), 1,
                       PlanOptions(efficiency=1.0)).step_time
    except Exception as e:  # noqa: BLE001
        print(f"  (planner: {type(e).__name__}: {str(e).splitlines()[0][:150]})")
    model, rest = name.split(" | ", 1)
    pl_ = f"{planned * 1e3:.2f} | {t / planned:.2f}" if planned else "- | -"
    print(f"| {model} | {rest} | {nparams / 1e6 if nparams else float('nan'):.1f}M | {t * 1e3:.2f} | "
          f"{flops / 1e12:.3f} | {flops / t / 1e12:.1f} | {flops / t / table:.1%} | {flops / t / p16:.1%} | {pl_} |",
          flush=True)
EOF
step mfu 170 python3 /tmp/suite/mfu.py

# ---------------------------------------------------------------- 5. decode throughput vs the roofline
if [ -n "${SMOKE:-}" ]; then
  GEN=(--batches 1 4 --prompt-len 16 --decode-steps 8 --repeats 2 --bandwidth-mib 64 --quantize int8)
else
  GEN=(--batches 1 16 64 --prompt-len 128 --decode-steps 64 --repeats 3 --bandwidth-mib 4096 --quantize int8,int4
       model.d_model=2048 model.n_layers=16 model.n_heads=16 model.n_kv_heads=8 model.d_ff=5632)
fi
step generate 100 python3 benchmarks/generate.py "${GEN[@]}" train.compute_dtype=bfloat16 train.param_dtype=bfloat16
# The serving engine's decode (several steps per dispatch, the paged cache by gather and by the
# paged-attention kernel) against the same roofline, at batch 1, 16 and 64.
if [ -n "${SMOKE:-}" ]; then SR=(--batches 1 --steps 8 --repeats 1 --bandwidth-mib 64)
else SR=(--batches 1 16 64 --prompt-len 128 --steps 64 --repeats 3 --bandwidth-mib 4096
         model.d_model=2048 model.n_layers=16 model.n_heads=16 model.n_kv_heads=8 model.d_ff=5632); fi
step serve_roofline 90 python3 benchmarks/serve_roofline.py "${SR[@]}" train.compute_dtype=bfloat16 \
  train.param_dtype=bfloat16

# ---------------------------------------------------------------- 6. non-causal attention, fwd+bwd
step attention_noncausal 45 python3 benchmarks/attention.py --seq $ATT_SEQ $ATT_EXTRA --causal false \
  --passes fwd+bwd --max-seconds 25 --json "$OUT/attention_noncausal.json"

# ---------------------------------------------------------------- 7. the flash-attention tests on the GPU
# tests/conftest.py forces 8 CPU devices; --noconftest skips it (this file needs none of its fixtures);
# -o addopts= drops pyproject's pytest-xdist options (not installed on the GPU machine).
# Cases without backend= run compiled Triton here; the others run their interpreters on the GPU.
if [ -z "${SMOKE:-}" ]; then
  step pytest_flash 70 python3 -m pytest --noconftest -o addopts= -q -p no:cacheprovider tests/test_flash_attention.py \
    -k "matches_reference or rows_without or masked_blocks or every_output or decode_matches"
  # Sliding windows and packed documents through the compiled kernels (flash and decode).
  step pytest_window 60 python3 -m pytest --noconftest -o addopts= -q -p no:cacheprovider \
    tests/test_sliding_window.py tests/test_packed_documents.py \
    -k "decode_kernel_takes_the_window or attend_paths_agree or computes_what_it_computes_alone"
fi
# The paged-attention kernel compiled for the GPU: error vs the gather path, time, K/V bandwidth.
step paged_attention 60 python3 benchmarks/paged_attention_gpu.py
# Soft-capping and sinks in the Pallas kernels vs XLA (errors, times); the chunked Gated DeltaNet in
# XLA vs its recurrence and softmax attention (benchmarks/gpu_attention_2026.sh runs just these two).
step attention_features 120 python3 benchmarks/attention_features_gpu.py ${SMOKE:+--smoke} \
  --out "$OUT/attention_features.json"
step gated_deltanet 120 python3 benchmarks/gated_deltanet_gpu.py ${SMOKE:+--smoke} --out "$OUT/gated_deltanet.json"

# ---------------------------------------------------------------- 8. quantized projections on the GPU
if [ -n "${SMOKE:-}" ]; then QZ=(--train-steps 5 --repeats 3 --matmul 256 512 --val-batches 1)
else QZ=(--train-steps 200 --repeats 50 --matmul 2048 8192); fi
step quantize 60 env JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}" python3 benchmarks/quantize.py "${QZ[@]}"

# ---------------------------------------------------------------- 9. autotune (leftover time only)
if [ -n "${SMOKE:-}" ]; then AT=(--quick --no-write)
else AT=(--seq 1024 4096 16384 --head-dims 64 128 --causal true --block-q 64 128 --block-kv 32 64 128
         --num-warps 4 8 --num-stages 2 3 --repeats 5 --cache "$OUT/attention_tuning.json" --json "$OUT/autotune.json"); fi
# The tuning over S in {1k, 4k, 16k} x head dims {64, 128} that DEFAULT_BLOCKS["gpu"] should come from.
step autotune 150 python3 benchmarks/autotune_attention.py "${AT[@]}"
if [ -z "${SMOKE:-}" ] && [ -s "$OUT/attention_tuning.json" ]; then
  step attention_tuned 45 python3 benchmarks/attention.py --tuned --cache "$OUT/attention_tuning.json" \
    --seq 4096 16384 --head-dims 128 --causal true --passes fwd+bwd --impls pallas cudnn
fi

# ---------------------------------------------------------------- 10. one kernel test alone, the step profile
# The kernel test that did not finish within its time box on the H200 (2026-11-30), alone; then where the
# training step's time goes on the GPU (XLA's trace by model part, benchmarks/train_step.py).
if [ -z "${SMOKE:-}" ]; then
  step masked_blocks_alone 60 timeout 50 python3 -m pytest --noconftest -o addopts= -q -p no:cacheprovider \
    tests/test_flash_attention.py -k masked_blocks_are_never_read
fi
step step_profile 90 python3 benchmarks/train_step.py --profile --steps 3

# ---------------------------------------------------------------- 11. Muon's step (issue #49)
# AdamW vs Muon on one GPU at a d1024 x 8 step: what five Newton-Schulz iterations per matrix add
# (one device: nothing is split, both variants are the same program).
step muon_step 90 python3 benchmarks/optimizer_step.py --steps 10 --layouts "1 device" \
  model.d_model=1024 model.n_layers=8 model.n_heads=8 model.n_kv_heads=8 model.d_ff=4096 data.seq_len=512

tar -C /tmp/suite -czf "$OUT/logs.tgz" . 2>/dev/null
echo
echo "=== summary after $(($(date +%s) - T0))s (budget ${BUDGET}s)"
printf '  %s\n' "${SUMMARY[@]}"
