"""PNG charts of ``vegas tune`` and ``vegas bench`` results (matplotlib, no display needed).

Figures are built with :class:`matplotlib.figure.Figure` directly (no pyplot): no GUI backend,
no global state.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_tune", "plot_bench"]

THROUGHPUT = "throughput (generated tokens / decode second)"


def _plain_ticks(axis, minor: bool = True) -> None:
    """Tick labels such as 20, 0.05 instead of 2×10^1, 5×10^-2 on a log axis (``minor``:
    the minor ticks labelled too)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(fmt)
    axis.set_minor_formatter(fmt if minor else NullFormatter())


def _figure(ncols: int = 1, width: float = 6.4):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 4.4), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def plot_tune(points: list[dict], recommendation: dict, opts, out: Path) -> list[str]:
    """Write the tune plots into ``out`` and return their file names.

    * ``tau_vs_budget.png``: step 1, τ (tokens per iteration) against the KV budget (tokens,
      log scale; sparsity on the top axis) at step 1's γ, one line per selector, knees
      circled, the recommended budget a dotted vertical line.
    * ``throughput_vs_gamma.png``: step 2, tokens/s against γ at each selector's knee
      sparsity, plain decoding of that step as a dashed line.
    * ``throughput_vs_sparsity.png``: step 3, tokens/s against sparsity at each selector's
      chosen γ, plain decoding of that step dashed.

    The recommended point is a star where it lies on a drawn curve.
    """
    from .tune_points import points_of

    best = recommendation.get("best")
    per = recommendation.get("selectors", {})
    context = recommendation["context"]
    written = []

    def save(fig, ax, name, xlabel, ylabel, title):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
        fig.savefig(out / name, dpi=100)
        written.append(name)

    def plain_line(ax, step):
        plain = recommendation.get("plain_tokens_per_second", {}).get(step)
        if plain:
            ax.axhline(plain, color="gray", linestyle="--", label="plain decoding")

    def star(ax, x, y, label="chosen"):
        ax.plot([x], [y], marker="*", markersize=16, color="gold", markeredgecolor="black", linestyle="none",
                label=label, zorder=5)

    # 1: τ against the KV budget
    fig, (ax,) = _figure()
    for sel in opts.selectors:
        curve = sorted(points_of(points, 1, sel, opts.num_draft_tokens), key=lambda p: p["sparsity_ratio"])
        if not curve:
            continue
        ax.plot([p["kv_budget"] for p in curve], [p["acceptance_length"] for p in curve], marker="o", label=sel)
        if sel in per:
            k = per[sel]["knee"]
            ax.plot([k["kv_budget"]], [k["acceptance_length"]], marker="o", markersize=14, fillstyle="none",
                    color="black", linestyle="none", label=f"knee ({sel})")
    if best:
        ax.axvline(best["kv_budget"], color="goldenrod", linestyle=":",
                   label=f"chosen: {best['selector']}, budget {best['kv_budget']}, γ={best['num_draft_tokens']}")
    ax.set_xscale("log")
    _plain_ticks(ax.xaxis)
    top = ax.secondary_xaxis("top", functions=(lambda b: b / context, lambda s: s * context))
    top.set_xlabel("sparsity (KV budget / context)")
    _plain_ticks(top.xaxis, minor=False)
    save(fig, ax, "tau_vs_budget.png", "KV budget (tokens)", "τ, acceptance length (tokens / iteration)",
         f"step 1: τ against KV budget, γ={opts.num_draft_tokens}, context {context} tokens")

    # 2: throughput against γ
    fig, (ax,) = _figure()
    for sel, rec in per.items():
        curve = sorted(points_of(points, 2, sel, sparsity=rec["knee"]["sparsity_ratio"]),
                       key=lambda p: p["num_draft_tokens"])
        curve = [p for p in curve if p["num_draft_tokens"] in opts.gammas]
        if curve:
            ax.plot([p["num_draft_tokens"] for p in curve], [p["tokens_per_second"] for p in curve], marker="o",
                    label=f"{sel}, sparsity {rec['knee']['sparsity_ratio']:g}")
        if sel == (best or {}).get("selector"):
            on = [p for p in curve if p["num_draft_tokens"] == best["num_draft_tokens"]]
            if on:
                star(ax, on[0]["num_draft_tokens"], on[0]["tokens_per_second"], f"chosen γ={best['num_draft_tokens']}")
    plain_line(ax, "2")
    ax.set_xticks(sorted(set(opts.gammas)))
    save(fig, ax, "throughput_vs_gamma.png", "γ (draft tokens per iteration)", THROUGHPUT,
         "step 2: throughput against γ at the knee sparsity")

    # 3: throughput against sparsity at the chosen γ
    fig, (ax,) = _figure()
    for sel, rec in per.items():
        curve = sorted(points_of(points, 3, sel, rec["num_draft_tokens"]), key=lambda p: p["sparsity_ratio"])
        if curve:
            ax.plot([p["sparsity_ratio"] for p in curve], [p["tokens_per_second"] for p in curve], marker="o",
                    label=f"{sel}, γ={rec['num_draft_tokens']}")
    plain_line(ax, "3")
    if best and best["step"] == 3:
        star(ax, best["sparsity_ratio"], best["tokens_per_second"])
    ax.set_xscale("log")
    _plain_ticks(ax.xaxis)
    save(fig, ax, "throughput_vs_sparsity.png", "sparsity (KV budget / context)", THROUGHPUT,
         "step 3: throughput against sparsity at the chosen γ")
    return written


def plot_bench(results: dict, path: str | Path) -> None:
    """``vegas bench``'s table as a PNG: τ (sampled and greedy, tokens per iteration) and
    speedup over plain decoding per selector, side by side."""
    rows = results["selectors"]
    names = list(rows)
    o = results["options"]
    fig, (ax_tau, ax_speed) = _figure(ncols=2, width=5.2)
    x = range(len(names))
    width = 0.38
    ax_tau.bar([i - width / 2 for i in x], [rows[n]["acceptance_length"] for n in names], width,
               label="τ sampled" if o["temperature"] else "τ greedy")
    ax_tau.bar([i + width / 2 for i in x], [rows[n]["greedy_acceptance_length"] for n in names], width,
               label=f"τ greedy ({o['check_tokens']}-token check)")
    ax_tau.axhline(o["num_draft_tokens"] + 1, color="gray", linestyle=":", label="γ + 1 (upper bound)")
    ax_tau.set_ylabel("τ, acceptance length (tokens / iteration)")
    ax_speed.bar(list(x), [rows[n]["speedup"] for n in names],
                 color=["tab:green" if rows[n]["speedup"] >= 1 else "tab:red" for n in names])
    ax_speed.axhline(1.0, color="gray", linestyle="--", label="plain decoding")
    ax_speed.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    for ax in (ax_tau, ax_speed):
        ax.set_xticks(list(x), names, rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"vegas bench: {o['backend']}, context {o['context']}, batch {o['batch_size']}, "
                 f"γ={o['num_draft_tokens']}, KV budget {results['kv_budget']}, T={o['temperature']}")
    fig.savefig(path, dpi=100)
