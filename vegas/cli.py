"""Command line: ``vegas bench`` (the main job), ``vegas generate``, ``vegas tune``, ``vegas ablate`` and ``vegas serve``."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click
from rich.console import Console

from .config import VegasConfig, VegasConfigError, VegasPluginError, parse_json_object

ROPE_EXAMPLE = '{"rope_type": "yarn", "factor": 4}'


def _rope_scaling(ctx, param, value: str | None) -> dict | None:
    """``--rope-scaling`` JSON -> dict (checked further by vegas.models.rope_scaled_config)."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"must be a JSON object such as '{ROPE_EXAMPLE}': {exc}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"must be a JSON object such as '{ROPE_EXAMPLE}', got {value!r}")
    return parsed


_MODEL_OPTIONS = [
    click.option("--model", default=None,
                 help="Model name (smollm2-135m, vegas-tiny-code), .gguf file, model directory or cached hub id "
                      "(default: the embedded vegas-tiny-code)."),
    click.option("--rope-scaling", default=None, callback=_rope_scaling,
                 help=f"RoPE scaling as JSON, e.g. '{ROPE_EXAMPLE}' (yarn, linear, llama3): "
                      "raises the model's context by the factor."),
    click.option("--backend", default="hf", show_default=True, help="Registered backend: hf, vllm, or a plugin's."),
]
_DRAFT_OPTIONS = [  # vegas tune sweeps these: it takes only the others
    click.option("--num-draft-tokens", "-g", default=4, show_default=True, type=int, help="γ, draft tokens per iteration."),
    click.option("--sparsity-ratio", default=0.05, show_default=True, type=float, help="KV budget / context, in (0, 1]."),
    click.option("--kv-budget", default=None, type=int, help="KV budget in tokens, >= 1 (overrides --sparsity-ratio)."),
    click.option("--min-kv-budget", default=256, show_default=True, type=int,
                 help="Floor of the KV budget that --sparsity-ratio gives (tokens)."),
]
_SAMPLING_OPTIONS = [
    click.option("--temperature", default=0.8, show_default=True, type=float, help="0 = greedy."),
    click.option("--top-p", default=0.95, show_default=True, type=float),
    click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"])),
    click.option("--device", default=None, help="cpu or cuda (default: cuda when available)."),
    click.option("--seed", default=0, show_default=True, type=int),
]


_CONFIG_OPTIONS = _MODEL_OPTIONS + _DRAFT_OPTIONS + _SAMPLING_OPTIONS


def _config_options(fn, options=None):
    for option in reversed(_CONFIG_OPTIONS if options is None else options):
        fn = option(fn)
    return fn


def _click_error(exc: VegasConfigError) -> click.ClickException:
    """``exc`` as click's usage error (exit code 2), naming the flag of the field at fault
    (``selector`` is ``--selectors`` on bench and tune) where the command has one; a plugin's
    failure (:class:`VegasPluginError`) as one ``Error:`` line without the usage banner."""
    if isinstance(exc, VegasPluginError):  # not a usage error: no usage banner, still exit status 2
        return OneLineError(str(exc))
    ctx = click.get_current_context()
    for param in ctx.command.params:
        if exc.field is not None and param.name in (exc.field, exc.field + "s"):
            return click.BadParameter(exc.problem, ctx=ctx, param=param)
    return click.UsageError(str(exc), ctx=ctx)


def _number_list(kind):
    """Callback: a comma-separated list of ``kind`` (None stays None: the preset's)."""

    def parse(ctx, param, value: str | None):
        if value is None:
            return None
        try:
            items = [v.strip() for v in value.split(",")]
            if "" in items:  # "0.02,,0.1": a missing item is said, not dropped
                raise click.BadParameter(f"must be comma-separated {kind.__name__}s, got {value!r}: an empty item "
                                         "(a stray comma?)")
            return [kind(v) for v in items]
        except ValueError:
            raise click.BadParameter(f"must be comma-separated {kind.__name__}s, got {value!r}") from None

    return parse


