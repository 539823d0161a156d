#!/usr/bin/env bash
# Device checks in one script: GPU tests, then the vLLM benchmark (`vegas bench --backend vllm`: greedy
# exactness + throughput and τ table) on the benchmark model SmolLM2-135M (9 query / 3 KV heads of 64, 30 layers, 8K context).
# Keeps going after a failure; logs in $OUT. Phases (PHASES, in order): env smollm2 kernels cuda kbench
# profile bench.
#
# The plan: build here once, then device calls made back to back (the machine stays warm only ~30 s
# after a call; a carried folder is removed there when the next call does not carry it):
#   PART_MB=18 bash ../shared/device/make_vllm_bundle.sh .device/vllm  # here: .device/vllm/p0..p9 (18 MB each)
#   bash scripts/make_smollm2_parts.sh .device/smollm2            # here: .device/smollm2/p0..p4 (23 MB each)
#   calls 1-8:   run(command="bash .device/vllm/pN/unpack.sh", carry=[".device/vllm/pN"])         N = 0..7
#   calls 9-12:  run(command="bash .device/smollm2/pN/unpack.sh", carry=[".device/smollm2/pN"])    N = 0..3
#   call 13:     run(command="bash .device/smollm2/p4/unpack.sh && bash scripts/device_smollm2.sh",
#                    carry=[".device/smollm2/p4"])      # reassembles the GGUF (sha256), converts it (~1 min)
#                                                       # into the HF checkpoint /tmp/smollm2-hf
#   call 14 (GPU tests, ~7-8 min):
#     run(command="KTEST_S=480 PHASES='env smollm2 kernels cuda' bash scripts/device_check.sh", carry=[])
#   call 15 (benchmark, ~7-8 min; one run per KV budget (BENCH_SPARSITIES, 5 % and 2 %), each plain + 4
#   selectors = 5 engines alive at once; greedy exactness of 32 prompts x 64 tokens against plain greedy;
#   batches 32 and 128 at T = 0.8, top-p 1):
#     run(command="PHASES=bench BENCH_S=480 bash scripts/device_check.sh", carry=[])
#   (call 15's BENCH_ARGS are the default below; call 14 alone takes the PHASES default's place.)
# The smollm2 phase is a no-op once /tmp/smollm2-hf exists; without the SmolLM2 parts it says what to carry.
# Tensor parallelism (kind nvidia-h200-x2; NVLink multicast stays off, NCCL_NVLS_ENABLE=0):
#   KTEST_S=480 PHASES="env kernels bench" BENCH_ARGS="... --engine-args '{\"tensor_parallel_size\": 2}'" \
#     bash scripts/device_check.sh
# A subset of the GPU tests: KTEST_ARGS="-k 'async or smoke'" (passed to pytest).
# The embedded tiny model instead of SmolLM2: BENCH_ARGS="--selectors collect2,ngram --context 16384,8192 ..."
#   (no --model: vegas bench defaults to the embedded model; vegas bench --help lists the flags).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
OUT=${OUT:-/tmp/vegas_out}; mkdir -p "$OUT"
PHASES=${PHASES:-"env smollm2 kernels cuda bench"}
BENCH_S=${BENCH_S:-480}
SMOLLM2=${SMOLLM2_HF:-/tmp/smollm2-hf}
BENCH_ARGS=${BENCH_ARGS:-"--model $SMOLLM2 --context 7680 --batch-size 32,128 \
  --selectors collect2,aggregated,sliding_window,quest --min-kv-budget 0 --new-tokens 256 --top-p 1 \
  --exact-prompts 32 --check-tokens 64"}
BENCH_SPARSITIES=${BENCH_SPARSITIES:-"0.05 0.02"}
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
    smollm2)
      say "SmolLM2 HF checkpoint (scripts/device_smollm2.sh)"
      timeout 300 bash scripts/device_smollm2.sh 2>&1 | grep -v "it/s]" | tee "$OUT/smollm2.log" | tail -3
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
        timeout 300 python3 scripts/vllm_profile.py --model "$SMOLLM2" --methods "$m" --selector "$sel" --batch "$b" \
          --out "$OUT/profile_${m}_${sel}_b$b" ${PROFILE_ARGS:-} > "$OUT/profile_${m}_${sel}_b$b.log" 2>&1
        echo "profile rc=$?"; grep -E "^\[|^    |Error" "$OUT/profile_${m}_${sel}_b$b.log" | tail -12
      done
      ;;
    bench)
      n=$(echo $BENCH_SPARSITIES | wc -w)
      for share in $BENCH_SPARSITIES; do
        say "vegas bench --backend vllm $BENCH_ARGS --sparsity-ratio $share (time limit $(( BENCH_S / n ))s)"
        eval "set -- $BENCH_ARGS"  # shell words: a JSON --engine-args stays one argument
        timeout $(( BENCH_S / n )) python3 -c "from vegas.cli import main; main()" bench --backend vllm "$@" \
          --sparsity-ratio "$share" --json "$OUT/bench_kv$share.json" > "$OUT/bench_kv$share.log" 2>&1
        echo "bench rc=$?"
        grep -E "^\||exactness|^error|Error|Traceback|FAILED" "$OUT/bench_kv$share.log" | grep -v "WARNING" | tail -40
      done
      ;;
  esac
done
say "done"
