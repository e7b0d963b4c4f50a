#!/usr/bin/env bash
# One GPU session's checks in one call (device time is short). Parts, run in the order PARTS names
# them (default: all but c2w_warm), each under its own time limit, each writing its log and
# results under $OUT as it goes, so a part cut short still reports what it measured:
#   moe       the MoE block's formulations (grouped ragged_dot, XLA or Pallas Triton lowering;
#             dense; assigned, pair by pair; gathered) at Qwen3-Omni's widths against transformers, decode
#             rows to 128 (benchmarks/moe_lowering.py);
#   shaped    the real-width AR suite (benchmarks/shaped_suite.py, transformers on the same shapes);
#   compile   one code2wav program's compile time (benchmarks/compile_time.py), one process each
#             (XLA's autotuning results last a process: a later compile of the same convolutions
#             skips that work): the whole solve, 1 x 32 codes, under each option set of
#             COMPILE_OPTIONS (comma-joined, "-" none; default: none, XLA's fusion autotuner off,
#             GPU autotuning off, XLA's memory limit x10), with its run time; then each half alone;
#   compile3  the same for Qwen3-Omni's code2wav (released widths, 1 x 125 frames): whole decode,
#             transformer + upsampling, ConvNet decoder;
#             (COMPILE_PARTS: the halves' indices, default "1 2"; empty: the whole program only);
#   pick_flags  after compile or compile3 (PICK_FROM, default compile3): the option set whose
#             whole program compiled fastest at no more than 1.1x the default's run time goes into
#             XLA_FLAGS for the parts after it (e.g. PARTS="compile3 pick_flags stream3");
#   dilated   each code2wav's dilated convolutions alone, as written and split into undilated
#             phases, compile and run time side by side, Qwen3-Omni's (1 x 125
#             frames) then Qwen2.5-Omni's (1 x 125 codes), a process each, and whether XLA padded
#             the kernel with zeros (benchmarks/dilated_conv.py); then each whole program under
#             each form (OMNI_JAX_DILATED_CONV=direct|phased), its first compile and its run, a
#             process each (benchmarks/compile_time.py); DILATED_FAMILIES picks the families;
#   pick_dilated  after dilated: the form whose whole program (PICK_FAMILY's, default Qwen3-Omni's)
#             compiled faster at no more than 1.1x the direct form's run time goes into
#             OMNI_JAX_DILATED_CONV for the parts after it (e.g. PARTS="dilated pick_dilated stream3");
#   compile_warm  the whole solve twice, from an empty persistent cache ($XLA_CACHE/compile), then
#             from what the first filled: a cold and a warm start's compile seconds;
#   code2wav  the code2wav suite on `small` (Qwen2.5-Omni-7B's token2wav widths), transformers'
#             token2wav on the same GPU (benchmarks/code2wav_suite.py), JAX's persistent
#             compilation cache in $XLA_CACHE/code2wav (a cold start: it begins empty);
#   c2w_warm  the code2wav suite again, ours only, from the cache the code2wav part filled: the
#             warm start's warm-up time;
#   overlap   the AR suite on `small`, ours only, overlapped steps (the default) and
#             --sequential-steps taking turns, OVERLAP_RUNS times each (issue 18's A/B on a GPU),
#             sharing a persistent cache in $XLA_CACHE/ar: the first run compiles (cold, over
#             100 s on an H200), the others load its programs (about 10 s);
#   profile   the AR suite on `small` with a jax.profiler trace of its measured run (issue 18: on
#             an H200 its steps were the host's, 2.4 to 4.2 ms against 0.4 ms of weight matmuls):
#             benchmarks/trace_summary.py's text summary (host spans, device streams, costliest
#             kernels) and the trace itself (for Perfetto) come back;
#   host      the host's share of a decode step by phase (schedule, pack, sampling, update) at
#             1, 32 and 256 rows, no device work (benchmarks/host_step.py), and penalised as
#             the talker's (400-token ids, 1 / 32 / 128 rows): seconds;
#   stream    Qwen2.5-Omni's streamed speech on `small` (--suite e2e --stream): TTFA, RTF and
#             throughput, streamed against offline, at STREAM_LEVELS clients (issue 22);
#   stream3   Qwen3-Omni's (--suite e2e_qwen3 --stream) on `small`, transformers' generate as the
#             reference (REFERENCE): TTFA against vLLM-omni's published 523 ms at c = 1 (issue 23);
#             cold, its warm-up did not end in 330 s on an H200 (RESULTS.md, fourth to sixth
#             sessions: code2wav's programs compile slowly): give it a whole call, seed it
#             (AUTOTUNE_SEED), or run it again while the machine is warm (its cache then holds
#             what the first run compiled);
#   streams   stream3 (ours only) and stream side by side, cold, each filling a persistent cache of
#             its own (STREAMS_COLD_S each; their measured runs may overlap, so these figures are
#             not clean), then each again alone from its cache (STREAMS_WARM_S each, 0: not run): the
#             clean ones;
#   step_memory  the memory plan's largest AR step against XLA's count of the compiled step, at
#             Qwen2-7B's widths in bfloat16 (STEP_LAYERS layers, default 28), budgets 2048 and 16,
#             the default attention and the jnp path (benchmarks/step_memory.py), then Qwen3-Omni-30B-A3B's
#             thinker decoder (--decoder qwen3-omni, STEP3_LAYERS layers, default 4: its experts' rows,
#             which the plan counts as every expert's on every row where a step runs them dense; on CPU
#             5.3-5.5x XLA's count at two layers); and whether this
#             jaxlib knows --xla_cpu_enable_concurrency_optimized_scheduler (omni_jax/cpu_schedule.py);
#             and the plan's encoder calls (the host CPU's float32 count) against XLA's count of the
#             whole bfloat16 encoder on the GPU, at the released widths (benchmarks/encoder_memory.py);
#   tests     the test suite (or the files TESTS names) with JAX_PLATFORMS=cuda.
# Usage, from the repository root: OUT=/some/dir PARTS="moe tests" bash benchmarks/gpu.sh;
# STREAM_TOKENS the stream parts' step budget (text prompts are short: fewer token-row programs),
# STREAM_ARGS more of benchmarks.run's arguments for them (e.g. "--max-model-len 1024" or
# "--stream-sizes first_chunk_frames=4"),
# MOE_S, SHAPED_S, STEP_MEMORY_S (each of its runs), DILATED_S (each family), COMPILE_S, COMPILE3_S, COMPILE_WARM_S, C2W_S, C2W_WARM_S, OVERLAP_S (each
# run), PROFILE_S, STREAM_S, STREAM3_S, STREAMS_COLD_S, STREAMS_WARM_S and TESTS_S bound the parts
# (seconds), TESTS names test files (default: all), WORKERS pytest-xdist's, C2W_BATCHES the
# code2wav batch sizes, C2W_MODEL its model (small), XLA_CACHE the persistent caches' root, SUITE_MODEL the overlap and stream parts' model (small; tiny for a quick
# check of the script on a CPU), REFERENCE= (empty) leaves transformers out of the shaped, code2wav
# and stream3 parts, STREAM_CACHE a stream part's persistent cache (default $XLA_CACHE/<part>; 0: none).
# Autotuning results outlast the machine: with a persistent cache on, XLA keeps the GPU autotuner's
# results in its xla_gpu_per_fusion_autotune_cache_dir (JAX's default), and a program's first
# compile in a process spends most of its time finding them (RESULTS.md, sixth session). Every
# call leaves autotune.tgz beside its other files, refreshed after each part: the results in all
# its parts' caches, merged (their files are named by what they tune). AUTOTUNE_SEED=file.tgz,
# such a file from an earlier call (carried), fills the caches of the code2wav, overlap, profile
# and stream parts with them before they run, so that their warm-ups tune only what is new;
# compile, compile3 and compile_warm measure first compiles and are never seeded.
set -u
OUT=${OUT:-/tmp/omni_jax_gpu}
PARTS=${PARTS:-moe shaped compile compile_warm code2wav tests}
XLA_CACHE=${XLA_CACHE:-/tmp/omni_jax_xla_cache}
mkdir -p "$OUT"
# JAX and torch share the GPU in the suites that run both: neither may take it all up front.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD \
  XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  date -u
  echo "XLA_FLAGS=${XLA_FLAGS:-}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, jax, flax, transformers, torch; print(sys.version.split()[0], jax.__version__, \
jax.devices(), flax.__version__, transformers.__version__, torch.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || echo "editable install failed (PYTHONPATH still holds the tree): see install.log"

