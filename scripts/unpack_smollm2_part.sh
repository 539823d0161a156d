#!/usr/bin/env bash
# Runs ON the device machine. Each part folder built by scripts/make_smollm2_parts.sh holds a copy of this
# script: in each call run the copy in the part you carried (`bash .device/smollm2/pN/unpack.sh`). It stashes
# the part in ~/.smollm2-parts (the device removes carried folders that the next call does not carry, but keeps
# the stash while the machine stays warm); the call that completes the set writes
# /tmp/smollm2/<name>.gguf and checks its sha256 (once per machine), and installs the gguf wheel that the
# last part carries into /tmp/site-gguf (scripts/device_serving.sh puts it on PYTHONPATH after /tmp/site,
# so that the vLLM bundle's own copy, where unpacked, comes first).
set -euo pipefail
PART=$(cd "$(dirname "$0")" && pwd)
STASH="$HOME/.smollm2-parts"
OUTD=${SMOLLM2_GGUF_DIR:-/tmp/smollm2}
mkdir -p "$STASH"
cp -n "$PART"/* "$STASH"/ 2>/dev/null || true
read -r SHA NAME < "$STASH/SHA256"
install_gguf() {
  [ -d /tmp/site-gguf/gguf ] && return 0
  local whl
  whl=$(ls "$STASH"/gguf-*.whl 2>/dev/null | sort -V | tail -1)  # the newest: a stash may hold an older build's
  [ -n "$whl" ] || return 0  # parts made before the wheel was added
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-gguf "$whl"
  echo "gguf installed in /tmp/site-gguf"
}
if [ -f "$OUTD/$NAME" ]; then echo "$NAME already in $OUTD"; install_gguf; exit 0; fi
N=$(cat "$STASH/NPARTS")
for n in $(seq 0 $((N-1))); do
  [ -f "$STASH/smollm2.part$n" ] || { echo "stashed $(ls "$STASH" | grep -c '^smollm2.part') of $N SmolLM2 parts; carry the next one"; exit 0; }
done
mkdir -p "$OUTD"
for n in $(seq 0 $((N-1))); do cat "$STASH/smollm2.part$n"; done > "$OUTD/$NAME.tmp"
echo "$SHA  $OUTD/$NAME.tmp" | sha256sum -c --quiet || { echo "sha256 of the reassembled $NAME is wrong" >&2; rm -f "$OUTD/$NAME.tmp"; exit 1; }
mv "$OUTD/$NAME.tmp" "$OUTD/$NAME"
install_gguf
echo "SmolLM2 unpacked: $OUTD/$NAME ($(du -sh "$OUTD/$NAME" | cut -f1))"
