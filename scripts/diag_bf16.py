"""Diagnostic (device): does a left-padded, chunk-prefilled batch decode like each prompt alone (HF, CUDA)?"""
import os, sys, torch
from vegas import Pipeline, VegasConfig
from vegas.prompts import cut_contexts, package_source
from vegas.sampling import SamplingParams
import vegas.backends.hf as hf

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
pipe = Pipeline(os.environ.get("DIAG_MODEL"), selector=None, dtype=dtype, device="cuda")
ids = pipe.tokenizer(package_source(), add_special_tokens=False).input_ids
prompts = cut_contexts(ids, 2048, 2); prompts[1] = prompts[1][:1500]
config = VegasConfig(num_draft_tokens=4, kv_budget=128, recent_window=16)
g = SamplingParams()
def run(batch, chunk, sel=None):
    hf.PREFILL_CHUNK_TOKENS = chunk
    return [o.token_ids for o in pipe.backend.generate(batch, max_new_tokens=32, sampling=g, selector=sel, config=config)]
alone = run([prompts[1]], 100000)[0]
with torch.inference_mode():
    one = pipe.backend.model(torch.tensor([prompts[1] + alone[:20]], device="cuda")).logits[0, len(prompts[1]) - 1:].float().argmax(-1).tolist()
print(dtype, "alone vs one-pass argmax (teacher forced):", sum(a == b for a, b in zip(alone[:20], one[:20])), "/ 20")
for chunk in (100000, 1024, 512, 96):
    for sel in (None, "collect2"):
        out = run(prompts, chunk, sel)[1]
        i = next((i for i, (a, b) in enumerate(zip(out, alone)) if a != b), None)
        print(dtype, "chunk", chunk, sel, "padded-in-batch vs alone: first diff", i)
