"""The main job: plain decoding and each selector on the same prompts, one table.

Throughput runs sample (temperature 0.8, top-p 0.95 by default): greedy decoding of the
small embedded model falls into repetition loops (design notes (docs/design-notes.md) §7), which makes greedy
throughput meaningless. Every run also checks exactness: a short greedy generation per
selector must equal plain greedy decoding on the same prompts, token for token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .backends.base import RequestOutput
from .config import VegasConfigError, VegasPluginError, kv_budget_for
from .pipeline import Pipeline
from .plugins import PLAIN, SelectorSkips, create_selector, selector_names
from .progress import LoggedProgress, plain_printer
from .prompts import cut_contexts, prompt_text
from .sampling import SamplingParams

__all__ = ["BenchOptions", "bench_config", "clearly_faster", "median_row", "run_bench", "summarize", "verdict"]


@dataclass
class BenchOptions:
    """Options of ``vegas bench`` (see ``vegas bench --help``)."""

    model: str | None = None
    rope_scaling: dict | None = None
    backend: str = "hf"
    selectors: list[str] | None = None  # None: every registered selector (plugins included); plain always runs
    context: int = 4096
    new_tokens: int = 64
    batch_size: int = 2
    num_draft_tokens: int = 4
    sparsity_ratio: float = 0.05
    kv_budget: int | None = None
    min_kv_budget: int = 256
    temperature: float = 0.8
    top_p: float = 0.95
    check_tokens: int = 16
    prompts: str | None = None
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    repeats: int = 1  # timed runs per method, interleaved across methods; rows report the median


def bench_config(opts) -> dict:
    """The :class:`~vegas.config.VegasConfig` fields of a benchmark's Vegas runs, on either
    backend (``opts``: :class:`BenchOptions` or the vLLM bench's options): γ, sparsity ratio, KV
    budget and its floor as given, and no fallback to plain steps (:mod:`vegas.draft_policy`), so
    that each selector's own τ and speed are measured."""
    return {"num_draft_tokens": opts.num_draft_tokens, "sparsity_ratio": opts.sparsity_ratio,
            "kv_budget": opts.kv_budget, "min_kv_budget": opts.min_kv_budget, "fallback": False}


def summarize(outputs: list[RequestOutput]) -> dict:
    """Batch-level figures of one ``generate`` call.

    Returns:
        ``tokens_per_second`` (generated tokens / decode seconds), ``acceptance_length``
        (tokens emitted per iteration, over the batch), ``selection_overhead`` (selection
        seconds / decode seconds), token and second counts.
    """
    stats = [o.stats for o in outputs]
    generated = sum(s.num_generated for s in stats)
    iterations = sum(s.iterations for s in stats)
    decode = stats[0].decode_seconds
    return {
        "generated_tokens": generated,
        "iterations": iterations,
        "acceptance_length": generated / iterations if iterations else 0.0,
        "decode_seconds": decode,
        "prefill_seconds": stats[0].prefill_seconds,
        "tokens_per_second": generated / decode if decode else 0.0,
        "selection_overhead": stats[0].selection_seconds / decode if decode else 0.0,
    }


def _prompts(pipe: Pipeline, opts: BenchOptions) -> list[list[int]]:
    text = prompt_text(opts.prompts)
    ids = pipe.tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    return cut_contexts(ids, opts.context, opts.batch_size)


def _raise_if_bad_options(opts: BenchOptions, pipe: Pipeline) -> None:
    for name in ("batch_size", "new_tokens", "check_tokens", "repeats"):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise VegasConfigError.bad(name, f"must be an integer >= 1, got {value!r}")
    generated = max(opts.new_tokens, opts.check_tokens)
    room = pipe.backend.max_context - generated - opts.num_draft_tokens - 1
    if not 2 <= opts.context <= room:
        longer = (" (a longer context: --rope-scaling, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4}')"
                  if opts.context > room else "")
        raise VegasConfigError.bad(
            "context", f"must be in [2, {room}] tokens: the model context is {pipe.backend.max_context} and "
            f"max(--new-tokens, --check-tokens) = {generated} tokens plus γ + 1 "
            f"verification slots need the rest; got {opts.context}{longer}"
        )


def run_bench(opts: BenchOptions, console: Console | None = None) -> dict:
    """Run the benchmark and return the results (also what ``--json`` writes).

    With every selector (``opts.selectors`` None), a plugin selector that fails to build or
    raises is skipped, with its error under ``results["skipped"]``; a named one fails the run.

    Raises:
        VegasConfigError: a bad option (named in the message).
        VegasPluginError: a selector named in ``opts.selectors`` failed.
    """
    console = console or Console(stderr=True)
    SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)  # before any work
    pipe = Pipeline(
        opts.model, selector=None, backend=opts.backend, dtype=opts.dtype, device=opts.device,
        rope_scaling=opts.rope_scaling, **bench_config(opts),
    )
    _raise_if_bad_options(opts, pipe)
    every = opts.selectors is None  # "all": a failing plugin selector is skipped, not fatal
    if every:
        opts.selectors = selector_names()
    skipped = SelectorSkips(every, plain_printer(console, "yellow"))
    for name in list(opts.selectors):  # fail on an unknown name before any work
        try:
            create_selector(name, pipe.config)
        except VegasPluginError as exc:
            skipped.skip(name, exc)
            opts.selectors.remove(name)
    opts.selectors = [name for name in opts.selectors if name != PLAIN]  # plain decoding: the reference row
    prompts = _prompts(pipe, opts)
    sampled = dict(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
    results: dict = {
        "options": asdict(opts),
        "config": asdict(pipe.config),
        "kv_budget": kv_budget_for(pipe.config, opts.context),
        "selectors": {},
        "skipped": skipped,
    }

    with LoggedProgress(console=console, transient=True) as progress:  # off a terminal: a line per run
        total = 1 + len(opts.selectors) + opts.repeats * (1 + len(opts.selectors))
        task = progress.add_task("vegas bench", total=total)

        def drop(name: str, exc: VegasPluginError, runs_left: int) -> None:
            """Skip ``name`` (or raise): no 'done' line for its step, and the total loses its runs."""
            skipped.skip(name, exc)
            progress.skip(task)
            progress.update(task, total=progress._tasks[task].total - runs_left)

        progress.update(task, description="plain greedy (reference)")
        reference = pipe.generate(prompts, max_new_tokens=opts.check_tokens, selector=None)
        progress.advance(task)
        greedy: dict[str, list[RequestOutput]] = {}
        for name in opts.selectors:  # the check also warms each selector up before it is timed
            progress.update(task, description=f"{name}: greedy exactness check")
            try:
                greedy[name] = pipe.generate(prompts, max_new_tokens=opts.check_tokens, selector=name)
            except VegasPluginError as exc:
                drop(name, exc, opts.repeats)
                continue
            progress.advance(task)
        timed: dict[str | None, list[dict]] = {None: [], **{name: [] for name in greedy}}
        kind = "greedy" if SamplingParams(**sampled).greedy else "sampled"
        for r in range(opts.repeats):  # interleaved: a load that drifts meets every method alike
            for name in list(timed):
                run = f", run {r + 1}/{opts.repeats}" if opts.repeats > 1 else ""
                progress.update(task, description=f"{name or 'plain'}: timed {kind} decoding{run}")
                try:
                    out = pipe.generate(prompts, max_new_tokens=opts.new_tokens, selector=name, **sampled)
                except VegasPluginError as exc:
                    drop(name, exc, opts.repeats - r - 1)
                    del timed[name]
                    continue
                timed[name].append(summarize(out))
                row = timed[name][-1]
                progress.advance(task, note=f"{row['tokens_per_second']:.1f} tok/s, τ {row['acceptance_length']:.2f}")
        results["plain"] = median_row(timed.pop(None))
        for name, rows in timed.items():
            row = median_row(rows)
            row["greedy_acceptance_length"] = summarize(greedy[name])["acceptance_length"]
            row["lossless"] = all(g.token_ids == r.token_ids for g, r in zip(greedy[name], reference))
            row["speedup"] = row["tokens_per_second"] / results["plain"]["tokens_per_second"]
            results["selectors"][name] = row
    return results


def median_row(rows: list[dict]) -> dict:
    """The run with the median tok/s (the lower middle one of an even count), plus every run's
    tok/s and τ (``tokens_per_second_runs``, ``acceptance_length_runs``) and their spreads
    (``tokens_per_second_spread``, ``acceptance_length_spread``: largest minus smallest; 0 for
    one run)."""
    order = sorted(rows, key=lambda row: row["tokens_per_second"])
    row = dict(order[(len(order) - 1) // 2])
    for key in ("tokens_per_second", "acceptance_length"):
        runs = [r[key] for r in rows]
        row[f"{key}_runs"], row[f"{key}_spread"] = runs, max(runs) - min(runs)
    return row


def clearly_faster(a: dict, b: dict) -> bool:
    """Whether point ``a`` decodes faster than point ``b`` beyond the noise: its median tok/s
    exceeds ``b``'s by more than the spread of either's repeats (rows of :func:`median_row`)."""
    spread = max(a.get("tokens_per_second_spread", 0.0), b.get("tokens_per_second_spread", 0.0))
    return a["tokens_per_second"] - b["tokens_per_second"] > spread


def verdict(results: dict) -> str:
    """One line: the method to use on this machine. A selector only when it is
    :func:`clearly_faster` than plain decoding over repeated runs, else plain decoding
    (``--selector none``); from single runs (no spread) always plain decoding. The line says
    why: every selector slower, single runs, or not faster beyond the spread."""
    plain, rows = results["plain"], results["selectors"]
    if not rows:
        return "plain decoding only: no selector was measured"
    best = max(rows, key=lambda name: rows[name]["tokens_per_second"])
    row = rows[best]
    runs = len(plain["tokens_per_second_runs"])
    if row["speedup"] < 1.0:  # slower even in its best run: no spread could change that
        return (f"recommended: plain decoding (--selector none): every selector ran slower than plain decoding on "
                f"this machine (the fastest, {best}, at {row['speedup']:.2f}× plain)")
    if runs < 2:  # no spread: a lucky run would decide
        return (f"recommended: plain decoding (--selector none): single runs cannot tell a selector from noise "
                f"(the fastest, {best}, ran at {row['speedup']:.2f}× plain); --repeats 3 measures the spread")
    noise = f"medians of {runs} runs"
    if clearly_faster(row, plain):
        return f"recommended: {best}, {row['speedup']:.2f}× plain decoding ({noise})"
    return (f"plain decoding is as fast or faster on this machine: the best selector, {best}, runs at "
            f"{row['speedup']:.2f}× plain ({noise}); recommended: plain decoding (--selector none)")


def greedy_tau_cap(check_tokens: int, num_draft_tokens: int) -> float:
    """Largest acceptance length a greedy run of ``check_tokens`` tokens can show: every
    iteration emits at most γ + 1 tokens, and the last one is cut at ``check_tokens``."""
    return check_tokens / math.ceil(check_tokens / (num_draft_tokens + 1))


def render(results: dict) -> Table:
    """A rich table of ``results`` (plain decoding first, then each selector)."""
    o = results["options"]
    check, gamma = o["check_tokens"], o["num_draft_tokens"]
    budget = ("--kv-budget" if o.get("kv_budget") is not None
              else f"sparsity {o['sparsity_ratio']}, min {results['config']['min_kv_budget']}")
    caption = "τ: tokens per iteration, the bonus token included (τ ≤ γ+1 = {})".format(gamma + 1)
    if results["selectors"]:
        new = o.get("new_tokens")
        new_cap = greedy_tau_cap(new, gamma) if new else gamma + 1
        if new_cap < gamma + 1:  # sampled τ is cut at --new-tokens as greedy τ is at --check-tokens
            caption += (f"; τ of a run of {new} new tokens cannot exceed {new_cap:.2f} (its last "
                        "iteration is cut at --new-tokens): raise --new-tokens for a finer τ")
        caption += (f"; τ greedy* comes from the {check}-token exactness run, so it cannot exceed "
                    f"{greedy_tau_cap(check, gamma):.2f} (raise --check-tokens for a finer one); selection: share "
                    "of decode time spent selecting KV entries")
        if results["kv_budget"] >= o["context"]:  # e.g. the default floor of 256 at a short --context
            caption += (f"; the KV budget ({results['kv_budget']}) covers the whole {o['context']}-token context, "
                        "so drafting attended to everything: lower --min-kv-budget or --sparsity-ratio, or raise "
                        "--context, to measure sparse drafting")
    table = Table(
        title=f"vegas bench: {o['backend']} backend, context {o['context']}, batch {o['batch_size']}, "
        f"γ={gamma}, KV budget {results['kv_budget']} ({budget}), T={o['temperature']}, "
        f"{o['new_tokens']} new tokens; exactness: {check} greedy tokens",
        caption=caption,
    )
    table.add_column("method", no_wrap=True)
    timed = "τ greedy" if SamplingParams(temperature=o["temperature"]).greedy else "τ sampled"  # the timed runs'
    for col in (timed, "τ greedy*", "tok/s", "speedup", "selection (% decode)", "lossless"):
        table.add_column(col, justify="right", no_wrap=True)
    plain = results["plain"]
    table.add_row("plain", "1.00", "1.00", f"{plain['tokens_per_second']:.1f}", "1.00×", "-", "ref")
    for name, r in results["selectors"].items():
        table.add_row(
            name,
            f"{r['acceptance_length']:.2f}",
            f"{r['greedy_acceptance_length']:.2f}",
            f"{r['tokens_per_second']:.1f}",
            f"{r['speedup']:.2f}×",
            f"{100 * r['selection_overhead']:.1f} %",
            "yes" if r["lossless"] else "NO",
        )
    for name in results.get("skipped", {}):
        table.add_row(name, "-", "-", "-", "-", "-", "skipped (plugin error)")
    return table


def write_json(results: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=2))
