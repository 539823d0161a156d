"""``vegas tune`` (a tiny sweep on the embedded model), its knee rule, plots, and ``vegas bench --plot``."""

import io
import json
import re

import pytest
from click.testing import CliRunner
from rich.console import Console

from vegas.cli import main
from vegas.config import VegasConfigError
from vegas.progress import LoggedProgress
from vegas.tune import TuneOptions, best_by_throughput, describe, fine_grid, knee, recommend, run_tune

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ("tau_vs_budget.png", "throughput_vs_gamma.png", "throughput_vs_sparsity.png")


def _point(step, sparsity, tau, tps, selector="collect2", gamma=4):
    return {"step": step, "selector": selector, "num_draft_tokens": gamma, "sparsity_ratio": sparsity,
            "kv_budget": int(sparsity * 1000), "acceptance_length": tau, "tokens_per_second": tps}


def test_knee_is_the_smallest_sparsity_within_tolerance_of_the_best_tau():
    curve = [_point(1, s, tau, 1.0) for s, tau in [(0.01, 2.0), (0.02, 3.5), (0.05, 3.9), (0.1, 4.0), (0.2, 3.95)]]
    assert knee(curve, 0.05)["sparsity_ratio"] == 0.02 + 0.03  # 3.9 >= 0.95 * 4.0; 3.5 is not
    assert knee(curve, 0.15)["sparsity_ratio"] == 0.02  # 3.5 >= 0.85 * 4.0
    assert knee(curve, 0.0)["sparsity_ratio"] == 0.1  # only the best itself
    assert knee(list(reversed(curve)), 0.05)["sparsity_ratio"] == 0.05  # order does not matter
    assert knee([], 0.05) is None
    assert fine_grid(0.1, 1.5, 1) == [0.06667, 0.1, 0.15]
    assert fine_grid(0.8, 1.5, 1) == [0.5333, 0.8]  # above 1 dropped


def test_recommend_follows_the_three_steps_on_synthetic_points():
    opts = TuneOptions(sparsities=[0.01, 0.05, 0.2], gammas=[2, 4, 8], fine_steps=1).resolved()
    points = [_point(1, s, tau, 1.0) for s, tau in [(0.01, 2.0), (0.05, 3.9), (0.2, 4.0)]]
    points += [{"step": 2, "selector": None, "num_draft_tokens": 1, "sparsity_ratio": None, "kv_budget": None,
                "acceptance_length": 1.0, "tokens_per_second": 10.0}]
    points += [_point(2, 0.05, 3.0, tps, gamma=g) for g, tps in [(2, 11.0), (4, 14.0), (8, 12.0)]]
    rec = recommend(points, opts)  # step 3 not measured yet: the step-2 choice
    assert rec["best"]["knee"]["sparsity_ratio"] == 0.05
    assert (rec["best"]["num_draft_tokens"], rec["best"]["sparsity_ratio"]) == (4, 0.05)
    assert rec["best"]["speedup"] == pytest.approx(1.4)
    points += [{**points[3], "step": 3, "tokens_per_second": 9.0}]
    points += [_point(3, s, 3.0, tps, gamma=4) for s, tps in [(0.03333, 13.0), (0.05, 12.0), (0.075, 12.5)]]
    rec = recommend(points, opts)
    assert (rec["best"]["num_draft_tokens"], rec["best"]["sparsity_ratio"]) == (4, 0.03333)
    assert rec["best"]["speedup"] == pytest.approx(13.0 / 9.0)  # against step 3's plain run
    assert rec["best"]["config"]["min_kv_budget"] == 0
    text = "\n".join(describe({**rec, "complete": True}))
    assert "VegasConfig(sparsity_ratio=0.03333, min_kv_budget=0)" in text
    # why the knee: its τ against the curve's best, each with its spread, and the rule
    assert ("knee (step 1, γ=4): sparsity 0.05, τ 3.90 (spread 0.00) against the best τ 4.00 (spread 0.00) "
            "at sparsity 0.2: the smallest sparsity within 5% or within the spread") in text
    assert "--additional-config '{\"vegas\": {\"selector\"" in text and '"num_speculative_tokens": 4' in text
    assert "num_draft_tokens" not in text.split("--additional-config")[1]  # γ only in speculative_config
    assert "vegas serve MODEL --config" in text
    assert rec["recommended"] == "collect2"


def _spread(point, tps_spread, tau_spread=0.0):
    return {**point, "tokens_per_second_spread": tps_spread, "acceptance_length_spread": tau_spread}


