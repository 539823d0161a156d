"""``vegas ablate``: the oracle selector, the overlap maths, retrieval prompts, the points file
(schema, resuming) and a tiny end-to-end run on the embedded model."""

import io
import json

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from vegas.ablate import AblateOptions, AblateStopped, plan, rope_for, run_ablate, spread
from vegas.cli import main
from vegas.config import VegasConfig, VegasConfigError
from vegas.interfaces import SelectionInput
from vegas.overlap import OverlapProbe, jaccard, pairwise_jaccard, topk_sets
from vegas.prompts import retrieval_prompts, source_label
from vegas.selection import collect_scores
from vegas.strategies import OracleSelector

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The embedded model's steps are overhead-bound: one thread is as fast, and avoids OpenMP
    threads spinning against each other on a shared 2-core machine (10x slower there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
PLOTS = ["tau_by_budget.png", "retrieval.png", "ablations.png", "overlap.png"]


def test_oracle_selects_the_exact_top_k_of_the_draft_query():
    torch.manual_seed(0)
    keys = torch.randn(2, 2, 40, 8)  # [B, KVH, L, D]
    query = torch.randn(2, 4, 1, 8)  # [B, H, 1, D]
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    oracle = OracleSelector(VegasConfig(recent_window=0, kv_budget=6))
    oracle.select(SelectionInput(0, None, valid, torch.tensor([6, 6]), keys))
    sel = oracle.select_for_query(0, query, None)
    logits = (query.view(2, 2, 2, 8) @ keys.transpose(-1, -2)).sum(dim=2).sum(dim=1)  # [B, L], heads summed
    for b in range(2):
        want = logits[b].masked_fill(~valid[b], float("-inf")).topk(6).indices.sort().values
        assert sel.indices[b, 0].tolist() == want.tolist() and sel.mask[b].all()


def test_oracle_per_kv_head_selects_each_heads_top_k_and_stays_lossless(pipe, click_ids):
    """granularity="kv_head": one exact top-k per KV head (the sum over its query heads), and the
    empty selection of ``select`` already carries those groups (a (B, 1, 0) one was refused by
    the selection check once ``select_for_query`` returned (B, KVH, k))."""
    torch.manual_seed(0)
    keys, query = torch.randn(1, 2, 30, 8), torch.randn(1, 4, 1, 8)  # [B, KVH, L, D], [B, H, 1, D]
    valid = torch.ones(1, 30, dtype=torch.bool)
    oracle = OracleSelector(VegasConfig(recent_window=0, kv_budget=5, granularity="kv_head"))
    assert oracle.select(SelectionInput(0, None, valid, torch.tensor([5]), keys)).indices.shape == (1, 2, 0)
    sel = oracle.select_for_query(0, query, None)
    logits = (query.view(1, 2, 2, 8) @ keys.transpose(-1, -2)).sum(dim=2)  # [B, KVH, L]
    for g in range(2):
        assert sel.indices[0, g].tolist() == logits[0, g].topk(5).indices.sort().values.tolist()

    prompts = [click_ids[30000:30300], click_ids[70000:70300]]
    saved = pipe.config
    try:
        pipe.config = VegasConfig(kv_budget=12, num_draft_tokens=4, granularity="kv_head", fallback=False)
        outs = pipe.generate(prompts, max_new_tokens=16, selector=OracleSelector(pipe.config))
    finally:
        pipe.config = saved
    plain = pipe.generate(prompts, max_new_tokens=16, selector=None)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.stats.acceptance_length > 1 for o in outs)


def test_oracle_drafts_at_least_as_well_as_collect2(pipe, click_ids):
    """Greedy τ on real prompts at a tiny budget: the draft query's own top-k beats the verified
    chunk's (a broken oracle, e.g. a bottom-k or stale keys, falls well below)."""
    prompts = [click_ids[30000:30300], click_ids[70000:70300]]
    saved = pipe.config
    try:
        pipe.config = VegasConfig(kv_budget=12, recent_window=0, num_draft_tokens=4, fallback=False)
        tau = {}
        for name, selector in (("collect2", "collect2"), ("oracle", OracleSelector(pipe.config))):
            outs = pipe.generate(prompts, max_new_tokens=16, selector=selector)
            tau[name] = sum(o.stats.num_generated for o in outs) / sum(o.stats.iterations for o in outs)
        plain = pipe.generate(prompts, max_new_tokens=16, selector=None)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # greedy stays lossless
    finally:
        pipe.config = saved
    assert tau["oracle"] >= tau["collect2"], tau


def test_kv_attended_counts_quests_partial_page_and_chunk(pipe, click_ids):
    """``kv_attended`` is what drafts attended, not the nominal budget: Quest's budget pages plus
    its always-attended partial page and verified chunk; the others exactly their budget."""
    from vegas.backends.hf import HFSession
    from vegas.sampling import SamplingParams, make_sampler
    from vegas.strategies import QuestSelector

    budget, gamma, page = 48, 4, 16  # 3 whole pages
    config = VegasConfig(kv_budget=budget, num_draft_tokens=gamma, page_size=page, fallback=False)
    # committed after prefill: 308 = 18 whole pages before the chunk's 5 tokens, then 20 recent
    # positions (the partial page's 15 and the chunk's 5), the most Quest attends beyond its
    # pages; 299 = 18 pages, then 11 recent ones (the batch's rows are left-padded apart)
    prompts = [click_ids[30000:30309], click_ids[70000:70300]]
    session = HFSession(pipe.backend.model, config, QuestSelector(config))
    session.prefill(prompts)
    assert session.kv_budgets.tolist() == [budget, budget]
    session.draft(gamma, make_sampler(SamplingParams(temperature=0), None))
    assert session.kv_attended.tolist() == [3 * page + 20, 3 * page + 11]

    saved = pipe.config
    try:
        pipe.config = config
        for name in ("collect2", "sliding_window", "quest", "oracle"):
            selector = OracleSelector(config) if name == "oracle" else name
            for out in pipe.generate(prompts, max_new_tokens=12, selector=selector):
                s = out.stats
                assert s.kv_budget == budget, name
                if name == "quest":  # beside its 3 pages, the chunk (γ + 1) and up to P - 1 of a partial page
                    assert budget + gamma + 1 <= s.kv_attended <= budget + gamma + page, s
                else:
                    assert s.kv_attended == budget, (name, s)
        assert all(o.stats.kv_attended is None for o in pipe.generate(prompts, max_new_tokens=2, selector=None))
    finally:
        pipe.config = saved


