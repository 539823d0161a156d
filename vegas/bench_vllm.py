"""``vegas bench --backend vllm``: plain vLLM, vLLM's n-gram proposer and Vegas selectors on the
same prompts, on one GPU, as a Markdown table and JSON.

Engines: one per method (``plain``, ``ngram``, one per Vegas selector: its selection is captured
into the verification CUDA graphs), made by :func:`vegas.backends.vllm.vllm_engine_kwargs` and
started by :func:`vegas.backends.vllm.start_engine`, as the backend's. The engines of a run are
alive at once, each with an equal share of ``gpu_memory_utilization`` (``--engine-args``, default
0.85), so that repeats interleave over methods: a load that drifts meets every method alike.

Prompts: windows of held-out code (``benchmarks/data/heldout_code_dev.jsonl.xz`` of the checkout,
:func:`vegas.prompts.heldout_path`; else installed click source, or ``--prompts``), tokenized with
the model's own tokenizer without special tokens; a shorter context is a prefix of the longer.
Every prompt is prefilled once per engine (``max_tokens=1``) so that prefix caching holds it; a
timed run then decodes ``new_tokens`` tokens per request (``ignore_eos``).

Closed batch (default): ``batch`` requests decoded together; the run waits for its slowest
request. Open batch (``open_factor`` K > 0): ``K x batch`` requests through ``batch`` slots
(``max_num_seqs = batch``, one set of engines per batch size), so a finished request's slot is
refilled at once, as in serving. Both time the same window: the first request's first token to the
last request's last token (vLLM's per-request timestamps).

Row figures (one row per context, batch and method; the run of median tok/s, with every run's
tok/s and τ and their spread, :func:`vegas.bench.median_row`):

- tok/s: (generated tokens - one per request) / decode window;
- τ: tokens emitted per verification (Vegas: the proposer's counters; ngram: vLLM's spec-decode
  metrics; plain: 1);
- ms/iter: decode window / batch steps (a batch step verifies every running request once; Vegas:
  the proposer's count, else ``batch x τ / tok/s``); draft ms/iter (Vegas): CUDA-event time of
  the draft phase; GPU ms/iter (Vegas, V1 runner only): that plus the verification forward (the V2
  runner's verification is not timed: blank);
- selection: GPU time of the selection inside verification / decode window (Vegas);
- floor ms/iter: the bytes one step reads at 4.3 TB/s (H200 HBM), :func:`byte_floor_ms`;
  byte bound: τ x plain floor / this floor, the speedup if both ran at their byte floor.

Exactness: ``exact_prompts`` prompts at the first context, ``check_tokens`` greedy tokens per
method, compared token by token with plain vLLM greedy; at the first differing token the plain
run's top-2 logprob gap is reported, and a gap within :data:`NEAR_TIE` of the dtype counts as a
near-tie (the method stays lossless; any other difference fails ``vegas bench``).

Everything but the engines (options, plan, byte floor, table, medians) runs on the CPU;
``import vegas.bench_vllm`` does not import vLLM.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .backends.vllm import (
    model_max_context,
    raise_if_only_sliding_window,
    shutdown_engine,
    start_engine,
    verify_cuda_graphs,
    vllm_engine_kwargs,
    vllm_installed,
    vllm_missing_message,
)
from .bench import bench_config, median_row
from .config import VegasConfig, VegasConfigError, kv_budget_for
from .plugins import PLAIN, create_selector, selector_names
from .prompts import cut_contexts, heldout_path, prompt_text
from .sampling import SamplingParams
from .vllm_plugin import settings as vegas_settings

__all__ = [
    "HBM_BYTES_PER_S",
    "NGRAM",
    "VllmBenchOptions",
    "byte_floor_ms",
    "compare",
    "decode_window",
    "engine_groups",
    "engine_kwargs",
    "load_prompts",
    "methods_of",
    "model_bytes",
    "run_vllm_bench",
    "summary_lines",
    "table",
    "write_json",
]

#: H200 HBM bandwidth, bytes per second (the byte floor's)
HBM_BYTES_PER_S = 4.3e12
#: vLLM's own n-gram (prompt lookup) proposer, a method next to plain and the Vegas selectors
NGRAM = "ngram"
#: the method name of plain vLLM in rows and JSON
PLAIN_ROW = "plain"
#: selectors whose verification reads every prefix key once more for the scores
SCORING = ("collect2", "aggregated", "last_token")
#: total share of GPU memory of the engines alive at once, unless ``engine_args`` says otherwise
GPU_MEMORY_UTILIZATION = 0.85


@dataclass
class VllmBenchOptions:
    """Options of ``vegas bench --backend vllm`` (see ``vegas bench --help``).

    ``selectors``: the methods besides plain vLLM (always measured, the reference): Vegas
    selector names and ``"ngram"``. ``contexts`` and ``batches``: prompt lengths (tokens) and batch
    sizes; every pair is a row per method. ``open_factor``: 0 for closed batches, K for open ones
    of ``K x batch`` requests. ``engine_args``: further ``vllm.LLM`` arguments for every engine
    (``gpu_memory_utilization`` there is the total of the engines alive at once).
    ``vllm_options``: ``VegasConfig.vllm`` fields of every Vegas engine.
    """

    model: str | None = None
    selectors: list[str] = field(default_factory=lambda: ["collect2"])
    contexts: list[int] = field(default_factory=lambda: [4096])
    batches: list[int] = field(default_factory=lambda: [2])
    open_factor: int = 0
    repeats: int = 1
    new_tokens: int = 64
    num_draft_tokens: int = 4
    sparsity_ratio: float = 0.05
    kv_budget: int | None = None
    min_kv_budget: int = 256
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    check_tokens: int = 16
    exact_prompts: int = 8
    #: ``VegasConfig.vllm`` fields of every Vegas engine (e.g. ``{"fallback": true}``)
    vllm_options: dict[str, Any] = field(default_factory=dict)
    prompts: str | None = None
    dtype: str = "bfloat16"
    engine_args: dict[str, Any] = field(default_factory=dict)


# ---- options and plan (CPU) -------------------------------------------------------------------


def methods_of(selectors: list[str]) -> list[str]:
    """The methods of a run: ``"plain"`` first, then each name of ``selectors`` once (``"none"``
    and ``"plain"`` are plain vLLM, measured anyway).

    Raises:
        VegasConfigError: (field ``selectors``) an unknown name, with the allowed ones.
    """
    known = selector_names()
    methods = [PLAIN_ROW]
    for name in selectors:
        if name in (PLAIN, PLAIN_ROW):
            continue
        if name != NGRAM and name not in known:
            raise VegasConfigError.bad(
                "selectors", f"has an unknown method {name!r}; allowed: {PLAIN_ROW} (always measured), {NGRAM} "
                f"(vLLM's n-gram proposer), {', '.join(known)}")
        if name not in methods:
            methods.append(name)
    return methods


def vegas_config(opts: VllmBenchOptions) -> VegasConfig:
    """The Vegas settings of every Vegas engine of the run (:func:`vegas.bench.bench_config`,
    checked by :class:`VegasConfig`)."""
    return VegasConfig(**bench_config(opts), vllm=dict(opts.vllm_options))


def raise_if_bad_options(opts: VllmBenchOptions, max_context: int | None) -> None:
    """Refuse bad counts and contexts that do not fit a model of ``max_context`` tokens (None:
    the model is not read yet; the context range is then checked against no model).

    Raises:
        VegasConfigError: with the field at fault (``batch_size`` for a batch, ``context`` for a
            context, ``repeats``, ``new_tokens``, ``check_tokens``, ``exact_prompts``,
            ``open_factor``) and the allowed values.
    """
    counts = [("batch_size", b, 1) for b in opts.batches] + [
        ("repeats", opts.repeats, 1), ("new_tokens", opts.new_tokens, 1), ("check_tokens", opts.check_tokens, 1),
        ("exact_prompts", opts.exact_prompts, 0), ("open_factor", opts.open_factor, 0)]
    for name, value, low in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise VegasConfigError.bad(name, f"must be an integer >= {low}, got {value!r}")
    if not opts.batches or not opts.contexts:
        raise VegasConfigError.bad("batch_size" if not opts.batches else "context", "must name at least one value")
    if max_context is None:
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 2 for c in opts.contexts):
            raise VegasConfigError.bad("context", f"must be integers >= 2, got {opts.contexts!r}")
        return
    room = max_context - max(opts.new_tokens, opts.check_tokens) - opts.num_draft_tokens - 1
    for context in opts.contexts:
        if isinstance(context, bool) or not isinstance(context, int) or not 2 <= context <= room:
            raise VegasConfigError.bad(
                "context", f"must be in [2, {room}] tokens: the model context is {max_context} and new tokens plus "
                f"γ + 1 verification slots need the rest; got {context!r}")


def engine_groups(opts: VllmBenchOptions) -> list[tuple[list[int], int]]:
    """The sets of engines a run starts, in order: ``(batch sizes measured, max_num_seqs)``.

    Closed batches: one set for every batch size (``max_num_seqs`` = the largest). Open batches:
    one set per batch size, whose ``max_num_seqs`` is that batch size (the slots).
    """
    if opts.open_factor:
        return [([b], b) for b in opts.batches]
    return [(list(opts.batches), max(opts.batches))]


def requests_of(opts: VllmBenchOptions, batch: int) -> int:
    """Requests of one timed run at ``batch``: ``batch`` (closed) or ``open_factor x batch``."""
    return batch * opts.open_factor if opts.open_factor else batch


def engine_kwargs(method: str, model: str, config: VegasConfig, *, max_model_len: int, max_num_seqs: int,
                  gpu_memory_utilization: float, seed: int = 0, dtype: str = "bfloat16",
                  engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments of one engine of the run (:func:`vllm_engine_kwargs`).

    Args:
        method: ``"plain"``, ``"ngram"`` (γ = ``config.num_draft_tokens`` prompt-lookup drafts) or a
            Vegas selector name (its settings in ``additional_config["vegas"]``).
        max_model_len, max_num_seqs: tokens per request and requests per step.
        gpu_memory_utilization: this engine's share of the GPU memory.
        engine_args: further ``LLM`` arguments; they win.
    """
    extra = dict(engine_args or {})
    kw: dict[str, Any] = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True, seed=seed)
    extra.pop("gpu_memory_utilization", None)
    # CUDA-graph capture sizes: what a user gets (vLLM's default; a Vegas engine widens it for
    # verification batches, vegas.vllm_plugin.graph_sizes) unless engine_args set them
    if extra.get("compilation_config"):
        kw["compilation_config"] = extra.pop("compilation_config")
    if method == NGRAM:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": config.num_draft_tokens,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    kw.update(extra)
    if method in (PLAIN_ROW, NGRAM):
        return vllm_engine_kwargs(model, dtype=dtype, **kw)
    selector = create_selector(method, config)
    return vllm_engine_kwargs(model, dtype=dtype, num_draft_tokens=config.num_draft_tokens,
                              verify_cuda_graphs=verify_cuda_graphs(selector, config),
                              settings=vegas_settings.settings_json(method, config), **kw)


