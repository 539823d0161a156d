#!/usr/bin/env bash
# One device call: kernel-vs-reference tests, CUDA tests of the whole suite, then the vLLM
# benchmark (greedy exactness + throughput table). Keeps going after a failure; logs in $OUT.
#
# Before it, in back-to-back device calls (the machine stays warm ~30 s), unpack the vLLM bundle
# built here by `bash ../shared/device/make_vllm_bundle.sh .device/vllm`:
#   run(command="bash .device/vllm/pN/unpack.sh", carry=[".device/vllm/pN"])   for N = 0..6
# then:
#   run(command="bash scripts/device_check.sh")            (BENCH_ARGS / BENCH_S / PHASES to adjust)
# Tensor parallelism (kind nvidia-h200-x2; NVLink multicast stays off, NCCL_NVLS_ENABLE=0):
#   KTEST_S=480 PHASES="env kernels bench" BENCH_ARGS="--tp 2 --tp-selection all_reduce,per_rank ..." \
#     bash scripts/device_check.sh
# A subset of the GPU tests: KTEST_ARGS="-k 'async or smoke'" (passed to pytest).
# The dummy Qwen3-8B latency table (plain step vs sparse draft step, verify step, selection):
#   PHASES=bench BENCH_S=250 BENCH_ARGS="--methods= --exact-prompts 0 --batches 4 --contexts 8192 \
#     --latency-8b --latency-contexts 32768,131072 --latency-batches 1,4" bash scripts/device_check.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export VLLM_ALLOW_INSECURE_SERIALIZATION=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
OUT=${OUT:-/tmp/vegas_out}; mkdir -p "$OUT"
PHASES=${PHASES:-"env kernels cuda bench"}
BENCH_S=${BENCH_S:-420}
BENCH_ARGS=${BENCH_ARGS:-"--methods vegas,plain,ngram --contexts 16384,8192 --batches 1,8,32,128 --new-tokens 128"}
T0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

if [ ! -d /tmp/site/vllm ]; then say "vLLM bundle not unpacked in /tmp/site (see header)"; fi
# vegas is on PYTHONPATH, not pip-installed: declare its vllm.general_plugins entry point so that
# vLLM's other processes (engine core, tensor-parallel workers) load vegas.vllm_plugin:register
EP=/tmp/site/vegas_device_entry_points-0.0.dist-info
if [ -d /tmp/site ] && [ ! -d "$EP" ]; then
  mkdir -p "$EP"
  printf 'Metadata-Version: 2.1\nName: vegas-device-entry-points\nVersion: 0.0\n' > "$EP/METADATA"
  printf '[vllm.general_plugins]\nvegas = vegas.vllm_plugin:register\n' > "$EP/entry_points.txt"
fi
for phase in $PHASES; do
  case $phase in
    env)
      say "env"
      nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee "$OUT/env.log"
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tee -a "$OUT/env.log"
      nvidia-smi topo -m 2>&1 | head -6 | tee -a "$OUT/env.log"
      python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.log"
      ;;
    kernels)
      say "kernel vs reference tests (tests/gpu)"
      eval "set -- ${KTEST_ARGS:-}"  # shell words, e.g. -k 'async or smoke'
      timeout ${KTEST_S:-240} python3 -m pytest tests/gpu -q -rs -p no:cacheprovider "$@" 2>&1 \
        | tee "$OUT/kernel_tests.log" | tail -25
      ;;
    cuda)
      say "CUDA tests of the suite (-k 'cuda or gpu', tests/gpu excluded)"
      timeout 150 python3 -m pytest tests -x -q -k "cuda or gpu" --ignore=tests/gpu -p no:cacheprovider 2>&1 \
        | tee "$OUT/cuda_tests.log" | tail -15
      ;;
    kbench)
      say "kernel timings (scripts/kernel_bench.py)"
      timeout 200 python3 scripts/kernel_bench.py 2>&1 | tee "$OUT/kernel_bench.log" | grep -E "^\[kernel\]|Error|error" | tail -12
      ;;
    profile)
      for spec in ${PROFILE_RUNS:-vegas:collect2:128 plain:none:128}; do
        IFS=: read -r m sel b <<< "$spec"
        say "profile $m $sel batch $b (scripts/vllm_profile.py)"
        timeout 300 python3 scripts/vllm_profile.py --method "$m" --selector "$sel" --batch "$b" \
          ${PROFILE_ARGS:-} > "$OUT/profile_${m}_${sel}_b$b.log" 2>&1
        echo "profile rc=$?"; grep -E "^\[plain wall\]|Error" "$OUT/profile_${m}_${sel}_b$b.log" | tail -3
      done
      ;;
    bench)
      left=$(( BENCH_S ))
      say "vllm_bench.py $BENCH_ARGS (time budget ${left}s)"
      timeout $(( left + 60 )) python3 scripts/vllm_bench.py $BENCH_ARGS --time-budget "$left" \
        --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      echo "bench rc=$?"
      grep -E "^\[|^\||exactness|errors|Error|error|Traceback|FAILED" "$OUT/bench.log" | grep -v "WARNING" | tail -80
      ;;
  esac
done
say "done"
