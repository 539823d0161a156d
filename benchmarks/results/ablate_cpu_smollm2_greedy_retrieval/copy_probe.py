"""How far SmolLM2-135M copies a passage from far back, by context and cue length (plain greedy).

Builds the retrieval study's copy-task prompts (:func:`vegas.prompts.retrieval_prompts`, the held-out
code set) with a cue of the given lengths and counts the tokens plain greedy decoding generates
before the first that differs from the passage (as ``vegas ablate``'s ``copied_tokens``).

    OMP_NUM_THREADS=2 python benchmarks/results/ablate_cpu_smollm2_greedy_retrieval/copy_probe.py CONTEXT PROMPTS CUES
    e.g. ... copy_probe.py 4096 8 16,64,256
"""
import sys
import time

from vegas import Pipeline
from vegas.ablate import _common_prefix
from vegas.prompts import heldout_path, read_text_source, retrieval_prompts

context, count, cues = int(sys.argv[1]), int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")]
pipe = Pipeline("smollm2-135m", selector=None, device="cpu")
tok = pipe.tokenizer
ids = tok(read_text_source(str(heldout_path())), add_special_tokens=False, verbose=False).input_ids
anchors = {t for t in set(ids) if tok.decode([t]).strip() == "def"}  # as vegas ablate's retrieval study
for cue in cues:
    rows = retrieval_prompts(ids, context, 32, anchors, cue=cue, answer=64)[:count]
    started = time.time()
    outs = pipe.generate([r["prompt"] for r in rows], max_new_tokens=64, selector=None)
    copied = [_common_prefix(o.token_ids, r["expected"]) for o, r in zip(outs, rows)]
    distance = sum(r["distance"] for r in rows) / len(rows)
    print(f"context {context} cue {cue}: passage ~{distance:.0f} tokens back, copied mean "
          f"{sum(copied) / len(copied):.1f}, per prompt {copied} ({time.time() - started:.0f} s)", flush=True)