# ---- prompts ----------------------------------------------------------------------------------


def load_prompts(model: str, count: int, length: int, source: str | Path | None = None) -> list[list[int]]:
    """``count`` windows of ``length`` token ids (:func:`vegas.prompts.cut_contexts`) of
    ``source`` (a text file, directory or ``.jsonl(.xz)`` document set; default: the checkout's
    held-out code, else installed click source), tokenized with ``model``'s tokenizer
    (transformers' ``AutoTokenizer``, no remote code), no special tokens.

    Raises:
        VegasConfigError: a bad source, or one shorter than ``length`` tokens.
    """
    from transformers import AutoTokenizer

    text = prompt_text(source, what="--prompts") if source is not None else prompt_text(heldout_path())
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    return cut_contexts(ids, length, count)


# ---- figures (CPU) ----------------------------------------------------------------------------


def model_bytes(cfg: dict) -> tuple[int, int]:
    """``(weight bytes one forward reads, KV-cache bytes per token)`` of a Llama/Qwen3-style
    transformers config (a dict) in bf16: attention and MLP weights of every layer plus the
    LM head; keys and values of every layer."""
    h = cfg["hidden_size"]
    hq, hkv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // hq
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * cfg["intermediate_size"]
    return 2 * (layers * per_layer + cfg["vocab_size"] * h), 2 * layers * 2 * hkv * d


