"""``vegas ablate``: the studies behind the method's claims, on one model and one prompt set.

Every point runs ``num_prompts`` prompts through the HF backend (CPU or CUDA) and records the
acceptance length τ (tokens emitted per iteration, accepted drafts + the bonus token) of each
prompt, with its mean, a 95 % bootstrap interval of the mean and the min–max over prompts.
Decoding samples (T = 0.8, top-p 0.95 by default; ``temperature=0`` measures greedy τ, which
loops on small models). Plain-step fallback is off (each selector's own τ), and the KV budget
is ``ceil(sparsity × context)`` (``min_kv_budget`` 0). Selectors attend different numbers of
KV entries at one budget (Quest attends its partial page and the verified chunk beside the
budget's pages), so every point also records ``kv_attended``, the KV entries per layer a
draft query attended (:attr:`vegas.outputs.RequestStats.kv_attended`), shown beside τ.

Studies (``studies``):

* ``budget``: τ over the sparsities ``budgets`` for every selector (``selectors``; default:
  every registered one plus ``oracle``, :class:`~vegas.strategies.OracleSelector`, the exact
  top-k of each draft query) at each of ``contexts``. A context beyond the model's gets YaRN
  (``rope_scaling``) with ``yarn_factor``, by default the smallest power of two that fits
  (:func:`rope_for`).
* ``ablation``: at the first context and ``ablation_sparsity``, ``aggregated``, ``collect2``
  and ``last_token`` with each of the config variants :data:`VARIANTS` (softmax-weight
  ranking, one set per KV head, no recent window), and each γ of ``gammas``.
* ``overlap``: at the first context, ``ablation_sparsity`` and γ = max(``gammas``),
  :class:`~vegas.overlap.OverlapProbe` (drafts as ``collect2``): Jaccard of the top-k sets of
  queries t and t + d within a verified chunk and across iterations, and of each proxy's set
  with the next chunk's queries.
* ``retrieval``: copy-task prompts (:func:`~vegas.prompts.retrieval_prompts`: the prompt ends
  with the start of a function defined more than half a context back) at each of ``contexts``,
  every selector and sparsity as in ``budget``; also the tokens copied exactly.

A point is identified by (prompt kind, selector, context, sparsity, γ, variant), so studies
share points (the ablation's default variant is a budget point when ``ablation_sparsity`` is
one of ``budgets``). Points are appended to ``OUT/points.json`` as they are measured
(:class:`~vegas.tune_points.PointStore`, as ``vegas tune``); a rerun with the same measurement
settings skips them, so a study can be extended (more contexts, budgets) or run in pieces
(``time_budget``). Plots and ``OUT/tables.md`` are drawn from whatever is measured
(:func:`vegas.plots.plot_ablate`).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console

from .config import VegasConfig, VegasConfigError, VegasPluginError, kv_budget_for
from .overlap import OverlapProbe
from .pipeline import Pipeline
from .plots import ABLATED
from .plugins import SelectorSkips, create_selector, selector_names
from .progress import LoggedProgress, plain_printer
from .prompts import (
    RETRIEVAL_MIN_CONTEXT,
    cut_contexts,
    heldout_path,
    prompt_text,
    retrieval_prompts,
    source_label,
)
from .sampling import SamplingParams
from .strategies import OracleSelector
from .tune_points import (
    PointStore,
    round_sparsity,
    same_setting,
    settings_device,
    source_settings,
    spread,
)

__all__ = ["AblateOptions", "AblateStopped", "run_ablate", "plan", "spread", "rope_for", "STUDIES", "VARIANTS", "QUICK"]

POINTS_FILE = "points.json"
STUDIES = ("budget", "ablation", "overlap", "retrieval")
ORACLE = "oracle"
PROBE = "overlap_probe"
#: config variants of the ablation study: name -> VegasConfig overrides
VARIANTS = {
    "default": {},
    "score_mode=weight": {"score_mode": "weight"},
    "granularity=kv_head": {"granularity": "kv_head"},
    "recent_window=0": {"recent_window": 0},
}
#: ``--quick``: every study, small (a CPU look at the command; not results)
QUICK = {"contexts": [1024], "budgets": [0.02, 0.1], "gammas": [2, 4], "num_prompts": 4, "batch_size": 4,
         "new_tokens": 32,
         "time_budget": 570.0}  # seconds: --quick stops before a point that would not end within 10 minutes (rerun
                                 # resumes), as tune's; each run measures one point at least
#: with one batch for all prompts (``batch_size`` >= ``num_prompts``) the HF backend keeps that batch
#: prefilled (``reuse_prefill``, :class:`~vegas.backends.hf.PrefillPrefix`): every point decodes the same
#: prompts, so a context's prompts are prefilled once, not once per point (the same tokens; the prefill of
#: 32 prompts of 32K tokens is ~1e15 float32 FLOPs, ~2 minutes on the H200). With several batches a point
#: never meets the batch the last one ended with, so nothing is kept
REUSE = {"reuse_prefill": True}
#: options whose change alters what a point measures: a rerun must match them to resume
MEASUREMENT_SETTINGS = ("model", "prompts", "new_tokens", "batch_size", "num_prompts", "temperature", "top_p",
                        "seed", "dtype", "device", "max_distance", "yarn_factor")


@dataclass
class AblateOptions:
    """Options of ``vegas ablate`` (see ``vegas ablate --help``).

    Units: ``contexts``, ``new_tokens`` in tokens; ``budgets`` and ``ablation_sparsity`` are
    KV budget / context in (0, 1]; ``gammas``, ``num_draft_tokens`` draft tokens per
    iteration; ``max_distance`` tokens; ``time_budget`` seconds.
    """

    model: str | None = None
    studies: list[str] = field(default_factory=lambda: list(STUDIES))
    selectors: list[str] | None = None  # None: every registered selector, plus oracle
    contexts: list[int] = field(default_factory=lambda: [4096, 8000, 16000, 32000])
    budgets: list[float] = field(default_factory=lambda: [0.01, 0.02, 0.05, 0.1, 0.2])
    num_draft_tokens: int = 4
    gammas: list[int] = field(default_factory=lambda: [2, 4, 6, 8])
    ablation_sparsity: float = 0.02
    num_prompts: int = 32
    batch_size: int = 8
    new_tokens: int = 64
    max_distance: int = 8
    yarn_factor: float | None = None  # None: the smallest power of two that fits (rope_for)
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    dtype: str = "float32"
    device: str | None = None
    prompts: str | None = None  # default: the checkout's held-out code, else installed click source
    out: str = "vegas-ablate"
    time_budget: float | None = None
    fresh: bool = False


def raise_if_bad_options(opts: AblateOptions) -> None:
    """Check ``opts`` before any model is loaded.

    Raises:
        VegasConfigError: the message names the option (``--flag``) and its allowed values.
    """
    unknown = [s for s in opts.studies if s not in STUDIES]
    if not opts.studies or unknown:
        raise VegasConfigError(f"studies (--studies) must be among {', '.join(STUDIES)}, got {opts.studies!r}")
    known = selector_names() + [ORACLE]
    bad = [s for s in opts.selectors or [] if s not in known]
    if opts.selectors is not None and (not opts.selectors or bad):
        raise VegasConfigError(f"selectors (--selectors) must be among {', '.join(known)}, got {opts.selectors!r}")
    for name, values, kind, low in (("contexts", opts.contexts, int, 2), ("gammas", opts.gammas, int, 1)):
        if not values or any(isinstance(v, bool) or not isinstance(v, kind) or v < low for v in values):
            raise VegasConfigError(f"{name} (--{name}) must be integers >= {low}, got {values!r}")
    if "retrieval" in opts.studies and min(opts.contexts) < RETRIEVAL_MIN_CONTEXT:
        raise VegasConfigError(f"contexts (--contexts) must be integers >= {RETRIEVAL_MIN_CONTEXT} with the retrieval "
                               f"study (a copy prompt needs its passage, far back, and a cue), got {opts.contexts!r}")
    for name, value, what, shown in (("budgets", opts.budgets, "numbers", opts.budgets),
                                     ("ablation_sparsity", [opts.ablation_sparsity], "a number", opts.ablation_sparsity)):
        if not value or any(isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1 for s in value):
            raise VegasConfigError(f"{name} (--{name.replace('_', '-')}) must be {what} in (0, 1], got {shown!r}")
    for name in ("num_draft_tokens", "num_prompts", "batch_size", "new_tokens", "max_distance"):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise VegasConfigError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, got {value!r}")
    if opts.yarn_factor is not None and not (isinstance(opts.yarn_factor, (int, float)) and opts.yarn_factor > 1):
        raise VegasConfigError(f"yarn_factor (--yarn-factor) must be a number > 1, got {opts.yarn_factor!r}")
    if opts.time_budget is not None and not opts.time_budget > 0:
        raise VegasConfigError(f"time_budget (--time-budget) must be seconds > 0, got {opts.time_budget!r}")
    SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)


def rope_for(context: int, room: int, max_context: int, factor: float | None = None) -> dict | None:
    """YaRN for a context beyond the model's: ``factor``, or by default the smallest power of two
    whose context fits ``context + room`` tokens (None when the model's ``max_context`` does)."""
    if context + room <= max_context:
        return None
    factor = factor or 2 ** math.ceil(math.log2((context + room) / max_context))
    return {"rope_type": "yarn", "factor": float(factor)}


def _raise_if_a_context_does_not_fit(opts: AblateOptions, room_for, max_context: int) -> None:
    """Before the first point: every context of ``opts.contexts`` plus ``room_for(context)``
    (new tokens and the verification slots) fits ``max_context`` tokens, scaled by YaRN where
    :func:`rope_for` scales it.

    Raises:
        VegasConfigError: naming --contexts and --yarn-factor, and the largest context that fits.
    """
    for context in opts.contexts:
        room = room_for(context)
        rope = rope_for(context, room, max_context, opts.yarn_factor)
        factor = rope["factor"] if rope else 1.0
        if context + room > max_context * factor:
            fits, need = int(max_context * factor) - room, (context + room) / max_context
            raise VegasConfigError(
                f"contexts (--contexts): {context:,} tokens and {room} more (new tokens, γ + 1 verification slots) "
                f"do not fit the model's {max_context:,} tokens with YaRN ×{factor:g} (--yarn-factor); give contexts "
                f"of at most {fits:,} tokens, or a --yarn-factor of at least {math.ceil(need * 100) / 100:g} (left "
                f"out, it is the smallest power of two that fits: {rope_for(context, room, max_context)['factor']:g})")


def plan(opts: AblateOptions, selectors: list[str]) -> list[dict]:
    """Every point of ``opts.studies``, as ``{study, prompt_kind, selector, context,
    sparsity_ratio, num_draft_tokens, variant}``, duplicates (shared points) dropped, in the
    order measured: by context, then study."""
    first, g, s_abl = opts.contexts[0], opts.num_draft_tokens, round_sparsity(opts.ablation_sparsity)
    specs = []

    def add(study, kind, sel, ctx, s, gamma=g, variant="default"):
        specs.append({"study": study, "prompt_kind": kind, "selector": sel, "context": ctx,
                      "sparsity_ratio": round_sparsity(s), "num_draft_tokens": gamma, "variant": variant})

    for ctx in opts.contexts:
        if "budget" in opts.studies:
            for sel in selectors:
                for s in opts.budgets:
                    add("budget", "heldout", sel, ctx, s)
        if "ablation" in opts.studies and ctx == first:
            for sel in [s for s in ABLATED if s in selectors]:
                for variant in VARIANTS:
                    add("ablation", "heldout", sel, ctx, s_abl, variant=variant)
                for gamma in opts.gammas:
                    add("ablation", "heldout", sel, ctx, s_abl, gamma=gamma)
        if "overlap" in opts.studies and ctx == first:
            add("overlap", "heldout", PROBE, ctx, s_abl, gamma=max(opts.gammas))
        if "retrieval" in opts.studies:
            for sel in selectors:
                for s in opts.budgets:
                    add("retrieval", "retrieval", sel, ctx, s)
    seen, out = set(), []
    for spec in specs:
        key = tuple(v for k, v in spec.items() if k != "study")
        if key not in seen:
            seen.add(key)
            out.append(spec)
    return out


def _same_setting(key: str, old: dict, new: dict) -> bool:
    """:class:`~vegas.tune_points.PointStore`'s rule, with ``batch_size`` compared as the rows a
    batch really holds (at most ``num_prompts``: a larger ``--batch-size`` measures the same)."""
    if key == "batch_size":
        def rows(settings):
            return min(settings.get("batch_size") or 0, settings.get("num_prompts") or 0)

        # a changed --num-prompts alone is named as itself, not as a batch of other rows
        return old.get("batch_size") == new.get("batch_size") or rows(old) == rows(new)
    return same_setting(key, old, new)


def point_key(spec: dict) -> dict:
    """The fields that identify a point in ``points.json``."""
    return {k: v for k, v in spec.items() if k != "study"}


def _make_selector(name: str, config: VegasConfig, opts: AblateOptions):
    if name == ORACLE:
        return OracleSelector(config)
    if name == PROBE:
        return OverlapProbe(config, max_distance=opts.max_distance)
    return create_selector(name, config)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Prompts:
    """Held-out prompts per context (cut once per context and kind)."""

    def __init__(self, text: str, opts: AblateOptions) -> None:
        self.text, self.opts, self.ids, self.anchors, self.cache = text, opts, None, None, {}

    def get(self, pipe: Pipeline, kind: str, context: int) -> list[dict]:
        if (kind, context) not in self.cache:
            tok = pipe.tokenizer
            if self.ids is None:
                self.ids = tok(self.text, add_special_tokens=False, verbose=False).input_ids
            if kind == "heldout":
                rows = [{"prompt": p} for p in cut_contexts(self.ids, context, self.opts.num_prompts, "--contexts")]
            else:
                if self.anchors is None:  # a function definition starts at a "def" token
                    self.anchors = {t for t in set(self.ids) if tok.decode([t]).strip() == "def"}
                rows = retrieval_prompts(self.ids, context, self.opts.num_prompts, self.anchors,
                                         answer=self.opts.new_tokens)
            self.cache[(kind, context)] = rows
        return self.cache[(kind, context)]


class AblateStopped(Exception):
    """The run stopped (out of device memory, Ctrl-C) before any point was in ``points.json``:
    nothing to keep and nothing written. Not a bad option: ``vegas ablate`` says it in one line
    (exit status 1)."""


class _OutOfTime(Exception):
    pass


class _OutOfMemory(Exception):
    """A point ran out of device memory: ``(point name, the allocator's message in short)``."""


def _allocator_summary(exc: BaseException) -> str:
    """The allocator's message up to its request (CUDA's runs ~600 characters on one line and
    repeats advice given in :func:`_out_of_memory_advice`)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    request = re.match(r".*?Tried to allocate [\d.]+ (?:[KMGT]iB|bytes)", line)
    return request.group(0) if request else line[:200]


def _out_of_memory_advice(device: str, point_name: str, summary: str, kept: bool = True) -> str:
    """One line: the point that ran out of ``device`` memory, the allocator's ``summary``, whether
    points are ``kept``, what to change."""
    fragmentation = ("; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation"
                     if device.startswith("cuda")
                     and "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") else "")
    kept_here = "the points measured before it are kept in points.json" if kept else "nothing was written"
    return (f"out of {device} memory at {point_name} ({summary}); {kept_here}. "
            f"Free the device's memory{fragmentation}; then rerun the same command, or measure with a "
            "smaller --batch-size into another --out (the batch size is a measurement setting)")


def measure(pipe: Pipeline, rows: list[dict], spec: dict, opts: AblateOptions) -> dict:
    """One point: ``rows`` (prompts, and for retrieval their expected continuations) decoded in
    batches of ``opts.batch_size`` with the spec's selector and config (see :func:`plan`).

    Returns:
        the point: the spec, ``kv_budget``, ``kv_attended`` (the KV entries per layer a draft
        query attended, :attr:`~vegas.outputs.RequestStats.kv_attended`, mean over prompts; None
        if none drafted; points measured before it existed lack it),
        ``acceptance_length`` (mean τ over prompts),
        ``tau`` (:func:`spread`), ``tau_per_prompt``; ``copied_tokens`` (:func:`spread` of the
        tokens generated before the first that differs from the passage) for retrieval
        prompts; ``jaccard`` (series -> per index d or draft step: mean, min, max over prompts)
        for the overlap probe.
    """
    base = VegasConfig(min_kv_budget=0, fallback=False)
    config = replace(base, num_draft_tokens=spec["num_draft_tokens"], sparsity_ratio=spec["sparsity_ratio"],
                     **VARIANTS.get(spec["variant"], {}))
    taus, attended, copied, jaccard = [], [], [], {}
    started = time.monotonic()
    config_before, pipe.config = pipe.config, config
    try:  # the caller's pipeline keeps its own config afterwards
        for i in range(0, len(rows), opts.batch_size):
            batch = rows[i : i + opts.batch_size]
            selector = _make_selector(spec["selector"], config, opts)
            outs = pipe.generate([r["prompt"] for r in batch], max_new_tokens=opts.new_tokens, selector=selector,
                                 temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
            taus += [o.stats.acceptance_length for o in outs]
            attended += [o.stats.kv_attended for o in outs if o.stats.kv_attended is not None]
            copied += [_common_prefix(o.token_ids, r["expected"]) for o, r in zip(outs, batch) if "expected" in r]
            if isinstance(selector, OverlapProbe):
                for series, per_prompt in selector.results().items():
                    jaccard.setdefault(series, []).extend(per_prompt)
    finally:
        pipe.config = config_before
    point = {
        **spec,
        "kv_budget": kv_budget_for(config, spec["context"]),
        "kv_attended": sum(attended) / len(attended) if attended else None,
        "acceptance_length": sum(taus) / len(taus),
        "tau": spread(taus, opts.seed),
        "tau_per_prompt": taus,
        "wall_seconds": time.monotonic() - started,
        "measured_at": time.time(),
    }
    if copied:
        point["copied_tokens"] = spread([float(c) for c in copied], opts.seed)
        point["distance_tokens"] = sum(r["distance"] for r in rows) / len(rows)
    if jaccard:
        point["jaccard"] = {series: _columns(rows_) for series, rows_ in jaccard.items()}
    return point


def _columns(per_prompt: list[list[float | None]]) -> dict:
    """Per index: mean, min and max over the prompts that have a value there."""
    out = {"mean": [], "min": [], "max": []}
    for column in zip(*per_prompt):
        seen = [v for v in column if v is not None]
        out["mean"].append(sum(seen) / len(seen) if seen else None)
        out["min"].append(min(seen) if seen else None)
        out["max"].append(max(seen) if seen else None)
    return out


def _unmeasurable_here(device: str | None, missing: list[dict]) -> str | None:
    """Why the ``missing`` points cannot be measured here: ``--device cuda`` where torch sees no
    GPU (a folder measured on a GPU machine, replotted elsewhere); None when they can."""
    if not (device or "").startswith("cuda") or torch.cuda.is_available():
        return None
    contexts = ", ".join(f"{c:,}" for c in sorted({s["context"] for s in missing}))
    studies = ", ".join(sorted({s["study"] for s in missing}))
    names = ",".join(sorted({s["selector"] for s in missing if s["selector"] != PROBE}))
    selectors = (f"; selectors {names}; a selector installed here that the GPU run did not measure, e.g. a "
                 "plugin's, is left out by naming the others with --selectors") if names else ""
    return (f"{len(missing)} point(s) of the plan are not in points.json (studies {studies}; contexts {contexts}"
            f"{selectors}) "
            f"and --device {device!r} needs a CUDA GPU, which this torch build does not see (tables and plots hold "
            "what is measured)")


def run_ablate(opts: AblateOptions, console: Console | None = None, pipe: Pipeline | None = None) -> dict:
    """Measure every planned point not yet in ``opts.out/points.json``, then draw the plots.

    Args:
        opts: the options.
        console: where progress goes (stderr by default).
        pipe: a loaded pipeline for contexts it fits without RoPE scaling (tests); by default
            one is built per RoPE scaling.

    Returns:
        ``{"points": count in points.json, "planned": count of this run's plan, "measured": count,
        "reused": count, "complete": bool, "stopped":
        reason or None, "failed": reason or None, "resume": how to go on, "plots": [file names],
        "tables": "tables.md"}``;
        ``failed`` (also in ``stopped``) when a point ran out of device memory
        (``torch.OutOfMemoryError``) or the run was interrupted (Ctrl-C): the run stops there,
        keeps and plots what was measured.

    Raises:
        VegasConfigError: a bad option (named), ``points.json`` from other settings, a plan with
            no point (``--selectors`` naming none that ``--studies`` runs), or a context longer
            than the prompt source (checked before the first point).
        AblateStopped: out of memory, or Ctrl-C, in a point before any point is in ``points.json``
            (then nothing is written; Ctrl-C while the model loads is not caught: click says "Aborted!").
    """
    started = time.monotonic()
    console = console or Console(stderr=True)
    raise_if_bad_options(opts)
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise VegasConfigError(f"out (--out) {str(out)!r} exists and is not a directory")
    source = opts.prompts or (str(heldout_path()) if heldout_path() else None)
    source_name = source_label(source)
    if source is None:
        console.print("[yellow]prompts: installed click source; the held-out set (benchmarks/data/"
                      "heldout_code_dev.jsonl.xz) is not here: run from a checkout or pass --prompts[/yellow]")
    # a bad --prompts file or --device is named as such, before points.json's settings are compared
    text = prompt_text(source)
    settings = source_settings({**{k: getattr(opts, k) for k in MEASUREMENT_SETTINGS},
                                "prompts": source or "package:click", "device": settings_device(opts.device)})
    store = PointStore(out / POINTS_FILE, settings, opts.fresh, "vegas ablate", same=_same_setting)
    skipped = SelectorSkips(opts.selectors is None, plain_printer(console, "yellow"))  # "all": one that raises is left out
    selectors = opts.selectors or selector_names() + [ORACLE]
    specs = plan(opts, selectors)
    planned = len(specs)  # specs empties on a replot without a GPU
    if not specs:  # only the ablation study, with none of the selectors it ablates
        raise VegasConfigError.bad("selectors", f"names none of the selectors that --studies "
                                   f"{','.join(opts.studies)} runs: the ablation study ablates {', '.join(ABLATED)}, "
                                   f"got {','.join(selectors)}")
    prompts = _Prompts(text, opts)
    pipes: dict[str, Pipeline] = {}
    state = {"measured": 0, "reused": 0, "last": 0.0, "fits": False}

    def room_for(context: int) -> int:
        """New tokens and the verification's γ + 1 slots; --gammas only where a study runs them (the
        ablation and overlap studies, at the first context)."""
        gammas = opts.gammas if context == opts.contexts[0] and {"ablation", "overlap"} & set(opts.studies) else []
        return opts.new_tokens + max(gammas + [opts.num_draft_tokens]) + 1

    reuse = REUSE if opts.batch_size >= opts.num_prompts else None

    def pipeline_for(context: int) -> tuple[Pipeline, dict | None]:
        native = pipe or pipes.get("native")
        if native is None:
            native = pipes["native"] = Pipeline(opts.model, selector=None, dtype=opts.dtype, device=opts.device,
                                                backend_options=reuse)
        if not state["fits"]:  # before any model with RoPE scaling loads
            _raise_if_a_context_does_not_fit(opts, room_for, native.backend.max_context)
            state["fits"] = True
        rope = rope_for(context, room_for(context), native.backend.max_context, opts.yarn_factor)
        if rope is None:
            return native, None
        key = str(rope)
        if key not in pipes:
            for k in [k for k in pipes if k != "native"]:  # one scaled model at a time
                del pipes[k]
            how = "--yarn-factor" if opts.yarn_factor else "the smallest power of two that fits; --yarn-factor sets it"
            console.print(f"[yellow]context {context:,}: beyond the model's {native.backend.max_context:,} tokens, "
                          f"so its RoPE is scaled with YaRN ×{rope['factor']:g} ({how}); τ there is the scaled "
                          "model's[/yellow]")
            pipes[key] = Pipeline(opts.model, selector=None, dtype=opts.dtype, device=opts.device, rope_scaling=rope,
                                  backend_options=reuse)
        return pipes[key], rope

    missing = [s for s in specs if store.find(**point_key(s)) is None]
    failed, where = None, ""
    stopped = _unmeasurable_here(opts.device, missing) if pipe is None and missing else None
    if stopped and not store.points:
        raise VegasConfigError.bad("device", f"{opts.device!r} needs a CUDA GPU, and this torch build sees none")
    if stopped:
        state["reused"], specs = len(specs) - len(missing), []  # replot only: no model is converted or loaded
        where = " on a machine with a CUDA GPU"
        console.print(f"[yellow]{len(missing)} point(s) need a CUDA GPU; plotting what was measured[/yellow]")
    elif pipe is None and missing:
        try:  # the model loads (or a bad --model / --device is named) before the progress bar
            pipeline_for(opts.contexts[0])
        except torch.OutOfMemoryError as exc:  # before any point: nothing to keep, nothing written
            raise AblateStopped(_out_of_memory_advice(settings_device(opts.device), "the model's load",
                                                      _allocator_summary(exc), kept=False)) from exc
    if not stopped:  # every context's prompts are cut before the first point: one too long for the source is
        for spec in missing:  # named now, with nothing written (the tokenizer is the same at every RoPE scaling)
            prompts.get(pipe or pipes["native"], spec["prompt_kind"], spec["context"])
    with LoggedProgress(console=console, transient=True) as progress:
        task = progress.add_task("vegas ablate", total=len(specs))
        point_name = "the first point"
        try:
            for spec in specs:
                if store.find(**point_key(spec)) is not None:
                    state["reused"] += 1
                    progress.skip(task)  # no "done" line naming the previous point
                    continue
                if spec["selector"] in skipped:
                    progress.skip(task)
                    continue
                point_name = (f"{spec['study']}: {spec['selector']} ctx {spec['context']} "
                              f"s={spec['sparsity_ratio']:g} γ={spec['num_draft_tokens']} {spec['variant']}")
                if (opts.time_budget is not None and state["measured"]  # each run measures one point at least
                        and time.monotonic() - started + state["last"] > opts.time_budget):
                    raise _OutOfTime(point_name)
                progress.update(task, description=point_name)
                try:  # a point's model (another RoPE scaling) may load here: out of memory too
                    p, rope = pipeline_for(spec["context"])
                    rows = prompts.get(p, spec["prompt_kind"], spec["context"])
                    point = {**measure(p, rows, spec, opts), "rope_scaling": rope}
                except VegasPluginError as exc:
                    skipped.skip(spec["selector"], exc)
                    progress.advance(task)
                    continue
                except torch.OutOfMemoryError as exc:
                    raise _OutOfMemory(point_name, _allocator_summary(exc)) from exc
                state["last"] = point["wall_seconds"]
                store.add(point)
                state["measured"] += 1
                attended = "" if point["kv_attended"] is None else f", attended {point['kv_attended']:.1f}"
                progress.advance(task, note=f"τ {point['acceptance_length']:.2f}{attended}")
        except _OutOfTime as exc:
            stopped = f"time budget of {opts.time_budget:g} s reached before {exc.args[0]}"
            plain_printer(console, "yellow")(f"{stopped}; plotting what was measured (rerun to resume)")
        except KeyboardInterrupt:  # Ctrl-C: what was measured is tabulated and plotted, as at a time budget
            if not store.points:
                raise AblateStopped(f"interrupted at {point_name}, before any point was measured; nothing "
                                    "written") from None
            failed = stopped = (f"interrupted at {point_name}; the points measured before it are kept in points.json: "
                                "rerun the same command to resume")
            plain_printer(console, "red")(f"interrupted at {point_name}; plotting what was measured")
        except _OutOfMemory as exc:
            failed = stopped = _out_of_memory_advice(settings_device(opts.device), *exc.args, kept=bool(store.points))
            if not store.points:
                raise AblateStopped(failed) from None
            plain_printer(console, "red")(f"out of memory at {exc.args[0]}; plotting what was measured")
    out.mkdir(parents=True, exist_ok=True)  # only now: every check passed (the first point makes it too)
    from .plots import ABLATE_PLOTS, plot_ablate, write_ablate_tables

    write_ablate_tables(store.points, out / "tables.md", source=source_name)
    if opts.fresh:  # the discarded points' plots go with them (a resume keeps those its options do not redraw)
        for name in ABLATE_PLOTS:
            (out / name).unlink(missing_ok=True)
    try:
        plots = plot_ablate(store.points, opts, out, source=source_name)
    except ImportError as exc:  # a machine without matplotlib (e.g. a GPU box with a fixed environment)
        plots = []
        console.print(f"[yellow]plots not drawn ({exc}): install matplotlib and rerun the same command to draw "
                      f"them; {out / 'points.json'} and {out / 'tables.md'} are written[/yellow]")
    return {"points": len(store.points), "planned": planned, "measured": state["measured"],
            "reused": state["reused"],
            "complete": stopped is None and not skipped, "stopped": stopped, "failed": failed,
            "resume": f"rerun the same command{where} to resume",
            "skipped": dict(skipped), "plots": plots,
            "tables": "tables.md", "options": asdict(opts)}