def test_jaccard_and_top_k_sets():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0]]])  # [B=1, 2 rows, L=5]
    allowed = torch.tensor([[True, True, True, True, False]])
    sets = topk_sets(scores, allowed, torch.tensor([2]))
    assert sets.tolist() == [[[True, True, False, False, False], [False, False, True, True, False]]]
    assert jaccard(sets[:, 0], sets[:, 1]).item() == 0.0 and jaccard(sets[:, 0], sets[:, 0]).item() == 1.0
    a = torch.tensor([[True, True, False]])
    b = torch.tensor([[True, False, True], [True, True, False]])
    assert pairwise_jaccard(a, b).tolist() == [[pytest.approx(1 / 3), 1.0]]


def test_per_row_scores_sum_to_the_summed_scores():
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 10, 8)
    allowed = torch.rand(2, 3, 10) > 0.3
    for mode in ("logit", "weight"):
        rows = collect_scores(q, k, allowed, 0.35, 2, mode, per_row=True)
        assert rows.shape == (2, 2, 3, 10)
        torch.testing.assert_close(rows.sum(dim=2), collect_scores(q, k, allowed, 0.35, 2, mode))


def test_overlap_probe_on_identical_rows_sees_full_overlap():
    """Rows whose scores agree choose one set: every Jaccard is 1 (and the probe drafts as collect2)."""
    probe = OverlapProbe(VegasConfig(kv_budget=3, recent_window=0, num_draft_tokens=2), max_distance=3)
    base = torch.arange(12, dtype=torch.float32)

    def step(num_valid):
        valid = torch.zeros(1, 12, dtype=torch.bool)
        valid[0, :num_valid] = True
        scores = base.expand(1, 1, 3, 12).clone()  # [B, G, m=3, L]
        return probe.select(SelectionInput(0, scores, valid, torch.tensor([3])))

    step(6)  # prefill: prompt slots are the first 6 - 3
    sel = step(8)  # 2 kept
    assert sel.indices.tolist() == [[[5, 6, 7]]]  # collect2's top-3 of the valid slots
    step(11)
    res = probe.results()
    assert res["within"][0][:2] == [1.0, 1.0] and res["across"][0][0] == 1.0
    assert res["proxy_collect2"][0][:3] == [1.0, 1.0, 1.0]


def test_retrieval_prompts_end_with_the_start_of_a_far_passage():
    ids = list(range(1000, 3000))
    anchors = {1500, 2100}
    rows = retrieval_prompts(ids, 400, 3, anchors, cue=8, answer=16)
    for r in rows:
        assert len(r["prompt"]) == 400 and r["distance"] >= (400 - 8) // 2
        body, cue = r["prompt"][:-8], r["prompt"][-8:]
        start = body.index(cue[0])
        assert body[start : start + 8] == cue and r["expected"] == body[start + 8 : start + 24]
    # an anchor whose passage repeats in the window (a second "def __init__(self") is skipped
    repeated = [7] + list(range(100, 300)) + list(range(100, 112)) + list(range(5000, 5179))  # 392 tokens
    (r,) = retrieval_prompts(repeated, 400, 1, {100, 150}, cue=8, answer=16)
    assert r["prompt"][-8:] == list(range(150, 158))