def test_points_are_chosen_over_others_only_beyond_the_spread():
    knee_pt, fast = _spread(_point(3, 0.05, 3.0, 12.0), 0.5), _spread(_point(3, 0.075, 3.0, 12.4), 0.3)
    assert best_by_throughput([knee_pt, fast], knee_pt) is knee_pt  # 0.4 tok/s apart, within a spread of 0.5
    assert best_by_throughput([knee_pt, fast]) is fast  # no preferred point: the fastest
    faster = _spread(fast, 0.3) | {"tokens_per_second": 12.6}
    assert best_by_throughput([knee_pt, faster], knee_pt) is faster  # 0.6 apart: beyond the spread
    curve = [_spread(_point(1, s, tau, 1.0), 0.0, spread) for s, tau, spread in [(0.01, 3.0, 0.0), (0.05, 3.7, 0.4),
                                                                                 (0.2, 4.0, 0.1)]]
    assert knee(curve, 0.05)["sparsity_ratio"] == 0.05  # 0.3 below the best: beyond 5 %, within the spread


def test_plain_decoding_is_recommended_where_no_selector_is_clearly_faster():
    opts = TuneOptions(sparsities=[0.05], gammas=[4], fine_steps=0).resolved()
    plain = {"step": 2, "selector": None, "num_draft_tokens": 1, "sparsity_ratio": None, "kv_budget": None,
             "acceptance_length": 1.0, "tokens_per_second": 100.0, "tokens_per_second_spread": 3.0}
    points = [_point(1, 0.05, 2.5, 1.0), plain, _spread(_point(2, 0.05, 2.5, 72.0), 2.0)]
    rec = recommend(points, opts)
    assert rec["recommended"] == "none" and rec["best"]["selector"] == "collect2"
    text = "\n".join(describe(rec))
    assert "plain decoding is faster on this machine" in text and "0.72× plain" in text
    assert "is slower than plain decoding" in text and "spread" not in text
    assert "recommended: plain decoding (selector 'none')" in text and "VegasConfig(" not in text
    rec = recommend(points[:2] + [_spread(_point(2, 0.05, 2.5, 102.0), 2.0)], opts)
    assert rec["recommended"] == "none"  # 2 % faster, within the spread of 3 tok/s
    text = "\n".join(describe(rec))
    assert "plain decoding is as fast or faster on this machine" in text and "by more than the spread" in text
    rec = recommend(points[:2] + [_spread(_point(2, 0.05, 2.5, 104.0), 2.0)], opts)
    assert rec["recommended"] == "collect2"
    rec = recommend(points[:1], opts)  # cut short before plain decoding was measured: no verdict either way
    assert rec["recommended"] is None and rec["best"]["selector"] == "collect2"
    text = "\n".join(describe(rec))
    assert text.startswith("no recommendation yet: plain decoding is not measured") and "plain decoding is as fast" not in text


def test_bench_verdict_says_when_plain_decoding_is_faster():
    from vegas.bench import verdict

    plain = {"tokens_per_second": 100.0, "tokens_per_second_runs": [98.0, 100.0, 103.0], "tokens_per_second_spread": 5.0}
    slow = {"tokens_per_second": 72.0, "speedup": 0.72, "tokens_per_second_spread": 1.0}
    fast = {"tokens_per_second": 110.0, "speedup": 1.1, "tokens_per_second_spread": 1.0}
    assert verdict({"plain": plain, "selectors": {"collect2": slow}}) == (
        "recommended: plain decoding (--selector none): every selector ran slower than plain decoding on this "
        "machine (the fastest, collect2, at 0.72× plain)")
    single = plain | {"tokens_per_second_runs": [100.0], "tokens_per_second_spread": 0.0}
    assert "every selector ran slower" in verdict({"plain": single, "selectors": {"collect2": slow}})
    tie = slow | {"tokens_per_second": 101.0, "speedup": 1.01}
    text = verdict({"plain": plain, "selectors": {"collect2": tie}})
    assert text.startswith("plain decoding is as fast or faster on this machine") and "1.01× plain" in text
    assert text.endswith("recommended: plain decoding (--selector none)")
    assert verdict({"plain": plain, "selectors": {"collect2": slow, "quest": fast}}).startswith(
        "recommended: quest, 1.10× plain decoding (medians of 3 runs)")
    assert verdict({"plain": plain, "selectors": {"quest": fast | {"tokens_per_second": 104.0}}}).startswith(
        "plain decoding is as fast")
    single = plain | {"tokens_per_second_runs": [100.0], "tokens_per_second_spread": 0.0}
    assert verdict({"plain": single, "selectors": {"quest": fast | {"tokens_per_second_spread": 0.0}}}) == (
        "recommended: plain decoding (--selector none): single runs cannot tell a selector from noise (the "
        "fastest, quest, ran at 1.10× plain); --repeats 3 measures the spread")


