"""The CuTe probe kernel (:mod:`vegas.kernels.cute_probe`, ``vllm.score_path="cute"``, issue 22) on an
H200, skipped without CUDA, vLLM 0.24 or the CuTe DSL (``scripts/cute_dsl_bundle.sh``).

Kernel (:func:`~vegas.kernels.cute_probe.probe_attention`): on random paged inputs (Qwen3-8B-like
32 q / 8 kv x 128, G = 4, and SmolLM2-like 9 q / 3 kv x 64, G = 3; chunks of 5, a padded request
with an empty chunk and a one-query chunk, contexts up to 40K; unsplit, vLLM's split heuristic, 7
splits and a split count that leaves the last split empty) its output is bitwise the plain CuTe
kernel's on the unpacked batch, its stored scores are the reference within fp32 rounding of the
hi/lo probe, nothing is stored past a request's context but the last column pair's partner, the
KV-head sums equal the separate score kernel's and select the same top-k, the result is bitwise
reproducible and replays from a CUDA graph.

Engine: vLLM greedy with ``score_path="cute"`` (V2 runner, full CUDA graphs) equals plain vLLM
greedy up to bf16 near-ties and its stats say ``score_path == "cute"``: on the embedded SmolLM2
(head_dim 64) and on a tiny random Qwen3 with head_dim 128, G = 4.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_fa3_scores_cuda import _separate
from tests.verify_cases import assert_replays_from_a_cuda_graph, assert_same_scores, kernel_or_skip, plan_rows, rel_err, verify_batch

GAMMA = 4
#: Qwen3-8B and SmolLM2 heads
SHAPES = [(32, 8, 128), (9, 3, 64)]
#: verification chunks of γ + 1 queries; contexts up to 40K
CHUNKS, CTXS = [5, 5, 5, 5, 5], [1000, 17, 4096, 300, 40000]


def _cute():
    return kernel_or_skip("vegas.kernels.cute_probe")


def _rows(b, mode):
    """``(q_idx, q_weight, ctx_sel)`` of the selector the mode serves (collect2 / last_token)."""
    q_idx, q_weight, ctx_sel = plan_rows(b["cu_seqlens_q"], b["seq_lens"], GAMMA, "collect2")
    if mode == "first":
        q_idx, q_weight = q_idx[:, :1].contiguous(), q_weight[:, :1].contiguous()
    return q_idx, q_weight, ctx_sel


def _batch(chunks, ctxs, shape):
    """:func:`verify_batch` in bf16 on the GPU, no padding tokens, with its ``max_len`` (host int)."""
    b = verify_batch(chunks, ctxs, shape, dtype=torch.bfloat16, device="cuda", pad_tokens=0)
    b["max_len"] = max(c + n for c, n in zip(ctxs, chunks))
    return b


def _probe(cr, b, num_splits, mode="edges", ws=None, out=None):
    """The probe kernel into a NaN-filled score buffer (what it leaves unstored stays NaN); no host
    sync (a CUDA-graph capture calls it)."""
    n, hkv = b["block_table"].shape[0], b["k_cache"].shape[2]
    max_len = b["max_len"]
    ws = torch.full((n, hkv, cr.padded_len(max_len)), float("nan"), device="cuda") if ws is None else ws
    out = torch.empty_like(b["q"]) if out is None else out
    cr.probe_attention(b["q"], b["k_cache"], b["v_cache"], out, ws, b["cu_seqlens_q"], b["seq_lens"],
                       b["max_seqlen_q"], max_len, b["block_table"], b["scale"], num_splits=num_splits, mode=mode)
    return out, ws


def _plain_cute(cr, b, num_splits):
    from vllm.vllm_flash_attn.cute.interface import _flash_attn_fwd

    out = torch.empty_like(b["q"])
    _flash_attn_fwd(b["q"], b["k_cache"], b["v_cache"], cu_seqlens_q=b["cu_seqlens_q"], seqused_k=b["seq_lens"],
                    max_seqlen_q=b["max_seqlen_q"], max_seqlen_k=int(b["seq_lens"].max()),
                    page_table=b["block_table"], softmax_scale=b["scale"], causal=True, num_splits=num_splits,
                    out=out, tile_mn=cr.SCORE_TILE)
    return out


@pytest.mark.parametrize("mode", ["edges", "first"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
@pytest.mark.parametrize("num_splits", [0, 1, 7, "empty"])
def test_probe_scores_are_the_separate_kernels_and_output_is_plain_cutes(shape, num_splits, mode):
    cr = _cute()
    from vegas.kernels.triton_score_reduce import reduce_head_scores

    chunks, ctxs = CHUNKS + [0, 1], CTXS + [500, 3001]  # a padded request, a one-query chunk
    b = _batch(chunks, ctxs, shape)
    n, max_len = len(chunks), b["max_len"]
    if num_splits == "empty":
        num_splits = cr.empty_split_count(-(-max_len // cr.SCORE_TILE[1]))
    out, ws = _probe(cr, b, num_splits, mode)
    assert torch.equal(out, _plain_cute(cr, b, num_splits))  # the chunk's rows attend as without the probes
    q_idx, q_weight, ctx_sel = _rows(b, mode)
    ref = torch.zeros_like(ws)
    for s, (c, ctx) in enumerate(zip(chunks, ctxs)):
        if c == 0:
            assert ws[s].isnan().all()  # an empty chunk stores nothing
            continue
        assert not ws[s, :, :ctx].isnan().any() and ws[s, :, ctx + 1 :].isnan().all()  # ctx: a pair's partner
        start = int(b["cu_seqlens_q"][s])
        ref[s] = cr.reference_scores(b["q"][start:], b["k_cache"], b["block_table"][s : s + 1],
                                     torch.zeros(1, dtype=torch.int32, device="cuda"), b["seq_lens"][s : s + 1], c,
                                     b["scale"], ws.shape[-1], mode)[0]
        assert rel_err(ws[s, :, :ctx], ref[s, :, :ctx]) < 1e-4  # the hi/lo probe: ~16 mantissa bits
    scores = torch.empty(n, max_len, device="cuda")
    reduce_head_scores(ws.permute(1, 0, 2), scores, b["cu_seqlens_q"], ctx_sel)
    want = _separate(b, q_idx, q_weight, ctx_sel, max_len)
    if mode == "edges":  # the separate kernel's collect2 row of a one-query chunk counts it once
        want[-1] *= 2
    assert scores[-2, :500].eq(0).all()  # the padded request: zero before its ctx_sel (the reduce's rule)
    keep = torch.tensor([c > 0 for c in chunks], device="cuda")
    assert_same_scores(scores[keep], want[keep], b["block_table"][keep], ctx_sel[keep])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
def test_probe_is_deterministic_and_replays_from_a_cuda_graph(shape):
    cr = _cute()
    b = _batch(CHUNKS, CTXS, shape)
    first_out, first_ws = _probe(cr, b, 0)
    for _ in range(5):
        out, ws = _probe(cr, b, 0)
        assert torch.equal(out, first_out) and torch.equal(ws.nan_to_num(), first_ws.nan_to_num())
    ws.zero_()  # what a replay does not store stays as it is
    _probe(cr, b, 0, ws=ws, out=out)
    assert_replays_from_a_cuda_graph(lambda: _probe(cr, b, 0, ws=ws, out=out), out, ws)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
def test_padding_tokens_after_the_last_chunk(shape):
    """A captured batch's query tensor has tokens past ``cu_seqlens_q[-1]``: the chunk rows still
    attend as the plain kernel's, the scores are unchanged, and nothing faults."""
    cr = _cute()
    b = verify_batch(CHUNKS, CTXS, shape, dtype=torch.bfloat16, device="cuda", pad_tokens=3)
    b["max_len"] = max(c + n for c, n in zip(CTXS, CHUNKS))
    out, ws = _probe(cr, b, 0)
    torch.cuda.synchronize()
    real = sum(CHUNKS)
    assert torch.equal(out[:real], _plain_cute(cr, b, 0)[:real])
    _, ws_unpadded = _probe(cr, _batch(CHUNKS, CTXS, shape), 0)
    assert torch.equal(ws.nan_to_num(), ws_unpadded.nan_to_num())


