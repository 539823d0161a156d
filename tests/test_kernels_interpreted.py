"""The Triton kernels (score collection, raw and soft-capped; Quest page bounds) against their
PyTorch references on the CPU, run by Triton's interpreter (``TRITON_INTERPRET=1``), for every
head shape of :data:`tests.kernel_cases.HEAD_SHAPES`; and the kernels' block choices and shape
errors.

The interpreter is chosen when a kernel is defined, so the kernels run in one subprocess that
checks every shape and reports each one (small contexts keep it to seconds)."""

from __future__ import annotations


import pytest
import torch

from tests.kernel_cases import HEAD_SHAPES, run_interpreted, shape_id
from vegas.config import VegasConfigError


_CHILD = r"""
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
from tests.kernel_cases import HEAD_SHAPES, check_quest_kernel, check_score_kernel, shape_id
out = {}
for shape in HEAD_SHAPES:
    for kind, check in (("score", lambda s: check_score_kernel("cpu", s, [37, 5, 70, 0])),
                        ("capped", lambda s: check_score_kernel("cpu", s, [37, 5, 70, 0], softcap=1.5)),
                        ("quest", lambda s: check_quest_kernel("cpu", s, 12))):
        try:
            check(shape)
            out[f"{kind}:{shape_id(shape)}"] = "ok"
        except Exception:
            out[f"{kind}:{shape_id(shape)}"] = traceback.format_exc()[-2000:]
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    """``{"score:<shape>" | "quest:<shape>": "ok" or the traceback}`` from one interpreter run."""
    return run_interpreted(_CHILD)


@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=shape_id)
def test_score_kernel_matches_reference_interpreted(interpreted, shape):
    assert interpreted[f"score:{shape_id(shape)}"] == "ok", interpreted[f"score:{shape_id(shape)}"]


@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=shape_id)
def test_soft_capped_score_kernel_matches_reference_interpreted(interpreted, shape):
    """Gemma 2's ``logits_soft_cap``: capped per query row and head, then weighted and summed."""
    assert interpreted[f"capped:{shape_id(shape)}"] == "ok", interpreted[f"capped:{shape_id(shape)}"]


@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=shape_id)
def test_quest_kernel_matches_reference_interpreted(interpreted, shape):
    assert interpreted[f"quest:{shape_id(shape)}"] == "ok", interpreted[f"quest:{shape_id(shape)}"]


def test_common_rows_keep_the_unmasked_tuned_chunks():
    """8 x 128 and 2 x 64 are read as before (256- and 128-element chunks, no mask); other
    shapes take the widest exact chunk of at least 64 elements, else a masked padded one."""
    triton_score = pytest.importorskip("vegas.kernels.triton_score")
    chunks = triton_score.row_chunks
    assert chunks(8 * 128) == (256, True) and chunks(2 * 64) == (128, True)
    assert chunks(3 * 64) == (64, True) and chunks(32 * 128) == (256, True) and chunks(8 * 80) == (128, True)
    assert chunks(80) == (128, False) and chunks(5 * 80) == (256, False) and chunks(96) == (128, False)
    with pytest.raises(VegasConfigError, match="num_kv_heads \\* head_dim"):
        chunks(0)


def test_quest_blocks_read_long_rows_in_chunks():
    triton_quest = pytest.importorskip("vegas.kernels.triton_quest")
    blocks = triton_quest.quest_blocks
    assert blocks(2 * 64) == (128, 128, 32) and blocks(8 * 128) == (1024, 1024, 4)  # as before: one chunk
    assert blocks(3 * 64) == (256, 256, 16) and blocks(32 * 128) == (4096, 1024, 4)
    with pytest.raises(VegasConfigError, match="block_p"):
        blocks(128, 3)


def test_uneven_head_groups_are_refused_by_name():
    """9 query heads cannot share 2 KV heads: the reference, the Quest grouping and the Triton
    wrapper (before any launch) name both counts."""
    from vegas.kernels import collect_scores_reference
    from vegas.kernels.quest_pages import group_query

    q = torch.zeros(1, 2, 9, 64)
    keys = torch.zeros(4, 16, 2, 64)
    bt = torch.zeros(1, 4, dtype=torch.int32)
    ctx = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(VegasConfigError, match=r"num_q_heads \(9\) must be a multiple of num_kv_heads \(2\)"):
        collect_scores_reference(q, keys, bt, ctx, 10)
    with pytest.raises(VegasConfigError, match="num_q_heads"):
        group_query(q[0], 2)
    with pytest.raises(VegasConfigError, match="head_dim"):
        collect_scores_reference(q, torch.zeros(4, 16, 3, 32), bt, ctx, 10)
    triton_score = pytest.importorskip("vegas.kernels.triton_score")
    with pytest.raises(VegasConfigError, match="num_q_heads"):
        triton_score.collect_scores_layers_triton(q[None], torch.ones(1, 2), [keys], bt, ctx, 10)
    hnd = torch.zeros(4, 3, 16, 64).transpose(1, 2)  # (blocks, block_size, heads, dim), heads apart
    with pytest.raises(VegasConfigError, match="contiguous token rows"):
        triton_score.collect_scores_layers_triton(torch.zeros(1, 1, 2, 9, 64), torch.ones(1, 2), [hnd], bt, ctx, 10)
