"""Serving benchmark: vLLM's own ``vllm bench serve`` against an OpenAI-compatible server per
method (plain vLLM, plain vLLM without the Vegas plugin loaded, Vegas collect2, Vegas
sliding_window, vLLM's ngram), over request rates up
to saturation, with long prompts (4.8K-7.2K tokens: vLLM's random dataset, or held-out code through
vLLM's custom dataset). Prints a table (TTFT, TPOT, output tokens/s per method and rate) and
plots ``throughput_vs_rate.png`` and ``tpot_vs_rate.png``.

Every server is started with ``vegas serve`` (:mod:`vegas.serve`), so the command that runs is
the documented one. ``--model`` is resolved as everywhere in vegas (a model name such as
``smollm2-135m`` or a ``.gguf`` file becomes its converted checkpoint). ``--max-model-len``
defaults to what the requests need (the longest prompt, ``input_len x (1 + range_ratio)``, plus
``--output-len`` and a small margin, rounded up to 256) within the model's context
(``max_position_embeddings``); requests that do not fit the model are refused before any server
starts. On a GPU::

    python scripts/serve_bench.py --model smollm2-135m --input-len 6000 --range-ratio 0.2 --out serve-bench
    python scripts/serve_bench.py --dataset code --model /tmp/smollm2-hf --input-len 6000 --range-ratio 0.2
    python scripts/serve_bench.py --report serve-bench        # table and plots again from its JSON

(The defaults, 6,000 ± 20 % prompt tokens plus 256 output tokens, fit SmolLM2's 8,192-token context.)

Prompts: every timed run (rate, repeat) sends prompts of its own (:func:`run_seed`), the same
for every method, after an untimed warm-up run per server (``--warmup-prompts``): with vLLM's
prefix caching on, as users run it, a run that re-sent earlier prompts would measure no prefill.

What bounds the gain at rate inf (``--prefill-floor``): after plain's run at rate inf, as many new
prompts of the same lengths with one output token each; plain's duration over theirs is the most
a speculative method can gain there when prompts dominate (Amdahl's law; :func:`prefill_floor`).

Results: ``OUT/raw/<method>_r<rate>_k<repeat>.json`` (vLLM's result files; the warm-ups' in
``OUT/warmup``), ``OUT/summary.json``, ``OUT/table.md`` (with the prefill floor's bound when
measured, also ``OUT/prefill_floor.json``), the two PNGs and each server's log in ``OUT/logs``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vegas.config import VegasConfigError  # noqa: E402
from vegas.models import resolve_model  # noqa: E402
from vegas.serve import ServerError, ServerProcess, free_port, log_tail, plan_serve, read_config, vllm_command  # noqa: E402

METHODS = ("plain", "vllm", "collect2", "sliding_window", "ngram")
#: methods that run vLLM without Vegas: ``plain`` through ``vegas serve --selector none`` (Vegas'
#: ``vllm.general_plugins`` entry point loaded, its patches installed and inactive), ``vllm`` the same
#: server with no general plugin loaded (:data:`NO_PLUGINS_ENV`: vLLM as if vegas were not
#: installed), ``ngram`` vLLM's n-gram speculator
NON_VEGAS = ("plain", "vllm", "ngram")
#: the environment of the ``vllm`` method: vLLM loads no ``vllm.general_plugins`` entry point
#: when ``VLLM_PLUGINS`` is set to an empty string (vllm/envs.py)
NO_PLUGINS_ENV = {"VLLM_PLUGINS": ""}
NAME = "bench-model"  # --served-model-name
#: table columns: (result key, header, format)
COLUMNS = (
    ("completed", "done", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("mean_ttft_ms", "TTFT mean ms", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"),
    ("mean_tpot_ms", "TPOT mean ms", "{:.2f}"),
    ("p99_tpot_ms", "TPOT p99 ms", "{:.2f}"),
    ("mean_e2el_ms", "E2E mean ms", "{:.0f}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("request_throughput", "req/s", "{:.2f}"),
    ("spec_decode_acceptance_length", "τ", "{:.2f}"),
)


#: tokens kept above the longest request in the derived --max-model-len (vLLM's datasets
#: re-tokenise their prompts, which can add a few tokens); then rounded up to a multiple of 256
LEN_MARGIN = 64


def model_context(model: str) -> int:
    """The context of a model directory or hub id in tokens (its text config's
    ``max_position_embeddings``).

    Raises:
        VegasConfigError: the config cannot be read or has no ``max_position_embeddings``.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model).get_text_config()
    except (OSError, ValueError) as exc:
        raise VegasConfigError(f"model {model!r}: its config cannot be read ({exc})") from exc
    context = getattr(config, "max_position_embeddings", None)
    if not context:
        raise VegasConfigError(f"model {model!r} has no max_position_embeddings; pass --max-model-len")
    return int(context)


def longest_request(args) -> int:
    """Tokens of the longest request: the longest prompt plus ``--output-len``."""
    return math.ceil(args.input_len * (1 + args.range_ratio)) + args.output_len