def test_warm_up_compiles_the_engine_variants():
    """After :func:`warm_up`, calls of other batch sizes and split counts compile nothing more."""
    cr = _cute()
    cr.warm_up(32, 8, 128, torch.bfloat16, 16, "cuda")
    assert cr.is_warm(32, 8, 128, torch.bfloat16, 16) and not cr.is_warm(32, 8, 128, torch.float16, 16)
    compiled = len(cr._CACHE), _pack_compiles()
    b = _batch(CHUNKS, CTXS, (32, 8, 128))
    for splits in (0, 7):
        _probe(cr, b, splits)
    torch.cuda.synchronize()
    assert (len(cr._CACHE), _pack_compiles()) == compiled


def _pack_compiles() -> int:
    """Variants of the probe packing kernel Triton compiled on this GPU (its per-device kernel cache)."""
    from vegas.kernels.probe_queries import _pack_kernel

    caches = getattr(_pack_kernel, "device_caches", None)
    device = torch.cuda.current_device()
    if caches is None or device not in caches:
        return 0
    return len(caches[device][0])


# -- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_smollm2():
    _cute()
    pytest.importorskip("vllm")
    from tests.gpu.test_vllm_backend_cuda import TP1, _plain_reference

    return _plain_reference(TP1)


def test_vllm_cute_score_path_keeps_greedy_equal(plain_smollm2, monkeypatch):
    """The embedded SmolLM2 (9 q / 3 kv x 64) on the V2 runner with full CUDA graphs: the
    verification scores come from the probe kernel, greedy equals plain up to bf16 near-ties."""
    from tests.gpu.test_vllm_backend_cuda import _assert_equal_up_to_ties
    from tests.gpu.test_vllm_v2 import _vegas_v2

    prompts, sp, plain = plain_smollm2
    vegas, stats = _vegas_v2(monkeypatch, "collect2", prompts, sp, score_path="cute")
    assert stats["score_path"] == "cute", stats
    assert stats["full_cuda_graphs"] and not stats["graph_failed"], stats
    assert stats["proposals"] > 0 and stats["acceptance_length"] > 1.0, stats
    _assert_equal_up_to_ties(plain, vegas)


