"""``vegas tune``: find an operating point (sparsity, γ) for a model, a prompt set and a selector.

Three steps, each run on the same prompts (cut from held-out source, as ``vegas bench``) with
sampled decoding (T = 0.8, top-p 0.95 by default):

Every point is measured ``repeats`` times (default 3, seeds ``seed``, ``seed + 1``, ...) and
keeps the run of median tokens/s, with the spread (largest minus smallest) of its runs' τ and
tokens/s. A point is chosen over another only when their medians differ by more than the
larger of their spreads (:func:`vegas.bench.clearly_faster`).

1. **Sparsity knee.** At a fixed γ (``num_draft_tokens``, default 4), the acceptance length τ
   (tokens per iteration, the bonus token included) over a grid of sparsity ratios (KV budget /
   context). The knee is the *smallest* sparsity whose τ is within ``tolerance`` (default 5 %)
   of the best τ of the grid, or within the spread of the two (:func:`knee`). Beyond it a
   larger budget buys little acceptance and costs drafting time.
2. **γ sweep.** At the knee sparsity, throughput (generated tokens / decode seconds) for each
   γ of a grid, and plain decoding in the same step for the speedup; step 1's γ stays unless
   another γ is clearly faster.
3. **Fine sparsity.** At that γ, the knee sparsity times ``fine_factor ** k`` for
   ``k = -fine_steps .. fine_steps``; the knee stays unless another sparsity is clearly faster.

Every selector in ``selectors`` goes through every step (step 1 of all of them first, so a
short time budget still gives the τ curves); the best selector is the one whose chosen point
decodes fastest, and it is recommended only when it is clearly faster than plain decoding;
otherwise the recommendation is plain decoding (selector ``none``), and it says so.

Every measured point is appended to ``OUT/points.json`` as soon as it is measured. A rerun
with the same measurement settings (model, backend, prompts, context, new tokens, batch,
sampling, dtype, device, min KV budget) skips the points already there; different settings
raise :class:`~vegas.config.VegasConfigError` naming them (``fresh=True`` discards the old
points). A point is identified by (step, selector, γ, sparsity): each step
measures its own points, plain decoding included, so that the throughputs it compares come
from minutes close together (a load that drifts over a long run would otherwise favour the
points measured later). ``time_budget`` (seconds, counted from the start, model loading included)
stops before a point that would not finish in time, judged by the previous point's duration;
plots and the recommendation are then written from what was measured. Each run measures at least one
point, however short the budget, so that rerunning the same command always gets further.

Outputs in ``OUT``: ``points.json``, ``recommendation.json``, ``tau_vs_budget.png``,
``throughput_vs_gamma.png``, ``throughput_vs_sparsity.png``.

The KV budget of a point is ``max(ceil(context * sparsity), min_kv_budget)``
(:func:`vegas.config.kv_budget_for`); tune sets ``min_kv_budget`` to 0 by default so that the
sparsity grid is the budget it says (the library's default floor of 256 tokens would flatten
every sparsity below 256 / context), and the recommended config carries that value.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.console import Console

from .bench import clearly_faster, median_row, summarize
from .config import VegasConfig, VegasConfigError, VegasPluginError, kv_budget_for
from .pipeline import Pipeline
from .plugins import PLAIN, SelectorSkips, selector_names
from .progress import LoggedProgress, plain_printer
from .prompts import cut_contexts, prompt_text
from .sampling import SamplingParams
from .tune_points import (
    PointStore,
    points_of,
    round_sparsity,
    settings_device,
    source_settings,
)

__all__ = ["TuneOptions", "run_tune", "knee", "best_by_throughput", "vllm_settings", "QUICK", "FULL"]

POINTS_FILE = "points.json"
RECOMMENDATION_FILE = "recommendation.json"

#: defaults of a full run and of ``--quick`` (for options left unset)
FULL = {
    "context": 4096, "new_tokens": 64, "batch_size": 2,
    "sparsities": [0.01, 0.018, 0.033, 0.06, 0.11, 0.2],  # log-spaced 0.01 .. 0.2
    "gammas": [1, 2, 3, 4, 6, 8], "fine_steps": 2, "time_budget": None, "repeats": 3,
}
QUICK = {
    "context": 1024, "new_tokens": 32, "batch_size": 1,
    "sparsities": [0.01, 0.025, 0.06, 0.15],
    "gammas": [2, 4, 6], "fine_steps": 1,
    "time_budget": 570.0,  # seconds: --quick stops before a point that would not end within 10 minutes (rerun resumes)
    "repeats": 3,
}

#: options whose change alters what a point measures: a rerun must match them to resume
MEASUREMENT_SETTINGS = (
    "model", "rope_scaling", "backend", "prompts", "context", "new_tokens", "batch_size",
    "temperature", "top_p", "seed", "dtype", "device", "min_kv_budget", "repeats",
)


@dataclass
class TuneOptions:
    """Options of ``vegas tune`` (see ``vegas tune --help``); None takes :data:`FULL`'s value,
    or :data:`QUICK`'s with ``quick``.

    Units: ``context``, ``new_tokens``, ``min_kv_budget`` in tokens; ``sparsities`` are KV
    budget / context in (0, 1]; ``gammas`` and ``num_draft_tokens`` in draft tokens per
    iteration; ``tolerance`` a fraction of the best τ; ``time_budget`` in seconds.
    """

    model: str | None = None
    rope_scaling: dict | None = None
    backend: str = "hf"
    selectors: list[str] = field(default_factory=lambda: ["collect2"])
    context: int | None = None
    new_tokens: int | None = None
    batch_size: int | None = None
    num_draft_tokens: int = 4  # γ of step 1
    sparsities: list[float] | None = None
    gammas: list[int] | None = None
    tolerance: float = 0.05
    fine_factor: float = 1.5
    fine_steps: int | None = None
    min_kv_budget: int = 0
    temperature: float = 0.8
    top_p: float = 0.95
    prompts: str | None = None
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    repeats: int | None = None  # timed runs per point (seeds seed, seed + 1, ...): median and spread
    out: str = "vegas-tune"
    time_budget: float | None = None
    quick: bool = False
    fresh: bool = False
    #: a plugin selector that raises is skipped (its error under ``"skipped"``) instead of failing
    #: the run: what ``--selectors all`` asks for, as ``vegas bench`` does
    skip_failing: bool = False

    def resolved(self) -> "TuneOptions":
        """A copy with every None default filled from :data:`QUICK` or :data:`FULL`."""
        preset = QUICK if self.quick else FULL
        return replace(self, **{k: v for k, v in preset.items() if getattr(self, k) is None and v is not None})


def raise_if_bad_options(opts: TuneOptions) -> None:
    """Check ``opts`` (resolved) before any model is loaded.

    Raises:
        VegasConfigError: the message names the option (``--flag``) and its allowed values.
    """
    if not [s for s in opts.selectors if s != PLAIN]:
        raise VegasConfigError.bad("selectors", f"must name at least one selector, or 'all' (plain decoding "
                                                f"is always measured), got {opts.selectors!r}")
    known = selector_names(plain=True)
    unknown = [s for s in opts.selectors if s not in known]
    if unknown:
        raise VegasConfigError.bad("selectors", f"unknown selector(s) {', '.join(map(repr, unknown))}; known: "
                                                f"{', '.join(s for s in known if s != PLAIN)}, or 'all' (plain "
                                                "decoding is always measured)")
    if not opts.sparsities or any(
        isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1 for s in opts.sparsities
    ):
        raise VegasConfigError.bad("sparsities", f"must be numbers in (0, 1], got {opts.sparsities!r}")
    if not opts.gammas or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in opts.gammas):
        raise VegasConfigError.bad("gammas", f"must be integers >= 1, got {opts.gammas!r}")
    for name, values in (("selectors", opts.selectors), ("gammas", opts.gammas),
                         ("sparsities", [round_sparsity(s) for s in opts.sparsities])):
        if len(set(values)) != len(values):
            same = " (to 4 significant digits)" if name == "sparsities" else ""
            raise VegasConfigError.bad(name, f"names a value twice{same}, got {getattr(opts, name)!r}")
    for name, minimum in (("num_draft_tokens", 1), ("context", 2), ("new_tokens", 1), ("batch_size", 1),
                          ("fine_steps", 0), ("min_kv_budget", 0), ("repeats", 1)):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise VegasConfigError.bad(name, f"must be an integer >= {minimum}, got {value!r}")
    if not 0 <= opts.tolerance < 1:
        raise VegasConfigError.bad("tolerance", f"must be a fraction in [0, 1), got {opts.tolerance!r}")
    if not opts.fine_factor > 1:
        raise VegasConfigError.bad("fine_factor", f"must be a number > 1, got {opts.fine_factor!r}")
    if opts.time_budget is not None and not opts.time_budget > 0:
        raise VegasConfigError.bad("time_budget", f"must be a number of seconds > 0, got {opts.time_budget!r}")
    SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)


def knee(points: list[dict], tolerance: float) -> dict | None:
    """The knee of a τ-against-sparsity curve (the points of one selector at one γ).

    Rule: the point with the smallest ``sparsity_ratio`` whose ``acceptance_length`` τ (of its
    median run) is below the best point's τ by at most ``tolerance * best τ``, or by at most the
    spread of the two (``acceptance_length_spread``, 0 when absent). None when ``points`` is empty.
    """
    if not points:
        return None
    best = max(points, key=lambda p: p["acceptance_length"])

    def near(p: dict) -> bool:
        spread = max(p.get("acceptance_length_spread", 0.0), best.get("acceptance_length_spread", 0.0))
        return best["acceptance_length"] - p["acceptance_length"] <= max(tolerance * best["acceptance_length"], spread)

    return min((p for p in points if near(p)), key=lambda p: p["sparsity_ratio"])


def best_by_throughput(points: list[dict], preferred: dict | None = None) -> dict | None:
    """The point with the highest (median) ``tokens_per_second``, but ``preferred`` unless that
    one is clearly faster (:func:`vegas.bench.clearly_faster`). None when there is no point."""
    fastest = max(points, key=lambda p: p["tokens_per_second"]) if points else None
    if preferred is None or fastest is None or clearly_faster(fastest, preferred):
        return fastest
    return preferred


def fine_grid(center: float, factor: float, steps: int) -> list[float]:
    """``center * factor ** k`` for ``k = -steps .. steps``, rounded, those above 1 dropped."""
    return sorted({round_sparsity(center * factor**k) for k in range(-steps, steps + 1) if center * factor**k <= 1})


def vllm_settings(selector: str, config: VegasConfig) -> dict:
    """How the chosen point is switched on in vLLM: ``speculative_config`` (engine argument, or
    ``vllm serve --speculative-config``; γ) and ``additional_config`` (``{"vegas": the selector
    name plus the :class:`VegasConfig` fields}``; see :mod:`vegas.vllm_plugin.settings`).
    Every registered selector runs on vLLM (built-ins on fast paths, others on the generic path)."""
    from .vllm_plugin import CLASS_PATH
    from .vllm_plugin.settings import settings_json

    spec = {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": config.num_draft_tokens}
    return {"speculative_config": spec, "additional_config": {"vegas": json.loads(settings_json(selector, config))}}


class _OutOfTime(Exception):
    pass


def run_tune(opts: TuneOptions, console: Console | None = None, pipe: Pipeline | None = None) -> dict:
    """Run the three steps and write ``opts.out`` (see the module docstring).

    Args:
        opts: the options; None fields take the :data:`FULL` / :data:`QUICK` defaults.
        console: where progress goes (stderr by default).
        pipe: a loaded pipeline to measure with (tests); by default one is built from
            ``opts``. Its config is replaced for each point.

    Returns:
        the recommendation (also written to ``recommendation.json``): the chosen point per
        selector, the overall ``best`` (selector, config, τ, tokens/s, speedup), the vLLM
        settings, and ``complete`` False with ``stopped`` when the time budget cut the run.

    Raises:
        VegasConfigError: a bad option (named), or ``points.json`` from other settings.
    """
    started = time.monotonic()
    console = console or Console(stderr=True)
    opts = opts.resolved()
    raise_if_bad_options(opts)
    opts.selectors = [s for s in opts.selectors if s != PLAIN]  # plain decoding is measured in steps 2 and 3
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise VegasConfigError(f"out (--out) {str(out)!r} exists and is not a directory")
    # a bad --prompts file or --device is named as such, before points.json's settings are compared
    text = prompt_text(opts.prompts)
    settings = source_settings({**{k: getattr(opts, k) for k in MEASUREMENT_SETTINGS},
                                "device": settings_device(opts.device)})
    store = PointStore(out / POINTS_FILE, settings, opts.fresh, "vegas tune")
    if pipe is None:
        pipe = Pipeline(opts.model, selector=None, backend=opts.backend, dtype=opts.dtype, device=opts.device,
                        rope_scaling=opts.rope_scaling, min_kv_budget=opts.min_kv_budget, fallback=False)
    room = pipe.backend.max_context - opts.new_tokens - max(opts.gammas + [opts.num_draft_tokens]) - 1
    if not opts.context <= room:
        raise VegasConfigError(
            f"context (--context) must be in [2, {room}] tokens for this model: its context is "
            f"{pipe.backend.max_context} and --new-tokens plus the largest γ + 1 verification slots need the rest; "
            f"got {opts.context} (a longer context: --rope-scaling, e.g. "
            "'{\"rope_type\": \"yarn\", \"factor\": 4}')")
    ids = pipe.tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    prompts = cut_contexts(ids, opts.context, opts.batch_size)
    sampled = dict(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
    base = VegasConfig(min_kv_budget=opts.min_kv_budget, fallback=False)  # the selector's own τ, no plain steps
    n_sel, fine = len(opts.selectors), 2 * opts.fine_steps + 1
    # a point whose configuration (None: plain decoding) differs from the last one run first runs once
    # untimed, on the same prompts (the batch and the context shape what is compiled and captured) with
    # fewer new tokens: a backend may build an engine per configuration (vLLM keeps one engine, built again
    # for each new one: its full CUDA graphs hold the selection), whose first calls pay one-off costs (on
    # the H200, 2026-12-04, a warm-up of one 64-token prompt left the first timed run at 50 tok/s, 4 % of the
    # next two)
    total = n_sel * len(opts.sparsities) + 2 + n_sel * len(opts.gammas) + n_sel * fine
    state = {"last": 0.0, "reused": 0, "measured": 0, "config": ()}
    skipped = SelectorSkips(opts.skip_failing, plain_printer(console, "yellow"))

    def live() -> list[str]:
        return [sel for sel in opts.selectors if sel not in skipped]

    def measure(step: int, selector: str | None, gamma: int, sparsity: float | None) -> dict | None:
        """The point, from ``points.json`` or measured now (and stored); None when the selector
        raised and is skipped (``opts.skip_failing``)."""
        found = store.find(step=step, selector=selector, num_draft_tokens=gamma if selector else 1,
                           sparsity_ratio=round_sparsity(sparsity) if selector else None)
        label = "plain decoding" if selector is None else f"{selector} γ={gamma} sparsity={round_sparsity(sparsity):g}"
        if found is not None:
            progress.skip(task)
            state["reused"] += 1
            return found
        if (opts.time_budget is not None and state["measured"]
                and time.monotonic() - started + state["last"] > opts.time_budget):  # each run measures one at least
            raise _OutOfTime(f"step {step}: {label}")
        cfg = replace(base, num_draft_tokens=gamma, sparsity_ratio=sparsity or base.sparsity_ratio)
        pipe.config = cfg
        t0 = time.monotonic()  # the warm-up counts: the time budget judges the next point by this one
        try:
            if state["config"] != (selector, gamma, sparsity):
                progress.update(task, description=f"warm-up: {label}")
                pipe.generate(prompts, max_new_tokens=min(opts.new_tokens, 2 * (gamma + 1)), selector=selector,
                              **sampled)
                state["config"] = (selector, gamma, sparsity)
            progress.update(task, description=f"step {step}: {label}")
            runs = [summarize(pipe.generate(prompts, max_new_tokens=opts.new_tokens, selector=selector,
                                            **{**sampled, "seed": opts.seed + r}))
                    for r in range(opts.repeats)]
        except VegasPluginError as exc:
            if selector is None:
                raise
            skipped.skip(selector, exc)
            progress.skip(task)  # no 'done' line: the step did not finish
            return None
        state["last"] = time.monotonic() - t0
        point = {
            "step": step, "selector": selector, "num_draft_tokens": gamma,
            "sparsity_ratio": round_sparsity(sparsity) if selector else None,
            "kv_budget": kv_budget_for(cfg, opts.context) if selector else None,
            **median_row(runs), "wall_seconds": state["last"], "measured_at": time.time(),
        }
        store.add(point)
        state["measured"] += 1
        progress.advance(task, note=f"τ {point['acceptance_length']:.2f}, {point['tokens_per_second']:.2f} tok/s")
        return point

    stopped, config_before = None, pipe.config
    with LoggedProgress(console=console, transient=True) as progress:
        task = progress.add_task("vegas tune", total=total)
        try:
            for sel in opts.selectors:  # step 1
                for s in opts.sparsities:
                    if measure(1, sel, opts.num_draft_tokens, s) is None:
                        break  # skipped: a plugin selector that raised
            measure(2, None, 1, None)  # plain decoding, the speedup's reference
            for sel in live():  # step 2
                s = _knee_of(store.points, sel, opts)["sparsity_ratio"]
                for g in opts.gammas:
                    if measure(2, sel, g, s) is None:
                        break
            measure(3, None, 1, None)
            for sel in live():  # step 3
                s = _knee_of(store.points, sel, opts)["sparsity_ratio"]
                g = _best_gamma(store.points, sel, s, opts)
                for f in fine_grid(s, opts.fine_factor, opts.fine_steps):
                    if measure(3, sel, g, f) is None:
                        break
        except _OutOfTime as exc:
            stopped = f"time budget of {opts.time_budget:g} s reached before {exc.args[0]}"
            console.print(f"[yellow]{stopped}; writing what was measured[/yellow]")
        finally:
            pipe.config = config_before
    recommendation = recommend(store.points, replace(opts, selectors=live()))
    recommendation["skipped"] = dict(skipped)
    recommendation["complete"] = stopped is None
    recommendation["stopped"] = stopped
    recommendation["elapsed_seconds"] = time.monotonic() - started
    recommendation["reused_points"] = state["reused"]
    recommendation["measured_points"] = state["measured"]
    out.mkdir(parents=True, exist_ok=True)  # only now: every check passed (the first point makes it too)
    (out / RECOMMENDATION_FILE).write_text(json.dumps(recommendation, indent=2))
    from .plots import plot_tune

    recommendation["plots"] = plot_tune(store.points, recommendation, opts, out)
    (out / RECOMMENDATION_FILE).write_text(json.dumps(recommendation, indent=2))
    return recommendation


def _curve(points: list[dict], selector: str, opts: TuneOptions) -> list[dict]:
    """Step 1's points of ``selector``: ``opts.sparsities`` at ``opts.num_draft_tokens``."""
    grid = {round_sparsity(s) for s in opts.sparsities}
    return [p for p in points_of(points, 1, selector, opts.num_draft_tokens) if p["sparsity_ratio"] in grid]


