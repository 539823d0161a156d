"""The device benchmark script's host-side logic (no vLLM, no GPU): engine plan, byte floor,
exactness comparison and table. A bug here would only show up after a device run."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vb():
    return load_script("vllm_bench")


def _args(**kw):
    base = dict(selectors=["collect2", "aggregated", "sliding_window"], extra_gammas="", extra_gamma_selectors="collect2",
                verify_graphs="full", name_suffix="", gamma=4, exact_prompts=8, model=str(ROOT / "vegas" / "model"),
                sparsity=0.05, min_kv_budget=256, kv_budget=0, tp=1, tp_selection="all_reduce",
                tp_selections=["all_reduce"], vegas_scheduling="async", vegas_schedulings=["async"])
    base.update(kw)
    return argparse.Namespace(**base)


def test_full_graphs_build_one_engine_per_selector(vb):
    jobs = vb.engine_jobs(_args(extra_gammas="8"), ["plain", "vegas"])
    labels = [(m, tuple(a.selectors) if m == "vegas" else None, a.verify_graphs, a.name_suffix, a.gamma) for m, a in jobs]
    assert labels == [
        ("plain", None, "full", "", 4),
        ("vegas", ("collect2",), "full", "", 4),
        ("vegas", ("aggregated",), "full", "", 4),
        ("vegas", ("sliding_window",), "full", "", 4),
        ("vegas", ("collect2",), "full", "-g8", 8),
    ]
    both = vb.engine_jobs(_args(verify_graphs="both"), ["vegas"])
    assert [(a.verify_graphs, a.name_suffix, len(a.selectors)) for _, a in both][-1] == ("piecewise", "-pw", 3)


def test_tensor_parallel_builds_one_vegas_engine_per_score_reduction(vb):
    args = _args(tp=2, tp_selections=["all_reduce", "per_rank"], selectors=["collect2", "sliding_window"])
    jobs = vb.engine_jobs(args, ["plain", "vegas"])
    got = [(m, tuple(a.selectors) if m == "vegas" else None, a.tp_selection, a.name_suffix) for m, a in jobs]
    assert got == [
        ("plain", None, "all_reduce", ""),
        ("vegas", ("collect2",), "all_reduce", ""),
        ("vegas", ("sliding_window",), "all_reduce", ""),
        ("vegas", ("collect2",), "per_rank", "-per_rank"),  # sliding_window reduces no scores
    ]
    assert vb.vegas_cfg(jobs[3][1], "collect2")["tp_selection"] == "per_rank"
    pw = vb.engine_jobs(_args(tp=2, tp_selections=["all_reduce", "per_rank"], verify_graphs="piecewise"), ["vegas"])
    assert [(a.selectors, a.name_suffix) for _, a in pw] == [
        (["collect2", "aggregated", "sliding_window"], ""), (["collect2", "aggregated"], "-per_rank")]
    # one GPU: the reduction is ignored, one engine per selector
    assert len(vb.engine_jobs(_args(tp_selections=["all_reduce", "per_rank"]), ["vegas"])) == 3


def test_scheduling_modes_build_one_vegas_engine_each(vb):
    args = _args(vegas_schedulings=["async", "sync"], selectors=["collect2", "sliding_window"], extra_gammas="6")
    got = [(m, tuple(a.selectors) if m == "vegas" else None, a.vegas_scheduling, a.name_suffix)
           for m, a in vb.engine_jobs(args, ["plain", "vegas"])]
    assert got == [
        ("plain", None, "async", ""),
        ("vegas", ("collect2",), "async", ""),
        ("vegas", ("sliding_window",), "async", ""),
        ("vegas", ("collect2",), "sync", "-sync"),
        ("vegas", ("sliding_window",), "sync", "-sync"),
        ("vegas", ("collect2",), "async", "-g6"),
    ]


def test_open_batch_builds_one_engine_per_batch_size(vb):
    args = _args(steady=4, batches=[128, 32], selectors=["collect2"])
    got = [(m, a.batches, a.exact_prompts) for m, a in vb.engine_jobs(args, ["plain", "vegas"])]
    assert got == [("plain", [128], 8), ("vegas", [128], 8), ("plain", [32], 0), ("vegas", [32], 0)]


def test_table_compares_open_batches_with_open_plain(vb):
    rows = [
        {"ctx": 16384, "batch": 128, "method": "plain", "tok_per_s": 20000.0, "ms_per_token_step": 6.4,
         "mode": "closed", "requests": 128},
        {"ctx": 16384, "batch": 128, "method": "plain", "tok_per_s": 25000.0, "ms_per_token_step": 5.1,
         "mode": "steady", "requests": 512},
        {"ctx": 16384, "batch": 128, "method": "vegas-collect2", "tok_per_s": 50000.0, "ms_per_token_step": 2.6,
         "mode": "steady", "requests": 512},
    ]
    text = vb.table({"rows": rows})
    assert "| 16384 | 128 open (512 req.) | vegas-collect2 | 50000 | 2.60 |" in text
    assert text.rstrip().endswith("| 2.00x |  |")  # against the open-batch plain row, not the closed one


def test_byte_floor_splits_over_tensor_parallel_gpus(vb):
    one = vb.byte_floor_ms(_args(), "vegas", "collect2", 16384, 32)
    two = vb.byte_floor_ms(_args(tp=2), "vegas", "collect2", 16384, 32)
    assert two == pytest.approx(one / 2)


def test_byte_floor_counts_what_a_step_reads(vb):
    cfg = json.loads((ROOT / "vegas" / "model" / "config.json").read_text())
    weights, kv = vb.model_bytes(cfg)
    assert kv == 8 * 2 * 2 * 64 * 2  # layers x (K, V) x kv heads x head_dim x bf16 = 4 KiB
    args = _args()
    plain = vb.byte_floor_ms(args, "plain", None, 16384, 128)
    assert plain == pytest.approx((weights + 128 * 16384 * kv) / 4.3e12 * 1e3)
    budget = math.ceil(16384 * 0.05)
    drafts = 4 * (weights + 128 * (budget + 5) * kv)
    sliding = vb.byte_floor_ms(args, "vegas", "sliding_window", 16384, 128)
    collect2 = vb.byte_floor_ms(args, "vegas", "collect2", 16384, 128)
    assert sliding == pytest.approx(((weights + 128 * 16384 * kv) + drafts) / 4.3e12 * 1e3)
    assert collect2 - sliding == pytest.approx(128 * 16384 * kv / 2 / 4.3e12 * 1e3)  # the keys, once more


def test_exactness_reports_the_first_difference_and_its_gap(vb):
    lp = SimpleNamespace
    ref = {"plain": [[1, 2, 3], [4, 5, 6]],
           "plain_logprobs": [None, [{5: lp(logprob=-0.5)}, {5: lp(logprob=-0.1), 9: lp(logprob=-0.1)}, {}]]}
    out = vb.compare([[1, 2, 3], [4, 9, 6]], ref)
    assert out["identical"] == 1 and out["total"] == 2
    assert out["diffs"] == [{"prompt": 1, "first_diff": 1, "top2_logprob_gap": 0.0, "differing_tokens": 1}]


def test_table_has_speedup_and_byte_bound(vb):
    rows = [
        {"ctx": 16384, "batch": 32, "method": "plain", "tok_per_s": 10000.0, "ms_per_token_step": 3.2, "floor_ms": 0.5},
        {"ctx": 16384, "batch": 32, "method": "vegas-collect2", "tok_per_s": 15000.0, "ms_per_token_step": 2.1,
         "floor_ms": 0.9, "acceptance_length": 3.6, "selection_overhead": None,
         "per_iteration_ms": {"wall": 5.8}, "gpu_ms_per_iteration": 3.0},
    ]
    text = vb.table({"rows": rows})
    assert "| 16384 | 32 | vegas-collect2 | 15000 | 5.80 | 3.00 | 0.90 | 3.60 |  | 1.50x | 2.00x |" in text


def test_kv_budget_shares_build_one_vegas_engine_each(vb):
    """--sparsity 0.05,0.02: every vegas engine once per share, the second share's rows suffixed
    '-kv2%', and each engine's proposer config and byte floor use its own share."""
    args = _args(sparsities=[0.05, 0.02], selectors=["collect2", "quest"], min_kv_budget=0)
    jobs = vb.engine_jobs(args, ["plain", "vegas"])
    got = [(m, tuple(a.selectors) if m == "vegas" else None, a.sparsity, a.name_suffix) for m, a in jobs]
    assert got == [
        ("plain", None, 0.05, ""),
        ("vegas", ("collect2",), 0.05, ""),
        ("vegas", ("quest",), 0.05, ""),
        ("vegas", ("collect2",), 0.02, "-kv2%"),
        ("vegas", ("quest",), 0.02, "-kv2%"),
    ]
    assert vb.vegas_cfg(jobs[3][1], "collect2")["sparsity_ratio"] == 0.02
    assert vb.kv_budget_tokens(jobs[3][1], 7680) == 154 and vb.kv_budget_tokens(jobs[1][1], 7680) == 384
    assert vb.kv_budget_tokens(_args(sparsity=0.02), 7680) == 256  # the default floor wins without --min-kv-budget 0
    assert vb.byte_floor_ms(jobs[3][1], "vegas", "collect2", 7680, 32) < vb.byte_floor_ms(jobs[1][1], "vegas",
                                                                                        "collect2", 7680, 32)
    assert vb.sparsity_suffix(0.005) == "-kv0.5%"