def max_model_len(args, context: int) -> int:
    """``--max-model-len`` for these requests on a model of ``context`` tokens: ``args.max_model_len``
    when given, else the longest request plus :data:`LEN_MARGIN`, rounded up to 256, at most
    ``context``.

    Raises:
        VegasConfigError: the longest request does not fit ``--max-model-len`` or the model's
            context, or ``--max-model-len`` exceeds the model's context.
    """
    need = longest_request(args)
    what = (f"the longest request ({args.input_len} x (1 + {args.range_ratio:g}) prompt tokens + "
            f"--output-len {args.output_len} = {need} tokens)")
    if need > context:
        raise VegasConfigError(f"{what} exceeds the model's context of {context} tokens; lower --input-len, "
                               "--range-ratio or --output-len")
    if args.max_model_len is None:
        return min(context, -(-(need + LEN_MARGIN) // 256) * 256)
    if args.max_model_len > context:
        raise VegasConfigError(f"--max-model-len {args.max_model_len} exceeds the model's context of {context} tokens")
    if need > args.max_model_len:
        raise VegasConfigError(f"{what} does not fit --max-model-len {args.max_model_len}")
    return args.max_model_len


def rate_value(rate) -> float:
    """A request rate as a float (``"inf"``, ``inf`` and numbers alike)."""
    return float(rate)


def rate_label(rate) -> str:
    r = rate_value(rate)
    return "inf" if math.isinf(r) else f"{r:g}"


#: a method ``<selector>-skip`` runs that Vegas selector with ``vllm.prefill_skip_tokens``
#: = ``--prefill-skip-tokens`` (no selection or drafting in forwards carrying a prefill chunk;
#: the default since 2026-12-03 is 2,048 on the V2 runner), ``<selector>-noskip`` with 0 (drafting
#: after every forward, the default before)
SKIP_SUFFIX = "-skip"
#: method suffix -> the ``VegasConfig.vllm`` fields it sets (``<selector><suffix>``, merged into --config)
VARIANTS = {
    SKIP_SUFFIX: lambda args: {"prefill_skip_tokens": args.prefill_skip_tokens},
    "-noskip": lambda args: {"prefill_skip_tokens": 0},
    "-overlap": lambda args: {"score_overlap": True},
    "-indraft": lambda args: {"select_in_draft": True},
    "-separate": lambda args: {"select_in_draft": False},
    "-fallback": lambda args: {"fallback": True},
}
#: a last suffix ``-g<N>`` runs the method with γ = N instead of ``--gamma`` (``collect2-skip-g2``)
GAMMA_SUFFIX = re.compile(r"-g([1-9][0-9]*)$")


def split_variant(method: str) -> tuple[str, list[str]]:
    """``(selector, suffixes)`` of a method name: the :data:`VARIANTS` suffixes it ends with, in
    the order written (``collect2-skip-fallback`` -> ``("collect2", ["-skip", "-fallback"])``;
    none: ``[]``), and a last :data:`GAMMA_SUFFIX` (``collect2-skip-g2`` -> ``("collect2",
    ["-skip", "-g2"])``)."""
    suffixes = []
    gamma = GAMMA_SUFFIX.search(method)
    if gamma:
        suffixes.append(gamma.group(0))
        method = method[:gamma.start()]
    while True:
        suffix = next((s for s in VARIANTS if method.endswith(s)), None)
        if suffix is None:
            return method, suffixes[::-1]
        suffixes.append(suffix)
        method = method.removesuffix(suffix)


def method_config(method: str, args) -> tuple[str, dict]:
    """``(selector, --config values)`` of a Vegas method: ``--config``'s values with the ``vllm``
    fields of each of its :data:`VARIANTS` suffixes merged in."""
    selector, suffixes = split_variant(method)
    config = args.config_values
    for suffix in suffixes:
        if suffix in VARIANTS:
            config = {**config, "vllm": {**config.get("vllm", {}), **VARIANTS[suffix](args)}}
    return selector, config


def method_gamma(method: str, args) -> int:
    """γ of a method: its :data:`GAMMA_SUFFIX`'s, else ``--gamma``."""
    gamma = GAMMA_SUFFIX.search(method)
    return int(gamma.group(1)) if gamma else args.gamma


def method_args(method: str, args) -> tuple[list[str], list[str]]:
    """``(vegas serve options, extra vllm serve arguments)`` of a method."""
    if method in ("plain", "vllm"):
        return ["--selector", "none"], []
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.gamma, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
        return ["--selector", "none"], ["--speculative-config", json.dumps(spec)]
    selector, config = method_config(method, args)
    opts = ["--selector", selector, "-g", str(method_gamma(method, args)), "--sparsity-ratio", str(args.sparsity_ratio)]
    if config:
        opts += ["--config", json.dumps(config)]
    return opts, []


def method_env(method: str, env: dict) -> dict:
    """The environment of a method's server: ``env``, with :data:`NO_PLUGINS_ENV` for ``vllm``."""
    return {**env, **NO_PLUGINS_ENV} if method == "vllm" else env


def server_argv(method: str, args, port: int, gpu_memory_utilization: float | None = None) -> list[str]:
    """The ``vegas serve`` command of a method's server (``gpu_memory_utilization`` defaults to
    ``--gpu-memory-utilization``; with ``--kv-cache-gib`` the KV pool is that size,
    ``--kv-cache-memory-bytes``, instead of what vLLM measures free)."""
    opts, extra = method_args(method, args)
    util = args.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
    kv = ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))] if args.kv_cache_gib else []
    return [sys.executable, "-c", "from vegas.cli import main; main()", "serve", args.model, *opts,
            "--port", str(port), "--host", "127.0.0.1", "--",
            "--served-model-name", NAME, "--max-model-len", str(args.max_model_len),
            "--gpu-memory-utilization", f"{util:.3f}", *kv, "--max-num-seqs", str(args.max_num_seqs),
            "--seed", "0", *extra, *args.serve_arg]