seed_cache() {  # a persistent cache's root: AUTOTUNE_SEED's autotuning results put in it
  [ -n "${AUTOTUNE_SEED:-}" ] && [ "$1" != 0 ] || return 0
  mkdir -p "$1/xla_gpu_per_fusion_autotune_cache_dir" \
    && tar xzf "$AUTOTUNE_SEED" -C "$1/xla_gpu_per_fusion_autotune_cache_dir" \
    && echo "seeded $1 with $(tar tzf "$AUTOTUNE_SEED" | grep -vc /$) autotuning results from $AUTOTUNE_SEED"
}

moe() {
  echo "== MoE formulations (limit ${MOE_S:-150}s)"
  timeout -s INT "${MOE_S:-150}" python3 -m benchmarks.moe_lowering --tokens 1,2,4,8,16,32,128 --json "$OUT/moe.json" >"$OUT/moe.log" 2>&1
  echo "moe exit $?"
  grep -E "^N=|cannot run" "$OUT/moe.log"
}

shaped() {
  echo "== shaped suite (limit ${SHAPED_S:-300}s)"
  timeout -s INT "${SHAPED_S:-300}" python3 -m benchmarks.shaped_suite ${REFERENCE---reference} \
    --json "$OUT/shaped.json" --batches "${BATCHES:-1,64,8,256}" --prefill "${PREFILL:-512,2048,8192}" \
    >"$OUT/shaped.log" 2>&1
  echo "shaped suite exit $?"
  grep -E "^(ours|transformers)" "$OUT/shaped.log"
  tail -5 "$OUT/shaped.log"
}