def test_spread_rope_and_plan():
    s = spread([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and 1.0 <= s["ci95"][0] <= 2.5 <= s["ci95"][1]
    assert rope_for(4000, 73, 8192) is None
    assert rope_for(16000, 73, 8192) == {"rope_type": "yarn", "factor": 2.0}
    assert rope_for(32000, 73, 8192) == {"rope_type": "yarn", "factor": 4.0}
    assert rope_for(16000, 73, 8192, 4) == {"rope_type": "yarn", "factor": 4.0}
    opts = AblateOptions(contexts=[512, 1024], budgets=[0.02, 0.1], gammas=[2, 4])
    specs = plan(opts, ["collect2", "oracle"])
    keys = [tuple(v for k, v in s.items() if k != "study") for s in specs]
    assert len(keys) == len(set(keys))  # the ablation's default at 0.02 is the budget point
    assert sum(s["study"] == "budget" for s in specs) == 8 and sum(s["study"] == "retrieval" for s in specs) == 8
    assert [s["num_draft_tokens"] for s in specs if s["study"] == "overlap"] == [4]
    assert {s["context"] for s in specs if s["study"] == "ablation"} == {512}
    with pytest.raises(VegasConfigError, match="--studies"):
        run_ablate(AblateOptions(studies=["nope"]), Console(file=io.StringIO()))


def _tiny(tmp_path, source, **kw):
    return AblateOptions(**{
        "selectors": ["collect2", "oracle"], "contexts": [128], "budgets": [0.1], "gammas": [2],
        "num_draft_tokens": 2, "ablation_sparsity": 0.1, "num_prompts": 2, "batch_size": 2, "new_tokens": 4,
        "max_distance": 3, "device": "cpu", "prompts": str(source), "out": str(tmp_path / "out"), **kw})


def test_tiny_run_writes_schema_plots_tables_and_resumes(counted, tmp_path, click_ids):
    pipe, calls = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))
    config_before = pipe.config
    res = run_ablate(_tiny(tmp_path, source), Console(file=io.StringIO()), pipe=pipe)
    assert pipe.config is config_before  # the caller's pipeline keeps its config (γ, budget, fallback)
    out = tmp_path / "out"
    data = json.loads((out / "points.json").read_text())
    assert data["version"] == 1 and data["settings"]["num_prompts"] == 2 and data["settings"]["temperature"] == 0.8
    # budget: 2 selectors; ablation: collect2's 3 non-default variants (its default and γ=2 are the budget
    # point); overlap: 1; retrieval: 2
    assert res["measured"] == len(data["points"]) == 2 + 3 + 1 + 2
    for p in data["points"]:
        assert {"study", "prompt_kind", "selector", "context", "sparsity_ratio", "num_draft_tokens", "variant",
                "kv_budget", "kv_attended", "acceptance_length", "tau", "tau_per_prompt", "rope_scaling"} <= set(p)
        assert len(p["tau_per_prompt"]) == 2 and p["tau"]["n"] == 2 and p["kv_budget"] == 13
        assert p["kv_attended"] == 13  # score-based selectors attend exactly their budget
        assert 1.0 <= p["tau"]["ci95"][0] <= p["acceptance_length"] <= p["tau"]["ci95"][1] <= 3.0
    probe = next(p for p in data["points"] if p["selector"] == "overlap_probe")
    assert set(probe["jaccard"]) == {"within", "across", "proxy_last_token", "proxy_collect2", "proxy_aggregated"}
    assert all(0 <= v <= 1 for v in probe["jaccard"]["within"]["mean"] if v is not None)
    retrieval = [p for p in data["points"] if p["prompt_kind"] == "retrieval"]
    assert all("copied_tokens" in p and p["distance_tokens"] >= 56 for p in retrieval)
    assert res["plots"] == PLOTS
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(PNG)
    tables = (out / "tables.md").read_text()
    assert "| oracle |" in tables and "### ablations" in tables and "| within |" in tables
    # headings name the prompt source, not the last measured point
    headings = [line for line in tables.splitlines() if line.startswith("###")]
    assert headings and all(" ctx " not in h for h in headings), headings
    assert any(source_label(str(source)) in h for h in headings), headings

    assert "| 0.1 (13 tok.): τ | attended |" in tables and "| 13.0 |" in tables  # the budget in tokens in the header
    # the budget study alone (one default point per selector) has nothing to ablate: no ablations.png
    from vegas.plots import plot_ablate

    alone = tmp_path / "budget_only"
    alone.mkdir()
    budget_only = [p for p in data["points"] if p["study"] == "budget"]
    assert plot_ablate(budget_only, _tiny(tmp_path, source), alone) == ["tau_by_budget.png"]
    assert not (alone / "ablations.png").exists()
    # the same sparsities at a second context: τ against context (tau_by_context.png), beside the budget panels
    longer = [{**p, "context": 2 * p["context"]} for p in budget_only]
    two = tmp_path / "two_contexts"
    two.mkdir()
    assert plot_ablate(budget_only + longer, _tiny(tmp_path, source), two) == ["tau_by_budget.png", "tau_by_context.png"]
    assert (two / "tau_by_context.png").read_bytes().startswith(PNG)
    # overlap.png draws the probe at the ablation context (the run's first), as ablations.png does
    probe_elsewhere = {**probe, "context": 2 * probe["context"]}
    assert "overlap.png" not in plot_ablate([probe_elsewhere], _tiny(tmp_path, source), two)
    assert plot_ablate([probe_elsewhere], _tiny(tmp_path, source, contexts=[2 * probe["context"]]), two) == [
        "overlap.png"]

    # points.json from before kv_attended: its points are reused, their attended cells "–"
    for p in data["points"]:
        del p["kv_attended"]
    (out / "points.json").write_text(json.dumps(data))
    measured = len(calls)
    again = run_ablate(_tiny(tmp_path, source), Console(file=io.StringIO()), pipe=pipe)
    assert len(calls) == measured and again["reused"] == len(data["points"]) and again["measured"] == 0
    assert "| 13.0 |" not in (out / "tables.md").read_text() and "] | – |" in (out / "tables.md").read_text()
    more = run_ablate(_tiny(tmp_path, source, budgets=[0.1, 0.2], studies=["budget"]), Console(file=io.StringIO()),
                      pipe=pipe)
    assert more["measured"] == 2 and more["reused"] == 2  # a grid extended: only the new points
    # --device left out on this CPU machine: the same device, so the points are reused (it was refused)
    if not torch.cuda.is_available():
        auto = run_ablate(_tiny(tmp_path, source, device=None, studies=["budget"]), Console(file=io.StringIO()),
                          pipe=pipe)
        assert auto["measured"] == 0 and auto["reused"] == 2
    with pytest.raises(VegasConfigError, match=r"other settings \(--new-tokens: 4 -> 5\).*--fresh"):
        run_ablate(_tiny(tmp_path, source, new_tokens=5), Console(file=io.StringIO()), pipe=pipe)
    # a bad value is named as such, not as a change of settings against points.json
    with pytest.raises(VegasConfigError, match=r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        run_ablate(_tiny(tmp_path, source, device="tpu"), Console(file=io.StringIO()), pipe=pipe)
    binary = tmp_path / "bin.dat"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(VegasConfigError, match="binary"):
        run_ablate(_tiny(tmp_path, binary), Console(file=io.StringIO()), pipe=pipe)


def test_a_gpu_folder_replots_without_a_gpu_and_names_what_is_unmeasured(counted, tmp_path, click_ids, monkeypatch):
    """A folder measured with ``--device cuda``, rerun where no GPU is (the H200 folders, which
    time budgets leave partial): it replots what is measured and names what is not, without
    converting or loading a model; with nothing measured it refuses, naming --device."""
    pipe, _ = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))
    run_ablate(_tiny(tmp_path, source, studies=["budget"]), Console(file=io.StringIO()), pipe=pipe)
    out = tmp_path / "out"
    data = json.loads((out / "points.json").read_text())
    data["settings"]["device"] = "cuda"
    (out / "points.json").write_text(json.dumps(data))
    (out / "tau_by_budget.png").unlink()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import vegas.ablate

    monkeypatch.setattr(vegas.ablate, "Pipeline", lambda *a, **k: pytest.fail("no model may load"))
    log = io.StringIO()
    res = run_ablate(_tiny(tmp_path, source, studies=["budget", "retrieval"], device="cuda",
                           selectors=["collect2", "oracle", "sliding_window"]), Console(file=log, width=300))
    assert res["measured"] == 0 and res["reused"] == 2 and res["plots"] == ["tau_by_budget.png"]
    assert res["planned"] == 6 and res["points"] == 2  # the plan, and what points.json holds
    assert (out / "tau_by_budget.png").is_file() and not res["complete"] and res["failed"] is None
    assert res["stopped"].startswith("4 point(s) of the plan are not in points.json (studies budget, retrieval; "
                                     "contexts 128; selectors collect2,oracle,sliding_window; a selector installed "
                                     "here that the GPU run did not measure, e.g. a plugin's, is left out by naming "
                                     "the others with --selectors) and --device 'cuda' needs a CUDA GPU")
    assert "4 point(s) need a CUDA GPU; plotting what was measured" in log.getvalue()
    assert res["resume"] == "rerun the same command on a machine with a CUDA GPU to resume"
    res = run_ablate(_tiny(tmp_path, source, studies=["budget"], device="cuda"), Console(file=io.StringIO()))
    assert res["complete"] and res["measured"] == 0 and res["reused"] == 2
    with pytest.raises(VegasConfigError, match=r"device .*'cuda' needs a CUDA GPU, and this torch build sees none"):
        run_ablate(_tiny(tmp_path, source, studies=["budget"], device="cuda", out=str(tmp_path / "empty")),
                   Console(file=io.StringIO()))
    assert not (tmp_path / "empty").exists()