def _tiny(out, **kw):
    kw = {"repeats": 1, **kw}
    return TuneOptions(context=128, new_tokens=4, batch_size=1, sparsities=[0.05, 0.5], gammas=[2], fine_steps=1,
                       device="cpu", out=str(out), **kw)


def test_tiny_sweep_writes_points_plots_recommendation_and_resumes(counted, tmp_path):
    pipe, calls = counted
    stream = io.StringIO()
    rec = run_tune(_tiny(tmp_path), Console(file=stream, width=200), pipe=pipe)
    data = json.loads((tmp_path / "points.json").read_text())
    # step 1: 2 sparsities; step 2: plain + 1 γ; step 3: plain + 3 fine sparsities
    assert len(data["points"]) == 8 and data["settings"]["context"] == 128
    assert {p["step"] for p in data["points"]} == {1, 2, 3}
    for name in PLOTS:
        blob = (tmp_path / name).read_bytes()
        assert blob.startswith(PNG) and len(blob) > 1000
    saved = json.loads((tmp_path / "recommendation.json").read_text())
    assert saved["best"]["selector"] == "collect2" and saved["complete"] is True
    assert saved["best"]["num_draft_tokens"] == 2 and saved["plots"] == list(PLOTS)
    assert rec["best"] == saved["best"]
    log = stream.getvalue()  # not a terminal: one line per measured point, with seconds
    assert log.count(" done in ") == 8 and "step 3: collect2 γ=2" in log and "elapsed" in log
    measured = len(calls)

    rec = run_tune(_tiny(tmp_path), Console(file=io.StringIO()), pipe=pipe)  # resumed: nothing to measure
    assert len(calls) == measured and rec["reused_points"] == 8
    assert len(json.loads((tmp_path / "points.json").read_text())["points"]) == 8

    result = CliRunner().invoke(main, [  # the command resumes the same points too
        "tune", "--context", "128", "--new-tokens", "4", "--batch-size", "1", "--sparsities", "0.05,0.5",
        "--gammas", "2", "--fine-steps", "1", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    assert "8 points (0 measured now, 8 reused from an earlier run; 8 in points.json)" in result.output
    assert " done in " not in result.output
    result = CliRunner().invoke(main, [  # another grid: its own points counted, not the file's
        "tune", "--context", "128", "--new-tokens", "4", "--batch-size", "1", "--sparsities", "0.05",
        "--gammas", "2", "--fine-steps", "0", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path),
    ])
    found = re.search(r"5 points \((\d) measured now, (\d) reused from an earlier run; (\d+) in points.json\)",
                      result.output)
    assert found, result.output
    measured_now, reused, in_file = map(int, found.groups())
    assert measured_now + reused == 5 and reused >= 2 and in_file == 8 + measured_now
    second = json.loads((tmp_path / "recommendation.json").read_text())  # this run's, from its own timings
    if second["recommended"] == "none":  # plain decoding was as fast on this machine
        assert "recommended: plain decoding (selector 'none')" in result.output
    else:
        assert "VegasConfig(num_draft_tokens=2" in result.output and "--speculative-config" in result.output

    with pytest.raises(VegasConfigError, match=r"other settings \(--new-tokens: 4 -> 5\).*--fresh"):
        run_tune(TuneOptions(**{**vars(_tiny(tmp_path)), "new_tokens": 5}), Console(file=io.StringIO()), pipe=pipe)


def test_time_budget_stops_cleanly_and_still_writes(counted, tmp_path):
    """A budget shorter than a point: the run measures one (before, none: every rerun said "rerun
    to resume" and got no further), then stops before the next, naming it, and writes the plots."""
    pipe, _ = counted
    rec = run_tune(_tiny(tmp_path, time_budget=1e-3), Console(file=io.StringIO()), pipe=pipe)
    assert rec["measured_points"] == 1 and rec["complete"] is False and "time budget" in rec["stopped"]
    # the step is named: plain decoding is measured in steps 2 and 3
    assert "reached before step 1: collect2 γ=4 sparsity=" in rec["stopped"], rec["stopped"]
    assert "sparsity=0.05" not in rec["stopped"]  # the first point was measured
    assert describe(rec)[0].startswith("no recommendation yet: plain decoding is not measured")
    again = run_tune(_tiny(tmp_path, time_budget=1e-3), Console(file=io.StringIO()), pipe=pipe)
    assert again["measured_points"] == 1 and again["reused_points"] == 1
    for name in PLOTS:
        assert (tmp_path / name).read_bytes().startswith(PNG)


def test_repeats_time_each_point_several_times(counted, tmp_path):
    pipe, calls = counted
    opts = TuneOptions(**{**vars(_tiny(tmp_path)), "sparsities": [0.5], "fine_steps": 0, "repeats": 2})
    run_tune(opts, Console(file=io.StringIO()), pipe=pipe)
    points = json.loads((tmp_path / "points.json").read_text())["points"]
    assert len(points) == 5  # step 1: 1; step 2: plain + 1 γ; step 3: plain + 1
    assert all(len(p["tokens_per_second_runs"]) == 2 for p in points)
    # a warm-up whenever the configuration changes (collect2 at step 1's γ; plain, collect2 at step 2's γ;
    # plain, collect2 at step 3's) + 2 runs per point
    assert len(calls) == 5 + 2 * 5


def test_no_timed_run_follows_a_change_of_configuration(pipe, monkeypatch, tmp_path):
    """A backend may build an engine per configuration (vLLM keeps one, rebuilt on each change): the
    first call after a change is an untimed warm-up on the same prompts with fewer new tokens, never
    a timed run."""
    calls = []
    original = pipe.generate

    def generate(prompts, max_new_tokens, selector=None, **kw):
        cfg = pipe.config
        calls.append((selector, cfg.num_draft_tokens if selector else 1, cfg.sparsity_ratio if selector else None,
                      max_new_tokens, [len(p) for p in prompts]))
        return original(prompts, max_new_tokens=max_new_tokens, selector=selector, **kw)

    monkeypatch.setattr(pipe, "generate", generate)
    opts = TuneOptions(**{**vars(_tiny(tmp_path)), "gammas": [1, 3], "new_tokens": 12, "batch_size": 2})
    run_tune(opts, Console(file=io.StringIO()), pipe=pipe)
    timed = [i for i, c in enumerate(calls) if c[3] == opts.new_tokens]
    assert timed and all(i > 0 and calls[i - 1][:3] == calls[i][:3] for i in timed)
    warm_ups = [c for i, c in enumerate(calls) if i not in timed]
    assert warm_ups and all(c[3] == 2 * (c[1] + 1) for c in warm_ups)  # γ = 1 (and plain): 4 tokens
    assert all(c[4] == [opts.context] * 2 for c in calls)  # the timed runs' prompts, warm-ups included


@pytest.mark.parametrize("args, message", [
    (["--selectors", ","], "--selectors"),
    (["--selectors", "none"], "must name at least one selector, or 'all' (plain decoding is always measured)"),
    (["--selectors", "nope"], "Invalid value for '--selectors': unknown selector(s) 'nope'; known: aggregated, "),
    (["--sparsities", "0.1,1.5"], "(0, 1]"),
    (["--sparsities", "0"], "--sparsities"),
    (["--sparsities", "x"], "comma-separated floats"),
    (["--gammas", "2,0"], "--gammas"),
    (["--gammas", "2,4,2"], "'--gammas': names a value twice"),
    (["--sparsities", "0.1,0.10000001"], "'--sparsities': names a value twice (to 4 significant digits)"),
    (["--selectors", "collect2,collect2"], "'--selectors': names a value twice"),
    (["-g", "0"], "--num-draft-tokens"),
    (["--time-budget", "0"], "--time-budget"),
    (["--tolerance", "1"], "--tolerance"),
    (["--repeats", "0"], "--repeats"),
    (["--context", "40000", "--device", "cpu"], "got 40000 (a longer context: --rope-scaling, e.g. "),
])
def test_tune_names_bad_options(args, message):
    result = CliRunner().invoke(main, ["tune", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_failed_tune_leaves_no_out_directory(tmp_path):
    """A run that fails a check creates neither --out nor its parents."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "parent" / "out"
    for args in (["--model", str(tmp_path / "nope")], ["--device", "bogus"], ["--min-kv-budget", "-1"],
                 ["--prompts", str(empty), "--device", "cpu"]):
        result = CliRunner().invoke(main, ["tune", "--quick", "--out", str(out), *args])
        assert result.exit_code == 2, (args, result.output)
        assert not (tmp_path / "parent").exists(), args


def test_points_file_that_is_a_directory_is_refused_before_measuring(tmp_path):
    (tmp_path / "out" / "points.json").mkdir(parents=True)
    for cmd in (["tune", "--quick"], ["ablate", "--quick", "--contexts", "256", "--num-prompts", "1"]):
        for fresh in ([], ["--fresh"]):
            result = CliRunner().invoke(main, [*cmd, "--device", "cpu", "--out", str(tmp_path / "out"), *fresh])
            assert result.exit_code == 2 and "points.json exists and is not a file" in result.output, result.output


def test_points_file_that_cannot_be_replaced_is_named(tmp_path, monkeypatch):
    from vegas.tune_points import PointStore

    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("vegas.tune_points.os.replace", refuse)
    store = PointStore(tmp_path / "out" / "points.json", {"a": 1}, fresh=False, command="vegas tune")
    with pytest.raises(VegasConfigError, match=r"cannot write .*points.json \(Operation not permitted\); choose another --out"):
        store.add({"step": 1})
    assert not (tmp_path / "out" / "points.json.tmp").exists()


def test_logged_progress_prints_a_line_per_step_off_a_terminal():
    stream = io.StringIO()
    with LoggedProgress(console=Console(file=stream), transient=True) as progress:
        task = progress.add_task("x", total=2)
        progress.update(task, description="run a")
        progress.advance(task, note="τ 3.00")
        progress.update(task, description="run b")
        progress.skip(task)
    lines = [line for line in stream.getvalue().splitlines() if line]  # rich ends with a blank line
    # the first step is said as it starts (it may take minutes: a 32K prefill), later ones only as they end
    assert lines[0] == "run a started" and len(lines) == 2
    assert lines[1].startswith("run a done in ") and lines[1].endswith("τ 3.00") and "(1/2, elapsed" in lines[1]


def test_bench_plot_writes_a_png(tmp_path):
    out = tmp_path / "bench.png"
    result = CliRunner().invoke(main, [
        "bench", "--context", "128", "--new-tokens", "4", "--check-tokens", "4", "--batch-size", "1",
        "--selectors", "collect2", "--plot", str(out), "--device", "cpu",
    ])
    assert result.exit_code == 0, result.output
    blob = out.read_bytes()
    assert blob.startswith(PNG) and len(blob) > 1000
    assert "collect2: timed sampled decoding done in" in result.output  # the log line per run
    result = CliRunner().invoke(main, ["bench", "--plot", str(tmp_path), "--selectors", "collect2"])
    assert result.exit_code == 2 and "--plot" in result.output


def test_bench_plot_format_is_checked_before_the_run(tmp_path, monkeypatch):
    import vegas.bench

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before --plot was checked")

    monkeypatch.setattr(vegas.bench, "run_bench", no_run)
    result = CliRunner().invoke(main, ["bench", "--selectors", "collect2", "--plot", str(tmp_path / "p.txt")])
    assert result.exit_code == 2 and "format 'txt' is not one matplotlib writes" in result.output, result.output
    assert "png" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "p.txt").exists()


def test_quick_preset_is_small_and_bounded_and_explicit_options_win():
    quick = TuneOptions(quick=True).resolved()
    assert (quick.context, quick.new_tokens, quick.batch_size, quick.time_budget) == (1024, 32, 1, 570.0)
    assert len(quick.sparsities) == 4 and quick.gammas == [2, 4, 6] and quick.fine_steps == 1 and quick.repeats == 3
    assert TuneOptions(quick=True, context=512, time_budget=60).resolved().time_budget == 60
    assert TuneOptions().resolved().time_budget is None and TuneOptions().resolved().context == 4096


def test_a_plugin_selector_that_raises_is_skipped_under_all_and_fatal_when_named(counted, tmp_path, monkeypatch):
    """``vegas tune --selectors all`` (``skip_failing``): a selector that raises while decoding is
    skipped and named in the recommendation; the others are tuned. Named by the user, it fails."""
    from vegas.config import VegasPluginError

    pipe, _ = counted
    generate = pipe.generate

    def failing(prompts, selector=None, **kw):
        if selector == "quest":  # stands in for a plugin selector whose select() raises
            raise VegasPluginError("selector 'quest' (plugin 'bad') raised in select(): RuntimeError: boom")
        return generate(prompts, selector=selector, **kw)

    monkeypatch.setattr(pipe, "generate", failing)
    log = io.StringIO()
    opts = TuneOptions(**{**vars(_tiny(tmp_path)), "selectors": ["quest", "collect2"], "sparsities": [0.5],
                          "fine_steps": 0, "skip_failing": True})
    rec = run_tune(opts, Console(file=log), pipe=pipe)
    assert set(rec["skipped"]) == {"quest"} and set(rec["selectors"]) == {"collect2"}
    assert rec["best"]["selector"] == "collect2" and "skipped: selector 'quest'" in log.getvalue()
    done = [line for line in log.getvalue().splitlines() if "quest" in line and " done in " in line]
    assert done == [], done  # no 'done' line for a step that raised
    assert any("skipped selector quest" in line for line in describe(rec))
    with pytest.raises(VegasPluginError, match="quest"):
        run_tune(TuneOptions(**{**vars(_tiny(tmp_path / "named")), "selectors": ["quest"], "sparsities": [0.5],
                                "fine_steps": 0}), Console(file=io.StringIO()), pipe=pipe)


def test_sources_are_matched_by_what_they_name_not_by_their_path(tmp_path, monkeypatch):
    """A points file resumes from another checkout or machine: the model and the prompts are
    compared by content where both sides know it, else by file name; other settings exactly."""
    from vegas import models
    from vegas.tune_points import PointStore, source_settings

    here, there = tmp_path / "here", tmp_path / "there"
    for d in (here, there):
        d.mkdir()
        (d / "heldout.jsonl").write_text("same text")
        (d / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF same weights")
    monkeypatch.setattr(models, "named_model_gguf", lambda name: here / "SmolLM2-135M-Instruct.Q4_1.gguf")
    points = tmp_path / "out" / "points.json"

    def store(**settings):
        return PointStore(points, source_settings({"batch_size": 8, **settings}), fresh=False, command="vegas ablate")

    first = store(model=str(there / "SmolLM2-135M-Instruct.Q4_1.gguf"), prompts=str(there / "heldout.jsonl"))
    first.add({"tau": 3.0})
    # the model by name (its package's GGUF, the same content) and the prompts by a relative path
    monkeypatch.chdir(here)
    assert store(model="smollm2-135m", prompts="heldout.jsonl").points == [{"tau": 3.0}]
    # the same name with other content is refused, as is another value of an ordinary setting
    (here / "heldout.jsonl").write_text("other text")
    with pytest.raises(VegasConfigError, match=r"--prompts: .*heldout.jsonl"):
        store(model="smollm2-135m", prompts="heldout.jsonl")
    with pytest.raises(VegasConfigError, match=r"--batch-size: 8 -> 4"):
        PointStore(points, source_settings({"batch_size": 4, "model": "smollm2-135m",
                                            "prompts": str(there / "heldout.jsonl")}), fresh=False, command="x")


def test_sources_never_match_by_a_shared_last_name(tmp_path, monkeypatch):
    from vegas.tune_points import same_setting

    def same(a, b, key="model", **extra):
        return same_setting(key, {key: a, **extra}, {key: b})

    assert not same("meta-llama/Llama-3.2-1B", "someone/Llama-3.2-1B")  # hub ids compare whole
    (tmp_path / "a" / "model").mkdir(parents=True)
    (tmp_path / "b" / "model").mkdir(parents=True)
    assert not same(str(tmp_path / "a" / "model"), str(tmp_path / "b" / "model"))  # directories too
    assert not same("Qwen/Qwen2.5-0.5B", "/models/Qwen2.5-0.5B")
    # a file measured elsewhere (absent here, no content stored) matches a file here of its name only
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert same("/elsewhere/x.gguf", str(tmp_path / "x.gguf"))
    assert not same("/elsewhere/x.gguf", str(tmp_path / "x.gguf"), model_content="0123456789abcdef")
    assert not same("/elsewhere/x.gguf", str(tmp_path / "a" / "model"))
    # the same path whose file changed is refused
    from vegas.models import content_key

    old_key = content_key(tmp_path / "x.gguf")
    (tmp_path / "x.gguf").write_bytes(b"GGUF changed")
    assert not same(str(tmp_path / "x.gguf"), str(tmp_path / "x.gguf"), model_content=old_key)
    assert same(None, "package:click", key="prompts")  # tune's None is the installed click source


def test_the_default_model_matches_its_name():
    from vegas.tune_points import same_setting

    assert same_setting("model", {"model": None}, {"model": "vegas-tiny-code"})
    assert not same_setting("model", {"model": None}, {"model": "smollm2-135m"})