@pytest.mark.parametrize("raw", ["0", "0.05,x", "1.5", ""])
def test_bad_sparsity_is_named(vb, raw):
    with pytest.raises(ValueError, match="--sparsity must be a comma list of numbers in \\(0, 1\\]"):
        vb.parse_sparsities(raw)


def test_tau_table_has_one_column_per_budget(vb):
    def row(sel, sp, k, tau):
        return {"ctx": 7680, "batch": 32, "method": f"vegas-{sel}", "selector": sel, "sparsity": sp, "kv_budget": k,
                "acceptance_length": tau, "mode": "closed"}

    rows = [row("collect2", 0.05, 384, 3.9), row("quest", 0.05, 384, 4.0), row("collect2", 0.02, 154, 3.5)]
    text = vb.tau_table({"rows": rows + [{"ctx": 7680, "batch": 32, "method": "plain"}]})
    assert text.splitlines()[0] == "| ctx | batch | selector | τ at 5 % (384) | τ at 2 % (154) |"
    assert "| 7680 | 32 | collect2 | 3.90 | 3.50 |" in text and "| 7680 | 32 | quest | 4.00 |  |" in text
    assert vb.tau_table({"rows": []}) == ""


def test_model_is_checked_before_any_engine(vb, tmp_path):
    with pytest.raises(ValueError, match="--model .* is not a checkpoint directory"):
        vb.check_model(str(tmp_path / "smollm2-hf"), vegas=True)
    llama = tmp_path / "smol"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                   "num_attention_heads": 9, "num_key_value_heads": 3}))
    vb.check_model(str(llama), vegas=True)
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma2", "num_hidden_layers": 2}))
    vb.check_model(str(gemma), vegas=False)  # plain vLLM runs sliding-window models
    with pytest.raises(ValueError, match="sliding-window attention .* backend='hf'"):
        vb.check_model(str(gemma), vegas=True)


