"""Stopping: every EOS id of the model ends a sequence, and a finished sequence leaves the batch."""

import pytest

from vegas.backends import hf


def _eos_after(outputs, row, n):
    """A token that row ``row`` emits first at index ``n`` and that no other row emits."""
    others = {t for i, out in enumerate(outputs) if i != row for t in out}
    for i in range(n, len(outputs[row])):
        token = outputs[row][i]
        if token not in outputs[row][:i] and token not in others:
            return i, token
    pytest.skip("no token unique to one row in this output")


@pytest.mark.parametrize("selector", [None, "quest"])  # quest: a selector with per-sequence state
def test_one_row_stops_on_eos_while_the_others_go_on(pipe, code_prompts, click_ids, monkeypatch, selector):
    prompts = [click_ids[20000:20400], click_ids[5000:5300], click_ids[60000:60350]]
    plain = [o.token_ids for o in pipe.generate(prompts, max_new_tokens=24, selector=None)]
    stop_at, eos = _eos_after(plain, 0, 3)

    batch_sizes = []
    real_verify = hf.HFSession.verify

    def spy_verify(self, draft_tokens):
        batch_sizes.append(draft_tokens.shape[0])
        return real_verify(self, draft_tokens)

    monkeypatch.setattr(hf.HFSession, "verify", spy_verify)
    monkeypatch.setattr(hf.HFBackend, "eos_token_ids", property(lambda self: frozenset({eos})))
    out = pipe.generate(prompts, max_new_tokens=24, selector=selector)  # γ = 4 (the default)

    assert out[0].token_ids == plain[0][: stop_at + 1]  # stops on the EOS token, EOS included
    assert [o.token_ids for o in out[1:]] == plain[1:]  # the others run to max_new_tokens
    assert batch_sizes[0] == 3 and batch_sizes[out[0].stats.iterations] == 2  # the finished row left the batch
    stats = out[0].stats
    gamma = 0 if selector is None else pipe.config.num_draft_tokens
    # γ drafts per drafting iteration (a full-suite run once saw 2 iterations with 4 drafts: an
    # earlier test had left the session pipeline at γ = 2, vegas.ablate.measure did not restore it)
    assert stats.num_drafted == (stats.iterations - stats.plain_steps) * gamma
    assert batch_sizes.count(3) == stats.iterations  # ... nor verified


def test_generation_config_eos_ids_are_used(pipe):
    eos = pipe.backend.eos_token_ids
    assert pipe.tokenizer.eos_token_id in eos
    gen = pipe.backend.model.generation_config.eos_token_id
    assert set([gen] if isinstance(gen, int) else gen or []) <= set(eos)


def test_accepted_drafts_count_only_what_was_emitted():
    """A stop inside an iteration's accepted drafts (max_new_tokens, EOS) cuts them: the stats count
    the accepted drafts that were emitted, never more than the tokens generated."""
    from vegas.loop import _Outputs

    out = _Outputs(1, 1, ())
    out.emit(0, [7, 8, 9, 10, 11], 4, 4)  # all four drafts accepted, one token allowed
    stats = out.stats[0]
    assert (stats.num_generated, stats.num_drafted, stats.num_accepted) == (1, 4, 1)
    more = _Outputs(1, 64, (9,))
    more.emit(0, [7, 8, 9, 10, 11], 4, 4)  # EOS (9) third
    assert (more.stats[0].num_generated, more.stats[0].num_accepted) == (3, 3)