def byte_floor_ms(cfg: dict, method: str, *, context: int, batch: int, gamma: int, kv_budget: int,
                  tensor_parallel: int = 1) -> float:
    """Milliseconds to read the bytes of one decode step (plain, ngram) or one Vegas iteration
    (any other method: a selector) at :data:`HBM_BYTES_PER_S`, split over ``tensor_parallel``
    GPUs reading in parallel (communication left out).

    Plain and ngram: weights + the whole KV cache of ``batch`` requests of ``context`` tokens.
    Vegas: that (verification), the keys once more for the scores (:data:`SCORING` selectors),
    and γ draft steps of weights + ``min(kv_budget, context) + γ + 1`` positions per request
    (quest: plus every page's two key bounds, 2/16 of the keys, per draft step). Activations and
    logits are left out.
    """
    weights, kv = model_bytes(cfg)
    total = weights + batch * context * kv
    if method not in (PLAIN_ROW, NGRAM):
        if method in SCORING:
            total += batch * context * kv / 2
        total += gamma * (weights + batch * (min(kv_budget, context) + gamma + 1) * kv)
        if method == "quest":
            total += gamma * batch * context * kv / 2 * 2 / 16
    return total / HBM_BYTES_PER_S / tensor_parallel * 1e3


def decode_window(outs) -> float | None:
    """Seconds from the first request's first token to the last request's last token, from
    vLLM's per-request timestamps (``RequestOutput.metrics``); None when vLLM did not record them."""
    try:
        firsts = [o.metrics.first_token_ts for o in outs]
        lasts = [o.metrics.last_token_ts for o in outs]
    except AttributeError:
        return None
    if not firsts or min(firsts) <= 0 or max(lasts) <= min(firsts):
        return None
    return max(lasts) - min(firsts)


