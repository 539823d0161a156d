"""The fused verification kernel (attention + score collection, issue 14) against its PyTorch
reference and today's separate score reference on the CPU, run by Triton's interpreter
(``TRITON_INTERPRET=1``), in float32; and its block choices and argument errors.

The interpreter is chosen when a kernel is defined, so the kernel runs in one subprocess that
checks every case and reports each one (tiny batches keep it under a minute)."""

from __future__ import annotations


import pytest
import torch

from tests.fused_cases import plan_rows, verify_batch
from tests.kernel_cases import run_interpreted
from vegas.config import VegasConfigError


#: id -> (shape, chunk lengths, cached contexts, selector, num_splits, extra kwargs)
CASES = {
    # SmolLM2 (9 q / 3 kv x 64) and Qwen3-8B (32 q / 8 kv x 128): γ = 4 decode chunks (5, 5)
    # and a one-token chunk, one pass and three key slices, both selectors
    "smollm2-collect2": ((9, 3, 64), [5, 5, 1], [40, 55, 70], "collect2", 1, {}),
    "smollm2-aggregated-split3": ((9, 3, 64), [5, 5, 1], [40, 55, 70], "aggregated", 3, {}),
    "qwen3-8b-collect2": ((32, 8, 128), [5, 5, 1], [40, 55, 70], "collect2", 1, {}),
    "qwen3-8b-aggregated-split2": ((32, 8, 128), [5, 1], [60, 47], "aggregated", 2, {}),
    # MQA (scores written in place), head_dim 80 (masked), a 23-token prefill chunk (several
    # query tiles), an empty chunk and a first chunk with nothing to score (ctx_sel = 0)
    "mqa80-prefill-empty-split2": ((8, 1, 80), [5, 23, 0, 3], [40, 30, 50, 0], "collect2", 2, {}),
    # ratio 2, head_dim 96, a 20-token prefill chunk (4 query tiles of 16 rows)
    "96-prefill": ((6, 3, 96), [5, 20, 1], [44, 33, 66], "aggregated", 1, {}),
    # head_dim 256, 32-key tiles, a key tile that straddles ctx_sel, γ = 2
    "256-gamma2": ((4, 2, 256), [3, 3, 1], [41, 64, 70], "collect2", 1, {"gamma": 2}),
}

_CHILD = r"""
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
from tests.fused_cases import check_fused
from tests.test_fused_verify_interpreted import CASES
out = {}
for name, (shape, chunks, ctxs, selector, splits, extra) in CASES.items():
    try:
        out[name] = list(check_fused("cpu", shape, chunks, ctxs, selector=selector, num_splits=splits, **extra))
    except Exception:
        out[name] = traceback.format_exc()[-2000:]
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    """``{case: [out_err, score_err] or the traceback}`` from one interpreter run."""
    return run_interpreted(_CHILD)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_kernel_matches_references_interpreted(interpreted, case):
    """Output within 1e-4 (relative norm) of the float64 reference, scores within 1e-4 of both
    references with the same ``-inf`` pattern, padding tokens and other layers' rows untouched."""
    res = interpreted[case]
    assert isinstance(res, list), res


def test_plan_rows_match_make_plan():
    """The tests' scored rows are the vLLM plan's (collect2 and aggregated, a one-token chunk)."""
    from vegas.config import VegasConfig
    from vegas.plugins import create_selector
    from vegas.vllm_plugin.selectors.plan import RowTable, make_plan

    b = verify_batch([5, 5, 1], [40, 55, 70], (9, 3, 64), pad_tokens=0)
    for selector in ("collect2", "aggregated"):
        sel = create_selector(selector, VegasConfig(num_draft_tokens=4))
        rows = RowTable.of(sel, 4, torch.device("cpu"))
        plan = make_plan(b["cu_seqlens_q"], b["seq_lens"], int(b["seq_lens"].max()), 4, sel, rows)
        q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], 4, selector)
        assert torch.equal(plan.q_idx, q_idx) and torch.equal(plan.q_weight, q_weight)
        assert torch.equal(plan.ctx_sel, ctx_sel)


def test_blocks_and_splits():
    fv = pytest.importorskip("vegas.kernels.triton_fused_verify")
    assert fv.fused_blocks(3, 5, 64) == (16, 64, 64)  # SmolLM2, γ = 4: 15 rows
    assert fv.fused_blocks(4, 5, 128) == (32, 64, 128)  # Qwen3-8B: 20 rows
    assert fv.fused_blocks(1, 5, 80) == (16, 64, 128) and fv.fused_blocks(2, 1, 256) == (16, 32, 256)
    with pytest.raises(VegasConfigError, match="one query tile"):
        fv.fused_blocks(8, 17, 128)
    assert fv.choose_num_splits(256, 16384, 132) == 2  # tiny, batch 128: 256 programs -> 512 slices
    assert fv.choose_num_splits(32, 131072, 132) == 8  # Qwen3-8B, batch 4
    assert fv.choose_num_splits(12, 131072, 132) == 16  # SmolLM2, batch 4
    assert fv.choose_num_splits(12, 700, 132) == 1  # short contexts stay whole


def test_bad_arguments_are_refused_by_name():
    fv = pytest.importorskip("vegas.kernels.triton_fused_verify")
    b = verify_batch([5, 1], [40, 20], (9, 3, 64))
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["cu_seqlens_q"], b["seq_lens"], 5, 0.125)
    q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], 4, "collect2")
    scores = torch.zeros(2, 80)
    with pytest.raises(VegasConfigError, match="q_idx, q_weight, ctx_sel and score_span"):
        fv.fused_verify_attention(*args, scores=scores, q_idx=q_idx, q_weight=q_weight, ctx_sel=ctx_sel)
    with pytest.raises(VegasConfigError, match="float32"):
        fv.fused_verify_attention(*args, scores=scores.double(), q_idx=q_idx, q_weight=q_weight, ctx_sel=ctx_sel,
                                  score_span=5)
    with pytest.raises(VegasConfigError, match="num_q_heads"):
        fv.fused_verify_attention(b["q"][:, :8], *args[1:])
    with pytest.raises(VegasConfigError, match="v_cache shape"):
        fv.fused_verify_attention(b["q"], b["k_cache"], b["v_cache"][:, :8], *args[3:])
