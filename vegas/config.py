"""Validated configuration of a Vegas run.

Every field is checked once, at construction; a bad value raises
:class:`VegasConfigError` whose message names the parameter and the allowed values.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypeVar

__all__ = [
    "DRAFT_POLICY_FIELDS",
    "SCORE_PATHS",
    "TP_SELECTIONS",
    "VERIFY_CUDA_GRAPH_MODES",
    "VegasConfig",
    "VegasConfigError",
    "VllmOptions",
    "check_device_name",
    "kv_budget_for",
    "parse_json_object",
    "recent_window_for",
]

#: how tensor-parallel ranks select on the vLLM backend (each rank holds a slice of the heads)
TP_SELECTIONS = ("all_reduce", "per_rank")
#: CUDA-graph modes of the vLLM backend's verification forward
VERIFY_CUDA_GRAPH_MODES = ("full", "piecewise")
#: where the vLLM backend's verification scores come from (``VegasConfig.vllm.score_path``)
SCORE_PATHS = ("auto", "cute")
#: how the vLLM backend's V2 runner verifies seeded requests (``VegasConfig.vllm.seeded_verification``)
SEEDED_VERIFICATIONS = ("rejection", "coupled")
#: default largest row count (requests) the vLLM backend captures a draft CUDA graph for
DEFAULT_DRAFT_GRAPH_MAX_ROWS = 256
#: default cost of one sparse draft forward over one plain decode step: the dummy Qwen3-8B
#: H200 latencies (docs/vllm.md) measured 6.2 ms against 22.5 ms at 128K (0.28) and 5.3 against
#: 6.3 ms at 32K (0.84); the long-context ratio, which makes fallback conservative elsewhere
DEFAULT_FALLBACK_DRAFT_COST = 0.28
#: default cost of one verification of γ + 1 tokens (with scores and selection) over one plain
#: decode step (decode is bandwidth-bound: γ + 1 queries cost little more than one, plus the
#: score pass)
DEFAULT_FALLBACK_VERIFY_COST = 1.1

Budget = TypeVar("Budget")  # int, or a torch.LongTensor of any shape


class VegasConfigError(ValueError):
    """A parameter of a Vegas run is outside its allowed values.

    Args:
        message: the whole message (names the parameter, says how to fix it).
        field: the parameter at fault when there is one (a :class:`VegasConfig` field or an
            argument name), so that a front end can name it its own way (the CLI: its flag).
        problem: the message without the parameter's name (default: ``message``).
    """

    def __init__(self, message: str, *, field: str | None = None, problem: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.problem = problem or message

    @classmethod
    def bad(cls, field: str, problem: str) -> VegasConfigError:
        """``"<field> <problem>"``, with ``field`` and ``problem`` kept for front ends."""
        return cls(f"{field} {problem}", field=field, problem=problem)


class VegasPluginError(VegasConfigError):
    """A selector or backend failed to build or raised while running; the message names it and
    the plugin that registered it (the original exception is chained as ``__cause__``)."""


def _raise_if_not_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise VegasConfigError.bad(name, f"must be an integer >= {minimum}, got {value!r}")


def _raise_if_not_number(name: str, value: object, *, positive: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise VegasConfigError.bad(name, f"must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def _raise_if_not_one_of(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise VegasConfigError.bad(name, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")


_DEVICE_NAME = re.compile(r"(cpu|cuda)(:[0-9]+)?")


def check_device_name(device: str) -> None:
    """Raise :class:`VegasConfigError` (field ``device``) unless ``device`` names a device the
    backends run on: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (whether that GPU exists is the
    backend's check)."""
    if not isinstance(device, str) or not _DEVICE_NAME.fullmatch(device):
        raise VegasConfigError.bad("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def parse_json_object(raw: str, source: str) -> dict[str, Any]:
    """``raw`` parsed as a JSON object (``source`` names it in errors).

    Raises:
        VegasConfigError: not JSON, or JSON but not an object.
    """
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise VegasConfigError(f"{source} must be a JSON object: {e}") from None
    if not isinstance(values, dict):
        raise VegasConfigError(f"{source} must be a JSON object, got {raw!r}")
    return values


def _raise_if_unknown(values: dict, cls: type, source: str) -> None:
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise VegasConfigError(f"{source}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(known)}")


@dataclass(frozen=True)
class VllmOptions:
    """Settings that only the vLLM backend reads (the nested ``VegasConfig.vllm``).

    Args:
        tp_selection: with tensor parallelism, ``"all_reduce"`` sums every rank's per-layer
            scores (its heads' share of the head sum) before the top-k, so all ranks select what
            one GPU would (one float32 all-reduce of ``layers x batch x context`` per
            verification); ``"per_rank"`` selects from each rank's own heads without
            communication. Ignored on one GPU.
        verify_cuda_graphs: ``"full"``: verification runs in vLLM's full CUDA graphs with the
            selection captured into them (the selector and budget are then fixed per engine);
            ``"piecewise"``: attention and selection run eagerly every step. A selector without
            a fast path always runs piecewise.
        draft_cuda_graphs: capture each draft phase (γ forwards) as one CUDA graph per row
            bucket (1, 2, 4, 8, then multiples of 8, of 16 above 256 rows); False drafts eagerly.
        draft_graph_max_rows: largest row count (requests) a draft graph is captured for;
            larger batches draft eagerly. Integer >= 1.
        prefill_skip_tokens: a runner forward that carries at least this many prompt tokens
            (tokens beyond ``γ + 1`` per request: a prefill chunk) neither selects nor drafts:
            it costs what plain vLLM's step costs, so prompts waiting behind it (time to first
            token) are not slowed by the draft phase; its decoding rows emit one token and
            the next step verifies no drafts. On the V2 runner with asynchronous scheduling the
            scheduler decides (:mod:`vegas.vllm_plugin.step_switch`) and reserves no draft slots
            for the next step, so that step costs a plain step too; elsewhere the forward
            decides and the next step still verifies γ + 1 tokens per request. Integer >= 0
            (tokens); 0 drafts after every forward; None (default): 2,048 where the scheduler
            decides (V2 runner, asynchronous scheduling: ``vegas serve`` and ``LLM`` on Llama,
            Mistral, Qwen3), 0 elsewhere. Measured on the H200 (SmolLM2-135M, `vllm bench
            serve`, 2026-12-03, ``benchmarks/results/h200_2026-12-03_s21_serve_skip/``): TTFT
            1.05x / 0.95x / 0.87x plain at request rates 4 / 16 / inf with 2,048.
        fallback: measured fallback to plain steps on the V2 runner with asynchronous
            scheduling (:class:`vegas.vllm_plugin.step_switch.MeasuredFallback`): the scheduler
            compares the output tokens per second of drafting and of plain steps on the
            engine's own decode steps (a short probe of the other mode now and then) and keeps
            the faster; plain steps reserve no draft slots. Off by default until measured on a
            GPU; ignored elsewhere.
        score_overlap: in verification forwards captured into vLLM's full CUDA graphs, score
            each layer's collect queries on a side stream as soon as its attention is done, so
            that the score pass (one read of every layer's keys, bandwidth-bound) runs beside
            the later layers' launch-bound kernels instead of after the last one; the top-k
            joins the side stream. Same scores, same selection. Eager (piecewise) forwards score
            all layers in one launch at the last layer either way (a launch per layer would
            cost host time there). Ignored by the generic path and the FA3 score path.
        select_in_draft: for the score-based top-k selectors (collect2, aggregated,
            last_token) on one GPU: the verification only keeps its collect queries, and the
            score pass and top-k run in the draft phase instead, in groups of layers on a side
            stream (:mod:`vegas.vllm_plugin.drafting.in_draft`), each layer of the first draft
            forward waiting only for its own group's selection. The draft forwards are
            launch-bound (a draft forward at batch 128 moves ~1.4 GB in ~1.65 ms against the
            bus's 4.3 TB/s), so the bandwidth-bound score pass runs beside them instead of
            after the verification's last layer. Same scores, same selection (tests compare
            them). The selection's GPU time is then part of the draft phase (``draft_ms``), not
            ``select_ms``. ``None`` (default): on wherever it applies on vLLM's V2 runner (off
            on V1, where it has not run on a GPU yet), unless ``score_overlap`` or
            ``score_path="cute"`` is set or the FA3 score extension loads (each replaces the
            same score pass another way); ``True``: on, refused with ``score_overlap`` or
            ``score_path="cute"``; ``False``: off (the score pass after the verification's last
            layer). Ignored by the other selectors and with tensor parallelism. The default
            since the H200 serve run of 2026-12-02 (``benchmarks/results/vllm_h200_2026-12-02_s12_indraft``:
            SmolLM2-135M, rate inf, 1.21x plain against 1.08x without it, TTFT and TPOT lower
            at every rate, greedy equal to plain up to bf16 ties).
        score_path: where a score-based selector's verification scores come from. ``"auto"``
            (default): FA3 with the score output when the optional ``_vegas_fa3_C`` extension
            loads (``VEGAS_FA3_EXT``), else FA3 and the separate score pass over the prefix keys
            (:mod:`vegas.kernels.triton_score`). ``"cute"`` (experimental): decode-shaped
            verification runs through vLLM's CuTe-DSL attention, with probe queries (each
            request's scored rows summed per KV head) in front of each chunk whose logits the
            kernel stores (:mod:`vegas.kernels.cute_probe`,
            :mod:`vegas.vllm_plugin.selection.cute_verify`), for collect2 and last_token (others
            are refused when the engine is configured); calls it does not cover (prefill chunks,
            a window, soft-capping, FP8 cache, head_dim other than 64/128, probe tokens and chunk
            over one 64-row tile, a variant not compiled before CUDA-graph capture) take FA3 and
            the separate pass. Needs an sm90 GPU and ``nvidia-cutlass-dsl[cu13]==4.5.2`` +
            ``quack-kernels`` (``scripts/cute_dsl_bundle.sh``); without them one log line says
            why and ``"auto"``'s path runs. Its kernels JIT-compile when the engine starts (10-18 s
            each on an H200). Kernel measured on an H200
            (``benchmarks/results/cute_probe_h200_2026-12-04``, per model step in a CUDA graph,
            qlen 5, x FA3): Qwen3-8B shape (head_dim 128) 128K batch 4 1.092x against 1.429x for
            FA3 + the separate pass, 32K batch 1 1.159x against 1.349x; SmolLM2 shape (head_dim
            64), 7,680 context, batch 128 1.372x against 1.241x (slower). In an engine: two of
            its three GPU engine tests failed on 2026-12-04 (the log was cut by the time limit;
            two likely causes, the packing kernel compiling again inside CUDA-graph capture and
            unwritten gather rows for a captured batch's padding tokens, fixed since, not yet
            re-run): not for use yet.
        seeded_verification: how the V2 runner verifies the drafts of a request with an
            explicit seed (``SamplingParams.seed``, the OpenAI ``seed`` field).
            ``"rejection"``: vLLM's rejection sampling, as for every other request; the
            emitted tokens then depend on the drafts, which depend on the KV selection's batch
            numerics, so the same seeded request can give another output among other batch
            neighbours. ``"coupled"`` (default since 2026-12-03, after its GPU tests passed on V1
            and V2): Gumbel-max coupling (:mod:`vegas.vllm_plugin.coupling`;
            Daliri, Musco and Suresh, 2024): each verified position emits the target's own seeded
            sample, the token plain vLLM draws there, and a draft drawn with the same noise is
            accepted iff it equals it; the output is then plain vLLM's seeded output whatever was
            drafted, at somewhat lower acceptance for those requests. Unseeded requests always
            take rejection sampling. The V1 runner has no counter-keyed target sampler to couple
            with: there ``"coupled"`` withholds the drafts of seeded sampled requests
            (:func:`vegas.vllm_plugin.coupling.withhold_drafts`), reproducible at plain speed.

    Raises:
        VegasConfigError: a field is outside its allowed values.
    """

    tp_selection: Literal["all_reduce", "per_rank"] = "all_reduce"
    verify_cuda_graphs: Literal["full", "piecewise"] = "full"
    draft_cuda_graphs: bool = True
    draft_graph_max_rows: int = DEFAULT_DRAFT_GRAPH_MAX_ROWS
    prefill_skip_tokens: int | None = None
    fallback: bool = False
    score_overlap: bool = False
    select_in_draft: bool | None = None
    score_path: Literal["auto", "cute"] = "auto"
    seeded_verification: Literal["rejection", "coupled"] = "coupled"

    def __post_init__(self) -> None:
        _raise_if_not_one_of("vllm.tp_selection", self.tp_selection, TP_SELECTIONS)
        _raise_if_not_one_of("vllm.verify_cuda_graphs", self.verify_cuda_graphs, VERIFY_CUDA_GRAPH_MODES)
        if not isinstance(self.draft_cuda_graphs, bool):
            raise VegasConfigError.bad("vllm.draft_cuda_graphs", f"must be true or false, got {self.draft_cuda_graphs!r}")
        _raise_if_not_int("vllm.draft_graph_max_rows", self.draft_graph_max_rows, 1)
        if self.prefill_skip_tokens is not None:
            _raise_if_not_int("vllm.prefill_skip_tokens", self.prefill_skip_tokens, 0)
        if not isinstance(self.fallback, bool):
            raise VegasConfigError.bad("vllm.fallback", f"must be true or false, got {self.fallback!r}")
        if not isinstance(self.score_overlap, bool):
            raise VegasConfigError.bad("vllm.score_overlap", f"must be true or false, got {self.score_overlap!r}")
        _raise_if_not_one_of("vllm.score_path", self.score_path, SCORE_PATHS)
        _raise_if_not_one_of("vllm.seeded_verification", self.seeded_verification, SEEDED_VERIFICATIONS)
        if self.select_in_draft is not None and not isinstance(self.select_in_draft, bool):
            raise VegasConfigError.bad("vllm.select_in_draft",
                                       f"must be true, false or null (automatic), got {self.select_in_draft!r}")
        if self.select_in_draft and (self.score_overlap or self.score_path == "cute"):
            other = "vllm.score_overlap true" if self.score_overlap else 'vllm.score_path "cute"'
            raise VegasConfigError.bad(
                "vllm.select_in_draft", f"true cannot be combined with {other} (each replaces the same score pass); "
                'with select_in_draft true use score_overlap false and score_path "auto", or leave select_in_draft '
                "null to choose automatically")


@dataclass(frozen=True)
class VegasConfig:
    """Hyperparameters of verification-guided sparse drafting.

    Args:
        num_draft_tokens: γ, draft tokens per iteration (tokens); integer >= 1.
        sparsity_ratio: KV budget as a share of each sequence's context, in (0, 1].
            Used when ``kv_budget`` is None. Default 0.05 (the reference implementation's).
        kv_budget: KV budget k in tokens (KV entries per layer a draft query attends to,
            besides the positions appended since the last selection); integer >= 1, or None.
            Overrides ``sparsity_ratio``. A budget at or above the context is allowed:
            drafting then attends to everything.
        min_kv_budget: lower bound of the budget derived from ``sparsity_ratio`` (tokens).
        num_sinks: attention sinks kept by the sliding-window selector (tokens).
        window: recent positions kept by the sliding-window selector (tokens); None means
            ``budget - num_sinks`` so that baselines compare at equal budget. A window that is
            set overrides the KV budget for that selector: it keeps ``num_sinks + window``
            positions whatever ``kv_budget`` or ``sparsity_ratio`` say.
        page_size: Quest page size P (tokens).
        recent_window: the last committed positions every score-based selector keeps inside
            its budget (tokens, at most half the budget), on top of the top-k of the rest;
            0 = pure top-k. Default 64
            (the reference keeps the recent tokens; at 4K context, γ=4, budget 256 it raised
            collect2 τ from 3.62 to 4.27 greedy and 2.74 to 3.37 sampled).
        granularity: ``"layer"`` (one index set per layer shared by its heads, the seed's
            formula) or ``"kv_head"`` (one set per KV head).
        score_mode: ``"logit"`` (rank by summed pre-softmax logits, the seed's formula) or
            ``"weight"`` (rank by summed re-materialised softmax weights, the reference
            implementation's default).
        fallback: no regression where drafting loses (:mod:`vegas.draft_policy`): a batch
            whose measured acceptance length τ makes drafting slower than plain decoding
            (``τ / (γ·fallback_draft_cost + fallback_verify_cost) < fallback_min_gain``)
            takes plain steps, probing again every ``fallback_probe_interval`` steps; counted in
            :attr:`RequestStats.plain_steps`. Output is unchanged (greedy token-identical).
            HF backend only: the vLLM backend ignores it (under vLLM's async scheduling the
            draft slots are scheduled before the proposer runs, so a batch cannot skip them;
            see docs/vllm.md).
        fallback_draft_cost: one sparse draft forward over one plain decode step; number > 0.
            Default 0.28 (dummy Qwen3-8B on an H200 at 128K; 0.84 at 32K).
        fallback_verify_cost: one verification of γ + 1 tokens over one plain decode step;
            number > 0. Default 1.1.
        fallback_min_gain: draft while the predicted speedup is at least this; number > 0.
            Default 1.0 (break-even).
        fallback_hysteresis: a probe resumes drafting only at a predicted speedup of
            ``fallback_min_gain + fallback_hysteresis``; number >= 0. Default 0.1.
        fallback_probe_interval: plain steps between probes (drafting iterations that measure
            τ again); integer >= 1. Default 16.
        vllm: :class:`VllmOptions` (or a dict of its fields), read by the vLLM backend only.

    Raises:
        VegasConfigError: a field is outside its allowed values.
    """

    num_draft_tokens: int = 4
    sparsity_ratio: float = 0.05
    kv_budget: int | None = None
    min_kv_budget: int = 256
    num_sinks: int = 4
    window: int | None = None
    page_size: int = 16
    recent_window: int = 64
    granularity: Literal["layer", "kv_head"] = "layer"
    score_mode: Literal["logit", "weight"] = "logit"
    fallback: bool = True
    fallback_draft_cost: float = DEFAULT_FALLBACK_DRAFT_COST
    fallback_verify_cost: float = DEFAULT_FALLBACK_VERIFY_COST
    fallback_min_gain: float = 1.0
    fallback_hysteresis: float = 0.1
    fallback_probe_interval: int = 16
    vllm: VllmOptions = field(default_factory=VllmOptions)

    def __post_init__(self) -> None:
        if isinstance(self.vllm, dict):
            _raise_if_unknown(self.vllm, VllmOptions, "vllm")
            object.__setattr__(self, "vllm", VllmOptions(**self.vllm))
        if not isinstance(self.vllm, VllmOptions):
            names = ", ".join(f.name for f in fields(VllmOptions))
            raise VegasConfigError(f"vllm must be an object of vLLM options ({names}), got {self.vllm!r}")
        _raise_if_not_int("num_draft_tokens", self.num_draft_tokens, 1)
        ratio = self.sparsity_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 < ratio <= 1):
            raise VegasConfigError.bad("sparsity_ratio", f"must be a number in (0, 1], got {ratio!r}")
        if self.kv_budget is not None:  # 0 would leave drafting nothing but its own new tokens
            _raise_if_not_int("kv_budget", self.kv_budget, 1)
        _raise_if_not_int("min_kv_budget", self.min_kv_budget, 0)
        _raise_if_not_int("num_sinks", self.num_sinks, 0)
        if self.window is not None:
            _raise_if_not_int("window", self.window, 0)
        _raise_if_not_int("page_size", self.page_size, 1)
        _raise_if_not_int("recent_window", self.recent_window, 0)
        _raise_if_not_one_of("granularity", self.granularity, ("layer", "kv_head"))
        _raise_if_not_one_of("score_mode", self.score_mode, ("logit", "weight"))
        if not isinstance(self.fallback, bool):
            raise VegasConfigError.bad("fallback", f"must be true or false, got {self.fallback!r}")
        _raise_if_not_number("fallback_draft_cost", self.fallback_draft_cost, positive=True)
        _raise_if_not_number("fallback_verify_cost", self.fallback_verify_cost, positive=True)
        _raise_if_not_number("fallback_min_gain", self.fallback_min_gain, positive=True)
        _raise_if_not_number("fallback_hysteresis", self.fallback_hysteresis, positive=False)
        _raise_if_not_int("fallback_probe_interval", self.fallback_probe_interval, 1)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> VegasConfig:
        """A config from a dict of its fields (``vllm`` a nested dict); ``source`` names it in errors.

        Raises:
            VegasConfigError: an unknown field or a value outside its allowed values.
        """
        _raise_if_unknown(values, cls, source)
        return cls(**values)

    @classmethod
    def from_json(cls, raw: str, source: str = "JSON") -> VegasConfig:
        """A config from a JSON object of its fields (the inverse of :meth:`to_json`).

        Raises:
            VegasConfigError: not a JSON object, an unknown field, or a bad value.
        """
        return cls.from_dict(parse_json_object(raw, source), source)

    def to_dict(self) -> dict[str, Any]:
        """Every field, ``vllm`` as a nested dict (JSON-serialisable)."""
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


#: :class:`VegasConfig`'s fields of the HF backend's draft policy (:mod:`vegas.draft_policy`); the
#: vLLM backend does not read them (its measured fallback is ``vllm.fallback``)
DRAFT_POLICY_FIELDS = tuple(f.name for f in fields(VegasConfig) if f.name.startswith("fallback"))


def kv_budget_for(config: VegasConfig, context_len: Budget) -> Budget:
    """KV budget k (tokens) for a sequence whose committed context has ``context_len`` tokens.

    The one budget rule of every backend and selector (a selector may override it through
    :meth:`vegas.interfaces.Selector.budget`): ``config.kv_budget`` if set, else
    ``max(ceil(context_len * sparsity_ratio), min_kv_budget)`` (the reference
    implementation's rule). May exceed ``context_len``; callers clamp.

    Args:
        context_len: an int, or a ``torch.LongTensor`` of any shape (elementwise, in float64
            as the int rule, no host sync).

    Returns:
        an int, or a ``torch.LongTensor`` of ``context_len``'s shape.
    """
    if isinstance(context_len, int):
        if config.kv_budget is not None:
            return config.kv_budget
        return max(math.ceil(context_len * config.sparsity_ratio), config.min_kv_budget)
    if config.kv_budget is not None:
        return context_len.new_full(context_len.shape, config.kv_budget)
    scaled = (context_len.double() * config.sparsity_ratio).ceil().long()
    return scaled.clamp(min=config.min_kv_budget)


def recent_window_for(config: VegasConfig, budget: Budget) -> Budget:
    """Last committed positions a score-based selector keeps inside its budget (tokens):
    ``min(budget // 2, config.recent_window)`` (at most half, so that small budgets still
    rank by the scores).

    Args:
        budget: an int, or a ``torch.LongTensor`` of any shape (elementwise).
    """
    if isinstance(budget, int):
        return min(budget // 2, config.recent_window)
    return (budget // 2).clamp(max=config.recent_window)
