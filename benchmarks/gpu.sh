#!/usr/bin/env bash
# One GPU session's checks in one call (device time is short): the environment, the MoE block's
# formulations (grouped ragged_dot, XLA or Pallas Triton lowering; dense) at Qwen3-Omni's widths
# against transformers (benchmarks/moe_lowering.py), the
# real-width AR suite (benchmarks/shaped_suite.py, transformers on the same shapes first), then the
# test suite on the GPU. Each part has its own time limit and writes its log and results under $OUT as it goes,
# so a part cut short still reports what it measured.
# Usage, from the repository root: OUT=/some/dir bash benchmarks/gpu.sh; MOE_S, SHAPED_S and TESTS_S
# bound the three parts (seconds), TESTS names test files (default: all), WORKERS pytest-xdist's,
# REFERENCE= (empty) leaves transformers out.
set -u
OUT=${OUT:-/tmp/omni_jax_gpu}
MOE_S=${MOE_S:-90}
SHAPED_S=${SHAPED_S:-300}
TESTS_S=${TESTS_S:-200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, jax, flax, transformers, torch; print(sys.version.split()[0], jax.__version__, \
jax.devices(), flax.__version__, transformers.__version__, torch.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || echo "editable install failed (PYTHONPATH still holds the tree): see install.log"
echo "== MoE ragged_dot lowerings (limit ${MOE_S}s)"
timeout -s INT "$MOE_S" python3 -m benchmarks.moe_lowering --json "$OUT/moe.json" >"$OUT/moe.log" 2>&1
echo "moe lowering exit $?"
grep -E "^N=" "$OUT/moe.log"
echo "== shaped suite (limit ${SHAPED_S}s)"
timeout -s INT "$SHAPED_S" python3 -m benchmarks.shaped_suite ${REFERENCE---reference} --json "$OUT/shaped.json" \
  --batches "${BATCHES:-1,64,8,256}" --prefill "${PREFILL:-512,2048,8192}" >"$OUT/shaped.log" 2>&1
echo "shaped suite exit $?"
grep -E "^(ours|transformers)" "$OUT/shaped.log"
tail -5 "$OUT/shaped.log"
echo "== tests on the GPU (limit ${TESTS_S}s)"
JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT "$TESTS_S" \
  python3 -m pytest ${TESTS:-tests} -q -n "${WORKERS:-8}" -p no:cacheprovider --junitxml="$OUT/junit.xml" -rfE \
  --durations=20 >"$OUT/tests.log" 2>&1
echo "tests exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
