#!/usr/bin/env bash
# One device session in few calls, for a short device budget (runs ON the device machine).
#
#   call 1:     run(command="bash .device/vllm/p0/unpack.sh && bash scripts/device_session.sh start",
#                   carry=[".device/vllm/p0"])
#               starts, in the background (setsid; it outlives the call while the machine is held), the
#               GPU tests that need no vLLM: the score/Quest kernels, the HF backend on CUDA. Logs in
#               /tmp/vegas_bg.
#   calls 2-7:  run(command="bash .device/vllm/pN/unpack.sh", carry=[".device/vllm/pN"])     N = 1..6
#   call 8:     run(command="bash scripts/device_session.sh finish")
#               the vLLM tests (greedy equal to plain vLLM for built-in fast paths, Quest, the h2o plugin
#               and a selector defined in a test file on the generic path; FA page tables), then the
#               background logs; everything lands in $OUT.
# FINISH_S bounds call 8 (seconds; default 420). Phases that do not fit are skipped and say so.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
BG=/tmp/vegas_bg
OUT=${OUT:-/tmp/vegas_out}; mkdir -p "$OUT" "$BG"
T0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${FINISH_S:-420} - ($(date +%s) - T0) )); }
pt() { python3 -m pytest -q -rs -p no:cacheprovider "$@"; }

case ${1:-} in
  start)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$BG/env.log" 2>&1
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$BG/env.log" 2>&1
    # a copy of the checkout: carried folders and the tree may change under later calls
    rm -rf /tmp/vegas_src && mkdir -p /tmp/vegas_src && cp -r vegas tests scripts plugins pyproject.toml /tmp/vegas_src/
    setsid nohup bash -c "
      cd /tmp/vegas_src; export PYTHONPATH=/tmp/vegas_src
      timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_kernels_cuda.py tests/gpu/test_vllm_quest_cuda.py tests/gpu/test_device_timer.py > $BG/kernel_tests.log 2>&1
      timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_hf_cuda.py > $BG/hf_cuda_tests.log 2>&1
      timeout 150 python3 scripts/fused_verify_bench.py --case smollm2 > $BG/fused_bench.log 2>&1
      echo done > $BG/DONE" > /dev/null 2>&1 < /dev/null &
    say "background GPU tests started (logs in $BG)"; cat "$BG/env.log"
    ;;
  finish)
    [ -d /tmp/site/vllm ] || say "vLLM is not unpacked in /tmp/site: carry .device/vllm/p0..p6 first"
    EP=/tmp/site/vegas_device_entry_points-0.0.dist-info  # vegas is on PYTHONPATH, not installed
    if [ -d /tmp/site ] && [ ! -d "$EP" ]; then
      mkdir -p "$EP"
      printf 'Metadata-Version: 2.1\nName: vegas-device-entry-points\nVersion: 0.0\n' > "$EP/METADATA"
      printf '[vllm.general_plugins]\nvegas = vegas.vllm_plugin:register\n' > "$EP/entry_points.txt"
    fi
    # vLLM profiles free GPU memory at engine start: background GPU work must have ended by then
    for _ in $(seq 1 ${BG_WAIT_S:-240}); do [ -f "$BG/DONE" ] && break; sleep 1; done
    [ -f "$BG/DONE" ] || { say "background GPU tests still running: stopping them"; pkill -f vegas_src; sleep 2; }
    export PYTHONPATH=$PYTHONPATH:$PWD/plugins/vegas-h2o  # the example plugin, registered by hand in the tests
    say "vLLM backend tests (tests/gpu/test_vllm_backend_cuda.py)"
    timeout $(( $(left) - 150 )) python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_backend_cuda.py \
      -k "plugin or quest or (async and True)" -s 2>&1 | grep -v "it/s\]" > "$OUT/vllm_backend_tests.log"
    grep -E "on vllm|passed|failed|Error|FAILED" "$OUT/vllm_backend_tests.log" | tail -15
    say "FA page tables"
    timeout $(( $(left) - 60 > 10 ? $(left) - 60 : 10 )) python3 -m pytest -q -rs -p no:cacheprovider \
      tests/gpu/test_vllm_fa_pages.py > "$OUT/fa_tests.log" 2>&1
    tail -3 "$OUT/fa_tests.log"
    if [ -f scripts/vllm_v2_smoke.py ] && [ "$(left)" -gt 100 ]; then
      say "V2 runner smoke"
      timeout $(( $(left) - 20 )) python3 scripts/vllm_v2_smoke.py vegas/model --selector collect2 --batch 8 --new-tokens 128 > "$OUT/v2_smoke.log" 2>&1
      tail -8 "$OUT/v2_smoke.log"
    fi
    say "background logs"
    ls "$BG"; cp "$BG"/*.log "$OUT"/ 2>/dev/null
    for f in "$BG"/*tests.log; do echo "--- $f"; tail -4 "$f"; done
    tail -25 "$BG/fused_bench.log" 2>/dev/null
    say "done"
    ;;
  *) echo "usage: device_session.sh start|finish" >&2; exit 2 ;;
esac