#: top-2 logprob gap at or below which a first difference from plain greedy counts as a near-tie
#: of the dtype: two bf16 steps of a logit in [16, 32) (SmolLM2's and Qwen3's top logits), as the
#: GPU tests' ``BF16_TIE``; float16 has 3 more mantissa bits. Verification scores γ + 1 query rows
#: per request where plain decoding scores one, so its GEMMs round differently and a token whose
#: two best logits lie within a rounding step may flip; everything after it then differs.
NEAR_TIE = {"bfloat16": 0.25, "float16": 0.25 / 8}


def compare(tokens: list[list[int]], reference: list[list[int]], logprobs: list | None = None,
            near_tie: float = 0.0) -> dict:
    """Greedy outputs ``tokens`` against plain vLLM's ``reference`` (one token list per prompt).

    Args:
        logprobs: vLLM's per-position ``{token: Logprob}`` of the reference (top 2 at least), or None.
        near_tie: the largest top-2 logprob gap at the first difference that counts as a near-tie
            (:data:`NEAR_TIE` of the engine's dtype; 0: only exact ties).

    Returns:
        ``identical`` and ``total`` prompt counts; per differing prompt its index, the first
        differing position, the reference's top-2 logprob gap there (None without logprobs), the
        differing token count and ``near_tie`` (gap known and <= ``near_tie``); ``near_ties`` (how
        many differing prompts are near-ties) and ``lossless`` (every prompt identical or a near-tie).
    """
    same, diffs = 0, []
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a == b:
            same += 1
            continue
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        gap = None
        lp = logprobs[i] if logprobs else None
        if lp is not None and j < len(lp) and lp[j]:
            values = sorted((v.logprob for v in lp[j].values()), reverse=True)
            gap = values[0] - values[1] if len(values) >= 2 else None
        diffs.append({"prompt": i, "first_diff": j, "top2_logprob_gap": gap,
                      "differing_tokens": sum(x != y for x, y in zip(a, b)),
                      "near_tie": gap is not None and gap <= near_tie})
    ties = sum(d["near_tie"] for d in diffs)
    return {"identical": same, "total": len(tokens), "near_ties": ties, "lossless": ties == len(diffs),
            "diffs": diffs}


def _fmt(value, spec: str) -> str:
    return "" if value is None else spec.format(value)


