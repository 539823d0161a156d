"""PNG charts of ``vegas tune``, ``vegas bench`` and ``vegas ablate`` results (matplotlib, no display needed).

Figures are built with :class:`matplotlib.figure.Figure` directly (no pyplot): no GUI backend,
no global state.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["plot_tune", "plot_bench", "plot_ablate", "ABLATE_PLOTS", "write_ablate_tables", "paired_difference"]

THROUGHPUT = "throughput (generated tokens / decode second)"


#: the selectors of the ablation study (they share the verified-chunk scores)
ABLATED = ("aggregated", "collect2", "last_token")
#: the selector the paired differences are taken against (the method's), and the upper bound
PAIRED_BASE, PAIRED_BOUND = "collect2", "oracle"


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


def _panels(count: int, width: float = 4.6, per_row: int = 3):
    """A figure of ``count`` panels, at most ``per_row`` a row, sharing one τ axis (so that the
    panels compare), the unused ones removed; one legend goes below them (:func:`_legend`)."""
    from matplotlib.figure import Figure

    cols, rows = min(count, per_row), math.ceil(count / per_row)
    fig = Figure(figsize=(max(width * cols, 6.4), 3.9 * rows + 0.6), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False, sharey=True).flat)
    for ax in axes[count:]:
        ax.remove()
    for ax in axes[:count]:
        ax.yaxis.set_tick_params(labelleft=True)
    return fig, axes[:count]


def _legend(fig, axes, selectors: list[str]) -> None:
    """One legend for every panel, outside them (per-panel legends covered the curves), in the
    order of ``selectors``, and the τ label on each row's first panel."""
    for ax in axes:
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("τ (tokens / iteration), mean and 95 % CI")
    seen = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    names = [sel for sel in selectors if sel in seen]
    rows = math.ceil(len(names) / (8 if fig.get_figwidth() >= 10 else 4))  # as few rows as fit, filled evenly
    fig.legend([seen[n] for n in names], names, loc="outside lower center", ncols=math.ceil(len(names) / rows),
               fontsize="small")


def _with_runs(ax, x: list, curve: list[dict], key: str, **style) -> None:
    """``key`` of each point (its median run) against ``x``, with the min–max of the point's repeats
    (``<key>_runs``, where recorded) as error bars."""
    y = [p[key] for p in curve]
    runs = [p.get(f"{key}_runs") or [p[key]] for p in curve]
    err = [[max(v - min(r), 0.0) for v, r in zip(y, runs)], [max(max(r) - v, 0.0) for v, r in zip(y, runs)]]
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, **style)


def _grid_ticks(axis, values: set) -> None:
    """Ticks at the grid's own values (budgets, sparsities such as 0.1333), plainly labelled; without
    values, the log axis's own major ticks (its minor ones crowd: 700800900)."""
    if values:
        axis.set_ticks(sorted(values))
    _plain_ticks(axis, minor=False)


