#!/usr/bin/env bash
# Serving-speed runs of issue 19 on the H200 (runs ON the device machine, after the vLLM bundle and the
# SmolLM2 parts are unpacked and converted: see the header of scripts/device_check.sh). The HF-backend jobs
# (ablate23, tests21 hf) need only the SmolLM2 parts, whose last one carries the gguf wheel.
#   bash scripts/device_serving.sh profile   # step timelines (scripts/vllm_profile.py), one process per engine
#   bash scripts/device_serving.sh serve     # vllm bench serve against vegas serve (scripts/serve_bench.py)
#   bash scripts/device_serving.sh greedy    # greedy Vegas (V2 runner) against plain vLLM (tests/gpu/test_vllm_v2.py)
#   bash scripts/device_serving.sh offline   # vegas bench --backend vllm: plain vs collect2, closed and open batches
#   bash scripts/device_serving.sh bg-start "JOB1" ["JOB2" ...]  # any of these subcommands (with arguments, and
#                                            # VAR=value prefixes) one after another, detached: outlives the call
#   bash scripts/device_serving.sh bg-wait [SECONDS]   # wait for them (default 540 s); each call brings back what
#                                            # is done so far ($OUT/bg.tgz: every job's $OUT and the log; keep
#                                            # large files such as torch-profiler traces out of a queued job)
#   bash scripts/device_serving.sh tests21 [NAMES]  # issue 21's GPU tests, one after another, each with its own
#                                            # time limit (seeds seeds-invariant seeds-v2 plugin softcap serve invariant
#                                            # invariant-smollm2 faults; default all; also probe: scripts/invariance_probe.py,
#                                            # and hf: the HF backend on CUDA, tests/gpu/test_hf_cuda.py)
#   bash scripts/device_serving.sh cute-tests [NAMES]  # issue 22: tests/gpu/test_cute_probe_cuda.py (kernel engine)
#   bash scripts/device_serving.sh cute      # issue 22: the CuTe-DSL attention (+ score writer) against FA3 and
#                                            # FA3 + the separate score pass (scripts/cute_decode_bench.py); needs
#                                            # the .device/cute parts unpacked after the vLLM bundle
# A serve run starts its servers one after another (~2 min each; --start-together with --kv-cache-gib starts
# them side by side, faster, but plain measured 0.77x as fast that way on 2026-12-04: not for figures), then
# the runs. Longer than one 10-minute device call:
# bg-start "SERVE_S=1500 SERVE_ARGS='...' serve", then bg-wait in calls made back to back (each brings
# back serve/raw/ so far: scripts/serve_bench.py --report on it makes the table).
# GREEDY_K selects tests of the greedy run (pytest -k), e.g. GREEDY_K="not sampling".
# PROFILE_METHODS (default "plain vegas"; also vegas-v1, vegas-v2), PROFILE_ARGS, SERVE_ARGS adjust the runs; logs and JSON land in $OUT.
set -u
SELF=$(realpath "$0")  # this script, wherever it was called from (the detached runs call it again)
cd "$(dirname "$SELF")/.."
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the cutlass-dsl wheel (.device/cute parts) keeps its packages in python_packages/, named by a .pth that a
# pip --target directory does not read
CUTLASS_PY=/tmp/site/nvidia_cutlass_dsl/python_packages
[ -d "$CUTLASS_PY" ] && export PYTHONPATH=$PYTHONPATH:$CUTLASS_PY
# the gguf wheel from the SmolLM2 parts (scripts/unpack_smollm2_part.sh): all the HF-backend jobs (ablate23,
# tests21 hf) need beyond the image, so they run without the vLLM bundle; after /tmp/site, whose copy wins
[ -d /tmp/site-gguf ] && export PYTHONPATH=$PYTHONPATH:/tmp/site-gguf
OUT=${OUT:-/tmp/vegas_out}; mkdir -p "$OUT"
MODEL=${SMOLLM2_HF:-/tmp/smollm2-hf}
# vegas is on PYTHONPATH, not installed: its vllm.general_plugins entry point, for vllm serve's processes
EP=/tmp/site/vegas_device_entry_points-0.0.dist-info
if [ -d /tmp/site ] && [ ! -d "$EP" ]; then
  mkdir -p "$EP"
  printf 'Metadata-Version: 2.1\nName: vegas-device-entry-points\nVersion: 0.0\n' > "$EP/METADATA"
  printf '[vllm.general_plugins]\nvegas = vegas.vllm_plugin:register\n' > "$EP/entry_points.txt"