def table(results: dict) -> str:
    """The rows of ``results`` as a Markdown table: tok/s (median, and the spread of the repeats),
    x plain (against plain vLLM at the same context, batch and mode), τ, ms/iter, draft ms/iter,
    GPU ms/iter (blank where not measured), floor ms/iter, selection share of the decode time, byte bound."""
    rows = results["rows"]

    def key(r):
        return r["ctx"], r["batch"], r["mode"]

    plain = {key(r): r for r in rows if r["method"] == PLAIN_ROW}
    lines = ["| ctx | batch | method | tok/s | spread | x plain | τ | ms/iter | draft ms/iter | GPU ms/iter "
             "| floor ms/iter | selection | byte bound |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = plain.get(key(r))
        batch = r["batch"] if r["mode"] == "closed" else f"{r['batch']} open ({r['requests']} req.)"
        tau, floor = r.get("acceptance_length"), r.get("floor_ms")
        bound = None
        if r["method"] not in (PLAIN_ROW, NGRAM) and tau and floor and base and base.get("floor_ms"):
            bound = tau * base["floor_ms"] / floor
        speedup = base and r["tokens_per_second"] / base["tokens_per_second"]
        share = r.get("selection_share")
        in_draft = (r.get("stats") or {}).get("score_path") == "in_draft"
        lines.append(
            f"| {r['ctx']} | {batch} | {r['method']} | {r['tokens_per_second']:.0f} | "
            f"{r.get('tokens_per_second_spread', 0.0):.0f} | {_fmt(speedup, '{:.2f}x')} | {_fmt(tau, '{:.2f}')} | "
            f"{_fmt(r.get('ms_per_iteration'), '{:.2f}')} | {_fmt(r.get('draft_ms_per_iteration'), '{:.2f}')} | "
            f"{_fmt(r.get('gpu_ms_per_iteration'), '{:.2f}')} | "
            f"{_fmt(floor, '{:.2f}')} | "
            f"{'in draft' if in_draft else _fmt(share if share is None else 100 * share, '{:.1f}%')} | "
            f"{_fmt(bound, '{:.2f}x')} |")
    return "\n".join(lines)


# ---- the run (GPU) ----------------------------------------------------------------------------


def _model_config(model: str) -> dict | None:
    """The model's (text) transformers config as a dict, or None when it cannot be read."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model, trust_remote_code=False)
    except Exception:  # a hub id offline: the table leaves the byte floor out
        return None
    return (cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg).to_dict()


def _spec_counts(llm) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, accepted tokens) so far, summed over engines."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def _generate(llm, prompts: list[list[int]], sampling):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


def _timed(llm, method: str, prompts: list[list[int]], sampling, batch: int) -> dict:
    """One timed run: tok/s, τ, ms/iter and (Vegas) the proposer's figures of its window."""
    vegas = method not in (PLAIN_ROW, NGRAM)
    if vegas:
        llm.collective_rpc("vegas_configure", args=(None, True))  # reset the proposer's counters
    before = _spec_counts(llm) if method == NGRAM else {}
    t = time.perf_counter()
    outs = _generate(llm, prompts, sampling)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    window = decode_window(outs)
    decode_s = window or wall
    run = {"generated_tokens": tokens, "wall_s": wall, "decode_s": decode_s,
           "timing": "engine timestamps" if window else "wall time",
           "tokens_per_second": (tokens - len(outs)) / decode_s, "acceptance_length": 1.0}
    if method == NGRAM:
        after = _spec_counts(llm)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = (after.get("vllm:spec_decode_num_accepted_tokens", 0)
                    - before.get("vllm:spec_decode_num_accepted_tokens", 0))
        run["acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
    run["ms_per_iteration"] = batch * run["acceptance_length"] / max(run["tokens_per_second"], 1e-9) * 1e3
    if vegas:
        st = llm.collective_rpc("vegas_stats")[0]
        steps = max(st.get("proposals", 0), 1)
        run.update({
            "acceptance_length": st.get("acceptance_length") or 0.0,
            "batch_steps": st.get("proposals", 0),
            "ms_per_iteration": decode_s * 1e3 / steps,
            # V1 times the draft phase and the verification forward; V2 the draft phase only
            "draft_ms_per_iteration": st["draft_ms"] / steps if "draft_ms" in st else None,
            "gpu_ms_per_iteration": ((st["draft_ms"] + st["verify_fwd_ms"]) / steps
                                     if "draft_ms" in st and "verify_fwd_ms" in st else None),
            # with vllm.select_in_draft the selection runs inside the draft phase (in draft ms), untimed apart
            "selection_share": (None if st.get("score_path") == "in_draft"
                                else st.get("select_ms", 0) / (decode_s * 1e3)),
            "full_cuda_graphs": st.get("full_cuda_graphs"),
            "stats": st,
        })
    return run


def _vllm_sampling(**kw):
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(detokenize=False, **kw)


def run_vllm_bench(opts: VllmBenchOptions, log: Callable[[str], None] = print,
                   save: Callable[[dict], None] | None = None) -> dict:
    """Run the benchmark (see the module docstring) and return the results: ``options``,
    ``config`` (the Vegas settings), ``rows`` (one per context, batch, mode and method; see
    :func:`table`), ``exactness`` (per method, :func:`compare`) and ``errors`` (per engine that
    failed to start or run; the others go on).

    Args:
        log: called with a progress line per step.
        save: called with the results so far after each batch size (e.g. to write the JSON).

    Raises:
        VegasConfigError: a bad option (its field named, before prompts are read or an engine
            starts), or vLLM not installed.
    """
    from .models import resolve_model

    config = vegas_config(opts)
    methods = methods_of(opts.selectors)
    SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)  # checks them
    if opts.dtype not in ("bfloat16", "float16"):
        raise VegasConfigError.bad("dtype", f"must be bfloat16 or float16 with the vllm backend, got {opts.dtype!r}")
    raise_if_bad_options(opts, None)  # what needs no model, before vLLM is looked for
    if not vllm_installed():  # before a model is converted or read
        raise VegasConfigError(vllm_missing_message("vegas bench --backend vllm"))
    model = resolve_model(opts.model)
    raise_if_bad_options(opts, model_max_context(model))
    vegas = [m for m in methods if m not in (PLAIN_ROW, NGRAM)]
    for name in vegas:
        vegas_settings.raise_if_unsupported(create_selector(name, config), config, opts.engine_args.get("block_size"))
    max_model_len = min(max(opts.contexts) + max(opts.new_tokens, opts.check_tokens) + 64, model_max_context(model))
    if vegas:
        raise_if_only_sliding_window(model, max_model_len)

    n_prompts = max([requests_of(opts, b) for b in opts.batches] + [opts.exact_prompts])
    longest = load_prompts(model, n_prompts, max(opts.contexts), opts.prompts)
    by_ctx = {c: [p[:c] for p in longest] for c in opts.contexts}
    log(f"prompts: {len(longest)} x {max(opts.contexts)} tokens")
    cfg = _model_config(model)
    tp = int(opts.engine_args.get("tensor_parallel_size", 1))
    total_mem = float(opts.engine_args.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION))
    results: dict = {"options": asdict(opts), "model": model, "config": asdict(config), "methods": methods,
                     "rows": [], "exactness": {}, "errors": {}}
    sampled = dict(temperature=opts.temperature, top_p=opts.top_p)

    for group, (batches, max_num_seqs) in enumerate(engine_groups(opts)):
        engines: dict[str, Any] = {}
        for method in methods:
            kw = engine_kwargs(method, model, config, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                               gpu_memory_utilization=total_mem / len(methods), seed=opts.seed, dtype=opts.dtype,
                               engine_args=opts.engine_args)
            t = time.perf_counter()
            try:
                engines[method] = start_engine(kw, None if method in (PLAIN_ROW, NGRAM) else method)
            except Exception as e:  # one failing engine must not hide the others
                results["errors"][method] = repr(e)
                log(f"engine {method} FAILED: {e!r}")
                continue
            log(f"engine {method} (max_num_seqs {max_num_seqs}) ready in {time.perf_counter() - t:.1f}s")
        try:
            if group == 0 and opts.exact_prompts and PLAIN_ROW in engines:
                _exactness(engines, by_ctx[opts.contexts[0]][: opts.exact_prompts], opts, results, log)
            for ctx in opts.contexts:
                prompts = by_ctx[ctx]
                for method, llm in engines.items():  # prefix caching holds every prompt from here on
                    _generate(llm, prompts[: requests_of(opts, max(batches))], _vllm_sampling(max_tokens=1))
                for batch in batches:
                    _measure(engines, prompts, ctx, batch, opts, config, cfg, tp, sampled, results, log)
                    if save is not None:
                        save(results)
        finally:
            for llm in engines.values():
                shutdown_engine(llm)
    return results