class _LogFormat(logging.Formatter):
    """``vegas: message``, ``vegas: warning: message`` at WARNING and above; another library's
    record starts with its logger's name instead."""

    def format(self, record: logging.LogRecord) -> str:
        source = "vegas" if record.name.split(".")[0] == "vegas" else record.name
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"{source}: {level}{super().format(record)}"


@click.group()
@click.version_option(package_name="vegas")
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
def main(verbose: bool) -> None:
    """vegas: lossless self-speculative decoding with verification-guided sparse attention."""
    handler = logging.StreamHandler()
    handler.setFormatter(_LogFormat())
    logging.basicConfig(handlers=[handler])  # other libraries: warnings and errors
    logging.getLogger("vegas").setLevel(logging.INFO if verbose else logging.WARNING)
    if not sys.stderr.isatty():  # a log file gets vegas' lines, not transformers' redrawn progress bars
        # tqdm reads TQDM_DISABLE when imported (transformers' GGUF conversion uses tqdm directly)
        os.environ.setdefault("TQDM_DISABLE", "1")
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


@main.command()
@_config_options
@click.option("--selectors", default="all", show_default=True,
              help="Comma-separated selector names; 'all' = every registered selector, plugins included; "
                   "plain decoding ('none') is always measured, as the reference. With --backend vllm also "
                   "'ngram' (vLLM's n-gram proposer).")
@click.option("--context", default="4096", show_default=True, callback=_number_list(int),
              help="Prompt length in tokens; with --backend vllm a comma list (one row per context).")
@click.option("--new-tokens", default=64, show_default=True, type=int, help="Tokens generated per prompt.")
@click.option("--batch-size", default="2", show_default=True, callback=_number_list(int),
              help="Prompts decoded together; with --backend vllm a comma list (one row per batch size).")
@click.option("--check-tokens", default=16, show_default=True, type=int,
              help="Tokens of the greedy exactness check per selector.")
@click.option("--prompts", default=None, type=click.Path(exists=True),
              help="Text file, directory or .jsonl(.xz) document set to cut prompts from (default: installed click "
                   "source; with --backend vllm the checkout's held-out code, else click source).")
@click.option("--repeats", default=1, show_default=True, type=int,
              help="Timed runs per method, interleaved across methods; rows report the median tok/s, and a "
                   "selector is recommended over plain decoding only when faster by more than the spread.")
@click.option("--open", "open_factor", default=None, type=int, metavar="K",
              help="vllm backend: open batches, K x batch requests through batch slots (max_num_seqs = batch) "
                   "[default: 0, closed batches].")
@click.option("--exact-prompts", default=None, type=int,
              help="vllm backend: prompts of the greedy exactness check, at the first context; 0 skips it "
                   "[default: 8].")
@click.option("--engine-args", default=None,
              help="vllm backend: further vllm.LLM arguments of every engine as a JSON object, e.g. "
                   "'{\"tensor_parallel_size\": 2, \"enforce_eager\": true}'; gpu_memory_utilization is the "
                   "total of the engines alive at once [default: 0.85].")
@click.option("--vllm-options", default=None,
              help="vllm backend: VegasConfig.vllm settings of every Vegas engine as a JSON object, e.g. "
                   "'{\"fallback\": true}' or '{\"prefill_skip_tokens\": 2048}' (docs/vllm.md).")
@click.option("--json", "json_path", default=None, type=click.Path(), help="Write results as JSON here.")
@click.option("--plot", "plot_path", default=None, type=click.Path(),
              help="Write the table as a chart here (τ and speedup per selector; hf backend): a format "
                   "matplotlib writes, from the extension (png, pdf, svg, ...); no extension writes PATH.png.")
