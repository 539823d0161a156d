#!/usr/bin/env bash
# Carry-able parts of what vLLM 0.24.0's CuTe-DSL attention (fa_version=4) needs and the device bundle
# of shared/device/make_vllm_bundle.sh lacks: nvidia-cutlass-dsl[cu13]==4.5.2 (vLLM's pin; ~154 MB of
# wheels: -libs-base 74.5 MB, -libs-cu13 78.8 MB), quack-kernels==0.3.3 (vLLM's lower bound, 0.2 MB), cuda-bindings 13,
# cuda-pathfinder, einops and torch-c-dlpack-ext,
# for python 3.12 on x86_64. Used by scripts/cute_decode_bench.py (issue 22).
# Usage (here): scripts/cute_dsl_bundle.sh DEST        (DEST: an ignored folder, e.g. .device/cute)
# Result: DEST/p0 … DEST/pN, PART_MB (default 18) each. On the device, carry ONE part per call, in calls made
# back to back, after the vLLM bundle's parts, and run `bash DEST/pN/unpack.sh` for the part carried; the
# last one installs the wheels into /tmp/site (export PYTHONPATH=/tmp/site, as for vLLM).
set -euo pipefail
DEST=${1:?usage: cute_dsl_bundle.sh DEST}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
# also what the DSL and vLLM's cute package import that the device's torch environment may lack:
# cuda.bindings (the DSL's driver calls), einops (cute/testing.py, imported by cute/interface.py),
# torch-c-dlpack-ext (quack's dependency); a package the device already has is shadowed by /tmp/site
python3 -m pip download -q --no-deps $PLAT -d "$W/whl" nvidia-cutlass-dsl==4.5.2 nvidia-cutlass-dsl-libs-base==4.5.2 \
  nvidia-cutlass-dsl-libs-cu13==4.5.2 quack-kernels==0.3.3 "cuda-bindings>=13,<14" "cuda-pathfinder>=1.1" einops \
  torch-c-dlpack-ext
ls -l "$W/whl"
tar -C "$W/whl" -cf "$W/cute.tar" .
rm -rf "$DEST"; mkdir -p "$DEST"
split -b "${PART_MB:-18}M" -d -a 1 "$W/cute.tar" "$W/cd.part"
n=0; for f in "$W"/cd.part*; do mkdir -p "$DEST/p$n"; mv "$f" "$DEST/p$n/"; n=$((n+1)); done
for d in "$DEST"/p*; do
  echo "$n" > "$d/NPARTS"
  cat > "$d/unpack.sh" <<'EOF'
#!/usr/bin/env bash
# Runs ON the device: stash this part; once all are stashed, install the wheels into /tmp/site (no network).
set -euo pipefail
PART=$(cd "$(dirname "$0")" && pwd)
STASH="$HOME/.cute-dsl-bundle"
mkdir -p "$STASH"; cp -n "$PART"/* "$STASH"/ 2>/dev/null || true
if [ -d /tmp/site/cutlass ]; then echo "cutlass-dsl already in /tmp/site"; exit 0; fi
N=$(cat "$STASH/NPARTS")
for n in $(seq 0 $((N-1))); do
  [ -f "$STASH/cd.part$n" ] || { echo "stashed $(ls "$STASH" | grep -c '^cd.part') of $N parts; carry the next one"; exit 0; }
done
mkdir -p /tmp/cute-whl /tmp/site
for n in $(seq 0 $((N-1))); do cat "$STASH/cd.part$n"; done | tar -x -C /tmp/cute-whl
python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/cute-whl/*.whl
echo "cutlass-dsl + quack installed: $(ls /tmp/cute-whl)"
EOF
done
du -sh "$DEST"/p*