def _knee_of(points: list[dict], selector: str, opts: TuneOptions) -> dict | None:
    """Step 1's knee over :func:`_curve`."""
    return knee(_curve(points, selector, opts), opts.tolerance)


def _tau_point(p: dict) -> dict:
    """Sparsity, KV budget, τ (of the median run) and τ's spread (max − min over runs) of a point."""
    return {"sparsity_ratio": p["sparsity_ratio"], "kv_budget": p["kv_budget"],
            "acceptance_length": p["acceptance_length"], "acceptance_length_spread": p.get("acceptance_length_spread", 0.0)}


def _best_gamma(points: list[dict], selector: str, sparsity: float, opts: TuneOptions) -> int:
    """Step 2's γ at the knee: step 1's γ (the smallest of ``opts.gammas`` if it is not one)
    unless another is clearly faster; step 1's γ while none is measured."""
    curve = [p for p in points_of(points, 2, selector, sparsity=sparsity) if p["num_draft_tokens"] in opts.gammas]
    preferred = opts.num_draft_tokens if opts.num_draft_tokens in opts.gammas else min(opts.gammas)
    best = best_by_throughput(curve, next((p for p in curve if p["num_draft_tokens"] == preferred), None))
    return best["num_draft_tokens"] if best else opts.num_draft_tokens


