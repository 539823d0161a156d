"""Diagnostic (device): bf16 CUDA greedy divergence between Vegas and plain on the HF backend."""
import sys, torch
from vegas import Pipeline, VegasConfig
from vegas.prompts import cut_contexts, package_source
from vegas.sampling import SamplingParams
import vegas.backends.hf as hf
print("vegas from", hf.__file__)
chunk = int(sys.argv[1]) if len(sys.argv) > 1 else 0
if chunk and hasattr(hf, "PREFILL_CHUNK_TOKENS"):
    hf.PREFILL_CHUNK_TOKENS = chunk
import os
pipe = Pipeline(os.environ.get("DIAG_MODEL"), selector=None, dtype="bfloat16", device="cuda")
ids = pipe.tokenizer(package_source(), add_special_tokens=False).input_ids
prompts = cut_contexts(ids, 2048, 2); prompts[1] = prompts[1][:1500]
config = VegasConfig(num_draft_tokens=4, kv_budget=128, recent_window=16)
g = SamplingParams()
for batch in (prompts, prompts[1:]):
    ref = pipe.backend.generate(batch, max_new_tokens=32, sampling=g, selector=None, config=config)
    for sel in ("collect2", "sliding_window"):
        out = pipe.backend.generate(batch, max_new_tokens=32, sampling=g, selector=sel, config=config)
        for p, o, r in zip(batch, out, ref):
            if o.token_ids == r.token_ids:
                print(len(batch), sel, len(p), "same"); continue
            i = next(i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b)
            with torch.inference_mode():
                lg = pipe.backend.model(torch.tensor([p + r.token_ids[:i]], device="cuda")).logits[0, -1].float()
            top = lg.topk(3)
            print(len(batch), sel, len(p), "diff at", i, "one-pass top3", [round(float(v), 3) for v in top.values], top.indices.tolist(),
                  "ref", r.token_ids[i], "spec", o.token_ids[i], "spec logit", round(float(lg[o.token_ids[i]]), 3))
