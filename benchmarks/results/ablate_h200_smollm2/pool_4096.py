"""The ablation at 4,096 tokens, 2 %, pooled over the three runs on the same 32 held-out prompts, each with
its own random draws: this folder (one batch of 32 on an H100, session 32), ../ablate_h200_smollm2_b8 (H200,
batches of 8, session 25) and ../ablate_cpu_smollm2_32p (CPU, batches of 8, sessions 14, 30, 31). Each pair
(variant, default; or selector, selector) comes from one run; the bootstrap (vegas.tune_points.spread, seed 0)
resamples the pooled per-prompt differences; % of the pooled mean τ of the second. Run from the checkout's
root: python benchmarks/results/ablate_h200_smollm2/pool_4096.py"""
import json

from vegas.tune_points import spread

RUNS = {name: json.load(open(f"benchmarks/results/{folder}/points.json"))["points"]
        for name, folder in (("gpu32", "ablate_h200_smollm2"), ("h200b8", "ablate_h200_smollm2_b8"),
                             ("cpu", "ablate_cpu_smollm2_32p"))}


def at(points, selector, variant="default", gamma=4):
    """The held-out point at 4,096 tokens, 2 %; the ablation study's own default where it has one."""
    found = [p for p in points if p["selector"] == selector and p["variant"] == variant and p["context"] == 4096
             and p["num_draft_tokens"] == gamma and p["sparsity_ratio"] == 0.02 and p["prompt_kind"] == "heldout"]
    found.sort(key=lambda p: p["study"] != "ablation")
    return found[0] if found else None


def show(label, a, b):
    cells = []
    for names in (("gpu32",), ("h200b8",), ("cpu",), ("gpu32", "h200b8", "cpu")):
        d, ref = [], []
        for n in names:
            x, y = at(RUNS[n], *a), at(RUNS[n], *b)
            if x and y:
                d += [u - v for u, v in zip(x["tau_per_prompt"], y["tau_per_prompt"])]
                ref += y["tau_per_prompt"]
        if not d:
            cells.append("–")
            continue
        s, m = spread(d, 0), sum(ref) / len(ref)
        lo, hi = (100 * c / m for c in s["ci95"])
        cell = f"{100 * s['mean'] / m:+.1f} % [{lo:+.1f}, {hi:+.1f}] (n={len(d)})"
        cells.append(f"**{cell}**" if lo > 0 or hi < 0 else cell)
    print(f"| {label} | " + " | ".join(cells) + " |")


print("| difference | GPU, one batch of 32 | H200, batches of 8 | CPU | pooled |")
print("|---|---|---|---|---|")
for sel in ("collect2", "aggregated", "last_token"):
    for v in ("granularity=kv_head", "recent_window=0", "score_mode=weight"):
        show(f"{sel}: {v} − default", (sel, v), (sel,))
for a, b in (("collect2", "aggregated"), ("collect2", "last_token"), ("aggregated", "last_token")):
    for v in ("default", "granularity=kv_head", "recent_window=0", "score_mode=weight"):
        show(f"{a} − {b}, {v}", (a, v), (b, v))
    for g in (2, 6, 8):
        show(f"{a} − {b}, γ = {g}", (a, "default", g), (b, "default", g))