def recommend(points: list[dict], opts: TuneOptions) -> dict:
    """The chosen point per selector and overall, from whatever ``points`` holds.

    Per selector: the knee sparsity (step 1), the γ at it (step 2), the sparsity of the fine
    grid at that γ (step 3), each kept unless another point is clearly faster; a step without
    points keeps the previous step's choice (γ of step 1, the knee). The speedup divides by
    plain decoding of the chosen point's step. ``best``: the selector whose chosen point has
    the highest tokens/s; ``recommended``: its name when it is clearly faster than plain
    decoding, ``"none"`` (plain decoding) when it is not, None while plain decoding of its step
    is not measured (a run cut short by its time budget).
    """
    plain = {step: next(iter(points_of(points, step, None)), None) for step in (2, 3)}
    per: dict[str, dict] = {}
    for sel in opts.selectors:
        k = _knee_of(points, sel, opts)
        if k is None:
            continue
        gamma = _best_gamma(points, sel, k["sparsity_ratio"], opts)
        grid = fine_grid(k["sparsity_ratio"], opts.fine_factor, opts.fine_steps)
        fine = [p for p in points_of(points, 3, sel, gamma) if p["sparsity_ratio"] in grid]
        at_knee = next((p for p in fine if p["sparsity_ratio"] == k["sparsity_ratio"]), None)
        step2 = points_of(points, 2, sel, gamma, k["sparsity_ratio"])
        chosen = best_by_throughput(fine, at_knee) or best_by_throughput(step2) or k
        ref = plain.get(chosen["step"])
        cfg = VegasConfig(num_draft_tokens=chosen["num_draft_tokens"], sparsity_ratio=chosen["sparsity_ratio"],
                          min_kv_budget=opts.min_kv_budget)
        per[sel] = {
            "knee": {**_tau_point(k), "num_draft_tokens": k["num_draft_tokens"],
                     "best": _tau_point(max(_curve(points, sel, opts), key=lambda p: p["acceptance_length"]))},
            "step": chosen["step"],
            "num_draft_tokens": chosen["num_draft_tokens"],
            "sparsity_ratio": chosen["sparsity_ratio"],
            "kv_budget": chosen["kv_budget"],
            "acceptance_length": chosen["acceptance_length"],
            "tokens_per_second": chosen["tokens_per_second"],
            "speedup": chosen["tokens_per_second"] / ref["tokens_per_second"] if ref else None,
            "faster_than_plain": bool(ref) and clearly_faster(chosen, ref),
            "config": asdict(cfg),
            "vllm": vllm_settings(sel, cfg),
        }
    best = max(per, key=lambda s: per[s]["tokens_per_second"], default=None)
    if best is None or per[best]["speedup"] is None:
        recommended = None  # nothing, or no plain decoding to compare with, measured yet
    else:
        recommended = best if per[best]["faster_than_plain"] else PLAIN
    return {
        "best": {"selector": best, **per[best]} if best else None,
        "recommended": recommended,
        "selectors": per,
        "plain_tokens_per_second": {str(step): p["tokens_per_second"] for step, p in plain.items() if p},
        "rule": f"knee: smallest sparsity with τ >= (1 - {opts.tolerance:g}) × best τ at γ={opts.num_draft_tokens}; "
                "or within the spread of the two; then the γ at the knee, and the sparsity of knee × "
                f"{opts.fine_factor:g}^k, |k| <= {opts.fine_steps}, at that γ: γ={opts.num_draft_tokens} and the knee "
                "unless another point's median tokens/s is higher by more than the spread of the two; plain "
                "decoding unless the best selector is faster by more than the spread",
        "context": opts.context,
        "tolerance": opts.tolerance,
        "points": len(points),
    }