def test_prompts_use_the_models_own_tokenizer(vb, tmp_path):
    """Two models with different tokenizers get different token ids for the same held-out code;
    no special tokens are added, and each window is a slice of the model's own tokenization."""
    import lzma

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    data = tmp_path / "code.jsonl.xz"
    with lzma.open(data, "wt") as f:
        for text in ("def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 1\n"):
            f.write(json.dumps({"text": text}) + "\n")
    words = sorted({w for t in ("def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 1\n")
                    for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(t)})
    model = tmp_path / "wordlevel"
    model.mkdir()
    tok = Tokenizer(models.WordLevel({w: i + 5 for i, w in enumerate(words)} | {"[UNK]": 0, "[BOS]": 1},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    tok.save(str(model / "tokenizer.json"))
    mine = vb.load_prompts(str(model), 2, 6, data)
    full = [i for t in ("def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 1\n")
            for i in tok.encode(t, add_special_tokens=False).ids]
    assert all(len(p) == 6 for p in mine) and 1 not in {i for p in mine for i in p}
    assert all(any(full[j : j + 6] == p for j in range(len(full))) for p in mine)
    embedded = vb.load_prompts(str(ROOT / "vegas" / "model"), 2, 6, data)
    assert embedded != mine


def test_device_check_default_bench_is_the_smollm2_plan(vb, tmp_path):
    """scripts/device_check.sh's default BENCH_ARGS parse, and plan plain plus the four selectors
    at 5 % and 2 % KV budgets (nine engines) on the SmolLM2 checkpoint at 7,680 tokens."""
    import re
    import shlex

    text = (ROOT / "scripts" / "device_check.sh").read_text()
    raw = re.search(r'BENCH_ARGS=\$\{BENCH_ARGS:-"(.*?)"\}', text, re.S).group(1).replace("\\\n", " ")
    model = tmp_path / "smollm2-hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30,
                                                   "num_attention_heads": 9, "num_key_value_heads": 3}))
    args = vb.parse_args(shlex.split(raw.replace("$SMOLLM2", str(model))))
    assert args.contexts == [7680] and args.batches == [32, 128] and args.temperature == 0.8
    assert args.exact_prompts == 32 and args.min_kv_budget == 0
    jobs = vb.engine_jobs(args, args.method_list)
    got = [m + a.name_suffix + (f":{a.selectors[0]}" if m == "vegas" else "") for m, a in jobs]
    sels = ["collect2", "aggregated", "sliding_window", "quest"]
    assert got == ["plain"] + [f"vegas:{s}" for s in sels] + [f"vegas-kv2%:{s}" for s in sels]
    assert [vb.kv_budget_tokens(a, 7680) for _, a in jobs[1:]] == [384] * 4 + [154] * 4