def compile_family(method: str) -> str:
    """Methods of one family share vLLM's ``torch.compile`` cache entry (every Vegas selector:
    :func:`vegas.vllm_plugin.patches.patch_compile_hash`); the first of a family compiles and
    writes it, so two of a family never start at once."""
    if method == "vllm":
        return "plain"  # the same model and settings as plain: whether their cache entries differ is vLLM's
    return method if method in NON_VEGAS else "vegas"


def start_waves(methods: list[str], concurrent: bool) -> list[list[str]]:
    """Groups of servers started together, each group after the previous one is ready: one
    server per group (one after another: vLLM sizes its KV pool from the free memory it measures
    at start, so nothing else may start meanwhile), or with ``concurrent`` (``--start-together``,
    fixed KV pools) the first server of each :func:`compile_family` together, then the next
    of each, and so on."""
    if not concurrent:
        return [[m] for m in methods]
    waves: list[list[str]] = []
    seen: dict[str, int] = {}
    for m in methods:
        i = seen[compile_family(m)] = seen.get(compile_family(m), -1) + 1
        if i == len(waves):
            waves.append([])
        waves[i].append(m)
    return waves


#: runs of one method that may time out before its remaining runs are skipped
MAX_TIMEOUTS = 2


def bench_timeout(rate, args) -> float:
    """Seconds one ``vllm bench serve`` run may take: ``--bench-timeout``, else the time to send
    the requests at ``rate`` plus 240 s."""
    if args.bench_timeout:
        return args.bench_timeout
    r = rate_value(rate)
    return 240.0 + (0.0 if math.isinf(r) else args.num_prompts / r)


def run_client(argv: list[str], log: Path, timeout: float) -> int:
    """One ``vllm bench serve`` run (``argv``: its command, as :func:`bench_argv` gives it) in this
    process: ``vllm.benchmarks.serve.main_async`` with the arguments the command parses to, the
    same code the command runs, without its ~25 s of start-up (importing vLLM, loading the
    tokenizer) per run. Output goes to ``log``.

    Returns:
        0 when the run finished, 1 when it raised (the traceback is in ``log``), 124 when it took
        longer than ``timeout`` seconds (cancelled).
    """
    import asyncio
    import contextlib
    import gc
    import traceback

    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(argv[argv.index("serve") + 1:])
    with Path(log).open("w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print("$", " ".join(argv), flush=True)
        try:
            asyncio.run(asyncio.wait_for(main_async(ns), timeout))
        except (asyncio.TimeoutError, TimeoutError):
            print(f"vllm bench serve: no result within {timeout:.0f} s; cancelled", flush=True)
            return 124
        except Exception:  # noqa: BLE001 - a failed run is logged and the benchmark goes on
            traceback.print_exc(file=f)
            return 1
        finally:
            gc.unfreeze()  # main_async freezes the heap (gc.freeze) for its run; later runs collect it
            gc.collect()
    return 0


def run_seed(args, rate, repeat: int) -> int:
    """The prompt seed of one timed run: its own for every (rate, repeat), the same for every
    method, never ``args.seed`` itself (the warm-up's). A run that re-sent earlier prompts would
    find them in vLLM's prefix cache (on by default, as users run it) and measure no prefill."""
    return args.seed + 1 + repeat * len(args.rates) + args.rates.index(rate)


def prompts_per_run(rate, args) -> int:
    """Requests of one timed run at ``rate``: ``--num-prompts-inf`` at rate inf when given, else
    ``--num-prompts``. At rate inf every request arrives at once and a run of 64 lasts 2-4 s,
    decided by the front end and the prefill order (paired ratios 0.67-1.54x on 2026-12-02): more
    requests make it a measurement."""
    if math.isinf(rate_value(rate)) and getattr(args, "num_prompts_inf", None):
        return args.num_prompts_inf
    return args.num_prompts


#: the pseudo-method of ``--prefill-floor`` runs: plain vLLM's server, rate inf, one output token
PREFILL_FLOOR = "prefill-floor"
#: added to a repeat's prompt seed for its prefill-floor run: prompts of the same lengths that no
#: server has seen (plain's prefix cache holds the timed run's prompts)
PREFILL_SEED_OFFSET = 1000


def bench_argv(method: str, rate, args, port: int, result_dir: Path, dataset_path: Path | None,
               repeat: int = 0, *, seed: int | None = None, num_prompts: int | None = None,
               output_len: int | None = None) -> list[str]:
    """The ``vllm bench serve`` command of one method, request rate and repeat; ``seed``
    (default :func:`run_seed`) picks the prompts, ``num_prompts`` defaults to
    :func:`prompts_per_run`, ``output_len`` to ``--output-len``."""
    seed = run_seed(args, rate, repeat) if seed is None else seed
    output_len = args.output_len if output_len is None else output_len
    argv = [*vllm_command(), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", args.model,
            "--num-prompts", str(num_prompts or prompts_per_run(rate, args)), "--request-rate", rate_label(rate),
            "--seed", str(seed),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir),
            "--result-filename", f"{method}_r{rate_label(rate)}_k{repeat}.json", "--metadata", f"method={method}"]
    if dataset_path is None:
        argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                 "--random-output-len", str(output_len), "--random-range-ratio", str(args.range_ratio)]
    else:
        argv += ["--dataset-name", "custom", "--dataset-path", str(dataset_path), "--skip-chat-template",
                 "--custom-output-len", str(output_len)]
    return argv