compile_options() {  # name (compile, compile3), then compile_time's arguments: one process each
  local name=$1 i=0 opts
  shift
  echo "== $name: $*, one process an option set, then each part alone (limit ${COMPILE_S:-90}s each)"
  : >"$OUT/$name.log"
  for set in ${COMPILE_OPTIONS:-- xla_gpu_experimental_enable_fusion_autotuner=False xla_gpu_autotune_level=0 \
    xla_gpu_memory_limit_slop_factor=1000}; do
    opts=$([ "$set" = - ] || echo "$set" | tr , '\n' | sed 's/^/--option /')
    (echo "-- whole, options: $set"; timeout -s INT "${COMPILE_S:-90}" python3 -m benchmarks.compile_time "$@" \
      --programs 0 --runs 3 $opts --json "$OUT/$name/$i.json") >>"$OUT/$name.log" 2>&1
    i=$((i + 1))
  done
  for part in ${COMPILE_PARTS-1 2}; do
    (echo "-- part $part alone"; timeout -s INT "${COMPILE_S:-90}" python3 -m benchmarks.compile_time "$@" \
      --programs $part --json "$OUT/$name/part$part.json") >>"$OUT/$name.log" 2>&1
  done
  grep -E "^--|lower_s|run" "$OUT/$name.log"
}

dilated() {
  echo "== dilated convolutions, direct against phased (limit ${DILATED_S:-150}s each)"
  : >"$OUT/dilated.log"
  for family in ${DILATED_FAMILIES:-qwen3_omni qwen2_5_omni}; do
    timeout -s INT "${DILATED_S:-150}" python3 -m benchmarks.dilated_conv --family "$family" \
      --json "$OUT/dilated_$family.json" >>"$OUT/dilated.log" 2>&1
    echo "$family: exit $?" >>"$OUT/dilated.log"
    for form in direct phased; do
      (echo "-- $family whole program, $form"; OMNI_JAX_DILATED_CONV=$form timeout -s INT "${DILATED_S:-150}" \
        python3 -m benchmarks.compile_time --family "$family" --codes 125 --programs 0 --runs 3 \
        --json "$OUT/dilated_${family}_$form.json") >>"$OUT/dilated.log" 2>&1
    done
  done
  grep -E "^(qwen|all:|input .*padded kernel True|-- |whole)" "$OUT/dilated.log"
}

compile() {
  mkdir -p "$OUT/compile"
  compile_options compile --codes 32
}

compile3() {
  mkdir -p "$OUT/compile3"
  compile_options compile3 --family qwen3_omni --codes 125
}

