"""Speculative sampling on the real model keeps the target's next-token distribution."""

import torch
from scipy.stats import chisquare

from vegas import VegasConfig
from vegas.sampling import SamplingParams


def test_first_token_follows_target_distribution(pipe, click_ids):
    prompt = click_ids[5000:5016]
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    with torch.inference_mode():
        logits = pipe.backend.model(torch.tensor([prompt])).logits[0, -1]
    p = sampling.probs(logits).double()  # the target distribution of the first new token

    batch = 1500
    # A tiny budget without a recent window: the draft distribution differs from the target.
    config = VegasConfig(num_draft_tokens=2, kv_budget=2, recent_window=0, num_sinks=0)
    outputs = pipe.backend.generate([prompt] * batch, max_new_tokens=1, sampling=sampling,
                                    selector="sliding_window", config=config)
    first = torch.tensor([o.token_ids[0] for o in outputs])
    accepted = sum(o.stats.num_accepted for o in outputs) / batch
    assert accepted < 1.8, "drafts must be rejected sometimes for the test to mean anything"

    top = torch.argsort(p, descending=True)[:6]
    counts = torch.stack([(first == t).sum() for t in top] + [(~torch.isin(first, top)).sum()]).double()
    probs = torch.cat([p[top], (1 - p[top].sum()).clamp_min(0).view(1)])
    keep = probs * batch >= 5  # chi-square needs expected counts >= 5
    observed, expected = counts[keep], probs[keep]
    expected = expected / expected.sum() * observed.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