def write_code_prompts(path: Path, args, seed: int = 0, num_prompts: int | None = None) -> Path:
    """Held-out code prompts as vLLM's custom dataset (JSONL, one ``{"prompt": text}`` a line):
    ``num_prompts`` (default ``--num-prompts``) cuts of ``args.prompts`` (default: the installed
    click source) of ``--input-len`` x (1 ± ``--range-ratio``) tokens at places drawn with ``seed``."""
    import random

    from transformers import AutoTokenizer

    from vegas.prompts import package_source, read_text_source

    text = read_text_source(args.prompts, what="--prompts") if args.prompts else package_source()
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok(text, add_special_tokens=False).input_ids
    lo, hi = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(num_prompts or args.num_prompts):
            n = min(rng.randint(lo, hi), len(ids) - 1)
            start = rng.randrange(0, len(ids) - n)
            f.write(json.dumps({"prompt": tok.decode(ids[start:start + n])}) + "\n")
    return path


RATIOS = (("output_throughput", "x_plain"), ("mean_ttft_ms", "ttft_x_plain"),
          ("mean_tpot_ms", "tpot_x_plain"), ("mean_e2el_ms", "e2el_x_plain"))


def repeat_index(path: Path) -> int | None:
    """The repeat of a result file named ``<method>_r<rate>_k<repeat>.json``, or None."""
    _, sep, tail = path.stem.rpartition("_k")
    return int(tail) if sep and tail.isdigit() else None


def load_results(result_dir: Path) -> list[dict]:
    """One row per (method, rate): the median over its repeats (one vLLM result file each) of
    every :data:`COLUMNS` value (None where the files lack one), the repeats' min and max output
    throughput, and the ratios to plain vLLM at the same rate (:data:`RATIOS`: ``x_plain`` for
    output throughput, ``ttft_x_plain``, ``tpot_x_plain``, ``e2el_x_plain``).

    A ratio is paired: the median over the repeats that both the method and plain ran (the same
    repeat index ``_k<N>`` in the file name: the same prompts, on the same servers) of the method's
    value over plain's, and ``<ratio>_repeats`` lists those per-repeat ratios in repeat order (the
    spread). Where no repeat pairs up (files without ``_k<N>``), the ratio is that of the medians
    and the list is empty (also for plain itself). Sorted by method then rate. A file without a
    numeric ``output_throughput`` is left out with a warning naming it.

    Raises:
        SystemExit: a file that is not JSON or not a JSON object (the message names it)."""
    import statistics

    runs: dict[tuple[str, str], dict] = {}
    for n, p in enumerate(sorted(Path(result_dir).glob("*.json"))):
        try:
            r = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SystemExit(f"{p} is not a vllm bench serve result: {exc}") from None
        if not isinstance(r, dict):
            raise SystemExit(f"{p} is not a vllm bench serve result: a JSON {type(r).__name__}, not an object")
        if not isinstance(r.get("output_throughput"), (int, float)):
            print(f"warning: {p} has no numeric output_throughput: left out", file=sys.stderr)
            continue
        method = r.get("method") or p.stem.rsplit("_r", 1)[0]
        k = repeat_index(p)
        runs.setdefault((method, rate_label(r.get("request_rate", "inf"))), {})[("k", k) if k is not None else ("n", n)] = r
    rows = []
    for (method, rate), by_repeat in runs.items():
        results = list(by_repeat.values())
        row = {"method": method, "rate": rate, "repeats": len(results)}
        for key, _, _ in COLUMNS:
            vals = [float(r[key]) for r in results if isinstance(r.get(key), (int, float))]
            row[key] = statistics.median(vals) if vals else None
        tput = [float(r["output_throughput"]) for r in results if isinstance(r.get("output_throughput"), (int, float))]
        row["throughput_min"], row["throughput_max"] = (min(tput), max(tput)) if tput else (None, None)
        rows.append(row)
    plain = {r["rate"]: r for r in rows if r["method"] == "plain"}
    for r in rows:
        base_row = plain.get(r["rate"]) or {}
        mine = runs[(r["method"], r["rate"])]
        base_runs = {} if r is base_row else runs.get(("plain", r["rate"]), {})
        common = sorted(k for k in mine if k[0] == "k" and k in base_runs)  # repeats both ran
        for key, ratio in RATIOS:
            paired = [float(mine[k][key]) / float(base_runs[k][key]) for k in common
                      if isinstance(mine[k].get(key), (int, float)) and isinstance(base_runs[k].get(key), (int, float))
                      and base_runs[k][key]]
            base = base_row.get(key)
            if paired:
                r[ratio] = statistics.median(paired)
            else:
                r[ratio] = r[key] / base if base and r[key] is not None else None
            r[ratio + "_repeats"] = paired
    order = {m: i for i, m in enumerate(METHODS)}
    return sorted(rows, key=lambda r: (order.get(r["method"], len(order)), r["method"], rate_value(r["rate"])))


