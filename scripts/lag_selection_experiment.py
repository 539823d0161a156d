#!/usr/bin/env python3
"""Does drafting from the previous verification's selection cost acceptance? (HF backend, CPU or GPU)

Taking selection off the critical path would mean drafting iteration i from the top-k chosen
after verification i-1, while verification i's scores are turned into the next selection beside
the (launch-bound) draft phase. This measures what that lag costs in τ: the same prompts, the
same pipeline, once with each iteration's fresh selection and once with the previous one
(``HFSession._select`` wrapped: it computes the new selection and keeps the old one in force; the
slots after the old selection stay attended densely, as after every selection).

    python scripts/lag_selection_experiment.py --context 4096 --prompts 4 --new-tokens 48

Prints τ per prompt for both and the per-prompt ratio. Prompts: windows of the held-out code set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vegas import Pipeline  # noqa: E402
from vegas.backends.hf import HFSession  # noqa: E402
from vegas.prompts import cut_contexts, heldout_path, read_text_source  # noqa: E402

LAG = {"on": False}
_select = HFSession._select


def lagged_select(self, scores):
    """The fresh selection is computed (and timed) as usual; with the lag on, the one it
    replaces stays in force for the next drafting phase (the first after the prefill is fresh)."""
    previous = (self.selections, self.selection_len)
    _select(self, scores)
    if LAG["on"] and previous[0] and previous[1]:
        self.selections, self.selection_len = previous


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--sparsity-ratio", type=float, default=0.05)
    p.add_argument("-g", "--gamma", type=int, default=4)
    args = p.parse_args(argv)
    HFSession._select = lagged_select
    pipe = Pipeline(args.model, selector="collect2", sparsity_ratio=args.sparsity_ratio, num_draft_tokens=args.gamma)
    ids = pipe.tokenizer(read_text_source(heldout_path()), add_special_tokens=False).input_ids
    prompts = cut_contexts(ids, args.context, args.prompts)
    taus = {}
    for mode in ("fresh", "lag1"):
        LAG["on"] = mode == "lag1"
        t0 = time.time()
        taus[mode] = [pipe.generate([pr], max_new_tokens=args.new_tokens)[0].stats.acceptance_length for pr in prompts]
        print(f"{mode}: τ mean {statistics.mean(taus[mode]):.3f} per prompt {[round(t, 2) for t in taus[mode]]} "
              f"({time.time() - t0:.0f} s)", flush=True)
    ratio = [b / a for a, b in zip(taus["fresh"], taus["lag1"])]
    print(f"lag1 / fresh per prompt: mean {statistics.mean(ratio):.3f}, min {min(ratio):.3f}, max {max(ratio):.3f}")


if __name__ == "__main__":
    main()