def bench(json_path, plot_path, selectors, **kwargs) -> None:
    """Plain decoding vs each selector on the same long prompts: τ, tok/s, speedup, exactness.

    With --backend vllm (a CUDA GPU and vLLM 0.24): plain vLLM, vLLM's ngram and each selector,
    one engine each, over every --context and --batch-size, closed or open (--open) batches;
    prints a Markdown table (tok/s, x plain, τ, ms/iter, selection share, byte floor and bound).
    """
    from .bench import BenchOptions, render, run_bench, verdict, write_json
    from .plugins import backend_names

    console = Console(width=None if sys.stdout.isatty() else 120)  # the table's 7 columns fit
    vllm_only = {k: kwargs.pop(k) for k in ("open_factor", "exact_prompts", "engine_args", "vllm_options")}
    try:
        backends = backend_names()
        if kwargs["backend"] not in backends:
            raise VegasConfigError.bad("backend", f"must be one of {', '.join(backends)}, got {kwargs['backend']!r}")
        names = None if selectors == "all" else [s.strip() for s in selectors.split(",") if s.strip()]
        if names == []:
            raise VegasConfigError.bad("selectors", "must name at least one selector, or 'all'")
        if names and len(set(names)) != len(names):
            raise VegasConfigError.bad("selectors", f"names a selector twice: {','.join(names)}")
        if names and "ngram" in names and kwargs["backend"] != "vllm":
            raise VegasConfigError.bad("selectors", "'ngram' is vLLM's n-gram proposer: it runs with --backend vllm "
                                                    f"only, got --backend {kwargs['backend']}")
        for flag, path in (("--json", json_path), ("--plot", plot_path)):
            if path and Path(path).is_dir():
                raise VegasConfigError(f"{flag} {path!r} is a directory; it must be a file path, such as "
                                       f"{str(Path(path) / ('out.json' if flag == '--json' else 'out.png'))!r}")
            if path and not Path(path).resolve().parent.is_dir():
                raise VegasConfigError(f"{flag} {path!r} must be a file path in an existing directory")
        if kwargs["backend"] == "vllm":
            return _bench_vllm(names, json_path, plot_path, vllm_only, kwargs)
        for name in ("open_factor", "exact_prompts", "engine_args", "vllm_options"):
            if vllm_only[name] is not None:
                raise VegasConfigError.bad(name, "is for --backend vllm only")
        for name in ("context", "batch_size"):
            if len(kwargs[name] or []) != 1:
                raise VegasConfigError.bad(name, f"takes one value with --backend {kwargs['backend']} "
                                                 f"(a comma list with --backend vllm), got {kwargs[name]!r}")
            kwargs[name] = kwargs[name][0]
        if plot_path:
            plot_path = _plot_path(plot_path)
        for flag, path in (("--json", json_path), ("--plot", plot_path)):
            if path:
                _check_writable(Path(path), flag)
        opts = BenchOptions(selectors=names, **kwargs)
        results = run_bench(opts, Console(stderr=True))
    except VegasConfigError as exc:
        raise _click_error(exc) from exc
    console.print(render(results))
    results["recommendation"] = verdict(results)
    click.echo(results["recommendation"])
    if json_path:
        write_json(results, json_path)
        console.print(f"results written to {json_path}")
    if plot_path:
        from .plots import plot_bench

        plot_bench(results, plot_path)
        console.print(f"chart written to {plot_path}")
    if not all(r["lossless"] for r in results["selectors"].values()):
        raise click.ClickException("greedy exactness check failed for some selector")


