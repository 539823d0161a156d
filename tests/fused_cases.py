"""Shared cases of the fused verification kernel tests (issue 14): a verification batch over a
paged cache in vLLM's layout, the scored rows as the vLLM plan picks them, and the check of the
Triton kernel against the PyTorch references, run on a GPU (``tests/gpu/test_fused_verify_cuda.py``)
and on the CPU under Triton's interpreter (``tests/test_fused_verify_interpreted.py``)."""

from __future__ import annotations

import torch

#: (num_q_heads, num_kv_heads, head_dim) the interpreter checks: SmolLM2 (3 x 64, ratio 3),
#: Qwen3-8B (8 x 128, ratio 4), MQA with a padded head dim, ratio 2 with head_dim 96, and 256
FUSED_SHAPES = [(9, 3, 64), (32, 8, 128), (8, 1, 80), (6, 3, 96), (4, 2, 256)]


def verify_batch(chunks, ctxs, shape, block_size=16, dtype=torch.float32, device="cpu", seed=0, pad_tokens=3):
    """A verification batch: request ``s`` has ``ctxs[s]`` cached positions before a chunk of
    ``chunks[s]`` queries (so ``seq_lens = ctxs + chunks``), keys and values in one
    ``[num_blocks, 2, block_size, kv_heads, head_dim]`` cache with shuffled blocks, and
    ``pad_tokens`` padding queries after the last request (as a captured batch has).

    Returns a dict: ``q``, ``k_cache``, ``v_cache``, ``block_table``, ``cu_seqlens_q``,
    ``seq_lens``, ``max_seqlen_q``, ``scale``."""
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctxs, chunks)]
    per_seq = [(n + block_size - 1) // block_size + 1 for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(chunks), max(per_seq), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(per_seq):
        block_table[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    kv = torch.randn(num_blocks, 2, block_size, hkv, d, generator=g).to(dtype).to(device)
    k_cache, v_cache = kv.unbind(1)
    cu = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + pad_tokens, hq, d, generator=g).to(dtype).to(device)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table.to(device), cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), max_seqlen_q=max(chunks),
        scale=d**-0.5,
    )


def plan_rows(cu_seqlens_q, seq_lens, gamma, selector):
    """``(q_idx, q_weight, ctx_sel)`` as :func:`vegas.vllm_plugin.selection.state.make_plan` builds them:
    the scored rows are among the last ``γ + 1`` tokens of each chunk (collect2: the first and
    last of them; aggregated: all of them) and ``ctx_sel`` is the position of the first."""
    n = seq_lens.shape[0]
    start, end = cu_seqlens_q[:n].long(), cu_seqlens_q[1 : n + 1].long()
    first = torch.maximum(start, end - 1 - gamma)
    ctx_sel = torch.clamp(seq_lens.long() - (end - first), min=0)
    if selector == "collect2":
        q_idx = torch.stack([first, end - 1], dim=1)
        q_weight = torch.ones(q_idx.shape, dtype=torch.float32, device=q_idx.device)
        q_weight[:, 1] = (end - 1 > first).float()
    else:
        raw = first[:, None] + torch.arange(gamma + 1, device=first.device)[None, :]
        q_weight = (raw <= (end - 1)[:, None]).float()
        q_idx = torch.minimum(raw, (end - 1)[:, None])
    return q_idx, q_weight, ctx_sel


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def check_fused(device, shape, chunks, ctxs, gamma=4, selector="collect2", num_splits=1, dtype=torch.float32,
                out_tol=1e-4, layers=3, layer=1, **kwargs):
    """The fused kernel against :func:`~vegas.kernels.fused_reference.fused_verify_reference`
    (output and scores) and the scores against today's separate score path's reference
    (:func:`vegas.kernels.collect_scores_layers_reference` of the gathered rows). The scores go to
    row ``layer`` of an ``(layers, num_seqs, max_len)`` buffer poisoned with NaN; padding tokens'
    output must stay untouched. Returns ``(out_err, score_err)``."""
    from vegas.kernels import collect_scores_layers_reference
    from vegas.kernels.fused_reference import fused_verify_reference
    from vegas.kernels.triton_fused_verify import fused_verify_attention

    b = verify_batch(chunks, ctxs, shape, dtype=dtype, device=device, seed=sum(shape) + len(chunks))
    q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], gamma, selector)
    num_seqs = len(chunks)
    max_len = int(b["seq_lens"].max()) + 7
    scores_all = torch.full((layers, num_seqs, max_len), float("nan"), device=device)
    out = torch.full_like(b["q"], 7.0)
    fused_verify_attention(
        b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["cu_seqlens_q"], b["seq_lens"], b["max_seqlen_q"],
        b["scale"], out=out, scores=scores_all[layer], q_idx=q_idx, q_weight=q_weight, ctx_sel=ctx_sel,
        score_span=gamma + 1, num_splits=num_splits, **kwargs,
    )
    want_out, want_sc = fused_verify_reference(
        b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["cu_seqlens_q"], b["seq_lens"], b["scale"],
        q_idx, q_weight, ctx_sel, max_len,
    )
    n_tok = int(b["cu_seqlens_q"][-1])
    assert torch.equal(out[n_tok:], torch.full_like(out[n_tok:], 7.0)), "padding tokens were written"
    assert not torch.isnan(out[:n_tok]).any()
    out_err = rel_err(out[:n_tok], want_out[:n_tok])
    assert out_err < out_tol, ("output", out_err)
    sc = scores_all[layer]
    assert torch.isnan(scores_all[:layer]).all() and torch.isnan(scores_all[layer + 1 :]).all(), "other layers written"
    assert not torch.isnan(sc).any()
    finite = torch.isfinite(want_sc)
    assert torch.equal(torch.isfinite(sc), finite)
    assert (sc[~finite] == float("-inf")).all()
    score_err = rel_err(sc[finite], want_sc[finite])
    assert score_err < 1e-4, ("scores", score_err)
    rows = b["q"][q_idx.reshape(-1)].view(1, num_seqs, q_idx.shape[1], *b["q"].shape[1:])
    separate = collect_scores_layers_reference(
        rows.double(), q_weight.double(), [b["k_cache"].double()], b["block_table"], ctx_sel, max_len, b["scale"]
    )[0]
    nonempty = (b["cu_seqlens_q"][1:] > b["cu_seqlens_q"][:-1])[:, None] & finite
    assert torch.equal(torch.isfinite(separate), finite)
    assert rel_err(sc[nonempty], separate[nonempty]) < 1e-4
    return out_err, score_err