def test_time_budget_measures_one_point_a_run_so_that_reruns_get_further(counted, tmp_path, click_ids):
    """A budget shorter than a point: each run still measures one (before, it measured none, said
    "rerun to resume", and every rerun did the same), then stops before the next and plots."""
    pipe, calls = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))
    opts = _tiny(tmp_path, source, studies=["budget"], time_budget=1e-6)
    res = run_ablate(opts, Console(file=io.StringIO()), pipe=pipe)
    assert len(calls) == 1 and res["measured"] == 1 and res["complete"] is False
    assert res["stopped"] == "time budget of 1e-06 s reached before budget: oracle ctx 128 s=0.1 γ=2 default"
    assert res["plots"] == ["tau_by_budget.png"] and res["resume"] == "rerun the same command to resume"
    res = run_ablate(opts, Console(file=io.StringIO()), pipe=pipe)
    assert res["measured"] == 1 and res["reused"] == 1 and res["complete"]


def test_without_matplotlib_the_points_and_tables_are_written(counted, tmp_path, click_ids, monkeypatch):
    """A machine without matplotlib (the GPU box's fixed environment) still gets points.json and
    tables.md, and a line saying how to draw the plots."""
    import vegas.plots

    pipe, _ = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))

    def no_matplotlib(*a, **k):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(vegas.plots, "plot_ablate", no_matplotlib)
    log = io.StringIO()
    res = run_ablate(_tiny(tmp_path, source, studies=["budget"]), Console(file=log, width=200), pipe=pipe)
    out = tmp_path / "out"
    assert res["plots"] == [] and res["complete"] and (out / "tables.md").is_file() and (out / "points.json").is_file()
    assert "plots not drawn" in log.getvalue() and "install matplotlib" in log.getvalue()