def render_table(rows: list[dict]) -> str:
    """A Markdown table of the rows; each "x plain" cell is the paired median of
    :func:`load_results`, each repeat's ratio in brackets where there are two or more."""
    head = ["method", "rate", "repeats"] + [h for _, h, _ in COLUMNS] + ["out tok/s min-max", "x plain",
                                                                          "TTFT x plain", "TPOT x plain", "E2E x plain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], r["rate"], str(r.get("repeats", 1))]
        cells += ["-" if r[k] is None else f.format(r[k]) for k, _, f in COLUMNS]
        lo, hi = r.get("throughput_min"), r.get("throughput_max")
        cells.append("-" if lo is None else f"{lo:.0f}-{hi:.0f}")
        for _, ratio in RATIOS:
            each = r.get(ratio + "_repeats") or []
            spread = f" ({', '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else ""
            cells.append("-" if r.get(ratio) is None else f"{r[ratio]:.2f}x{spread}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> list[Path]:
    """``throughput_vs_rate.png`` (output tokens/s) and ``tpot_vs_rate.png`` (mean TPOT, p99
    dashed) against the request rate, one line per method; the rates are evenly spaced ticks
    (``inf`` last: all requests at once)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in rows}, key=rate_value)
    x = {rate: i for i, rate in enumerate(rates)}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    written = []
    for name, keys, ylabel in (
        ("throughput_vs_rate.png", ("output_throughput",), "output tokens/s"),
        ("tpot_vs_rate.png", ("mean_tpot_ms", "p99_tpot_ms"), "TPOT, ms (mean; p99 dashed)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in methods:
            mine = [r for r in rows if r["method"] == m]
            for key, style in zip(keys, ("-o", "--x")):
                pts = [(x[r["rate"]], r[key]) for r in mine if r[key] is not None]
                if pts:
                    ax.plot(*zip(*pts), style, label=m if style == "-o" else None,
                            color=f"C{methods.index(m)}")
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("request rate, requests/s (inf: all at once)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(out) / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def prefill_floor(result_dir: Path) -> dict | None:
    """What bounds a speculative method at rate inf: per repeat, plain vLLM's run duration and the
    duration of its prefill-floor run (the same number of prompts of the same lengths, one output
    token each: the prompts' prefill and little else), from ``result_dir``'s result files.

    Returns:
        None without prefill-floor runs; else ``{"repeats": [{"repeat", "plain_s", "prefill_s"}],
        "plain_s", "prefill_s", "decode_share", "decode_free_bound"}`` (medians over the repeats
        that have both runs): ``decode_share`` = 1 - prefill / plain, the share of plain's run
        that decoding takes; ``decode_free_bound`` = plain / prefill, the output throughput over
        plain's that a method whose decoding cost nothing would reach (Amdahl's law).
    """
    import statistics

    result_dir = Path(result_dir)
    reps = []
    for p in sorted(result_dir.glob(f"{PREFILL_FLOOR}_rinf_k*.json")):
        k = p.stem.rsplit("_k", 1)[1]
        plain = result_dir / f"plain_rinf_k{k}.json"
        if not plain.exists():
            continue
        d_plain, d_floor = (float(json.loads(f.read_text())["duration"]) for f in (plain, p))
        reps.append({"repeat": int(k), "plain_s": d_plain, "prefill_s": d_floor})
    if not reps:
        return None
    plain_s = statistics.median(r["plain_s"] for r in reps)
    prefill_s = statistics.median(r["prefill_s"] for r in reps)
    return {"repeats": reps, "plain_s": plain_s, "prefill_s": prefill_s,
            "decode_share": 1.0 - prefill_s / plain_s, "decode_free_bound": plain_s / prefill_s}


def render_prefill_floor(floor: dict) -> str:
    """The prefill floor as Markdown: durations per repeat and the decode-free bound."""
    per = ", ".join(f"{r['plain_s']:.2f} / {r['prefill_s']:.2f}" for r in floor["repeats"])
    return (f"Rate inf, plain vLLM's run against its prompts alone (one output token, "
            f"`{PREFILL_FLOOR}`), s per repeat (plain / prompts alone): {per}. Medians: "
            f"{floor['plain_s']:.2f} s / {floor['prefill_s']:.2f} s; decoding is "
            f"{100 * floor['decode_share']:.0f} % of plain's run, so a method whose decoding cost "
            f"nothing would reach at most **{floor['decode_free_bound']:.2f}x** plain's output throughput "
            f"at rate inf.")


def report(out: Path, dest: Path | None = None) -> str:
    """Table, summary.json, table.md and plots from ``out/raw``, written to ``dest`` (default
    ``out``); returns the table.

    Raises:
        SystemExit: ``out/raw`` holds no results, or a result file that is not vLLM's JSON.
    """
    rows = load_results(out / "raw")
    floor = prefill_floor(out / "raw")
    rows = [r for r in rows if r["method"] != PREFILL_FLOOR]
    if not rows:
        raise SystemExit(f"no vllm bench serve results in {out / 'raw'}")
    dest = Path(dest or out)
    dest.mkdir(parents=True, exist_ok=True)
    table = render_table(rows)
    if floor:
        table += "\n\n" + render_prefill_floor(floor)
        (dest / "prefill_floor.json").write_text(json.dumps(floor, indent=1))
    (dest / "table.md").write_text(table + "\n")
    (dest / "summary.json").write_text(json.dumps(rows, indent=1))
    plot(rows, dest)
    return table


def kv_cache_tokens(log: Path) -> int | None:
    """The KV-cache tokens a vLLM server reported at start (``GPU KV cache size: N tokens``)."""
    import re

    found = re.findall(r"GPU KV cache size: ([\d,]+) tokens", log.read_text(errors="replace")) if log.exists() else []
    return int(found[-1].replace(",", "")) if found else None


def run(args) -> None:
    """Start every method's server, one after another (nothing else on the GPU while one
    starts) or, with ``--start-together`` (and ``--kv-cache-gib``), side by side (:func:`start_waves`), each with an equal
    share of ``--gpu-memory-utilization`` unless ``--one-server-at-a-time``; then run
    ``vllm bench serve`` repeats interleaved over methods and rates (repeat 1: rate a: plain,
    collect2, ...; rate b: ...; repeat 2: ...), so that drifts of the machine fall on every method
    alike. Each run goes through :func:`run_client` (in this process, with a timeout: a run that
    hangs costs :func:`bench_timeout`, not the session); a server that exited is skipped.

    Raises:
        SystemExit: vLLM is not installed (before any server starts).
    """
    from vegas.backends.vllm import vllm_installed, vllm_missing_message

    if not vllm_installed():
        raise SystemExit(vllm_missing_message("scripts/serve_bench.py"))
    out = Path(args.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    written: dict[int, Path] = {}  # seed -> its prompt file, written once in this run (every method reads it)

    def dataset(seed: int, num_prompts: int | None = None) -> Path | None:
        """The custom dataset file of one prompt seed (``--dataset code``), None for vLLM's random one."""
        if args.dataset != "code":
            return None
        if seed not in written:  # never a file left by an earlier run with other lengths
            written[seed] = write_code_prompts(out / f"code_prompts_s{seed}.jsonl", args, seed, num_prompts)
        return written[seed]

    t_end = time.monotonic() + args.time_budget if args.time_budget else math.inf
    groups = [[m] for m in args.methods] if args.one_server_at_a_time else [list(args.methods)]
    util = args.gpu_memory_utilization / (1 if args.one_server_at_a_time else len(args.methods))
    memory = {}
    timeouts: dict[str, int] = {}
    for methods in groups:
        servers = {}
        try:
            for wave in start_waves(methods, concurrent=args.start_together):
                if time.monotonic() > t_end:
                    print(f"[time budget] {', '.join(wave)} not started", flush=True)
                    break
                starting = {}
                for method in wave:
                    port = free_port()
                    server = ServerProcess(method, server_argv(method, args, port, util),
                                           out / "logs" / f"{method}.log", port, env=method_env(method, env),
                                           cwd=ROOT)
                    print(f"[{method}] {' '.join(server.argv)}", flush=True)
                    starting[method] = (server, port)
                t0 = time.monotonic()
                for method, (server, port) in starting.items():
                    try:
                        server.wait_ready(max(1.0, args.start_timeout - (time.monotonic() - t0)))
                    except ServerError as e:
                        print(f"[{method}] failed: {e}\n{log_tail(server.log, 5)}", flush=True)
                        server.stop()
                        continue
                    print(f"[{method}] ready after {time.monotonic() - t0:.0f} s", flush=True)
                    servers[method] = (server, port)
                    memory[method] = kv_cache_tokens(server.log)
                    print(f"[{method}] KV cache: {memory[method]} tokens", flush=True)
            for method, (server, port) in servers.items() if args.warmup_prompts else ():
                # untimed, prompts of their own (seed args.seed): lazy JIT and first-use paths of
                # every server run here, not inside a timed run
                cmd = bench_argv(method, math.inf, args, port, out / "warmup", dataset(args.seed, args.warmup_prompts),
                                 seed=args.seed, num_prompts=args.warmup_prompts)
                rc = run_client(cmd, out / "logs" / f"warmup_{method}.log", bench_timeout(math.inf, args))
                print(f"[{method}] warm-up ({args.warmup_prompts} prompts, rate inf): rc={rc}", flush=True)
            for rep, rate, method in ((rep, rate, m) for rep in range(args.first_repeat, args.first_repeat + args.repeats)
                                      for rate in args.rates
                                      for m in servers):
                if time.monotonic() > t_end:
                    print(f"[time budget] rate {rate_label(rate)} #{rep} and later skipped", flush=True)
                    break
                server = servers[method][0]
                if timeouts.get(method, 0) >= MAX_TIMEOUTS:
                    continue
                if server.proc.poll() is not None:
                    print(f"[{method}] rate {rate_label(rate)} #{rep}: skipped, the server exited with "
                          f"{server.proc.returncode}", flush=True)
                    continue
                cmd = bench_argv(method, rate, args, servers[method][1], out / "raw",
                                 dataset(run_seed(args, rate, rep), prompts_per_run(rate, args)), rep)
                log = out / "logs" / f"bench_{method}_r{rate_label(rate)}_k{rep}.log"
                t0 = time.monotonic()
                rc = run_client(cmd, log, bench_timeout(rate, args))
                print(f"[{method}] rate {rate_label(rate)} #{rep}: rc={rc} ({time.monotonic() - t0:.0f} s)", flush=True)
                if method == "plain" and args.prefill_floor and math.isinf(rate_value(rate)):
                    seed = run_seed(args, rate, rep) + PREFILL_SEED_OFFSET
                    floor_cmd = bench_argv(PREFILL_FLOOR, rate, args, servers[method][1], out / "raw",
                                           dataset(seed, prompts_per_run(rate, args)), rep, seed=seed, output_len=1)
                    floor_rc = run_client(floor_cmd, out / "logs" / f"bench_{PREFILL_FLOOR}_rinf_k{rep}.log",
                                          bench_timeout(rate, args))
                    print(f"[{PREFILL_FLOOR}] rate inf #{rep}: rc={floor_rc}", flush=True)
                if rc == 124:
                    timeouts[method] = timeouts.get(method, 0) + 1
                    if timeouts[method] >= MAX_TIMEOUTS:
                        print(f"[{method}] {MAX_TIMEOUTS} runs timed out: its remaining runs are skipped", flush=True)
                if rc:
                    print(log_tail(log, 20), flush=True)
        finally:
            for method, (server, _) in servers.items():
                try:
                    server.stop()
                except ServerError as e:
                    print(f"[{method}] {e}", flush=True)
                print(f"[{method}] server log tail:\n{log_tail(server.log, 3)}", flush=True)
    if memory:
        (out / "kv_cache_tokens.json").write_text(json.dumps(memory, indent=1))
    print(report(out))
    print("KV cache tokens per server:", json.dumps(memory))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None (those options say their default in words)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    p.add_argument("--model", default=str(ROOT / "vegas" / "model"),
                   help="Model name (smollm2-135m), .gguf file, model directory or hub id.")
    p.add_argument("--methods", default=",".join(METHODS), type=lambda s: [m for m in s.split(",") if m],
                   help="plain, vllm (plain with no vllm.general_plugins loaded: vLLM as without vegas), ngram, "
                        "or Vegas selector names (collect2, sliding_window, ...); "
                        "<selector>-skip: that selector with --prefill-skip-tokens; <selector>-noskip: with "
                        "vllm.prefill_skip_tokens 0 (drafting after every forward); <selector>-overlap: with "
                        "vllm.score_overlap; <selector>-indraft: with vllm.select_in_draft (the default); "
                        "<selector>-separate: without it (the score pass after the verification); <selector>-fallback: with "
                        "vllm.fallback; suffixes combine (collect2-skip-fallback); a last -g<N> sets that method's γ "
                        "(collect2-skip-g2).")
    p.add_argument("--rates", default="1,2,4,8,16,inf", type=rate_list,
                   help="Request rates (requests/s, > 0; inf sends all at once: saturation).")
    p.add_argument("--num-prompts", type=int, default=64, help="Requests per rate.")
    p.add_argument("--num-prompts-inf", type=int, default=None,
                   help="Requests per run at rate inf (default: --num-prompts); e.g. 256, where 64 requests "
                        "sent at once make runs of 2-4 s that noise decides.")
    p.add_argument("--repeats", type=int, default=3, help="Runs per rate and method (the table gives medians).")
    p.add_argument("--first-repeat", type=int, default=0,
                   help="Index of the first repeat (its prompt seed and result file name): e.g. 2 with --repeats 1 "
                        "adds a third repeat to an earlier run's raw/ folder, with that repeat's own prompts.")
    p.add_argument("--dataset", choices=("random", "code"), default="random",
                   help="random token prompts, or held-out code cut from --prompts.")
    p.add_argument("--prompts", default=None, help="Code file or directory for --dataset code (default: click).")
    p.add_argument("--input-len", type=int, default=6000, help="Mean prompt tokens.")
    p.add_argument("--range-ratio", type=float, default=0.2, help="Prompt length in input-len x (1 ± ratio).")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0,
                   help="Prompt seed: the warm-up's; timed run k of rate r uses its own (seed + 1 + k x rates + r), "
                        "the same for every method, so that no run finds its prompts in the prefix cache.")
    p.add_argument("--warmup-prompts", type=int, default=16,
                   help="Untimed requests (rate inf, prompts of their own) sent to every server before the runs; 0: none.")
    p.add_argument("-g", "--gamma", type=int, default=4, help="γ of Vegas and ngram.")
    p.add_argument("--sparsity-ratio", type=float, default=0.05)
    p.add_argument("--config", default=None, help="Further Vegas settings (vegas serve --config).")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM's max_model_len [default: the longest request plus a margin, within the model's "
                        "context].")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="GPU memory of all servers together (each server gets an equal share).")
    p.add_argument("--one-server-at-a-time", action="store_true",
                   help="One server per method in turn, each with all of --gpu-memory-utilization (repeats then "
                        "interleave over rates only).")
    p.add_argument("--prefill-floor", action="store_true",
                   help="After plain's run at rate inf, send as many new prompts of the same lengths with one "
                        "output token each: the table then says what share of plain's run decoding takes and "
                        "the most a speculative method could gain there (needs plain in --methods).")
    p.add_argument("--prefill-skip-tokens", type=int, default=2048,
                   help="vllm.prefill_skip_tokens of the '<selector>-skip' methods.")
    p.add_argument("--serve-arg", action="append", default=[], help="One more vllm serve argument (repeatable).")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--bench-timeout", type=float, default=None,
                   help="Seconds one vllm bench serve run may take [default: num-prompts / rate + 240].")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV pool of every server in GiB (vLLM's --kv-cache-memory-bytes): equal pools "
                        "[default: each server's pool is what vLLM measures free in its --gpu-memory-utilization "
                        "share, the setting users run].")
    p.add_argument("--start-together", action="store_true",
                   help="With --kv-cache-gib: start the servers side by side (the first of each compile family "
                        "together), saving ~1 min a server. Not for figures: on one H200 (2026-12-04) plain vLLM "
                        "started beside a Vegas server ran 0.77x as fast at rate inf as plain started alone.")
    p.add_argument("--time-budget", type=float, default=None, help="Seconds: skip what would start after it.")
    p.add_argument("--out", default=None, help="Results folder [default: serve-bench; with --report: the "
                                                 "folder read].")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="Only rebuild the table and plots from DIR/raw (written to --out when given, else DIR).")
    args = p.parse_args(argv)
    if args.report is None:
        args.out = args.out or "serve-bench"
        try:
            raise_if_bad_args(args)
            args.model = resolve_model(args.model)  # names and .gguf files -> a checkpoint directory
            args.max_model_len = max_model_len(args, model_context(args.model))
            raise_if_a_server_would_refuse(args)
        except VegasConfigError as exc:
            p.error(str(exc))
    return args