def _exactness(engines: dict, prompts: list[list[int]], opts: VllmBenchOptions, results: dict, log) -> None:
    """Greedy ``check_tokens`` tokens of every method against plain vLLM greedy."""
    ref = _generate(engines[PLAIN_ROW], prompts,
                    _vllm_sampling(temperature=0.0, max_tokens=opts.check_tokens, ignore_eos=True, logprobs=2))
    reference = [list(o.outputs[0].token_ids) for o in ref]
    logprobs = [o.outputs[0].logprobs for o in ref]
    for method, llm in engines.items():
        if method == PLAIN_ROW:
            continue
        outs = _generate(llm, prompts, _vllm_sampling(temperature=0.0, max_tokens=opts.check_tokens, ignore_eos=True))
        result = compare([list(o.outputs[0].token_ids) for o in outs], reference, logprobs,
                         NEAR_TIE.get(opts.dtype, 0.0))
        results["exactness"][method] = result
        log(f"exactness {method}: {result['identical']}/{result['total']} identical; diffs: {result['diffs']}")


def _measure(engines: dict, prompts, ctx: int, batch: int, opts: VllmBenchOptions, config: VegasConfig,
             cfg: dict | None, tp: int, sampled: dict, results: dict, log) -> None:
    """The rows of one context and batch size: a warm-up per engine, then ``repeats`` timed runs
    interleaved over the engines; each row the run of median tok/s (:func:`median_row`)."""
    n_req = requests_of(opts, batch)
    timed = _vllm_sampling(max_tokens=opts.new_tokens, ignore_eos=True, **sampled)
    runs: dict[str, list[dict]] = {m: [] for m in engines}
    for llm in engines.values():
        _generate(llm, prompts[:batch], _vllm_sampling(max_tokens=8, ignore_eos=True, **sampled))
    for r in range(opts.repeats):
        for method, llm in list(engines.items()):
            if method not in runs:
                continue
            try:
                run = _timed(llm, method, prompts[:n_req], timed, batch)
            except Exception as e:
                results["errors"][f"{method} ctx {ctx} batch {batch}"] = repr(e)
                log(f"{method} ctx {ctx} batch {batch} FAILED: {e!r}")
                runs.pop(method)
                continue
            runs[method].append(run)
            log(f"ctx {ctx} batch {batch} {method} run {r + 1}/{opts.repeats}: "
                f"{run['tokens_per_second']:.0f} tok/s, τ {run['acceptance_length']:.2f}")
    budget = min(kv_budget_for(config, ctx), ctx)
    for method, samples in runs.items():
        if not samples:
            continue
        row = {"ctx": ctx, "batch": batch, "method": method, "mode": "open" if opts.open_factor else "closed",
               "requests": n_req, **median_row(samples)}
        if method not in (PLAIN_ROW, NGRAM):
            row.update(selector=method, sparsity=config.sparsity_ratio, kv_budget=budget)
        if cfg is not None:
            row["floor_ms"] = byte_floor_ms(cfg, method, context=ctx, batch=batch, gamma=config.num_draft_tokens,
                                            kv_budget=budget, tensor_parallel=tp)
        results["rows"].append(row)