fastest_fit() {
  # Of compile_time.py JSON files (the first the default), the one whose program compiled fastest
  # at no more than 1.1x the default's run time (none printed: no run to compare).
  python3 - "$@" <<'PY'
import json, pathlib, sys
runs = [(f, json.loads(pathlib.Path(f).read_text())) for f in sys.argv[1:] if pathlib.Path(f).is_file()]
runs = [(r["rows"][0]["compile_s"], r["solve_s"], f) for f, r in runs if r["rows"] and r["solve_s"]]
base = next((s for _, s, f in runs if f == sys.argv[1]), None)
fit = [(c, f) for c, s, f in runs if base is not None and s <= 1.1 * base]
print(min(fit)[1] if fit else "")
PY
}

pick_flags() {
  # The option set of the last compile part that compiled the whole program fastest, at no more
  # than 1.1x the default's run time, into XLA_FLAGS for every part after it (none: unchanged).
  local best
  best=$(fastest_fit $(ls "$OUT/${PICK_FROM:-compile3}"/[0-9]*.json 2>/dev/null | sort -V))
  [ -n "$best" ] && best=$(python3 -c "import json, sys; print(' '.join(f'--{k}={v}' for k, v in \
json.load(open(sys.argv[1]))['options'].items()))" "$best")
  export XLA_FLAGS="${XLA_FLAGS:-} $best"
  echo "== pick_flags: XLA_FLAGS=$XLA_FLAGS"
}

pick_dilated() {
  # After dilated: the form of dilated convolution whose whole program (PICK_FAMILY's, default
  # Qwen3-Omni's) compiled faster at no more than 1.1x the direct form's run time, into
  # OMNI_JAX_DILATED_CONV for every part after it (direct when neither ran).
  local family=${PICK_FAMILY:-qwen3_omni} best
  best=$(fastest_fit "$OUT/dilated_${family}_direct.json" "$OUT/dilated_${family}_phased.json")
  export OMNI_JAX_DILATED_CONV=$([ "$best" = "$OUT/dilated_${family}_phased.json" ] && echo phased || echo direct)
  echo "== pick_dilated: OMNI_JAX_DILATED_CONV=$OMNI_JAX_DILATED_CONV"
}

compile_warm() {
  echo "== code2wav compile time, cold then warm from $XLA_CACHE/compile (limit ${COMPILE_WARM_S:-120}s each)"
  rm -rf "$XLA_CACHE/compile"
  for start in cold warm; do
    timeout -s INT "${COMPILE_WARM_S:-120}" python3 -m benchmarks.compile_time --codes 32 --programs 0 \
      --cache-dir "$XLA_CACHE/compile" --json "$OUT/compile_$start.json" >"$OUT/compile_$start.log" 2>&1
    echo "compile time ($start) exit $?"
    grep -E "lower_s" "$OUT/compile_$start.log"
  done
}

c2w_suite() {  # name, limit, reference flag
  seed_cache "$XLA_CACHE/code2wav"
  OMNI_JAX_COMPILATION_CACHE=$XLA_CACHE/code2wav timeout -s INT "$2" python3 -m benchmarks.run --suite code2wav \
    --model "${C2W_MODEL:-small}" $3 --batch-sizes "${C2W_BATCHES:-1,8}" --cache-dir /tmp/omni_jax_bench \
    --json "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  echo "$1 exit $?"
  grep -v -E "it/s\]|s/it\]|programs compiled\]" "$OUT/$1.log" | tail -30
}

code2wav() {
  echo "== code2wav suite, cold start (limit ${C2W_S:-300}s)"
  rm -rf "$XLA_CACHE/code2wav"  # its own: the other parts' caches (and autotuning results) stay
  c2w_suite c2w "${C2W_S:-300}" "${REFERENCE---reference}"
}

c2w_warm() {
  echo "== code2wav suite, warm start from $XLA_CACHE/code2wav, ours only (limit ${C2W_WARM_S:-150}s)"
  c2w_suite c2w_warm "${C2W_WARM_S:-150}" ""
}