fi
case ${1:-} in
  profile)
    for m in ${PROFILE_METHODS:-plain vegas}; do  # one process per engine (vLLM's graph pools)
      d="$OUT/${PROFILE_TAG:-}$m"  # PROFILE_TAG keeps two profile runs of one $OUT apart
      mkdir -p "$d"
      timeout ${PROFILE_S:-240} python3 scripts/vllm_profile.py --model "$MODEL" --methods "$m" \
        --out "$d" ${PROFILE_ARGS:-} 2>&1 | grep -v "it/s\]" > "$d/profile.log"
      grep -E "^\[|^    |Error" "$d/profile.log" | grep -v "rank0\]: \[rank0\]:   " | head -30
    done
    ;;
  serve)
    timeout ${SERVE_S:-560} python3 scripts/serve_bench.py --model "$MODEL" --out "$OUT/serve" \
      ${SERVE_ARGS:---methods plain,collect2 --rates 16,inf --repeats 3 --max-model-len 8192} 2>&1 \
      | tee "$OUT/serve_run.log" | tail -40  # the whole log stays (server starts, each run's rc)
    ;;
  bg-start)  # e.g. bg-start "tests21 faults" "PROFILE_ARGS='--workloads paced' profile": results under /tmp/vegas_bg
    shift
    if [ -f /tmp/vegas_bg/pid ] && kill -0 "$(cat /tmp/vegas_bg/pid)" 2>/dev/null; then
      echo "bg-start: a queue is still running (/tmp/vegas_bg/bg.log); bg-wait for it first" >&2; exit 2
    fi
    rm -rf /tmp/vegas_bg; mkdir -p /tmp/vegas_bg/out
    printf '%s\n' "$@" > /tmp/vegas_bg/jobs.txt
    (OUT=/tmp/vegas_bg/out setsid nohup bash "$SELF" bg-run > /tmp/vegas_bg/bg.log 2>&1 < /dev/null & echo $! > /tmp/vegas_bg/pid)
    echo "background jobs started ($#): /tmp/vegas_bg/bg.log"
    ;;
  bg-run)  # (bg-start's detached part) each line of /tmp/vegas_bg/jobs.txt: VAR=value prefixes, then a subcommand
    while IFS= read -r -u 3 job; do
      echo "[bg] $(date +%T) start: $job"
      ( eval "set -- $job"
        while [ $# -gt 0 ] && [[ $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; do export "$1"; shift; done
        bash "$SELF" "$@" ); rc=$?
      echo "[bg] $(date +%T) end (rc $rc): $job"
    done 3< /tmp/vegas_bg/jobs.txt
    touch /tmp/vegas_bg/done
    ;;
  bg-wait)
    [ -f /tmp/vegas_bg/jobs.txt ] || { echo "bg-wait: no queue on this machine (a fresh one? bg-start first)" >&2; exit 2; }
    end=$(( $(date +%s) + ${2:-540} ))
    while [ ! -f /tmp/vegas_bg/done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    grep "^\[" /tmp/vegas_bg/bg.log | tail -30
    tar -C /tmp/vegas_bg -czf "$OUT/bg.tgz" out bg.log jobs.txt
    if [ -f /tmp/vegas_bg/done ]; then echo "all jobs done: \$OUT/bg.tgz"
    else echo "still running; call bg-wait again (\$OUT/bg.tgz holds what is done so far)"; fi
    ;;
  offline)  # issue 19's offline rows: SmolLM2 7,680 tokens, plain vs collect2, closed then open (3 x batch
             # requests through batch slots), 3 repeats; OFFLINE_BATCHES (default "128 32"); the engine logs
             # (vLLM's "GPU KV cache size") give each KV pool: $OUT/bench_b<batch>_open<k>.log;
             # OFFLINE_OPEN (default "0 3": closed, then open) picks the rows
    for b in ${OFFLINE_BATCHES:-128 32}; do
      for k in ${OFFLINE_OPEN:-0 3}; do
        t0=$(date +%s)
        timeout ${OFFLINE_S:-290} python3 -c "from vegas.cli import main; main()" bench --backend vllm --model "$MODEL" \
          --selectors collect2 --context 7680 --batch-size $b --new-tokens 256 --top-p 1 --repeats 3 --open $k \
          --check-tokens 16 --json "$OUT/bench_b${b}_open$k.json" 2>&1 | grep -v "it/s\]" > "$OUT/bench_b${b}_open$k.log"
        echo "[batch $b open $k] $(( $(date +%s) - t0 )) s"
        grep -E "^\||KV cache size|Error" "$OUT/bench_b${b}_open$k.log" | tail -12
      done
    done
    ;;
  cute)  # CUTE_CASES="smollm2" or "qwen3" runs one half (each can take most of a call); CUTE_ARGS adds
         # flags, e.g. CUTE_ARGS=--no-scores to leave out the per-element score_mod writer measured 2026-12-02
    case " ${CUTE_CASES:-smollm2 qwen3} " in *" smollm2 "*)
      timeout ${CUTE_S:-330} python3 scripts/cute_decode_bench.py --case smollm2 --ctx 7680 --batch 32 --batch 128 \
        --qlen 5 --splits --reps 3 ${CUTE_ARGS:-} --json "$OUT/cute_smollm2.json" 2>&1 | grep -v "it/s\]" \
        | tee -a "$OUT/cute_bench.log" | tail -40 ;;
    esac
    case " ${CUTE_CASES:-smollm2 qwen3} " in *" qwen3 "*)
      timeout ${CUTE_QWEN_S:-300} python3 scripts/cute_decode_bench.py --case qwen3-8b --ctx 32768 --ctx 131072 --batch 1 --batch 4 \
        --qlen 5 --splits --reps 3 ${CUTE_ARGS:-} --json "$OUT/cute_qwen3.json" 2>&1 | grep -v "it/s\]" \
        | tee -a "$OUT/cute_bench.log" | tail -30 ;;
    esac
    ;;
  ablate23)  # issue 23 studies 1-4 on the HF backend (CUDA, float32, SmolLM2 from its GGUF as smollm2-135m
             # loads it), resumable: the points live in $OUT/ablate, seeded from the checkout's copy in
             # ABLATE_DIR (default benchmarks/results/ablate_h200_smollm2), so that every bg-wait brings them back
             # (copy out/ablate/ over ABLATE_DIR); ABLATE_CONTEXTS (default 4096,8000; then 16000,32000),
             # ABLATE_BATCH (default 32: at 8 rows the HF decode was host-bound, ~20-40 s a point on
             # 2026-12-04; more rows per forward, fewer forwards), ABLATE_BUDGET seconds, ABLATE_ARGS (more vegas ablate options, e.g. --studies budget)
    R=${ABLATE_DIR:-benchmarks/results/ablate_h200_smollm2}; mkdir -p "$OUT/ablate"; [ -d "$R" ] && cp -rn "$R"/. "$OUT/ablate"/
    GGUF=$(ls /tmp/smollm2/*.gguf 2>/dev/null | head -1)
    [ -n "$GGUF" ] || { echo "ablate23: no /tmp/smollm2/*.gguf (carry .device/smollm2 first)" >&2; exit 2; }
    t0=$(date +%s)
    # the 32K oracle point ran out of memory on 2026-12-04 with 31 GiB reserved but unallocated (the reused
    # prefix and the growing cache are two copies): expandable segments keep the allocator from fragmenting
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
    timeout $(( ${ABLATE_BUDGET:-780} + 240 )) python3 -c "from vegas.cli import main; main()" ablate --model "$GGUF" \
      --device cuda --dtype float32 --batch-size ${ABLATE_BATCH:-32} --yarn-factor 4 --contexts ${ABLATE_CONTEXTS:-4096,8000} \
      --time-budget ${ABLATE_BUDGET:-780} --out "$OUT/ablate" ${ABLATE_ARGS:-} > "$OUT/ablate.log" 2>&1; rc=$?
    echo "[ablate23] rc=$rc $(( $(date +%s) - t0 )) s"; tr '\r' '\n' < "$OUT/ablate.log" | grep -v 'it/s\]\|s/it\]\|^ *$' | tail -12
    exit $rc  # bg-run's "end (rc N)" line then says how vegas ablate ended
    ;;
  tune23)  # issue 23 item 5: vegas tune for collect2 on the vLLM backend, SmolLM2 7,680 tokens, with plain vLLM
           # in the same run; resumable like ablate23 ($OUT/tune, seeded from benchmarks/results/tune_h200_smollm2_vllm).
           # vLLM builds an engine per point (~50 s: its full CUDA graphs hold the selection), so the grids are
           # shorter than tune's defaults: TUNE_SPARSITIES (default 5 sparsities), TUNE_GAMMAS (default 2,4,6),
           # 1 fine step each side (13 points with plain: ~15 min)
    R=benchmarks/results/tune_h200_smollm2_vllm; mkdir -p "$OUT/tune"; [ -d "$R" ] && cp -rn "$R"/. "$OUT/tune"/
    t0=$(date +%s)
    VLLM_WORKER_MULTIPROC_METHOD=spawn timeout $(( ${TUNE_BUDGET:-600} + 240 )) python3 -c "from vegas.cli import main; main()" tune --backend vllm \
      --model "$MODEL" --selectors collect2 --context 7680 --dtype bfloat16 --time-budget ${TUNE_BUDGET:-600} \
      --sparsities ${TUNE_SPARSITIES:-0.01,0.02,0.05,0.1,0.2} --gammas ${TUNE_GAMMAS:-2,4,6} --fine-steps 1 \
      --out "$OUT/tune" > "$OUT/tune.log" 2>&1; rc=$?
    echo "[tune23] rc=$rc $(( $(date +%s) - t0 )) s"; grep -v "it/s\]" "$OUT/tune.log" | grep -v "^(EngineCore\|^INFO\|^WARNING" | tail -16
    exit $rc
    ;;
  cute-e2e)  # issue 22 end to end: vegas bench, SmolLM2 7,680 tokens, batch CUTE_BATCH (128), collect2 with
             # today's score path, then with vllm.score_path="cute" (each run has its own plain rows)
    for tag in auto cute; do
      opt='{}'; [ $tag = cute ] && opt='{"score_path": "cute"}'
      t0=$(date +%s)
      timeout ${CUTE_E2E_S:-290} python3 -c "from vegas.cli import main; main()" bench --backend vllm --model "$MODEL" \
        --selectors collect2 --context 7680 --batch-size ${CUTE_BATCH:-128} --new-tokens 256 --top-p 1 --repeats 3 \
        --vllm-options "$opt" --json "$OUT/e2e_$tag.json" 2>&1 | grep -v "it/s\]" > "$OUT/e2e_$tag.log"
      echo "[e2e $tag] $(( $(date +%s) - t0 )) s"
      grep -E "^\||score_path|CuTe|Error" "$OUT/e2e_$tag.log" | tail -14
    done
    ;;
  cute-tests)  # issue 22: the CuTe probe path's GPU tests (kernel, then engine; the .device/cute parts
               # installed after the vLLM bundle); logs: $OUT/cute_<name>.log, the summary line of each
    for t in ${2:-kernel engine}; do
      case $t in
        kernel) k="not vllm"; lim=300 ;;
        engine) k="vllm"; lim=${CUTE_ENGINE_S:-580} ;;
        *) echo "cute-tests: unknown test group $t (kernel engine)" >&2; exit 2 ;;
      esac
      t0=$(date +%s)
      VLLM_WORKER_MULTIPROC_METHOD=spawn timeout $lim python3 -m pytest -q -rs -p no:cacheprovider \
        tests/gpu/test_cute_probe_cuda.py -k "$k" > "$OUT/cute_$t.log" 2>&1; rc=$?
      echo "[$t] rc=$rc $(( $(date +%s) - t0 )) s: $(grep -E "passed|failed|error|skipped" "$OUT/cute_$t.log" | tail -1)"
    done
    ;;
  tests21)  # logs: $OUT/t21_<name>.log; the summary line of each
    v1="env VLLM_USE_V2_MODEL_RUNNER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn"
    for t in ${2:-seeds seeds-invariant seeds-v2 plugin softcap serve invariant invariant-smollm2 faults}; do
      case $t in
        seeds) cmd="$v1 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_seeds_cuda.py"; lim=280 ;;
        # the same under vLLM's batch-invariant kernels: passes -> the V1 failure is batch numerics reaching
        # the drafts (selection scores -> top-k -> draft probabilities); fails -> a seed/row bookkeeping bug
        seeds-invariant) cmd="$v1 VLLM_BATCH_INVARIANT=1 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_seeds_cuda.py"; lim=280 ;;
        # V2 runner, vllm.seeded_verification="coupled": seeded output independent of the neighbours (and of the drafts)
        seeds-v2) cmd="python3 -m pytest -s -q -rs -p no:cacheprovider tests/gpu/test_vllm_seeds_v2_cuda.py"; lim=300 ;;
        plugin) cmd="$v1 PYTHONPATH=$PYTHONPATH:$PWD/plugins/vegas-h2o python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_backend_cuda.py -k plugin"; lim=300 ;;
        softcap) cmd="$v1 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_backend_cuda.py -k soft_capped"; lim=420 ;;
        serve) cmd="python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_serve_cuda.py"; lim=480 ;;
        # one engine a minute: the embedded model's five engines, then SmolLM2's (its checkpoint converted);
        # -s: each case's verdict is in the log as soon as it is known
        invariant) cmd="python3 -m pytest -s -q -rs -p no:cacheprovider tests/gpu/test_vllm_batch_invariant.py -k tiny"; lim=480 ;;
        invariant-smollm2) cmd="python3 -m pytest -s -q -rs -p no:cacheprovider tests/gpu/test_vllm_batch_invariant.py -k smollm2"; lim=480 ;;
        # where a verification row's arithmetic differs from a decode step's (FA3 by query length, matmul by rows, decode vs prefill)
        probe) cmd="python3 scripts/invariance_probe.py --model $MODEL --json $OUT/invariance_probe.json"; lim=300 ;;
        faults) cmd="python3 -m pytest -s -q -rs -p no:cacheprovider tests/gpu/test_vllm_serving_faults.py"; lim=560 ;;  # nine engines, ~45 s each (8 started in 360 s, 2026-12-03)
        # the HF backend on CUDA (greedy Vegas = plain greedy, float32 and bf16; the selection timed by CUDA events)
        hf) cmd="python3 -m pytest -s -q -rs -p no:cacheprovider tests/gpu/test_hf_cuda.py"; lim=240 ;;
        *) echo "tests21: unknown test group $t (seeds seeds-invariant seeds-v2 plugin softcap serve invariant invariant-smollm2 probe faults hf)" >&2; exit 2 ;;
      esac
      t0=$(date +%s)
      timeout $lim $cmd > "$OUT/t21_$t.log" 2>&1; rc=$?
      echo "[$t] rc=$rc $(( $(date +%s) - t0 )) s: $(grep -E "passed|failed|error|skipped" "$OUT/t21_$t.log" | tail -1)"
    done
    ;;
  greedy)
    timeout ${GREEDY_S:-300} python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_v2.py \
      ${GREEDY_K:+-k "$GREEDY_K"} 2>&1 | tail -15
    ;;
  *) echo "usage: device_serving.sh profile|serve|greedy|offline|cute|cute-tests [NAMES]|cute-e2e|ablate23|tune23|tests21 [NAMES]|bg-start JOB...|bg-wait [SECONDS]" >&2; exit 2 ;;
esac
