#!/usr/bin/env bash
# Here, after a device call: bring the H200's `vegas ablate` points home. Takes the bg.tgz that
# `scripts/device_serving.sh bg-wait` returned (the run tool's files_at), copies its out/ablate/ over the
# folder (default benchmarks/results/ablate_h200_smollm2: points.json, tables.md, plots), redraws the plots
# here with the folder's settings (no GPU needed: unmeasured points are named, not measured) and copies them
# to docs/figures/h200-smollm2-b32-*.png.
#   bash scripts/collect_ablate.sh /work/.device/35/bg.tgz
set -euo pipefail
TGZ=${1:?usage: collect_ablate.sh BG_TGZ [FOLDER]}
DIR=${2:-benchmarks/results/ablate_h200_smollm2}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xzf "$TGZ"
[ -f "$tmp/out/ablate/points.json" ] || { echo "no out/ablate/points.json in $TGZ" >&2; exit 2; }
cp "$tmp/out/ablate/points.json" "$tmp/out/ablate/tables.md" "$DIR"/
[ -f "$tmp/bg.log" ] && grep "^\[" "$tmp/bg.log" | tail -20
# the folder's own settings: the contexts and studies it holds
read -r CONTEXTS STUDIES < <(python3 - "$DIR/points.json" <<'PY'
import json, sys
points = json.load(open(sys.argv[1]))["points"]
print(",".join(str(c) for c in sorted({p["context"] for p in points})),
      ",".join(sorted({p["study"] for p in points})))
PY
)
vegas ablate --model smollm2-135m --device cuda --batch-size 32 --yarn-factor 4 --contexts "$CONTEXTS" \
  --studies "$STUDIES" --out "$DIR" | tail -2
for f in tau_by_budget tau_by_context retrieval ablations overlap; do
  [ -f "$DIR/$f.png" ] && cp "$DIR/$f.png" "docs/figures/h200-smollm2-b32-$f.png"
done
git status --short "$DIR" docs/figures