@pytest.mark.parametrize("args, message", [
    (["--studies", "budget,nope"], "--studies"),
    (["--selectors", "nope"], "--selectors"),
    (["--budgets", "0.1,2"], "--budgets"),
    (["--budgets", "0.02,,0.1"], "Invalid value for '--budgets': must be comma-separated floats, got '0.02,,0.1'"),
    (["--gammas", "0"], "--gammas"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--ablation-sparsity", "2"], "ablation_sparsity (--ablation-sparsity) must be a number in (0, 1], got 2.0"),
    (["--device", "bogus"], "Invalid value for '--device': must be 'cpu', 'cuda' or 'cuda:N', got 'bogus'"),
    (["--contexts", "10,2048"], "contexts (--contexts) must be integers >= 64 with the retrieval study"),
    (["--contexts", "2048,200000", "--yarn-factor", "2", "--studies", "budget"],
     "contexts (--contexts): 200,000 tokens and 69 more (new tokens, γ + 1 verification slots) do not fit the "
     "model's 32,768 tokens with YaRN ×2 (--yarn-factor); give contexts of at most 65,467 tokens, or a "
     "--yarn-factor of at least 6.11 (left out, it is the smallest power of two that fits: 8)"),
])
def test_cli_refuses_bad_options(args, message, tmp_path):
    result = CliRunner().invoke(main, ["ablate", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and message in result.output


def test_failed_ablate_leaves_no_out_directory(tmp_path):
    """A run that fails a check creates neither --out nor its parents."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "parent" / "out"
    for args in (["--model", str(tmp_path / "nope")], ["--device", "bogus"], ["--prompts", str(empty)]):
        result = CliRunner().invoke(main, ["ablate", "--quick", "--out", str(out), *args])
        assert result.exit_code == 2, (args, result.output)
        assert not (tmp_path / "parent").exists(), args
    assert f"Invalid value for '--prompts': '{empty}' holds no text (empty or only whitespace)" in result.output


def test_cli_summary_counts_the_plan_and_the_file_apart(tmp_path, monkeypatch):
    """The last line names the plan's points and, apart, what points.json holds (a new user read
    "232 points (0 measured now, 180 reused)" as 52 points lost)."""
    import vegas.ablate

    monkeypatch.setattr(vegas.ablate, "run_ablate", lambda opts, console: {
        "planned": 180, "points": 232, "measured": 0, "reused": 180, "tables": "tables.md", "plots": [],
        "skipped": {}, "failed": None, "stopped": None, "resume": ""})
    result = CliRunner().invoke(main, ["ablate", "--quick", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "180 points (0 measured now, 180 reused from an earlier run; 232 in points.json); tables.md" in result.output


def _failing_measure(monkeypatch, tmp_path, pipe, click_ids, selector, exc):
    """A prompt source for :func:`_tiny`; ``vegas.ablate.measure`` raises ``exc`` for ``selector``'s points."""
    import vegas.ablate as ab

    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))
    real = ab.measure

    def measure(p, rows, spec, opts):
        if spec["selector"] == selector:
            raise exc
        return real(p, rows, spec, opts)

    monkeypatch.setattr(ab, "measure", measure)
    return source


def test_a_plugin_selector_that_raises_is_skipped_under_all_and_fatal_when_named(counted, tmp_path, click_ids,
                                                                                monkeypatch):
    """As vegas bench: with every selector (the default), a plugin selector that raises while
    decoding is skipped, said so, and the run completes otherwise; a selector named by the user fails the run."""
    import vegas.ablate as ab
    from vegas.config import VegasPluginError

    pipe, _ = counted
    source = _failing_measure(monkeypatch, tmp_path, pipe, click_ids, "boom", VegasPluginError(
        "selector 'boom' (plugin 'bad') raised in select(): RuntimeError: boom"))
    monkeypatch.setattr(ab, "selector_names", lambda: ["collect2", "boom"])
    monkeypatch.setattr(ab, "ORACLE", "collect2")  # keep the run to two selectors
    log = io.StringIO()
    res = run_ablate(_tiny(tmp_path, source, selectors=None, studies=["budget"]), Console(file=log), pipe=pipe)
    assert set(res["skipped"]) == {"boom"} and res["measured"] == 1 and not res["complete"]
    assert "skipped: selector 'boom'" in log.getvalue()
    with pytest.raises(VegasPluginError, match="boom"):
        run_ablate(_tiny(tmp_path, source, selectors=["boom"], studies=["budget"]), Console(file=io.StringIO()),
                   pipe=pipe)


def test_prompt_sources_read_as_what_they_are(tmp_path, monkeypatch):
    from vegas.prompts import HELDOUT, heldout_path, source_label

    assert source_label(None) == "click source (held-out set not found)"
    assert source_label(str(tmp_path / HELDOUT)) == "held-out code"
    assert source_label("/data/mine.jsonl.xz") == "mine.jsonl.xz"
    monkeypatch.setattr("vegas.prompts.__file__", str(tmp_path / "site" / "vegas" / "prompts.py"))
    monkeypatch.chdir(tmp_path)
    assert heldout_path() is None  # neither beside the installed package nor here
    (tmp_path / HELDOUT).parent.mkdir(parents=True)
    (tmp_path / HELDOUT).write_bytes(b"")
    assert heldout_path() == tmp_path / HELDOUT  # a checkout run from after pip install .


def test_a_prompt_source_shorter_than_the_context_names_both_flags():
    from vegas.prompts import cut_contexts

    with pytest.raises(VegasConfigError, match=r"context \(--context\) of 256 tokens is longer than the prompt "
                                               r"source \(3 tokens\).*--prompts"):
        cut_contexts([1, 2, 3], 256, 1)


def test_batch_size_is_compared_as_the_rows_a_batch_holds():
    from vegas.ablate import _same_setting

    assert _same_setting("batch_size", {"batch_size": 8, "num_prompts": 4}, {"batch_size": 32, "num_prompts": 4})
    assert not _same_setting("batch_size", {"batch_size": 8, "num_prompts": 32}, {"batch_size": 32, "num_prompts": 32})
    # --num-prompts 4 -> 2 alone was said as "--batch-size: 4 -> 4 (other content)" beside it
    assert _same_setting("batch_size", {"batch_size": 4, "num_prompts": 4}, {"batch_size": 4, "num_prompts": 2})