def rate_list(raw: str) -> list[float]:
    """``--rates``: comma-separated positive numbers or ``inf``."""
    try:
        rates = [rate_value(r) for r in raw.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"must be comma-separated request rates > 0 or inf, got {raw!r}")
    return rates


def raise_if_bad_args(args) -> None:
    """Refuse, before anything is created or started: unknown methods, counts below 1, ratios,
    memory shares and times out of range, ``--prompts`` that is missing or unused, a ``--config``
    that is not valid Vegas settings (its values then in ``args.config_values``).

    Raises:
        VegasConfigError: naming the option and what it allows.
    """
    from vegas.plugins import selector_names

    allowed = list(NON_VEGAS) + [n for n in selector_names() if n != "none"]
    zero_gamma = [m for m in args.methods if re.search(r"-g0[0-9]*$", m)]
    if zero_gamma:
        raise VegasConfigError(f"--methods {zero_gamma[0]}: the suffix -g<N> sets γ = N, an integer >= 1")
    bad = [m for m in args.methods if m not in allowed and split_variant(m)[0] not in allowed[len(NON_VEGAS):]]
    if bad or not args.methods:
        raise VegasConfigError(f"--methods: unknown {', '.join(bad) or '(none given)'}; allowed: "
                               f"{', '.join(allowed)}, and <selector> with one or more suffixes: {', '.join(VARIANTS)}, "
                               f"then -g<N> (γ = N)")
    for flag, value, least in (("--num-prompts", args.num_prompts, 1),
                               ("--num-prompts-inf", args.num_prompts_inf if args.num_prompts_inf is not None else 1, 1),
                               ("--repeats", args.repeats, 1), ("--first-repeat", args.first_repeat, 0),
                               ("--gamma", args.gamma, 1), ("--output-len", args.output_len, 1),
                               ("--input-len", args.input_len, 1), ("--prefill-skip-tokens", args.prefill_skip_tokens, 0),
                               ("--warmup-prompts", args.warmup_prompts, 0), ("--seed", args.seed, 0)):
        if value < least:
            raise VegasConfigError(f"{flag} must be an integer >= {least}, got {value}")
    for flag, value in (("--kv-cache-gib", args.kv_cache_gib), ("--bench-timeout", args.bench_timeout)):
        if value is not None and not 0 < value < math.inf:
            raise VegasConfigError(f"{flag} must be a finite number > 0, got {value}")
    for method in args.methods:  # two suffixes that set one field (collect2-skip-noskip) leave it to their order
        fields = [field for suffix in split_variant(method)[1] if suffix in VARIANTS
                  for field in VARIANTS[suffix](args)]
        if len(set(fields)) != len(fields):
            raise VegasConfigError(f"--methods {method}: two suffixes set the same setting "
                                   f"({', '.join(sorted({f for f in fields if fields.count(f) > 1}))}); give one")
    if len(set(args.rates)) != len(args.rates):
        raise VegasConfigError(f"--rates names a rate twice: {','.join(rate_label(r) for r in args.rates)} "
                               "(its runs would write the same result files)")
    if args.start_together and args.one_server_at_a_time:
        raise VegasConfigError("--start-together and --one-server-at-a-time contradict each other; give one")
    if not 0 < args.sparsity_ratio <= 1:
        raise VegasConfigError(f"--sparsity-ratio must be in (0, 1], got {args.sparsity_ratio}")
    if not 0 <= args.range_ratio < 1:
        raise VegasConfigError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.max_num_seqs < 1:
        raise VegasConfigError(f"--max-num-seqs must be an integer >= 1, got {args.max_num_seqs}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise VegasConfigError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    for flag, value in (("--start-timeout", args.start_timeout), ("--time-budget", args.time_budget)):
        if value is not None and not value > 0:
            raise VegasConfigError(f"{flag} must be a number of seconds > 0, got {value}")
    if args.prompts is not None:
        if args.dataset != "code":
            raise VegasConfigError("--prompts is read only with --dataset code")
        if not Path(args.prompts).exists():
            raise VegasConfigError(f"--prompts {args.prompts!r} is not a file or a directory")
    if args.prefill_floor and ("plain" not in args.methods or not any(math.isinf(r) for r in args.rates)):
        raise VegasConfigError("--prefill-floor runs on plain vLLM's server at rate inf: add plain to --methods "
                               "and inf to --rates")
    if args.start_together and not args.kv_cache_gib:
        raise VegasConfigError("--start-together needs --kv-cache-gib: vLLM sizes a pool from the memory free at "
                               "its start, so servers without fixed pools start one after another")
    if len(set(args.methods)) != len(args.methods):
        raise VegasConfigError(f"--methods names a method twice: {','.join(args.methods)}")
    args.config_values = read_config(args.config)[0] if args.config else {}
    if "selector" in args.config_values:
        raise VegasConfigError("--config must not name a selector: --methods names them")


def raise_if_a_server_would_refuse(args) -> None:
    """What ``vegas serve`` would refuse in a method's server command (its Vegas settings, a Quest
    page size other than vLLM's block size, a ``--serve-arg`` that sets what ``vegas serve`` sets),
    checked now by :func:`vegas.serve.plan_serve` itself, before any server starts.

    Raises:
        VegasConfigError: naming the method and what its server would refuse.
    """
    for method in args.methods:
        opts, _ = method_args(method, args)
        flags = dict(zip(opts[::2], opts[1::2]))
        argv = server_argv(method, args, port=8000)
        try:
            plan_serve(args.model, selector=flags["--selector"],
                       num_draft_tokens=int(flags["-g"]) if "-g" in flags else None,
                       sparsity_ratio=float(flags["--sparsity-ratio"]) if "--sparsity-ratio" in flags else None,
                       config=flags.get("--config"), port=8000, host="127.0.0.1",
                       extra_args=argv[argv.index("--") + 1:])
        except VegasConfigError as e:
            raise VegasConfigError(f"--methods {method}: its server would refuse: {e}") from None


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        print(report(Path(args.report), Path(args.out) if args.out else None))
    else:
        run(args)


if __name__ == "__main__":
    main()