overlap() {
  seed_cache "$XLA_CACHE/ar"
  for i in $(seq "${OVERLAP_RUNS:-2}"); do
    for mode in overlapped sequential; do
      flag=$([ "$mode" = sequential ] && echo --sequential-steps)
      echo "== AR suite, ${SUITE_MODEL:-small}, $mode, run $i (limit ${OVERLAP_S:-180}s)"
      OMNI_JAX_COMPILATION_CACHE=$XLA_CACHE/ar timeout -s INT "${OVERLAP_S:-180}" python3 -m benchmarks.run --suite ar --model "${SUITE_MODEL:-small}" $flag \
        --cache-dir /tmp/omni_jax_bench --json "$OUT/ar_${mode}_$i.json" >"$OUT/ar_${mode}_$i.log" 2>&1
      echo "ar $mode $i exit $?"
      grep -E "^omni_jax|^TTFT" "$OUT/ar_${mode}_$i.log"
    done
  done
}

profile() {
  echo "== AR suite, ${SUITE_MODEL:-small}, profiled (limit ${PROFILE_S:-240}s)"
  rm -rf "$XLA_CACHE/profile"
  seed_cache "$XLA_CACHE/ar"
  OMNI_JAX_COMPILATION_CACHE=$XLA_CACHE/ar timeout -s INT "${PROFILE_S:-240}" python3 -m benchmarks.run --suite ar \
    --model "${SUITE_MODEL:-small}" --profile "$XLA_CACHE/profile" --cache-dir /tmp/omni_jax_bench \
    --json "$OUT/ar_profiled.json" >"$OUT/ar_profiled.log" 2>&1
  echo "profiled ar exit $?"
  python3 -m benchmarks.trace_summary "$XLA_CACHE/profile" --top 15 >"$OUT/ar_trace.txt" 2>&1
  head -60 "$OUT/ar_trace.txt"
  find "$XLA_CACHE/profile" -name "*.trace.json.gz" -exec cp {} "$OUT/ar_trace.json.gz" \;
}

host() {
  echo "== host phases of a decode step"
  timeout -s INT 120 python3 -m benchmarks.host_step --json "$OUT/host_step.json" >"$OUT/host_step.log" 2>&1
  echo "host step exit $?"
  tail -5 "$OUT/host_step.log"
  # The talker's form: a repetition penalty, whose ids the device keeps (the id table).
  timeout -s INT 120 python3 -m benchmarks.host_step --prompt 400 --rows 1,32,128 --penalty 1.05 \
    --json "$OUT/host_step_penalty.json" >"$OUT/host_step_penalty.log" 2>&1
  echo "host step (penalised) exit $?"
  tail -5 "$OUT/host_step_penalty.log"
}

stream_suite() {  # name (stream, stream3), limit, then the suite's own arguments
  local name=$1 limit=$2 cache=${STREAM_CACHE:-$XLA_CACHE/$1}
  shift 2
  echo "== ${TAG:-}$name: $* --stream, ${SUITE_MODEL:-small} (limit ${limit}s, persistent cache: $cache)"
  seed_cache "$cache"
  OMNI_JAX_COMPILATION_CACHE=$cache timeout -k 30 -s INT "$limit" python3 -m benchmarks.run "$@" --stream \
    --model "${SUITE_MODEL:-small}" --concurrency "${STREAM_LEVELS:-1,4,16}" --repeats 1 \
    --max-num-batched-tokens "${STREAM_TOKENS:-256}" ${STREAM_ARGS:-} --cache-dir /tmp/omni_jax_bench \
    --json "$OUT/${TAG:-}$name.json" >"$OUT/${TAG:-}$name.log" 2>&1
  echo "${TAG:-}$name exit $?"
  grep -v -E "it/s\]|s/it\]|programs compiled|^\[transformers\]" "$OUT/${TAG:-}$name.log" | tail -25
}

stream() { stream_suite stream "${STREAM_S:-420}" --suite e2e; }

stream3() {
  stream_suite stream3 "${STREAM3_S:-420}" --suite e2e_qwen3 ${REFERENCE---reference} --requests-per-client 1
}