def test_what_the_fresh_user_met_is_named_before_the_first_point(counted, tmp_path, click_ids, monkeypatch):
    """Session 28's fresh user: a context longer than the prompt source failed only after the
    earlier contexts were measured (points.json without tables); an ablation-only run whose
    --selectors named none of the ablated selectors planned nothing and ended "0 points", exit 0;
    Ctrl-C in the first point was said as a usage error claiming kept points. Each now stops
    before anything is written."""
    import vegas.ablate as ab

    pipe, calls = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))
    out = tmp_path / "out"
    with pytest.raises(VegasConfigError, match=r"context \(--contexts\) of 5000 tokens is longer than the prompt "
                                               r"source \(\d+ tokens\)"):
        run_ablate(_tiny(tmp_path, source, contexts=[128, 5000], studies=["budget"]), Console(file=io.StringIO()),
                   pipe=pipe)
    with pytest.raises(VegasConfigError, match=r"selectors names none of the selectors that "
                                               r"--studies ablation runs: the ablation study ablates aggregated, "
                                               r"collect2, last_token, got sliding_window,quest"):
        run_ablate(_tiny(tmp_path, source, studies=["ablation"], selectors=["sliding_window", "quest"]),
                   Console(file=io.StringIO()), pipe=pipe)
    _failing_measure(monkeypatch, tmp_path, pipe, click_ids, "collect2", KeyboardInterrupt())
    with pytest.raises(AblateStopped, match=r"^interrupted at budget: collect2 ctx 128 s=0.1 γ=2 default, before "
                                            r"any point was measured; nothing written$"):
        run_ablate(_tiny(tmp_path, source, studies=["budget"]), Console(file=io.StringIO()), pipe=pipe)
    assert calls == [] and not out.exists()

    def stopped(opts, console):
        raise AblateStopped("interrupted at x, before any point was measured; nothing written")

    monkeypatch.setattr(ab, "run_ablate", stopped)
    result = CliRunner().invoke(main, ["ablate", "--out", str(out)])
    assert result.exit_code == 1 and "Usage:" not in result.output
    assert result.output == "Error: interrupted at x, before any point was measured; nothing written\n"


def test_room_holds_the_gammas_only_of_studies_that_run_them(counted, tmp_path, click_ids):
    """The budget study decodes at γ = --num-draft-tokens: reserving --gammas' largest too put
    YaRN on a context that fits natively (8,180 of SmolLM2's 8,192 with 4 new tokens)."""
    pipe, _ = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids))
    longest = pipe.backend.max_context
    for contexts, studies, room in (([longest], ["budget"], 4 + 2 + 1), ([longest], ["budget", "ablation"], 4 + 8 + 1),
                                    ([128, longest], ["budget", "overlap"], 4 + 2 + 1)):  # they run at the first
        with pytest.raises(VegasConfigError, match=rf"{longest:,} tokens and {room} more \(new tokens, γ \+ 1"):
            run_ablate(_tiny(tmp_path, source, contexts=contexts, studies=studies, gammas=[8], yarn_factor=1.0001),
                       Console(file=io.StringIO()), pipe=pipe)


def test_a_fresh_run_leaves_no_plot_of_the_discarded_points_and_a_resume_keeps_them(counted, tmp_path, click_ids):
    """--fresh: the discarded points' plots go too; a resume whose options do not redraw a plot
    (ablations.png is drawn at --ablation-sparsity) keeps it, as its points stay."""
    pipe, _ = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))
    out = tmp_path / "out"
    run_ablate(_tiny(tmp_path, source, studies=["ablation"], selectors=["collect2"]), Console(file=io.StringIO()),
               pipe=pipe)
    assert (out / "ablations.png").is_file()
    res = run_ablate(_tiny(tmp_path, source, studies=["budget"], selectors=["collect2"], budgets=[0.2],
                           ablation_sparsity=0.5), Console(file=io.StringIO()), pipe=pipe)
    assert res["plots"] == ["tau_by_budget.png"] and (out / "ablations.png").is_file()
    res = run_ablate(_tiny(tmp_path, source, studies=["overlap"], fresh=True), Console(file=io.StringIO()), pipe=pipe)
    assert res["plots"] == ["overlap.png"] and sorted(p.name for p in out.glob("*.png")) == ["overlap.png"]


def test_the_overlap_probe_is_not_named_as_a_selector(monkeypatch):
    from vegas.ablate import PROBE, _unmeasurable_here

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said = _unmeasurable_here("cuda", [{"study": "overlap", "context": 4096, "selector": PROBE}])
    assert "(studies overlap; contexts 4,096) and --device 'cuda'" in said and PROBE not in said


def test_tables_pair_selectors_over_the_same_prompts(tmp_path):
    from vegas.plots import paired_difference, write_ablate_tables
    from vegas.tune_points import spread

    def point(sel, taus, s=0.02):
        return {"study": "budget", "prompt_kind": "heldout", "selector": sel, "context": 4096, "sparsity_ratio": s,
                "num_draft_tokens": 4, "variant": "default", "kv_budget": 82, "tau": spread(taus),
                "tau_per_prompt": taus}

    base = [3.0, 2.0, 4.0, 3.0]
    c2, window = point("collect2", [t + 0.3 for t in base]), point("sliding_window", base)
    # the same 0.3 gain on every prompt: a +10 % difference, its interval a single point
    d = paired_difference(c2, window)
    assert abs(d["mean"] - 10.0) < 1e-9 and all(abs(c - 10.0) < 1e-9 for c in d["ci95"])
    assert paired_difference(c2, point("x", base[:3])) is None  # not the same prompts
    noisy = point("aggregated", [3.6, 1.9, 4.2, 3.4])
    write_ablate_tables([c2, window, noisy, point("oracle", [4.0, 4.0, 4.0, 4.0])], tmp_path / "t.md")
    text = (tmp_path / "t.md").read_text()
    assert "| collect2 − sliding_window | **+10.0 % [+10.0, +10.0]** |" in text
    assert "| collect2 − aggregated | " in text and "| oracle − collect2 | +21.2 % [" in text  # n.s.: not bold