def write_json(results: dict, path: str | Path) -> None:
    """``results`` as indented JSON at ``path`` (values JSON lacks, e.g. vLLM objects, as text)."""
    Path(path).write_text(json.dumps(results, indent=1, default=str))


def summary_lines(results: dict) -> list[str]:
    """What ``vegas bench --backend vllm`` prints after the table: the Vegas engines' vLLM
    options and where their verification scores came from (``score_path`` of their stats:
    ``separate``, ``fa3_ext``, ``cute``), exactness per method and the engines that failed."""
    lines = []
    vllm_options = results.get("options", {}).get("vllm_options") or {}
    if vllm_options:
        lines.append(f"vLLM options of the Vegas engines: {json.dumps(vllm_options)}")
    paths: dict[str, set] = {}
    for row in results.get("rows", []):
        path = (row.get("stats") or {}).get("score_path")
        if path:
            paths.setdefault(row["method"], set()).add(path)
    lines += [f"score path {m}: {', '.join(sorted(p))}" for m, p in paths.items()]
    lines += [f"exactness {m}: {v['identical']}/{v['total']} greedy outputs identical to plain vLLM"
             + (f", {v['near_ties']} differ first at a near-tie" if v.get("near_ties") else "")
             + (f"; first differences: {v['diffs']}" if v["diffs"] else "")
             for m, v in results["exactness"].items()]
    lines += [f"error {k}: {v}" for k, v in results["errors"].items()]
    return lines