streams() {
  echo "== stream3 and stream side by side, cold, filling persistent caches; then each alone from its cache"
  TAG=cold_ STREAM_CACHE=$XLA_CACHE/stream3 STREAM3_S=${STREAMS_COLD_S:-330} REFERENCE= stream3 &
  TAG=cold_ STREAM_CACHE=$XLA_CACHE/stream STREAM_S=${STREAMS_COLD_S:-330} stream &
  wait
  [ "${STREAMS_WARM_S:-150}" = 0 ] && return
  TAG=warm_ STREAM_CACHE=$XLA_CACHE/stream3 STREAM3_S=${STREAMS_WARM_S:-150} REFERENCE= stream3
  TAG=warm_ STREAM_CACHE=$XLA_CACHE/stream STREAM_S=${STREAMS_WARM_S:-150} stream
}

tests() {
  echo "== tests on the GPU (limit ${TESTS_S:-200}s)"
  JAX_PLATFORMS=cuda timeout -s INT "${TESTS_S:-200}" \
    python3 -m pytest ${TESTS:-tests} -q -n "${WORKERS:-8}" -p no:cacheprovider --junitxml="$OUT/junit.xml" \
    -rfE --durations=20 >"$OUT/tests.log" 2>&1
  echo "tests exit $?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
}

step_memory() {
  echo "== step_memory: Qwen2-7B widths, ${STEP_LAYERS:-28} layers, bfloat16 (limit ${STEP_MEMORY_S:-120}s each)"
  : >"$OUT/step_memory.log"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_enable_concurrency_optimized_scheduler=false" python3 -c "import jax; jax.devices()" \
    >>"$OUT/step_memory.log" 2>&1
  echo "XLA_FLAGS with the CPU scheduler flag: exit $?" | tee -a "$OUT/step_memory.log"
  for budget in 2048 16; do
    for backend in auto jnp; do
      timeout -s INT "${STEP_MEMORY_S:-120}" python3 -m benchmarks.step_memory --dtype bfloat16 \
        --layers "${STEP_LAYERS:-28}" --budget "$budget" --backend "$backend" >>"$OUT/step_memory.log" 2>&1
      echo "budget $budget, $backend: exit $?" >>"$OUT/step_memory.log"
    done
    timeout -s INT "${STEP_MEMORY_S:-120}" python3 -m benchmarks.step_memory --decoder qwen3-omni \
      --dtype bfloat16 --layers "${STEP3_LAYERS:-4}" --budget "$budget" >>"$OUT/step_memory.log" 2>&1
    echo "qwen3-omni, budget $budget: exit $?" >>"$OUT/step_memory.log"
  done
  for model in qwen2_5_omni qwen3_omni; do
    for encoder in audio vision; do
      timeout -s INT "${STEP_MEMORY_S:-120}" python3 -m benchmarks.encoder_memory --model "$model" \
        --encoder "$encoder" --dtype bfloat16 >>"$OUT/step_memory.log" 2>&1
      echo "$model $encoder: exit $?" >>"$OUT/step_memory.log"
    done
  done
  grep -E "^Qwen[23]|^qwen|exit" "$OUT/step_memory.log"
}

save_autotune() {
  # The autotuning results in every part's cache, merged, into $OUT/autotune.tgz: after each part,
  # so that a call cut by its limit still brings back what its finished parts tuned.
  rm -rf /tmp/omni_jax_autotune && mkdir -p /tmp/omni_jax_autotune
  find "$XLA_CACHE" -type d -name xla_gpu_per_fusion_autotune_cache_dir -exec cp -r {}/. /tmp/omni_jax_autotune \; \
    2>/dev/null
  if [ -n "$(ls -A /tmp/omni_jax_autotune)" ]; then
    tar czf "$OUT/autotune.tgz" -C /tmp/omni_jax_autotune .
    echo "autotune.tgz: $(ls /tmp/omni_jax_autotune | wc -l) autotuning results, $(du -h "$OUT/autotune.tgz" | cut -f1)"
  fi
}

for part in $PARTS; do
  "$part"
  save_autotune
done
# The device returns at most 8 files: PACK=1 leaves two, all.tgz holding the rest and autotune.tgz.
if [ "${PACK:-0}" = 1 ]; then
  mv "$OUT/autotune.tgz" /tmp/omni_jax_autotune.tgz 2>/dev/null
  tar czf /tmp/omni_jax_gpu_all.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/omni_jax_gpu_all.tgz "$OUT/all.tgz"
  mv /tmp/omni_jax_autotune.tgz "$OUT/autotune.tgz" 2>/dev/null
fi