def test_tables_pair_the_ablation_variants_over_the_same_prompts(tmp_path):
    """The ablation's verdicts are read off tables.md: collect2 against aggregated and last_token
    in each variant and γ, and each selector's variant against its own default (not across γ)."""
    from vegas.plots import write_ablate_tables
    from vegas.tune_points import spread

    def point(sel, taus, variant="default", gamma=4, context=4096):
        return {"study": "ablation", "prompt_kind": "heldout", "selector": sel, "context": context,
                "sparsity_ratio": 0.02, "num_draft_tokens": gamma, "variant": variant, "kv_budget": 82,
                "tau": spread(taus), "tau_per_prompt": taus}

    base = [3.0, 2.0, 4.0, 3.0]
    up = [t + 0.3 for t in base]  # +0.3 on every prompt, +10 % of the mean: an interval of one point
    points = [point("aggregated", base), point("collect2", up), point("last_token", base),
              point("collect2", base, "recent_window=0"), point("last_token", up, "recent_window=0"),
              point("aggregated", base, gamma=2), point("collect2", up, gamma=2),
              point("collect2", base, context=2048), point("collect2", up, "recent_window=0", context=2048)]
    write_ablate_tables(points, tmp_path / "t.md")
    text = (tmp_path / "t.md").read_text()
    ten, minus = "**+10.0 % [+10.0, +10.0]**", "**-9.1 % [-9.1, -9.1]**"
    assert f"| default | {ten} | {ten} | – | – | – |" in text
    # recent_window=0: collect2 lost its 10 % (-0.1/1.1 against last_token's and its own default), last_token
    # gained it; aggregated has no such point
    assert f"| recent_window=0 | – | {minus} | – | {minus} | {ten} |" in text
    assert f"| γ=2 | {ten} | – | – | – | – |" in text  # γ rows compare selectors, not γ against γ = 4
    # a second ablated context gets its own tables (a run resumed at another first context)
    assert text.index("### ablations, context 2048") < text.index("### ablations, context 4096")
    assert f"| recent_window=0 | – | – | {ten} |" in text


CUDA_OOM = ("CUDA out of memory. Tried to allocate 750.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
            "37.12 MiB is free. Of the allocated memory 107.85 GiB is allocated by PyTorch, and 31.24 GiB is reserved "
            "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda)")


@pytest.mark.parametrize("message, summary", [(CUDA_OOM, "(CUDA out of memory. Tried to allocate 750.00 MiB);"),
                                              ("", "(OutOfMemoryError);")])
@pytest.mark.parametrize("alloc_conf", [None, "expandable_segments:True"])
def test_a_point_out_of_device_memory_stops_the_run_keeps_what_was_measured_and_names_the_remedies(
        counted, tmp_path, click_ids, monkeypatch, message, summary, alloc_conf):
    """The 32K oracle point ran out of H200 memory on 2026-12-04 and ended vegas ablate in a
    traceback. Now the run stops at that point, keeps and tabulates the points before it, and
    says in one line which point, what the allocator asked for and what to change (the
    fragmentation setting only where it is not set already); the CLI exits 1 with that line."""
    import vegas.ablate as ab

    pipe, _ = counted
    source = _failing_measure(monkeypatch, tmp_path, pipe, click_ids, "oracle", torch.OutOfMemoryError(message))
    if alloc_conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)
    log = io.StringIO()
    res = run_ablate(_tiny(tmp_path, source, studies=["budget"], device="cuda"), Console(file=log), pipe=pipe)
    out = tmp_path / "out"
    points = json.loads((out / "points.json").read_text())["points"]
    assert [p["selector"] for p in points] == ["collect2"] and res["measured"] == 1
    assert not res["complete"] and res["failed"] == res["stopped"] and (out / "tables.md").is_file()
    failed = res["failed"]
    assert failed.startswith("out of cuda memory at budget: oracle ctx 128 s=0.1 γ=2 default " + summary)
    assert "--batch-size" in failed and "--out" in failed and "\n" not in failed and "GPU 0" not in failed
    assert ("expandable_segments:True" in failed) == (alloc_conf is None)
    said = [line for line in log.getvalue().splitlines() if "memory" in line or "plotting" in line]
    assert said == ["out of memory at budget: oracle ctx 128 s=0.1 γ=2 default; plotting what was measured"]

    monkeypatch.setattr(ab, "run_ablate", lambda opts, console: {**res, "plots": []})
    result = CliRunner().invoke(main, ["ablate", "--out", str(out)])
    assert result.exit_code == 1 and f"Error: incomplete: {failed}" in result.output


def test_budget_and_context_panels_share_one_tau_axis_one_legend_and_wrap(tmp_path, monkeypatch):
    """The H200 figures: panels of different contexts on one τ scale (separate scales made 2.6–3.8
    look like 3.0–4.5), one legend outside the panels (per-panel legends covered the oracle), at
    most three panels a row, and a selector's markers dodged so that equal points stay visible."""
    from matplotlib.figure import Figure

    from vegas.plots import DODGE, _budget_panels, _context_panels
    from vegas.tune_points import spread

    def point(sel, ctx, s, tau):
        return {"study": "budget", "prompt_kind": "heldout", "selector": sel, "context": ctx, "sparsity_ratio": s,
                "num_draft_tokens": 4, "variant": "default", "kv_budget": int(ctx * s), "tau": spread([tau, tau + 0.2]),
                "tau_per_prompt": [tau, tau + 0.2], "rope_scaling": {"factor": 4.0} if ctx > 8192 else None}

    points = [point(sel, ctx, s, base + 10 * s + (ctx > 8192))
              for sel, base in (("collect2", 2.0), ("quest", 2.0), ("oracle", 3.0))
              for ctx in (4096, 16000) for s in (0.01, 0.02, 0.05, 0.1, 0.2)]
    drawn = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **k: drawn.setdefault(path.name, fig))
    assert _budget_panels(points, "heldout", 4, "t", tmp_path / "b.png")
    assert _context_panels(points, 4, "t", tmp_path / "c.png")
    budget, context = drawn["b.png"], drawn["c.png"]
    assert len(budget.axes) == 2 and len(context.axes) == 5
    assert len({ax.get_position().y0 for ax in context.axes}) == 2  # two rows: 3 + 2
    for fig in (budget, context):
        assert len({ax.get_ylim() for ax in fig.axes}) == 1  # one τ scale
        assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
        assert [t.get_text() for t in fig.legends[0].get_texts()] == ["collect2", "oracle", "quest"]
    # collect2 and quest have equal τ at every point: their markers sit apart (oracle between them), not on each other
    xs = {c.get_label(): c.lines[0].get_xdata() for c in budget.axes[0].containers}
    assert abs(xs["quest"][0] / xs["collect2"][0] - DODGE ** 2) < 1e-9