def config_args(config: dict) -> str:
    """``name=value, ...`` of the config fields that differ from :class:`VegasConfig`'s defaults."""
    default = asdict(VegasConfig())
    return ", ".join(f"{k}={v!r}" for k, v in config.items() if default.get(k) != v)


def _knee_line(k: dict, recommendation: dict) -> str:
    """Why step 1 chose its knee: its τ against the curve's best τ, each with its spread."""
    top = k["best"]
    tol = recommendation.get("tolerance")
    within = f"within {tol:.0%} or within the spread" if tol is not None else "within the tolerance or the spread"
    return (f"  knee (step 1, γ={k['num_draft_tokens']}): sparsity {k['sparsity_ratio']:g}, τ {k['acceptance_length']:.2f} "
            f"(spread {k['acceptance_length_spread']:.2f}) against the best τ {top['acceptance_length']:.2f} "
            f"(spread {top['acceptance_length_spread']:.2f}) at sparsity {top['sparsity_ratio']:g}: the smallest "
            f"sparsity {within} (τ of each point's median run; spread = max − min over its runs)")


def describe(recommendation: dict) -> list[str]:
    """Lines that tell a person what to use (printed by ``vegas tune``): the best selector's
    point, and either its settings or, where it is not clearly faster, plain decoding."""
    best = recommendation["best"]
    if best is None:
        return ["no point was measured: nothing to recommend (raise --time-budget)"]
    speed = f", {best['speedup']:.2f}× plain" if best["speedup"] else ", plain decoding not measured"
    point = (f"selector {best['selector']}, γ={best['num_draft_tokens']}, sparsity {best['sparsity_ratio']:g} "
             f"(KV budget {best['kv_budget']} of {recommendation['context']} tokens): τ {best['acceptance_length']:.2f}, "
             f"{best['tokens_per_second']:.2f} tok/s{speed}")
    if recommendation["recommended"] is None:
        lines = [f"no recommendation yet: plain decoding is not measured, so the best point so far, {point}, has "
                 "nothing to be compared with"]
    elif recommendation["recommended"] == PLAIN:
        slower = best["speedup"] is not None and best["speedup"] < 1.0
        lines = [
            f"plain decoding is faster on this machine: the best point, {point}, is slower than plain decoding" if slower
            else f"plain decoding is as fast or faster on this machine: the best point, {point}, is not faster than "
            "plain decoding by more than the spread of their runs",
            f"recommended: plain decoding (selector {PLAIN!r}): Pipeline(selector={PLAIN!r}), vegas generate ... "
            f"--selector {PLAIN}, vegas serve MODEL --selector {PLAIN}",
        ]
    else:
        args = config_args(best["config"])
        lines = [f"recommended: {point}", _knee_line(best["knee"], recommendation),
                 f"  VegasConfig({args})", f"  Pipeline(selector={best['selector']!r}, {args})"]
        v = best["vllm"]
        spec = json.dumps(v["speculative_config"])
        extra = v.get("additional_config")
        if extra is None:
            lines.append(f"  vLLM: selector {best['selector']!r} is not available on the vllm backend")
        else:
            lines.append(f"  vLLM server: vegas serve MODEL --config '{json.dumps(extra['vegas'])}' "
                         f"-g {best['num_draft_tokens']}   (docs/serving.md)")
            lines.append(f"  or by hand: vllm serve MODEL --attention-backend FLASH_ATTN --speculative-config '{spec}' "
                         f"--additional-config '{json.dumps(extra)}'")
    for name in recommendation.get("skipped", {}):
        lines.append(f"  skipped selector {name} (plugin error, above); name the selectors with --selectors to leave it out")
    if not recommendation.get("complete", True):
        lines.append(f"  incomplete: {recommendation['stopped']}; rerun the same command to resume")
    return lines
