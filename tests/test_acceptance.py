"""Acceptance maths: greedy prefix rule and speculative rejection sampling."""

import torch
from scipy.stats import chisquare

from vegas.acceptance import greedy_accept, speculative_sampling


def one_hot_logits(tokens, vocab=5):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_greedy_accept_prefix_correction_and_bonus():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 2, 3]])
    target = torch.stack([
        one_hot_logits([1, 2, 3, 4]),  # all accepted, bonus 4
        one_hot_logits([1, 0, 3, 4]),  # reject at d_2: correction 0 (d_3 matching doesn't count)
        one_hot_logits([0, 2, 3, 4]),  # reject at d_1
    ])
    n, nxt = greedy_accept(drafts, target)
    assert n.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 0, 0]


def expected(probs, total):
    probs = probs.double()
    return (probs / probs.sum() * total).numpy()


def _emitted(draft_probs, target_probs, batch, seed):
    """Run speculative sampling on ``batch`` copies; return the first two emitted tokens."""
    g = torch.Generator().manual_seed(seed)
    gamma = draft_probs.shape[0]
    q = draft_probs.expand(batch, -1, -1)
    p = target_probs.expand(batch, -1, -1)
    drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=g).view(batch, gamma)
    n, nxt = speculative_sampling(drafts, q, p, g)
    seq = torch.cat([drafts, torch.zeros(batch, 1, dtype=torch.long)], dim=1)
    seq[torch.arange(batch), n] = nxt
    return seq[:, 0], seq[:, 1], n


def test_speculative_sampling_keeps_the_target_distribution():
    # γ = 2 over a 4-token vocabulary; the target's second step does not depend on the first
    # token here (p is given per position), so each emitted position must follow p exactly.
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.4, 0.3, 0.2, 0.1]])
    batch = 200_000
    first, second, n = _emitted(q, p, batch, seed=0)
    for tokens, probs in ((first, p[0]), (second[n >= 1], p[1])):
        counts = torch.bincount(tokens, minlength=4).double()
        stat = chisquare(counts.numpy(), expected(probs, counts.sum()))
        assert stat.pvalue > 1e-3, (counts / counts.sum(), probs)
    # and the acceptance rate of d_1 is Σ min(p, q) (Leviathan et al. 2023, §3.3)
    assert abs((n >= 1).double().mean() - torch.minimum(p[0], q[0]).sum()) < 0.01


def test_speculative_sampling_detects_a_wrong_rule():
    # The same test must fail for a naive rule that always accepts drafts: guards the test.
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25] * 4])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4]])
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.expand(50_000, -1), 1, generator=g)
    counts = torch.bincount(drafts.squeeze(1), minlength=4).double()
    assert chisquare(counts.numpy(), expected(p[0], counts.sum())).pvalue < 1e-6


def test_identical_distributions_accept_everything():
    p = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    _, _, n = _emitted(p[:2], p, 1000, seed=3)
    assert (n == 2).all()


def test_a_zero_probability_draft_is_never_accepted(monkeypatch):
    """r = 0.0 exactly (torch.rand can return it) must not accept a token the target gives p = 0."""
    draft = torch.tensor([[2]])
    q = torch.tensor([[[0.0, 0.2, 0.8, 0.0]]])
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25] * 4]])
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros_like(real_rand(*a, **k)))
    num_accepted, next_tokens = speculative_sampling(draft, q, p)
    assert num_accepted.tolist() == [0]
    assert next_tokens.item() in (0, 1)  # resampled from max(0, p - q), never token 2