def test_an_interrupted_run_keeps_tabulates_and_says_how_to_resume(counted, tmp_path, click_ids, monkeypatch):
    """Ctrl-C in a point: the points before it are kept and tabulated (before, only points.json was),
    and the run says where it stopped and to rerun; the next run resumes from there."""
    pipe, _ = counted
    source = _failing_measure(monkeypatch, tmp_path, pipe, click_ids, "oracle", KeyboardInterrupt())
    log = io.StringIO()
    res = run_ablate(_tiny(tmp_path, source, studies=["budget"]), Console(file=log, width=300), pipe=pipe)
    assert res["measured"] == 1 and not res["complete"] and (tmp_path / "out" / "tables.md").is_file()
    assert res["failed"] == ("interrupted at budget: oracle ctx 128 s=0.1 γ=2 default; the points measured before "
                             "it are kept in points.json: rerun the same command to resume")
    assert "interrupted at budget: oracle" in log.getvalue()
    monkeypatch.undo()
    res = run_ablate(_tiny(tmp_path, source, studies=["budget"]), Console(file=io.StringIO()), pipe=pipe)
    assert res["complete"] and res["measured"] == 1 and res["reused"] == 1


def test_out_of_memory_inside_a_selector_or_at_the_model_load_is_not_a_plugin_error(counted, tmp_path, click_ids,
                                                                                   monkeypatch):
    """Memory runs out where the work is: inside a selector (the oracle scores the whole context)
    it stopped being said as a plugin error (skipped under the default "all", the run exit 0);
    with --device left out the message crashed on None; at the model's load it was a traceback."""
    import vegas.ablate as ab
    from vegas.ablate import _allocator_summary
    from vegas.strategies import OracleSelector

    pipe, _ = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has a total capacity")

    monkeypatch.setattr(OracleSelector, "select_for_query", oom)
    monkeypatch.setattr(ab, "selector_names", lambda: ["collect2"])  # "all" = collect2 and the oracle
    res = run_ablate(_tiny(tmp_path, source, selectors=None, studies=["budget"], device=None),
                     Console(file=io.StringIO()), pipe=pipe)
    assert res["skipped"] == {} and res["measured"] == 1 and not res["complete"]
    assert res["failed"].startswith("out of cpu memory at budget: oracle ctx 128 s=0.1 γ=2 default "
                                    "(CUDA out of memory. Tried to allocate 512 bytes); ")
    assert _allocator_summary(torch.OutOfMemoryError("x " * 200)) == ("x " * 100)[:200]  # no request: cut

    monkeypatch.setattr(OracleSelector, "select", oom)  # the first point, in a new folder: nothing is written
    log = io.StringIO()
    with pytest.raises(AblateStopped, match=r"^out of cpu memory at budget: oracle ctx 128 s=0.1 γ=2 default "
                                            r"\(CUDA out of memory. Tried to allocate 512 bytes\); nothing was written"):
        run_ablate(_tiny(tmp_path, source, studies=["budget"], selectors=["oracle"], out=str(tmp_path / "new")),
                   Console(file=log), pipe=pipe)
    assert not (tmp_path / "new").exists() and "plotting what was measured" not in log.getvalue()

    monkeypatch.setattr(ab, "Pipeline", lambda *a, **k: oom())
    with pytest.raises(AblateStopped, match=r"^out of cpu memory at the model's load \(CUDA out of memory. "
                                            r"Tried to allocate 512 bytes\); nothing was written. .*--batch-size"):
        run_ablate(_tiny(tmp_path, source, studies=["budget"], device="cpu", out=str(tmp_path / "new")),
                   Console(file=io.StringIO()))
    assert not (tmp_path / "new").exists()


def test_a_context_beyond_the_model_says_it_scales_the_rope(counted, tmp_path, click_ids, monkeypatch):
    """YaRN is chosen when a context does not fit: the run says so (and which factor) before it loads
    the scaled model, instead of measuring another model silently."""
    from vegas import ablate

    pipe, _ = counted
    source = tmp_path / "src.py"
    source.write_text(pipe.tokenizer.decode(click_ids[:3000]))
    monkeypatch.setattr(pipe.backend.model.config, "max_position_embeddings", 100)

    class Loaded(Exception):
        pass

    def scaled(*args, rope_scaling=None, **kwargs):
        raise Loaded(rope_scaling)

    monkeypatch.setattr(ablate, "Pipeline", scaled)
    out = io.StringIO()
    with pytest.raises(Loaded, match="'factor': 2.0"):
        run_ablate(_tiny(tmp_path, source, studies=["budget"], selectors=["collect2"]), Console(file=out, width=300),
                   pipe=pipe)
    assert ("context 128: beyond the model's 100 tokens, so its RoPE is scaled with YaRN ×2 (the smallest power of "
            "two that fits; --yarn-factor sets it)") in out.getvalue()