def _bench_vllm(names, json_path, plot_path, vllm_only: dict, kwargs: dict) -> None:
    """``vegas bench --backend vllm`` (:mod:`vegas.bench_vllm`).

    Raises:
        VegasConfigError: a bad option (its field named), before any engine starts.
    """
    from .bench_vllm import VllmBenchOptions, run_vllm_bench, summary_lines, table, write_json
    from .config import parse_json_object
    from .plugins import selector_names

    for flag, value in (("--plot", plot_path), ("--rope-scaling", kwargs["rope_scaling"])):
        if value is not None:
            raise VegasConfigError(f"{flag} is for --backend hf only: vegas bench --backend vllm has no {flag}")
    if kwargs["device"] is not None and not str(kwargs["device"]).startswith("cuda"):
        raise VegasConfigError.bad("device", f"must be cuda with --backend vllm, got {kwargs['device']!r}")
    source = click.get_current_context().get_parameter_source("dtype")
    if kwargs["dtype"] == "float32" and source is not click.core.ParameterSource.DEFAULT:
        raise VegasConfigError.bad("dtype", "must be bfloat16 or float16 with --backend vllm (FA3 has no float32 "
                                   "path), got 'float32'")
    if json_path:
        _check_writable(Path(json_path))
    engine_args, vllm_options = vllm_only["engine_args"], vllm_only["vllm_options"]
    opts = VllmBenchOptions(
        model=kwargs["model"], selectors=names if names is not None else selector_names(),
        contexts=kwargs["context"] or [], batches=kwargs["batch_size"] or [],
        open_factor=0 if vllm_only["open_factor"] is None else vllm_only["open_factor"],
        repeats=kwargs["repeats"], new_tokens=kwargs["new_tokens"], num_draft_tokens=kwargs["num_draft_tokens"],
        sparsity_ratio=kwargs["sparsity_ratio"], kv_budget=kwargs["kv_budget"], min_kv_budget=kwargs["min_kv_budget"],
        temperature=kwargs["temperature"], top_p=kwargs["top_p"], seed=kwargs["seed"],
        check_tokens=kwargs["check_tokens"],
        exact_prompts=8 if vllm_only["exact_prompts"] is None else vllm_only["exact_prompts"],
        prompts=kwargs["prompts"],
        dtype="bfloat16" if kwargs["dtype"] == "float32" else kwargs["dtype"],  # the default float32: bf16 (FA3)
        engine_args=parse_json_object(engine_args, "--engine-args") if engine_args else {},
        vllm_options=_vllm_options(vllm_options),
    )

    def save(results: dict) -> None:
        if json_path:
            write_json(results, json_path)

    results = run_vllm_bench(opts, log=lambda line: click.echo(line, err=True), save=save)
    save(results)
    click.echo(table(results))
    for line in summary_lines(results):
        click.echo(line)
    if json_path:
        click.echo(f"results written to {json_path}", err=True)
    failed = [m for m, v in results["exactness"].items() if not v["lossless"]]
    if failed:
        raise click.ClickException(f"greedy exactness check: {', '.join(failed)} differ from plain vLLM greedy "
                                   "where plain's top-2 logprob gap is not a near-tie")


def _plot_path(path: str) -> str:
    """``--plot PATH`` checked against the formats matplotlib saves (PATH.png without an extension)."""
    from matplotlib.figure import Figure

    suffix = Path(path).suffix
    if not suffix:
        return path + ".png"
    formats = sorted(Figure().canvas.get_supported_filetypes())
    if suffix[1:].lower() not in formats:
        raise VegasConfigError(f"--plot {path!r}: format {suffix[1:]!r} is not one matplotlib writes; "
                               f"use one of {', '.join(formats)} (no extension: PNG)")
    return path