@pytest.mark.parametrize("selector", ["collect2", "last_token"])
def test_vllm_cute_score_path_on_a_head_dim_128_model(tmp_path_factory, monkeypatch, selector):
    """A tiny random Qwen3 with Qwen3-8B's attention shape per KV head (head_dim 128, G = 4): greedy
    with ``score_path="cute"`` equals plain vLLM greedy up to bf16 near-ties, and the stats say
    the probe kernel ran."""
    _cute()
    pytest.importorskip("vllm")
    import transformers

    from tests.gpu.test_vllm_backend_cuda import _assert_equal_up_to_ties, _generate, tiny_random_case
    from vegas.backends.vllm import vllm_engine_kwargs
    from vegas.config import VegasConfig
    from vegas.vllm_plugin import register
    from vegas.vllm_plugin.settings import settings_json

    config = transformers.Qwen3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    path, prompts, sp, kw = tiny_random_case(tmp_path_factory, "qwen3", config)
    register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    plain, _ = _generate(vllm_engine_kwargs(str(path), **kw), prompts, sp)
    settings = settings_json(selector, VegasConfig(min_kv_budget=64, vllm={"score_path": "cute"}))
    vegas, stats = _generate(vllm_engine_kwargs(str(path), num_draft_tokens=4, settings=settings, **kw), prompts, sp)
    assert stats["score_path"] == "cute" and stats["proposals"] > 0 and not stats["graph_failed"], stats
    _assert_equal_up_to_ties(plain, vegas)
