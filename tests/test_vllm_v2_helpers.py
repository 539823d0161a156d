"""CPU tests of the V2-runner speculator's tensor helpers and of its vLLM patches (fake vLLM modules)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vegas.vllm_plugin.drafting.engine import DraftBuffers, bucket_rows, draft_slots
from vegas.vllm_plugin.runners.v2_helpers import (
    acceptance_counts,
    draft_noise_positions,
    one_hot_draft_logits,
    step_inputs,
)

I32 = torch.int32


def test_step_inputs_map_slots_and_place_the_last_sampled_token():
    # batch rows 0..3 -> request slots 5, 2, 7, 0 (V2 sorts the batch every step)
    idx = torch.tensor([5, 2, 7, 0], dtype=I32)
    last_sampled = torch.arange(100, 108, dtype=I32)  # token of slot s: 100 + s
    # row 0: γ=4 drafts, 2 accepted -> 3 sampled, 2 rejected; row 1: all 4 accepted (+ bonus);
    # row 2: last chunk of a prefill (1 logit, 1 sampled); row 3: a partial prefill chunk
    num_sampled = torch.tensor([3, 5, 1, 0], dtype=I32)
    num_rejected = torch.tensor([2, 0, 0, 0], dtype=I32)
    seq_lens = torch.tensor([40, 30, 17, 64, 99], dtype=I32)  # one padded row past the batch
    nblocks = torch.tensor([3, 2, 2, 4], dtype=I32)
    active, token, pos0, nb = step_inputs(num_sampled, num_rejected, seq_lens, idx, last_sampled, nblocks)
    assert active.tolist() == [1, 1, 1, 0]
    assert token.tolist() == [105, 102, 107, 0]
    # verified chunk [35, 40): query 35 + 3 sampled -> the last sampled token is at 38
    assert pos0.tolist() == [38, 30, 17, 0]
    assert nb.tolist() == [3, 2, 2, 4]
    assert step_inputs(num_sampled, num_rejected, seq_lens, idx, last_sampled, nblocks).dtype == torch.int64
    # vLLM 0.24.0 keeps last_sampled_tokens as [max_num_reqs, 1] int64 (seen on the H200: the 1-D
    # assumption broke the first propose)
    column = last_sampled.long()[:, None]
    assert torch.equal(step_inputs(num_sampled, num_rejected, seq_lens, idx, column, nblocks)[1], token)


def test_step_inputs_agree_with_the_v1_async_positions():
    from vegas.vllm_plugin.async_sched import draft_start_positions

    seq_lens = torch.tensor([50, 21], dtype=I32)
    num_draft = torch.tensor([4, 4])
    counts = torch.tensor([1, 5], dtype=I32)  # sampled tokens
    num_rejected = (num_draft + 1 - counts).to(I32)  # V2: logits - sampled
    idx = torch.tensor([0, 1], dtype=I32)
    _, _, pos0, _ = step_inputs(counts, num_rejected, seq_lens, idx, torch.zeros(2, dtype=I32), torch.ones(2))
    assert pos0.tolist() == draft_start_positions(seq_lens, num_draft, counts).tolist()


def test_draft_buffers_fill_sends_padding_to_the_scratch_slot_and_views_share_memory():
    shared = DraftBuffers.allocate(8, 4, 11, True, "cpu")
    bufs = shared.view(4)
    shared.step_inputs.fill_(5)  # what an earlier, larger batch left behind
    bufs.fill(3, torch.ones((4, 3), dtype=torch.int64), temperature=torch.tensor([0.5, 0.0, 2.0]),
              slots=torch.tensor([3, 1, 2], dtype=I32), scratch=16)
    assert bufs.slots.tolist() == [3, 1, 2, 16] and bufs.temperature.tolist() == [0.5, 0.0, 2.0, 1.0]
    assert bufs.step_inputs[:, 3].tolist() == [0, 0, 0, 0]  # the padded row is inactive
    assert shared.step_inputs[0, :4].tolist() == [1, 1, 1, 0]  # a view, not a copy
    assert bufs.probs.shape == (4, 4, 11) and bufs.slot_mapping.shape[0] >= 1024
    assert bufs.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        bufs.fill(5, torch.ones((4, 5), dtype=torch.int64))  # more requests than rows


def test_draft_slots_write_only_into_owned_blocks():
    bs = 16
    bt = torch.tensor([[7, 9, 11, 13], [4, 99, 98, 97]], dtype=I32)  # row 1 owns 1 block; the rest is stale
    nblocks = torch.tensor([3, 1])
    active = torch.tensor([True, True])
    s = draft_slots(torch.tensor([17, 15]), active, nblocks, bt, bs, max_model_len=64)
    assert s.tolist() == [9 * bs + 1, 4 * bs + 15]
    # row 1's next position falls into a block it does not own; row 0 reaches max_model_len
    s = draft_slots(torch.tensor([64, 16]), active, nblocks, bt, bs, max_model_len=64)
    assert s.tolist() == [-1, -1]
    s = draft_slots(torch.tensor([17, 3]), torch.tensor([False, True]), nblocks, bt, bs, max_model_len=64)
    assert s.tolist() == [-1, 4 * bs + 3]
    # positions past the table width are clamped for the gather and never written
    s = draft_slots(torch.tensor([10_000, 0]), active, torch.tensor([1000, 1]), bt, bs, max_model_len=20_000)
    assert s.tolist() == [-1, 4 * bs]


def test_draft_noise_counters_are_disjoint_from_the_targets():
    pos = torch.arange(0, 4096)
    noise = draft_noise_positions(pos, 4096)
    assert noise.dtype == torch.int64 and int(noise.min()) >= 4096
    assert noise.tolist() == (pos + 4096).tolist()


def test_one_hot_draft_logits_touch_only_the_given_slots():
    logits = torch.randn(5, 3, 11)
    before = logits.clone()
    one_hot_draft_logits(logits, torch.tensor([1, 3], dtype=I32))
    q = torch.softmax(logits[[1, 3]], dim=-1)
    assert torch.equal(q[..., 0], torch.ones(2, 3)) and float(q[..., 1:].abs().sum()) == 0.0
    assert torch.equal(logits[[0, 2, 4]], before[[0, 2, 4]])


def test_acceptance_counts_count_rows_that_verified_drafts():
    # rows: 4 drafts (5 logits) 3 sampled; a prefill (1 logit); 4 drafts all accepted (5 sampled)
    cu = torch.tensor([0, 5, 6, 11], dtype=I32)
    counts = acceptance_counts(torch.tensor([3, 1, 5], dtype=I32), cu)
    assert counts.tolist() == [2, 8]


@pytest.mark.parametrize("n,cap,graph_max,rows", [
    (1, 256, 256, 1), (3, 256, 256, 4), (8, 256, 256, 8), (9, 256, 256, 16), (40, 256, 256, 40),
    (41, 256, 256, 48), (128, 256, 256, 128), (129, 256, 256, 136), (129, 132, 256, 132),
    (201, 200, 256, None), (257, 512, 512, 272), (300, 512, 256, None),
])
def test_bucket_rows(n, cap, graph_max, rows):
    assert bucket_rows(n, cap, graph_max) == rows


def test_bucket_rows_pad_at_most_a_step_and_give_few_graphs():
    sizes = {bucket_rows(n, 64, 256) for n in range(1, 65)}
    assert sizes == {1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64}  # the graphs captured for max_num_seqs 64
    assert all(bucket_rows(n, 512, 512) - n < (8 if n <= 256 else 16) for n in range(9, 513))


# ---- the vLLM patches, against fake vLLM modules ---------------------------------------------
def _fake_vllm(monkeypatch, unsupported_features, init_speculator):
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.24.0"
    config = types.ModuleType("vllm.config")
    config.VllmConfig = type("VllmConfig", (), {"_get_v2_model_runner_unsupported_features": unsupported_features})
    spec_decode = types.ModuleType("vllm.v1.worker.gpu.spec_decode")
    spec_decode.init_speculator = init_speculator
    for name in ("vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.v1.worker.gpu"].spec_decode = spec_decode
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    monkeypatch.setitem(sys.modules, "vllm.config.vllm", config)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.spec_decode", spec_decode)
    return config.VllmConfig, spec_decode


def _cfg(VllmConfig, model="vegas.vllm_plugin.proposer.VegasProposer"):
    c = VllmConfig()
    c.speculative_config = types.SimpleNamespace(method="custom_class", model=model)
    return c


def test_unsupported_check_lets_vegas_through_to_v2(monkeypatch):
    from vegas.vllm_plugin import patches

    def feats(self):
        return ["speculative method 'custom_class'", "dual batch overlap"]

    VllmConfig, _ = _fake_vllm(monkeypatch, feats, lambda vllm_config, device: None)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    patches.patch_v2_unsupported_check()
    wrapper = VllmConfig._get_v2_model_runner_unsupported_features
    patches.patch_v2_unsupported_check()  # idempotent: one wrapper
    assert VllmConfig._get_v2_model_runner_unsupported_features is wrapper and wrapper._vegas
    vegas, other = _cfg(VllmConfig), _cfg(VllmConfig, model="mypkg.Proposer")
    # default: the runner vLLM picks, so Vegas no longer counts as unsupported on V2
    assert vegas._get_v2_model_runner_unsupported_features() == ["dual batch overlap"]
    assert len(other._get_v2_model_runner_unsupported_features()) == 2
    # VLLM_USE_V2_MODEL_RUNNER, set, decides before vLLM asks: the wrapper reads no environment
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert vegas._get_v2_model_runner_unsupported_features() == ["dual batch overlap"]


def test_init_speculator_passes_other_engines_through(monkeypatch):
    from vegas.vllm_plugin import patches

    sentinel = object()
    VllmConfig, spec_decode = _fake_vllm(monkeypatch, lambda self: [], lambda vllm_config, device: sentinel)
    built = object()
    patches.patch_v2_init_speculator(lambda vllm_config, device: built)
    wrapper = spec_decode.init_speculator
    patches.patch_v2_init_speculator(lambda vllm_config, device: None)  # idempotent
    assert spec_decode.init_speculator is wrapper and wrapper._vegas
    assert wrapper(_cfg(VllmConfig, model="mypkg.Proposer"), "cpu") is sentinel
    assert wrapper(_cfg(VllmConfig), "cpu") is built  # the Vegas engine gets the builder's speculator


def test_rows_that_draft_counts_rows_that_sample_a_token():
    from types import SimpleNamespace

    import numpy as np

    from vegas.vllm_plugin.runners.v2_helpers import rows_that_draft

    def batch(scheduled, computed, prompt):
        return SimpleNamespace(num_reqs=len(scheduled), num_scheduled_tokens=np.array(scheduled),
                               num_computed_prefill_tokens_np=np.array(computed), prefill_len_np=np.array(prompt))

    # a decoding row, a row whose last prompt chunk runs now, a row still mid-prefill afterwards
    assert rows_that_draft(batch([5, 100, 8192], [600, 900, 0], [600, 1000, 9000])) == 2
    assert rows_that_draft(batch([8192, 8192], [0, 8192], [20000, 20000])) == 0  # prefill-only step: no draft phase
    assert rows_that_draft(batch([1], [10], [10])) == 1