def _check_writable(path: Path, flag: str = "--json") -> None:
    """Fail before the run, not after it, when ``path`` cannot be written (leaves no file behind)."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise VegasConfigError(f"{flag} {str(path)!r} cannot be written: {exc.strerror}") from None
    if not existed:
        path.unlink()


def _check_writable_dir(path: Path, flag: str = "--out") -> None:
    """Fail before the run, not after its first point, when directory ``path`` cannot be made or
    written: a scratch directory is made and removed in ``path``, or in its nearest existing
    parent when ``path`` does not exist yet (nothing is left behind)."""
    import tempfile

    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        if not where.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        Path(tempfile.mkdtemp(prefix=".vegas-check-", dir=where)).rmdir()
    except OSError as exc:
        raise VegasConfigError(f"{flag} {str(path)!r} cannot be written: {exc.strerror}") from None


@main.command()
@_config_options
@click.argument("prompt")
@click.option("--selector", default="collect2", show_default=True, help="Selector name, or 'none' for plain decoding.")
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--chat", is_flag=True,
              help="Send PROMPT as a user message through the model's chat template (chat models).")
def generate(prompt, selector, max_new_tokens, chat, model, rope_scaling, backend, dtype, device, temperature, top_p,
             seed, **config) -> None:
    """Generate after PROMPT and print text and statistics.

    PROMPT is text; '@path' reads it from a file (or the text files under a directory), and
    '@@' starts a text that begins with '@' (e.g. a Python decorator). With --chat, PROMPT is
    one user message and the model answers it.
    """
    from .pipeline import EMPTY_PROMPT, Pipeline, generation_options
    from .prompts import read_text_source

    if prompt.startswith("@") and not prompt.startswith("@@") and not prompt[1:].strip():
        raise click.UsageError(f"PROMPT {prompt!r} needs a path after '@' ('@@' starts a literal '@')")
    if not prompt:
        raise click.BadParameter(EMPTY_PROMPT, param_hint="'PROMPT'")
    try:
        # what needs no model is checked before one is loaded (or converted)
        generation_options(max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, chat=chat)
        if config["kv_budget"] is None:
            config.pop("kv_budget")
        pipe = Pipeline(model, selector=selector, backend=backend, dtype=dtype, device=device,
                        rope_scaling=rope_scaling, **config)
        if prompt.startswith("@@"):
            text = prompt[1:]
        elif prompt.startswith("@"):
            # a token covers at most the longest vocabulary entry: more bytes cannot fit the context
            longest = max(len(t) for t in pipe.tokenizer.get_vocab())
            text = read_text_source(prompt[1:], what="PROMPT file ('@@' starts a literal '@')",
                                    max_bytes=pipe.backend.max_context * longest)
        else:
            text = prompt
        out = pipe.generate(text, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            chat=chat)[0]
    except VegasConfigError as exc:
        raise _click_error(exc) from exc
    click.echo(out.text)
    s = out.stats
    # τ = tokens / iterations, a plain step (fallback) an iteration of one token: shown, so that it adds up
    plain = f", {s.plain_steps} plain steps (fallback: no draft, 1 token each)" if s.plain_steps else ""
    drafting = "plain decoding" if pipe.selector is None else (
        f"τ={s.acceptance_length:.2f} tokens/iteration over {s.iterations} iteration{'' if s.iterations == 1 else 's'} "
        f"(≤ γ+1 = {pipe.config.num_draft_tokens + 1}: the bonus token counts){plain}, "
        f"accepted {s.num_accepted}/{s.num_drafted} drafts, "
        + ("" if s.kv_attended is None else f"{s.kv_attended:.1f} KV entries attended per layer and draft, ")
        + f"KV budget {s.kv_budget} tokens"
    )
    click.echo(
        f"\n[{s.num_generated} token{'' if s.num_generated == 1 else 's'}, {drafting}, decode {s.decode_seconds:.2f} s, "
        f"selection {s.selection_seconds:.3f} s]",
        err=True,
    )


def _tune_options(fn):
    return _config_options(_config_options(fn, _SAMPLING_OPTIONS), _MODEL_OPTIONS)


@main.command()
@_tune_options
@click.option("--selectors", default="collect2", show_default=True,
              help="Comma-separated selector names to tune ('all' = every registered one); each gets its curves. "
                   "Plain decoding ('none') is always measured, and recommended where it is faster.")
@click.option("--quick", is_flag=True,
              help="Small sweep (context 1024, 32 new tokens, batch 1, 4 sparsities, γ 2,4,6, 3 fine points, "
                   "time budget 570 s) for a first look on a CPU.")
@click.option("--context", default=None, type=int, help="Prompt length in tokens [default: 4096; --quick 1024].")
@click.option("--new-tokens", default=None, type=int, help="Tokens generated per prompt and point [default: 64; --quick 32].")
@click.option("--batch-size", default=None, type=int, help="Prompts decoded together [default: 2; --quick 1].")
@click.option("--prompts", default=None, type=click.Path(exists=True),
              help="Text file, directory or .jsonl(.xz) document set to cut prompts from (default: installed click "
                   "source).")
@click.option("--num-draft-tokens", "-g", default=4, show_default=True, type=int, help="γ of step 1 (the sparsity sweep).")
@click.option("--sparsities", default=None, callback=_number_list(float),
              help="Step 1's sparsity grid, KV budget / context in (0, 1], comma-separated "
                   "[default: 0.01,0.018,0.033,0.06,0.11,0.2; --quick 0.01,0.025,0.06,0.15].")
@click.option("--gammas", default=None, callback=_number_list(int),
              help="Step 2's γ grid, integers >= 1 [default: 1,2,3,4,6,8; --quick 2,4,6].")
@click.option("--tolerance", default=0.05, show_default=True, type=float,
              help="Knee rule: the smallest sparsity whose τ is within this fraction of the best τ.")
@click.option("--fine-factor", default=1.5, show_default=True, type=float,
              help="Step 3 tries knee × factor^k, |k| <= --fine-steps.")
@click.option("--fine-steps", default=None, type=int, help="Step 3's points on each side of the knee [default: 2; --quick 1].")
@click.option("--min-kv-budget", default=0, show_default=True, type=int,
              help="Floor of the KV budget in tokens (VegasConfig.min_kv_budget; 0 lets the grid set the budget).")
@click.option("--time-budget", default=None, type=float,
              help="Seconds: stop before a point that would not finish in time (each run measures one at "
                   "least), then write plots and a recommendation [default: none; --quick 570].")
@click.option("--repeats", default=None, type=int,
              help="Timed runs per point (seeds --seed, +1, ...): the point keeps the run of median tokens/s and the "
                   "spread of its runs; a point is chosen over another only beyond the spread [default: 3].")
@click.option("--out", default="vegas-tune", show_default=True, type=click.Path(file_okay=False),
              help="Directory for points.json, recommendation.json and the PNG plots; a rerun resumes from it.")
@click.option("--fresh", is_flag=True, help="Discard the points already in --out instead of resuming.")
def tune(selectors, **kwargs) -> None:
    """Find the sparsity and γ to run with: τ over sparsities at a fixed γ (knee), tokens/s over γ
    at the knee, then tokens/s over sparsities near the knee; writes JSON and PNG plots to --out
    and prints the recommended VegasConfig (and the vLLM settings)."""
    from .tune import TuneOptions, describe, run_tune

    try:
        _check_writable_dir(Path(kwargs["out"]))
        every = selectors.strip() == "all"  # a plugin selector that raises is skipped, as in vegas bench
        if every:
            from .plugins import selector_names

            names = selector_names()
        else:
            names = [s.strip() for s in selectors.split(",") if s.strip()]
        results = run_tune(TuneOptions(selectors=names, skip_failing=every, **kwargs), Console(stderr=True))
    except VegasConfigError as exc:
        raise _click_error(exc) from exc
    for line in describe(results):
        click.echo(line)
    run = results["measured_points"] + results["reused_points"]
    click.echo(f"{run} points ({results['measured_points']} measured now, {results['reused_points']} reused from an "
               f"earlier run; {results['points']} in points.json), recommendation and plots "
               f"({', '.join(results['plots'])}) in {kwargs['out']}")


def _ablate_options(fn):
    return _config_options(fn, [_MODEL_OPTIONS[0]] + _SAMPLING_OPTIONS)


@main.command()
@_ablate_options
@click.option("--studies", default=",".join(("budget", "ablation", "overlap", "retrieval")), show_default=True,
              help="Comma-separated studies: budget, ablation, overlap, retrieval.")
@click.option("--selectors", default="all", show_default=True,
              help="Comma-separated selectors of the budget and retrieval studies, and which of the ablated "
                   "ones (aggregated, collect2, last_token) the ablation study runs; 'all' = every registered "
                   "selector plus oracle (exact top-k of each draft query).")
@click.option("--contexts", default=None, callback=_number_list(int),
              help="Prompt lengths in tokens; beyond the model's context YaRN is applied "
                   "[default: 4096,8000,16000,32000; --quick 1024].")
@click.option("--budgets", default=None, callback=_number_list(float),
              help="Sparsities (KV budget / context) [default: 0.01,0.02,0.05,0.1,0.2; --quick 0.02,0.1].")
@click.option("--num-draft-tokens", "-g", default=None, type=int, help="γ of the budget and retrieval studies [default: 4].")
@click.option("--gammas", default=None, callback=_number_list(int),
              help="γ values of the ablation; the overlap study runs at the largest [default: 2,4,6,8; --quick 2,4].")
@click.option("--ablation-sparsity", default=None, type=float,
              help="Sparsity of the ablation and overlap studies (at the first context) [default: 0.02].")
@click.option("--num-prompts", default=None, type=int, help="Prompts per point [default: 32; --quick 4].")
@click.option("--batch-size", default=None, type=int, help="Prompts decoded together [default: 8; --quick 4].")
@click.option("--new-tokens", default=None, type=int, help="Tokens generated per prompt [default: 64; --quick 32].")
@click.option("--max-distance", default=None, type=int, help="Largest query distance of the overlap study [default: 8].")
@click.option("--yarn-factor", default=None, type=float,
              help="YaRN factor for contexts beyond the model's [default: the smallest power of two that fits].")
@click.option("--prompts", default=None, type=click.Path(exists=True),
              help="Text file, directory or .jsonl(.xz) document set to cut prompts from (default: the "
                   "checkout's benchmarks/data/heldout_code_dev.jsonl.xz, else installed click source).")
@click.option("--out", default="vegas-ablate", show_default=True, type=click.Path(file_okay=False),
              help="Directory for points.json, tables.md and the PNG plots; a rerun resumes from it.")
@click.option("--time-budget", default=None, type=float,
              help="Seconds: stop before a point that would not finish in time (each run measures one at "
                   "least), then plot (rerun to resume) [default: none; --quick 570].")
@click.option("--fresh", is_flag=True, help="Discard the points already in --out instead of resuming.")
@click.option("--quick", is_flag=True, help="Every study, small (context 1024, 4 prompts in one batch, 32 new "
                                            "tokens, budgets 2 and 10 %, γ 2,4, a 570 s time budget: rerun to resume): a "
                                            "CPU look.")
def ablate(studies, selectors, quick, **kwargs) -> None:
    """The studies behind the method's claims on the HF backend: τ by KV budget and context
    (oracle included), ablations, top-k overlap of nearby queries, retrieval prompts; writes
    points.json as it goes, tables.md and PNG plots to --out."""
    from .ablate import QUICK, AblateOptions, AblateStopped, run_ablate

    given = {k: v for k, v in kwargs.items() if v is not None}
    try:
        _check_writable_dir(Path(kwargs["out"]))
        names = None if selectors.strip() == "all" else [s.strip() for s in selectors.split(",") if s.strip()]
        opts = AblateOptions(studies=[s.strip() for s in studies.split(",") if s.strip()], selectors=names,
                             **({**QUICK, **given} if quick else given))
        results = run_ablate(opts, Console(stderr=True))
    except VegasConfigError as exc:
        raise _click_error(exc) from exc
    except AblateStopped as exc:  # out of memory or Ctrl-C before the first point: one line, exit status 1
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{results['planned']} points ({results['measured']} measured now, {results['reused']} reused from an "
               f"earlier run; {results['points']} in points.json); "
               f"{results['tables']}" + (f" and plots ({', '.join(results['plots'])})" if results["plots"] else
                                         " (no plots)") + f" in {kwargs['out']}")
    for name in results["skipped"]:
        click.echo(f"skipped selector {name} (plugin error, above); name the selectors with --selectors to leave it out")
    if results.get("failed"):
        raise click.ClickException(f"incomplete: {results['failed']}")
    if results["stopped"]:
        click.echo(f"incomplete: {results['stopped']}; {results['resume']}")


class OneLineError(click.ClickException):
    """A bad setting said in one line (``Error: <message>``), exit status 2 as for usage errors."""

    exit_code = 2


@main.command()
@click.argument("model")
@click.option("--selector", default=None,
              help="Selector name (collect2, aggregated, sliding_window, quest, a plugin's...), or 'none' for "
                   "plain vLLM with the same other arguments [default: --config's selector, else collect2].")
@click.option("--num-draft-tokens", "-g", default=None, type=int,
              help="γ, draft tokens per iteration (vLLM's num_speculative_tokens), >= 1 [default: --config's, "
                   "else 4].")
@click.option("--sparsity-ratio", default=None, type=float, help="KV budget / context, in (0, 1] [default: 0.05].")
@click.option("--kv-budget", default=None, type=int, help="KV budget in tokens, >= 1 (overrides --sparsity-ratio).")
@click.option("--config", "config_json", default=None,
              help="Vegas settings as one JSON object or a JSON file: {\"selector\": ..., <VegasConfig fields>, "
                   "\"vllm\": {...}}; the options above override it.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--host", default=None, help="Address to listen on [default: vLLM's].")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16"]))
@click.option("--dry-run", is_flag=True, help="Check the settings and print the command; start nothing.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(model, selector, num_draft_tokens, sparsity_ratio, kv_budget, config_json, port, host, dtype, dry_run,
          vllm_args) -> None:
    """Start vLLM's OpenAI-compatible server (``vllm serve MODEL``) with Vegas as its speculative
    proposer, or plain vLLM with --selector none.

    MODEL is a model name (smollm2-135m), a .gguf file (both converted once, as everywhere in
    vegas), a model directory or a hub id. The model and the settings are checked first (a bad
    one fails here in one line, exit status 2, before any process starts); then the exact
    command is printed and run in this process's place. Vegas needs no environment
    variable: the settings travel in ``--additional-config '{"vegas": {...}}'``. Arguments after
    ``--`` go to ``vllm serve`` unchanged, e.g.
    ``vegas serve MODEL -g 4 -- --max-model-len 8192 --gpu-memory-utilization 0.8``.
    """
    from .serve import exec_plan, plan_serve, raise_if_vllm_missing

    try:
        plan = plan_serve(model, selector=selector, num_draft_tokens=num_draft_tokens, sparsity_ratio=sparsity_ratio,
                          kv_budget=kv_budget, config=config_json, port=port, host=host, dtype=dtype,
                          extra_args=list(vllm_args))
        if not dry_run:
            raise_if_vllm_missing()
    except VegasConfigError as exc:
        # a setting with a flag names the flag; the model (an argument) and anything else in one line,
        # Pipeline's message
        one_line = exc.field is None or exc.field == "model"
        raise (OneLineError(str(exc)) if one_line else _click_error(exc)) from exc
    for line in plan.describe():
        click.echo(line, err=not dry_run)
    if dry_run:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    exec_plan(plan)


def _vllm_options(text: str | None) -> dict:
    """``--vllm-options``: the JSON object of ``VegasConfig.vllm`` fields, checked here so that an
    error names the flag (an empty value is no options).

    Raises:
        VegasConfigError: not a JSON object, or a field outside ``VegasConfig.vllm``'s values.
    """
    if text is None or not text.strip():
        return {}
    options = parse_json_object(text, "--vllm-options")
    try:
        VegasConfig(vllm=options)
    except VegasConfigError as e:
        hint = (' (give the fields of "vllm" themselves, e.g. \'{"fallback": true}\', not \'{"vllm": {...}}\')'
                if "vllm" in options else "")
        raise VegasConfigError(f"--vllm-options: {e}{hint}") from None
    return options
