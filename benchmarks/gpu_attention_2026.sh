#!/usr/bin/env bash
# Issue #48's GPU figures in one call (about 5 minutes): the Pallas kernels with soft-capping, sinks
# and windows against XLA's reference (errors and times), and Gated DeltaNet's chunked form in XLA
# against its recurrence and causal softmax attention (the case for or against a Pallas kernel).
#
#   bash benchmarks/gpu_attention_2026.sh          # on the GPU machine, from the repo root; JSON under $OUT
#
# Needs only jax (the kernels and the delta rule import no pydantic/grain): PYTHONPATH=src.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_attention_2026}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/info.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/info.txt"
timeout -k 5 "${ATTN_S:-240}" python3 benchmarks/attention_features_gpu.py --out "$OUT/attention_features.json" \
  --budget "${ATTN_BUDGET:-120}" 2>&1 | tee "$OUT/attention_features.txt"
echo "attention_features rc=${PIPESTATUS[0]}"
timeout -k 5 "${GDN_S:-200}" python3 benchmarks/gated_deltanet_gpu.py --out "$OUT/gated_deltanet.json" \
  --budget-s "${GDN_BUDGET:-120}" 2>&1 | tee "$OUT/gated_deltanet.txt"
echo "gated_deltanet rc=${PIPESTATUS[0]}"