def test_vegas_rows_hand_the_proposer_its_settings(vb):
    """Each vegas engine's settings JSON parses into the proposer's selector name and VegasConfig."""
    from vegas.vllm_plugin.settings import build_selector, parse_settings

    args = _args(tp=2, tp_selection="per_rank", kv_budget=300, verify_graphs="piecewise", gamma=6)
    name, config = parse_settings(vb.vegas_settings(args, "quest"))  # γ is not among the settings
    assert name == "quest" and config.kv_budget == 300
    assert build_selector(name, config, args.gamma).config.num_draft_tokens == 6  # γ: speculative_config's
    assert config.vllm.tp_selection == "per_rank" and config.vllm.verify_cuda_graphs == "piecewise"


def test_fa3_extension_runs_every_vegas_engine_again(vb, monkeypatch):
    """``--fa3-ext``: each vegas engine once more with the FA3 score extension (rows '-fa3', no
    second exactness check); only those engines see ``VEGAS_FA3_EXT``."""
    jobs = vb.engine_jobs(_args(selectors=["collect2", "aggregated"], fa3_ext="/x/_vegas_fa3_C.so", fa3_on=False),
                          ["plain", "vegas"])
    got = [(m, a.name_suffix, a.fa3_on, a.exact_prompts) for m, a in jobs]
    assert got == [("plain", "", False, 8), ("vegas", "", False, 8), ("vegas", "", False, 8),
                   ("vegas", "-fa3", True, 0), ("vegas", "-fa3", True, 0)]
    monkeypatch.setenv("VEGAS_FA3_EXT", "/stale")
    seen = []
    monkeypatch.setattr(vb, "run_engine", lambda *a, **k: seen.append(vb.os.environ.get("VEGAS_FA3_EXT")))
    monkeypatch.setattr(vb, "shutdown", lambda llm: None)
    for m, a in jobs:
        vb.run_job(m, a, {}, {}, {})
    assert seen == [None, None, None, "/x/_vegas_fa3_C.so", "/x/_vegas_fa3_C.so"]
    assert vb.parse_args(["--methods", "plain"]).fa3_ext is None