def plot_tune(points: list[dict], recommendation: dict, opts, out: Path) -> list[str]:
    """Write the tune plots into ``out`` and return their file names.

    * ``tau_vs_budget.png``: step 1, τ (tokens per iteration) against the KV budget (tokens,
      log scale; sparsity on the top axis) at step 1's γ, one line per selector, knees
      circled, the recommended budget a dotted vertical line.
    * ``throughput_vs_gamma.png``: step 2, tokens/s against γ at each selector's knee
      sparsity, plain decoding of that step as a dashed line.
    * ``throughput_vs_sparsity.png``: step 3, tokens/s against sparsity at each selector's
      chosen γ, plain decoding of that step dashed.

    Each point is its median run, with the min–max of its repeats as error bars. The
    recommended point is a star where it lies on a drawn curve.
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
    budgets = set()
    for sel in opts.selectors:
        curve = sorted(points_of(points, 1, sel, opts.num_draft_tokens), key=lambda p: p["sparsity_ratio"])
        if not curve:
            continue
        budgets.update(p["kv_budget"] for p in curve)
        _with_runs(ax, [p["kv_budget"] for p in curve], curve, "acceptance_length", label=sel)
        if sel in per:
            k = per[sel]["knee"]
            ax.plot([k["kv_budget"]], [k["acceptance_length"]], marker="o", markersize=14, fillstyle="none",
                    color="black", linestyle="none", label=f"knee ({sel})")
    if best:
        ax.axvline(best["kv_budget"], color="goldenrod", linestyle=":",
                   label=f"chosen: {best['selector']}, budget {best['kv_budget']}, γ={best['num_draft_tokens']}")
    ax.set_xscale("log")
    _grid_ticks(ax.xaxis, budgets)
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
            _with_runs(ax, [p["num_draft_tokens"] for p in curve], curve, "tokens_per_second",
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
    ticks = set()
    for sel, rec in per.items():
        curve = sorted(points_of(points, 3, sel, rec["num_draft_tokens"]), key=lambda p: p["sparsity_ratio"])
        if curve:
            _with_runs(ax, [p["sparsity_ratio"] for p in curve], curve, "tokens_per_second",
                       label=f"{sel}, γ={rec['num_draft_tokens']}")
            ticks.update(p["sparsity_ratio"] for p in curve)
    plain_line(ax, "3")
    if best and best["step"] == 3:
        star(ax, best["sparsity_ratio"], best["tokens_per_second"])
    ax.set_xscale("log")
    _grid_ticks(ax.xaxis, ticks)
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


def _ablate_points(points: list[dict], **fields) -> list[dict]:
    return [p for p in points if all(p.get(k) == v for k, v in fields.items())]


def _tau_ci(points: list[dict]) -> tuple[list[float], list[list[float]]]:
    """τ means of ``points`` and their 95 % bootstrap intervals as matplotlib ``yerr``."""
    y = [p["tau"]["mean"] for p in points]
    return y, [[m - p["tau"]["ci95"][0] for m, p in zip(y, points)], [p["tau"]["ci95"][1] - m for m, p in zip(y, points)]]


def _tau_errorbar(ax, curve: list[dict], x: list, **style) -> None:
    """τ means of ``curve`` at ``x`` with their 95 % bootstrap intervals as error bars."""
    y, err = _tau_ci(curve)
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, **style)


#: a selector's markers sit this factor apart from the next one's on a log x axis, so that equal
#: points and overlapping intervals stay visible (the ticks name the measured values)
DODGE = 1.025
#: the built-in selectors' colours, the same in every figure (a plugin's take the next ones)
SELECTOR_COLOURS = {"aggregated": "C0", "collect2": "C1", "last_token": "C2", "quest": "C3", "sliding_window": "C4"}


def _colour(selector: str, selectors: list[str]) -> str:
    """``selector``'s colour: its own among :data:`SELECTOR_COLOURS`, else one after them by its
    place among the other selectors of ``selectors`` (the oracle is black)."""
    if selector == "oracle":
        return "black"
    if selector in SELECTOR_COLOURS:
        return SELECTOR_COLOURS[selector]
    others = [s for s in selectors if s not in SELECTOR_COLOURS and s != "oracle"]
    return f"C{(len(SELECTOR_COLOURS) + others.index(selector)) % 10}"


def _selector_lines(ax, points: list[dict], x: str, selectors: list[str]) -> None:
    """One τ line per selector of ``points`` against the field ``x`` (log axis; oracle dashed
    black), each selector dodged by its place in ``selectors`` (the same colour and offset in
    every panel)."""
    for i, sel in enumerate(selectors):
        curve = sorted((p for p in points if p["selector"] == sel), key=lambda p: p[x])
        if not curve:
            continue
        style = {"color": _colour(sel, selectors)} | ({"linestyle": "--"} if sel == "oracle" else {})
        shift = DODGE ** (i - (len(selectors) - 1) / 2)
        _tau_errorbar(ax, curve, [p[x] * shift for p in curve], label=sel, **style)


def _budget_panels(points: list[dict], kind: str, gamma: int, title: str, path: Path) -> bool:
    """τ against sparsity, one panel per context, one line per selector (oracle dashed)."""
    chosen = [p for p in _ablate_points(points, prompt_kind=kind, variant="default", num_draft_tokens=gamma)
              if p["study"] in ("budget", "retrieval")]
    contexts = sorted({p["context"] for p in chosen})
    if not contexts:
        return False
    fig, axes = _panels(len(contexts))
    selectors = sorted({p["selector"] for p in chosen})
    for ax, ctx in zip(axes, contexts):
        here = [p for p in chosen if p["context"] == ctx]
        _selector_lines(ax, here, "sparsity_ratio", selectors)
        rope = here[0].get("rope_scaling")
        extra = f", YaRN ×{rope['factor']:g}" if rope else ""
        if kind == "retrieval":
            extra += f", passage ~{here[0].get('distance_tokens', 0):,.0f} tokens back"
        ax.set_title(f"context {ctx:,}{extra}", fontsize="medium")
        ax.set_xscale("log")
        _plain_ticks(ax.xaxis, minor=False)  # minor labels run together within a decade (0.07 0.08 0.09)
        ax.set_xticks(sorted({p["sparsity_ratio"] for p in here}))  # the measured sparsities, labelled
        ax.set_xlabel("sparsity (KV budget / context)")
        ax.grid(True, which="both", alpha=0.3)
    _legend(fig, axes, selectors)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return True


def _context_panels(points: list[dict], gamma: int, title: str, path: Path) -> bool:
    """τ against context on held-out prompts, one panel per sparsity measured at two or more
    contexts, one line per selector (oracle dashed): whether a selector's gain over another
    grows with context. False (nothing drawn) when no sparsity has two contexts."""
    chosen = [p for p in _ablate_points(points, prompt_kind="heldout", variant="default", num_draft_tokens=gamma)
              if p["study"] == "budget"]
    sparsities = sorted(s for s in {p["sparsity_ratio"] for p in chosen}
                        if len({p["context"] for p in chosen if p["sparsity_ratio"] == s}) > 1)
    if not sparsities:
        return False
    fig, axes = _panels(len(sparsities))
    selectors = sorted({p["selector"] for p in chosen})
    for ax, s in zip(axes, sparsities):
        here = [p for p in chosen if p["sparsity_ratio"] == s]
        _selector_lines(ax, here, "context", selectors)
        contexts = sorted({p["context"] for p in here})
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c:,}" + ("\n(YaRN)" if any(p.get("rope_scaling") for p in here if p["context"] == c)
                                             else "") for c in contexts])
        ax.minorticks_off()
        ax.set_title(f"sparsity {s:g}", fontsize="medium")
        ax.set_xlabel("context (prompt tokens)")
        ax.grid(True, alpha=0.3)
    _legend(fig, axes, selectors)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return True


#: every file :func:`plot_ablate` may write (one whose study has no points is not drawn)
ABLATE_PLOTS = ("tau_by_budget.png", "retrieval.png", "tau_by_context.png", "ablations.png", "overlap.png")


def plot_ablate(points: list[dict], opts, out: Path, source: str = "held-out code") -> list[str]:
    """Write the ``vegas ablate`` plots into ``out`` and return their file names (a study
    without points draws nothing).

    * ``tau_by_budget.png``: τ (mean over prompts, 95 % bootstrap CI) against sparsity per
      selector, one panel per context, at γ = ``opts.num_draft_tokens``.
    * ``ablations.png``: τ per config variant of each ablated selector (bars), and τ
      against γ, at the ablation context and sparsity.
    * ``overlap.png``: Jaccard of top-k sets against query distance d (within a verified
      chunk, across iterations; min–max over prompts shaded), and of each proxy's set with
      the next chunk's queries against draft step, at the ablation context (as ``ablations.png``;
      ``tables.md`` lists every context's).
    * ``retrieval.png``: as ``tau_by_budget.png`` on copy-task prompts.
    * ``tau_by_context.png``: τ against context per selector, one panel per sparsity measured at
      two or more contexts (held-out prompts, γ = ``opts.num_draft_tokens``).

    ``source``: how the prompt source reads in titles (:func:`vegas.prompts.source_label`).
    """
    # integer ticks on the γ, query-distance and draft-step axes
    from matplotlib.ticker import MaxNLocator

    written = []
    gamma = opts.num_draft_tokens
    temp = f"T={opts.temperature:g}" if opts.temperature else "greedy"
    if _budget_panels(points, "heldout", gamma, f"τ by KV budget, {source}, γ={gamma}, {temp}",
                      out / "tau_by_budget.png"):
        written.append("tau_by_budget.png")
    if _budget_panels(points, "retrieval", gamma, f"τ by KV budget, copy-task (retrieval) prompts, γ={gamma}, {temp}",
                      out / "retrieval.png"):
        written.append("retrieval.png")
    if _context_panels(points, gamma, f"τ by context, {source}, γ={gamma}, {temp}", out / "tau_by_context.png"):
        written.append("tau_by_context.png")

    from .tune_points import round_sparsity

    ctx, s = opts.contexts[0], round_sparsity(opts.ablation_sparsity)
    here = _ablate_points(points, prompt_kind="heldout", context=ctx, sparsity_ratio=s)
    variants = [p for p in here if p["num_draft_tokens"] == gamma and p["selector"] in ABLATED]
    ablated = any(p["variant"] != "default" for p in here) or len({p["num_draft_tokens"] for p in here}) > 1
    if variants and ablated:  # the budget study alone has one default point per selector: nothing to compare
        fig, (ax_v, ax_g) = _figure(ncols=2, width=5.6)
        sels = [sel for sel in ABLATED if any(p["selector"] == sel for p in variants)]
        names = sorted({p["variant"] for p in variants}, key=lambda v: (v != "default", v))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs, ps = [], []
            for j, sel in enumerate(sels):
                found = [p for p in variants if p["selector"] == sel and p["variant"] == name]
                if found:
                    xs.append(j + (i - (len(names) - 1) / 2) * width)
                    ps.append(found[0])
            y, err = _tau_ci(ps)
            ax_v.bar(xs, y, width, yerr=err, capsize=2, label=name)
        ax_v.set_xticks(range(len(sels)), sels)
        ax_v.set_ylabel("τ (tokens / iteration), mean and 95 % CI")
        ax_v.set_title(f"config variants, γ={gamma}", fontsize="medium")
        ax_v.legend(fontsize="small")
        ax_v.grid(True, axis="y", alpha=0.3)
        for sel in sels:
            curve = sorted((p for p in here if p["selector"] == sel and p["variant"] == "default"),
                           key=lambda p: p["num_draft_tokens"])
            if curve:
                _tau_errorbar(ax_g, curve, [p["num_draft_tokens"] for p in curve], label=sel)
        ax_g.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_g.set_xlabel("γ (draft tokens per iteration)")
        ax_g.set_ylabel("τ (tokens / iteration)")
        ax_g.set_title("τ against γ", fontsize="medium")
        ax_g.grid(True, alpha=0.3)
        ax_g.legend(fontsize="small")
        fig.suptitle(f"ablations: context {ctx}, sparsity {s:g} (KV budget {variants[0]['kv_budget']}), {temp}")
        fig.savefig(out / "ablations.png", dpi=100)
        written.append("ablations.png")

    probe = [p for p in points if p["selector"] == "overlap_probe" and "jaccard" in p and p["context"] == ctx]
    if probe:
        p = probe[0]
        fig, (ax_d, ax_p) = _figure(ncols=2, width=5.6)
        for series, ax in (("within", ax_d), ("across", ax_d), ("proxy_last_token", ax_p),
                           ("proxy_collect2", ax_p), ("proxy_aggregated", ax_p)):
            col = p["jaccard"].get(series)
            if not col:
                continue
            xs = [i + 1 for i, v in enumerate(col["mean"]) if v is not None]
            ax.plot(xs, [col["mean"][x - 1] for x in xs], marker="o", label=series.replace("proxy_", ""))
            ax.fill_between(xs, [col["min"][x - 1] for x in xs], [col["max"][x - 1] for x in xs], alpha=0.15)
        ax_d.set_xlabel("query distance d (tokens)")
        ax_d.set_ylabel("Jaccard of top-k sets (mean; min–max over prompts)")
        ax_d.set_title("queries t and t + d: within a verified chunk, across iterations", fontsize="medium")
        ax_p.set_xlabel("draft step of the next iteration (row of the next verified chunk + 1)")
        ax_p.set_ylabel("Jaccard with the proxy's set")
        ax_p.set_title("the set a selector drafts with vs. each next query's own", fontsize="medium")
        for ax in (ax_d, ax_p):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # distances and draft steps
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
            ax.set_ylim(0, 1)
        fig.suptitle(f"top-k overlap over the prompt slots: context {p['context']}, KV budget {p['kv_budget']}, "
                     f"γ={p['num_draft_tokens']}, {temp}")
        fig.savefig(out / "overlap.png", dpi=100)
        written.append("overlap.png")
    return written


#: what the ``attended`` columns of ``tables.md`` hold
ATTENDED_NOTE = ("attended: KV entries per layer a draft query attended to among the committed ones "
                 "(`kv_attended`, mean over layers, draft steps, iterations and prompts; the drafts' own new "
                 "positions not counted), to read against the KV budget in the column header (tokens at the "
                 "prompt's length; the budget grows with the context as tokens are generated, by sparsity × "
                 "generated tokens at most); – : not recorded (points measured before it was)")


def _tau_cells(p: dict | None) -> list[str]:
    """τ mean [95 % CI] and ``kv_attended`` of point ``p``: two table cells ("–" where missing)."""
    if p is None:
        return ["–", "–"]
    t, attended = p["tau"], p.get("kv_attended")  # points.json from before kv_attended lacks it
    return [f"{t['mean']:.2f} [{t['ci95'][0]:.2f}, {t['ci95'][1]:.2f}]",
            "–" if attended is None else f"{attended:.1f}"]


def _budget_label(points: list[dict], sparsity: float) -> str:
    """Column label of a sparsity: ``"0.02 (21 tok.)"`` with the KV budget in tokens of the
    points at that sparsity (at the prompt's length), or the sparsity alone when none says it."""
    budget = next((p.get("kv_budget") for p in points if p["sparsity_ratio"] == sparsity and p.get("kv_budget")), None)
    return f"{sparsity:g}" + (f" ({budget} tok.)" if budget else "")


def _tau_header(columns: list[str]) -> list[str]:
    """Header and rule of a table with a τ and an attended column per entry of ``columns``."""
    return ["| selector | " + " | ".join(f"{c}: τ | attended" for c in columns) + " |",
            "|---" * (2 * len(columns) + 1) + "|"]


def paired_difference(a: dict, b: dict, seed: int = 0) -> dict | None:
    """τ of point ``a`` minus τ of point ``b`` over the same prompts (``tau_per_prompt``, in the
    same order: points of one prompt kind and context), in % of ``b``'s mean τ: ``{"mean", "ci95"}``
    (a 95 % percentile bootstrap of the mean difference, :func:`vegas.tune_points.spread`), or None
    where the prompts differ in number or a point lacks them."""
    from .tune_points import spread

    x, y = a.get("tau_per_prompt"), b.get("tau_per_prompt")
    if not x or not y or len(x) != len(y):
        return None
    d = spread([u - v for u, v in zip(x, y)], seed)
    ref = sum(y) / len(y)
    return {"mean": 100 * d["mean"] / ref, "ci95": [100 * c / ref for c in d["ci95"]]}


def _paired_cell(diff: dict | None) -> str:
    """``+9.5 % [+3.6, +14.8]``, bold where the interval excludes 0; "–" where missing."""
    if diff is None:
        return "–"
    lo, hi = diff["ci95"]
    cell = f"{diff['mean']:+.1f} % [{lo:+.1f}, {hi:+.1f}]"
    return f"**{cell}**" if lo > 0 or hi < 0 else cell


def _pair_cell(a: dict | None, b: dict | None) -> str:
    """The table cell of :func:`paired_difference` of points ``a`` and ``b``; "–" where either is missing."""
    return _paired_cell(paired_difference(a, b) if a and b else None)


def _paired_rows(here: list[dict], budgets: list[float]) -> list[str]:
    """Rows of paired differences for one prompt kind, context and γ: collect2 − each other
    selector, and oracle − collect2 (empty without collect2)."""
    def at(sel, s):
        return next((p for p in here if p["selector"] == sel and p["sparsity_ratio"] == s), None)

    sels = sorted({p["selector"] for p in here} - {PAIRED_BASE, PAIRED_BOUND})
    pairs = [(PAIRED_BASE, other) for other in sels] + [(PAIRED_BOUND, PAIRED_BASE)]
    rows = []
    for a, b in pairs:
        cells = [_pair_cell(at(a, s), at(b, s)) for s in budgets]
        if any(c != "–" for c in cells):
            rows.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    return rows


def _ablation_paired(here: list[dict], gamma: int, names: list[str], gammas: list[int]) -> list[str]:
    """The ablation's paired differences (over the same prompts, :func:`paired_difference`), a row
    per variant at γ ``gamma`` and per other γ: collect2 − aggregated and collect2 − last_token
    within the row, and each selector's variant − its own default (γ rows: none, τ grows with γ)."""
    def at(sel, variant, g):
        return next((p for p in here if p["selector"] == sel and p["variant"] == variant
                     and p["num_draft_tokens"] == g), None)

    sels = [s for s in ABLATED if any(p["selector"] == s for p in here)]
    rows = [(v, v, gamma) for v in names] + [(f"γ={g}", "default", g) for g in gammas if g != gamma]
    lines = [(f"paired over the same prompts (γ={gamma} unless named): mean difference of τ in % of the second's "
              "mean τ [95 % bootstrap interval, in %]; bold: the interval excludes 0"), "",
             ("| variant | collect2 − aggregated | collect2 − last_token | "
              + " | ".join(f"{s}: variant − default" for s in sels) + " |"), "|---" * (3 + len(sels)) + "|"]
    for label, variant, g in rows:
        own = ["–" if variant == "default" else _pair_cell(at(s, variant, g), at(s, "default", g)) for s in sels]
        lines.append(f"| {label} | {_pair_cell(at('collect2', variant, g), at('aggregated', variant, g))} | "
                     f"{_pair_cell(at('collect2', variant, g), at('last_token', variant, g))} | " + " | ".join(own) + " |")
    return lines + [""]


def write_ablate_tables(points: list[dict], path: Path, source: str = "held-out code") -> None:
    """Markdown tables of every ``vegas ablate`` point: τ mean [95 % CI] and the KV entries
    attended (``kv_attended``) per selector × sparsity for each prompt kind, context and γ; the
    ablation's variants and γ values with their paired differences, for each context ablated; the
    overlap series. ``source``: how the prompt source reads
    (:func:`vegas.prompts.source_label`)."""
    lines = [ATTENDED_NOTE + ".", ""]
    studied = [p for p in points if p["study"] in ("budget", "retrieval")]
    for kind, ctx, gamma in sorted({(p["prompt_kind"], p["context"], p["num_draft_tokens"]) for p in studied}):
        here = _ablate_points(studied, prompt_kind=kind, context=ctx, num_draft_tokens=gamma)
        budgets = sorted({p["sparsity_ratio"] for p in here})
        rope = here[0].get("rope_scaling")
        prompts = source if kind == "heldout" else f"copy-task (retrieval) prompts from {source}"
        lines += [f"### τ, {prompts}, context {ctx}" + (f" (YaRN ×{rope['factor']:g})" if rope else "")
                  + f", γ={gamma}: mean [95 % CI] over {here[0]['tau']['n']} prompts", "",
                  *_tau_header([_budget_label(here, s) for s in budgets])]
        for sel in sorted({p["selector"] for p in here}):
            cells = [c for s in budgets
                     for c in _tau_cells(next((p for p in here if p["selector"] == sel and p["sparsity_ratio"] == s),
                                              None))]
            lines.append(f"| {sel} | " + " | ".join(cells) + " |")
        paired = _paired_rows(here, budgets)
        if paired:
            lines += ["", "paired over the same prompts: mean difference of τ in % of the second's mean τ "
                      "[95 % bootstrap interval, in %]; bold: the interval excludes 0", "",
                      "| difference | " + " | ".join(f"{s:g}" for s in budgets) + " |",
                      "|---" * (len(budgets) + 1) + "|", *paired]
        if kind == "retrieval":
            lines += ["", "tokens copied exactly before the first difference from the passage (mean over prompts; "
                      f"passage ~{here[0].get('distance_tokens', 0):.0f} tokens back; the output is the target "
                      "model's whatever the selector, so differences between selectors come from sampling, "
                      "none under greedy decoding):", "",
                      "| selector | " + " | ".join(f"{s:g}" for s in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
            for sel in sorted({p["selector"] for p in here}):
                cells = [next((f"{p['copied_tokens']['mean']:.2f}" for p in here
                               if p["selector"] == sel and p["sparsity_ratio"] == s and "copied_tokens" in p), "–")
                         for s in budgets]
                lines.append(f"| {sel} | " + " | ".join(cells) + " |")
        lines.append("")
    variants = [p for p in points if p["variant"] != "default"]
    for ctx, s in sorted({(p["context"], p["sparsity_ratio"]) for p in variants}):  # each context ablated
        at = [p for p in variants if p["context"] == ctx and p["sparsity_ratio"] == s]
        here = [p for p in _ablate_points(points, prompt_kind="heldout", context=ctx, sparsity_ratio=s)
                if p["selector"] in ABLATED]
        gamma = at[0]["num_draft_tokens"]
        names = ["default"] + sorted({p["variant"] for p in at})
        sels = sorted({p["selector"] for p in at})
        lines += [f"### ablations, context {ctx}, sparsity {s:g}, γ={gamma}: τ mean [95 % CI]", "",
                  *_tau_header(names)]
        for sel in sels:
            cells = [c for v in names for c in _tau_cells(next((p for p in here if p["selector"] == sel and p["variant"] == v
                                                                 and p["num_draft_tokens"] == gamma), None))]
            lines.append(f"| {sel} | " + " | ".join(cells) + " |")
        gammas = sorted({p["num_draft_tokens"] for p in here if p["variant"] == "default"})
        lines += ["", f"### τ against γ, context {ctx}, sparsity {s:g}", "", *_tau_header([f"γ={g}" for g in gammas])]
        for sel in sels:
            cells = [c for g in gammas for c in _tau_cells(next((p for p in here if p["selector"] == sel
                                                                  and p["variant"] == "default"
                                                                  and p["num_draft_tokens"] == g), None))]
            lines.append(f"| {sel} | " + " | ".join(cells) + " |")
        lines += ["", *_ablation_paired(here, gamma, names, gammas)]
    for p in points:
        if "jaccard" not in p:
            continue
        series = list(p["jaccard"])
        width = max(len(p["jaccard"][s]["mean"]) for s in series)
        lines += [f"### top-k overlap (Jaccard, mean over prompts), context {p['context']}, KV budget "
                  f"{p['kv_budget']}, γ={p['num_draft_tokens']}; d = query distance, or draft step for proxies", "",
                  "| series | " + " | ".join(str(i + 1) for i in range(width)) + " |", "|---" * (width + 1) + "|"]
        for s in series:
            mean = p["jaccard"][s]["mean"]
            lines.append(f"| {s} | " + " | ".join("–" if v is None else f"{v:.3f}" for v in mean) + " |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
