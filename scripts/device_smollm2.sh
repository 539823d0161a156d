#!/usr/bin/env bash
# Runs ON the device machine (phase `smollm2` of scripts/device_check.sh), after the SmolLM2 parts are
# unpacked (scripts/make_smollm2_parts.sh): converts /tmp/smollm2/*.gguf into an HF checkpoint
# /tmp/smollm2-hf (bfloat16 safetensors, config, tokenizer.json) that vLLM and transformers load, once per
# machine (an existing complete checkpoint is kept). Needs torch, transformers and the `gguf` package (in
# the vLLM bundle, /tmp/site, or from the SmolLM2 parts, /tmp/site-gguf). About a minute on a CPU, ~30 s on the device machine.
# The inline step does what vegas.models does (GGUF -> HF checkpoint) with only the device machine's packages.
set -euo pipefail
SRC=${SMOLLM2_GGUF_DIR:-/tmp/smollm2}
DST=${SMOLLM2_HF:-/tmp/smollm2-hf}
if [ -f "$DST/config.json" ] && [ -f "$DST/tokenizer.json" ] && ls "$DST"/*.safetensors >/dev/null 2>&1; then
  echo "SmolLM2 HF checkpoint already in $DST"; exit 0
fi
GGUF=$(ls "$SRC"/*.gguf 2>/dev/null | head -1 || true)
[ -n "$GGUF" ] || { echo "no GGUF in $SRC: carry .device/smollm2/pN first (scripts/make_smollm2_parts.sh)" >&2; exit 1; }
PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}:/tmp/site-gguf "${PYTHON:-python3}" - "$GGUF" "$DST" <<'PYEOF'
import os, shutil, sys, time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

gguf, dst = Path(sys.argv[1]), Path(sys.argv[2])
t0 = time.time()
config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
want = model.state_dict()
try:  # dense float32 tensors under the HF names, whatever the loader does with packed weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
except Exception as e:  # an older loader: from_pretrained dequantizes; save_pretrained refuses it, so rebuild
    print(f"load_gguf_checkpoint: {e!r}; loading with from_pretrained", flush=True)
    tensors = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).state_dict()
tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
missing = sorted(k for k in want if k not in tensors and k not in tied)
bad = sorted(k for k in want if k in tensors and (tuple(tensors[k].shape) != tuple(want[k].shape)
                                                  or not tensors[k].is_floating_point()))
if missing or bad:
    sys.exit(f"GGUF conversion: missing {missing[:5]}, wrong shape or dtype {bad[:5]}")
model.load_state_dict({k: tensors[k] for k in want if k in tensors}, strict=False)
model.tie_weights()
model = model.to(torch.bfloat16)
model.config.dtype = torch.bfloat16
tmp = dst.with_name(dst.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
shutil.rmtree(dst, ignore_errors=True)
os.replace(tmp, dst)
c = model.config
print(f"SmolLM2 HF checkpoint in {dst} ({time.time() - t0:.0f}s): {type(model).__name__}, {c.num_hidden_layers} layers, "
      f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads of {c.hidden_size // c.num_attention_heads}, "
      f"context {c.max_position_embeddings}", flush=True)
PYEOF
