"""Greedy exactness of the HF backend across model architectures (CPU, float32, no downloads).

Tiny random-weight models are built here from transformers configs and saved with a small
word-level tokenizer, so that ``Pipeline(model=dir)`` loads them the way it loads any model
directory. The ground truth is ``model.generate(do_sample=False)`` on the same weights loaded
with ``attn_implementation="eager"``, one prompt at a time (no padding). For every architecture:

* vegas plain decoding (``selector=None``) equals that reference token for token;
* every built-in selector at γ ∈ {1, 4} equals it token for token;
* rejections really happen (0 < accepted < drafted for at least one selector), so the
  speculative checks cannot pass with drafts that are never wrong;
* for a few architectures, a left-padded batch of prompts of different lengths gives each
  prompt its single-prompt reference.

Prompts are longer than every sliding window and than the KV budget, and decoding runs past
both. Architectures whose attention needs something that plain SDPA attention would drop
(GPT-OSS attention sinks, Bloom's ALiBi outside ``AttentionInterface``) must be refused by
name when loaded, or else be exact. Gemma 2's logit soft-capping is implemented and tested
like the other architectures. Models with such a feature get weights that make the feature
decide the greedy output (checked by switching it off), so ignoring it cannot pass.

Mistral has every layer sliding with a window (24) above the KV budget (16): its rejection
check asks that drafting on sliding layers be sparse inside the window, not the full window.

The layouts cover GQA ratios 1, 2, 3 and 4 and head dims 16, 32, 64 and 80:

=========  =====  =======  ======  ===========================================================
arch       heads  kv heads head_d  what it exercises
=========  =====  =======  ======  ===========================================================
llama      4      2        16      mask built by ``create_causal_mask`` alone (no dict)
mistral    4      1        32      every layer sliding (window 24) via the config
qwen2      6      2        16      layer_types [full, sliding] (window 24), GQA 3
qwen3      4      1        64      q/k norms, dict of masks (works before the mask rewrite)
gemma3     4      2        32      [sliding (16), full], query_pre_attn_scalar 24, q/k norms
phi3       2      1        80      fused qkv, partial rotary (0.5)
gpt_neox   4      4        32      MHA, partial rotary (0.25), parallel residual
gemma2     4      2        16      [sliding (16), full], logit soft-cap 2 (q/k amplified so
                                   logits go far past it), final logit soft-cap 4
gemma2_full 4     1        16      [full, full], logit soft-cap 2 only (q/k amplified), MQA
=========  =====  =======  ======  ===========================================================
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from vegas import Pipeline, VegasConfig
from vegas.config import VegasConfigError
from vegas.sampling import SamplingParams
from vegas.strategies import OracleSelector

VOCAB = 512
NEW_TOKENS = 24
SELECTORS = ["collect2", "aggregated", "sliding_window", "quest", "last_token"]
GAMMAS = [1, 4]
GREEDY = SamplingParams(temperature=0.0)
#: KV budget far below the prompt so that drafts differ from the target and rollbacks happen.
KV_BUDGET = 16
SMALL = dict(kv_budget=KV_BUDGET, min_kv_budget=0, num_sinks=4, recent_window=4, page_size=4)
#: Quest attends the partial page and the verified chunk beside its budget's pages: one page of
#: budget keeps its drafts apart from the target (with 16, tiny Mistral accepted every draft)
QUEST_SMALL = dict(SMALL, kv_budget=4)

COMMON = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,  # no early stop: every run emits NEW_TOKENS tokens
    pad_token_id=0,
)

#: name -> (transformers config class, config fields on top of COMMON)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "mistral": (
        "MistralConfig",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=24),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
            use_sliding_window=True, sliding_window=24, max_window_layers=1,  # layer 0 full, layer 1 sliding
        ),
    ),
    "qwen3": ("Qwen3Config", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=64)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            query_pre_attn_scalar=24, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(hidden_size=160, num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5),
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=128, num_attention_heads=4, rotary_pct=0.25)),
    "gemma2": (
        "Gemma2Config",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.05,
            attn_logit_softcapping=2.0, final_logit_softcapping=4.0, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma2_full": (
        "Gemma2Config",
        dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, initializer_range=0.05,
            attn_logit_softcapping=2.0, final_logit_softcapping=None, sliding_window=16,
            layer_types=["full_attention", "full_attention"],
        ),
    ),
}

#: Attention that SDPA with a boolean mask cannot express: name -> (config class, fields,
#: weight tweak making the feature decide the greedy output, switch turning the feature off).
#: No sliding layers, so that only the named feature can make them wrong.


def _amplify_qk(model, factor=8.0):
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.mul_(factor)
        layer.self_attn.k_proj.weight.mul_(factor)


def _no_softcap(model):
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None


def _raise_sinks(model, value=6.0):
    for layer in model.model.layers:
        layer.self_attn.sinks.add_(value)


def _no_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.sinks.fill_(float("-inf"))


#: supported architectures with such a feature: name -> (weight tweak, switch turning it off)
FEATURES: dict[str, tuple] = {
    "gemma2": (_amplify_qk, _no_softcap),  # attention logits well beyond the cap
    "gemma2_full": (_amplify_qk, _no_softcap),
}

UNSUPPORTED: dict[str, tuple] = {
    "gpt_oss": (  # learned attention sinks -> the s_aux= kwarg
        "GptOssConfig",
        dict(
            hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
            layer_types=["full_attention", "full_attention"],
        ),
        _raise_sinks,  # the sinks take a real share of every softmax
        _no_sinks,
    ),
    "bloom": (  # ALiBi, computed in the model's own attention code, not through AttentionInterface
        "BloomConfig",
        dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None, pad_token_id=0),
        None,
        None,
    ),
}

CASES = [(a, s, g) for a in ARCHS for s in SELECTORS for g in GAMMAS]
CASE_IDS = [f"{a}-{s}-gamma{g}" for a, s, g in CASES]


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (length,), generator=g).tolist()


#: the single-prompt runs
PROMPT = _prompt(300, 0)
#: the mixed batch: different lengths, left-padded by the backend
BATCH = [_prompt(300, 1), _prompt(173, 2), _prompt(251, 3)]


def _config(arch: str, table=ARCHS):
    cls_name, fields = table[arch][:2]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"{cls_name} does not exist in the installed transformers {transformers.__version__}")
    return cls(**fields) if arch == "bloom" else cls(**{**COMMON, **fields})  # bloom names its fields n_*


def _window(config) -> int | None:
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) is None:
        return None
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(config.sliding_window)


def _first_divergence(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"first divergence at token {i}: got {a}, reference {b} (got {got[i:i + 6]}, want {want[i:i + 6]})"
    return f"lengths differ: got {len(got)} tokens, reference {len(want)}"


class Zoo:
    """Builds, saves and loads the tiny models once per session; caches every run."""

    def __init__(self, root):
        self.root = root
        self._pipes: dict[str, Pipeline] = {}
        self._refs: dict[str, AutoModelForCausalLM] = {}
        self._tok_dir = None

    def _tokenizer_files(self):
        if self._tok_dir is None:
            from tokenizers import Tokenizer, models, pre_tokenizers
            from transformers import PreTrainedTokenizerFast

            tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
            tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            self._tok_dir = self.root / "tokenizer"
            PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(self._tok_dir)
        return self._tok_dir

    @functools.cache
    def dir(self, arch: str):
        table = ARCHS if arch in ARCHS else UNSUPPORTED
        config = _config(arch, table)
        torch.manual_seed(sum(map(ord, arch)))
        model = AutoModelForCausalLM.from_config(config)
        tweak = UNSUPPORTED[arch][2] if arch in UNSUPPORTED else FEATURES.get(arch, (None,))[0]
        if tweak is not None:
            with torch.no_grad():
                tweak(model)
        path = self.root / arch
        model.save_pretrained(path)
        tok = self._tokenizer_files()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).write_bytes((tok / name).read_bytes())
        return path

    def config(self, arch: str):
        return transformers.AutoConfig.from_pretrained(self.dir(arch))

    def pipe(self, arch: str) -> Pipeline:
        if arch not in self._pipes:
            self._pipes[arch] = Pipeline(model=str(self.dir(arch)), selector=None, dtype="float32", device="cpu")
        return self._pipes[arch]

    @functools.cache
    def reference(self, arch: str, prompt: tuple[int, ...]) -> list[int]:
        """``generate(do_sample=False)`` on the eager model, one prompt, no padding."""
        if arch not in self._refs:
            self._refs[arch] = AutoModelForCausalLM.from_pretrained(self.dir(arch), attn_implementation="eager").eval()
        ids = torch.tensor([prompt])
        out = self._refs[arch].generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
        )
        return out[0, len(prompt):].tolist()

    @functools.cache
    def run(self, arch: str, selector: str | None, gamma: int, batch: bool = False):
        prompts = BATCH if batch else [PROMPT]
        config = VegasConfig(num_draft_tokens=gamma, **(QUEST_SMALL if selector == "quest" else SMALL))
        return self.pipe(arch).backend.generate(
            prompts, max_new_tokens=NEW_TOKENS, sampling=GREEDY, selector=selector, config=config
        )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one intra-op thread is as fast, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("archs"))


# -- the prompts really exercise windows and budgets -------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompts_exceed_window_and_budget(zoo, arch):
    config = zoo.config(arch)
    window = _window(config)
    shortest = min(len(PROMPT), *map(len, BATCH))
    assert shortest > KV_BUDGET
    if window is not None:
        assert shortest > 4 * window, f"{arch}: prompts must run well past the sliding window {window}"
    if arch in ("mistral", "qwen2", "gemma3", "gemma2"):
        assert window is not None, f"{arch} was meant to have sliding-window layers"
    if arch == "qwen2":
        assert config.layer_types == ["full_attention", "sliding_attention"]


# -- (a) plain vegas decoding == transformers greedy generate ----------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_plain_equals_generate(zoo, arch):
    want = zoo.reference(arch, tuple(PROMPT))
    assert len(want) == NEW_TOKENS and len(set(want)) > 1, "the reference must not be degenerate"
    got = zoo.run(arch, None, 1)[0].token_ids
    assert got == want, f"{arch} plain decoding != generate(): {_first_divergence(got, want)}"


# -- (b) speculative greedy == plain greedy ------------------------------------------------------
@pytest.mark.parametrize("arch,selector,gamma", CASES, ids=CASE_IDS)
def test_speculative_equals_plain(zoo, arch, selector, gamma):
    want = zoo.reference(arch, tuple(PROMPT))
    out = zoo.run(arch, selector, gamma)[0]
    assert out.token_ids == want, (
        f"{arch} / {selector} / gamma={gamma} != plain greedy: {_first_divergence(out.token_ids, want)} "
        f"(accepted {out.stats.num_accepted} of {out.stats.num_drafted} drafted)"
    )
    assert 0 <= out.stats.num_accepted <= out.stats.num_drafted
    drafting = out.stats.iterations - out.stats.plain_steps  # γ each; at most γ last ones capped at the tokens left
    assert (drafting - gamma) * gamma < out.stats.num_drafted <= drafting * gamma


# -- one selection per KV head (granularity="kv_head"): any KV-head count, MHA configs included -----
@pytest.mark.parametrize("arch", list(ARCHS))
def test_per_kv_head_selection_equals_plain(zoo, arch):
    """collect2 and the oracle with one top-k per KV head; GPT-NeoX's config has no
    ``num_key_value_heads`` (every head is its own KV head), which once raised AttributeError."""
    want = zoo.reference(arch, tuple(PROMPT))
    config = VegasConfig(num_draft_tokens=4, granularity="kv_head", **SMALL)
    for selector in ("collect2", OracleSelector(config)):
        out = zoo.pipe(arch).backend.generate([PROMPT], max_new_tokens=NEW_TOKENS, sampling=GREEDY,
                                              selector=selector, config=config)[0]
        assert out.token_ids == want, f"{arch} / {selector} per KV head: {_first_divergence(out.token_ids, want)}"
        assert out.stats.num_drafted > 0


# -- (c) the speculative checks are not vacuous ---------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_real_rejections_happen(zoo, arch):
    stats = {(s, g): zoo.run(arch, s, g)[0].stats for s in SELECTORS for g in GAMMAS}
    mixed = [k for k, st in stats.items() if 0 < st.num_accepted < st.num_drafted]
    summary = {f"{s}/g{g}": f"{st.num_accepted}/{st.num_drafted}" for (s, g), st in stats.items()}
    assert mixed, f"{arch}: no selector had both accepted drafts and rejections (accepted/drafted: {summary})"
    assert sum(st.num_drafted - st.num_accepted for st in stats.values()) > 0


# -- mixed batch, left padding ----------------------------------------------------------------
BATCH_ARCHS = ["llama", "mistral", "gemma3", "qwen3", "gemma2"]  # qwen3: control that worked before the rewrite
BATCH_SELECTORS = [None, "collect2", "quest"]


@pytest.mark.parametrize(
    "arch,selector",
    [(a, s) for a in BATCH_ARCHS for s in BATCH_SELECTORS],
    ids=[f"{a}-{s or 'plain'}" for a in BATCH_ARCHS for s in BATCH_SELECTORS],
)
def test_mixed_batch_equals_single_prompt_generate(zoo, arch, selector):
    gamma = 4
    outputs = zoo.run(arch, selector, gamma, batch=True)
    for i, (prompt, out) in enumerate(zip(BATCH, outputs)):
        want = zoo.reference(arch, tuple(prompt))
        assert out.token_ids == want, (
            f"{arch} / {selector or 'plain'} / gamma={gamma}, batch row {i} (prompt of {len(prompt)} tokens, "
            f"left-padded to {max(map(len, BATCH))}): {_first_divergence(out.token_ids, want)}"
        )
    if selector is not None:
        drafted = sum(o.stats.num_drafted for o in outputs)
        accepted = sum(o.stats.num_accepted for o in outputs)
        assert accepted < drafted, f"{arch} / {selector}: the batch must see rejections (accepted {accepted}/{drafted})"


# -- attention that SDPA would silently get wrong ------------------------------------------------
SWITCHES = {**{a: f[1] for a, f in FEATURES.items()}, **{a: u[3] for a, u in UNSUPPORTED.items() if u[3]}}


@pytest.mark.parametrize("arch", list(SWITCHES))
def test_feature_decides_the_output(zoo, arch):
    """Sanity of the exactness tests: with the feature switched off, greedy decoding differs, so
    a backend that ignores the feature cannot be exact by luck."""
    want = zoo.reference(arch, tuple(PROMPT))
    model = AutoModelForCausalLM.from_pretrained(zoo.dir(arch), attn_implementation="eager").eval()
    with torch.no_grad():
        SWITCHES[arch](model)
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                         pad_token_id=0)
    assert out[0, len(PROMPT):].tolist() != want, f"{arch}: switching the feature off does not change the output"


@pytest.mark.parametrize("arch", list(UNSUPPORTED))
def test_unsupported_attention_is_refused_by_name_or_exact(zoo, arch):
    """Refused at load with a VegasConfigError naming the model; a backend that does load it
    must then be exact (plain and speculative) and really draft sparsely (rejections)."""
    path = zoo.dir(arch)
    config = transformers.AutoConfig.from_pretrained(path)
    names = {config.model_type.lower(), *(a.lower() for a in config.architectures or [])}
    try:
        pipe = Pipeline(model=str(path), selector=None, dtype="float32", device="cpu")
    except VegasConfigError as exc:
        assert any(n in str(exc).lower() for n in names), f"the refusal must name the model ({names}): {exc}"
        assert str(path) in str(exc), f"the refusal must name the path the user gave: {exc}"
        assert "tensor(" not in str(exc) and "\n" not in str(exc), f"one line, no tensor dump: {exc}"
        return
    want = zoo.reference(arch, tuple(PROMPT))
    got = pipe.generate([PROMPT], max_new_tokens=NEW_TOKENS, selector=None)[0].token_ids
    assert got == want, f"{arch} loaded but plain decoding is wrong: {_first_divergence(got, want)}"
    rejections = 0
    for selector in ("collect2", "sliding_window"):
        out = pipe.backend.generate(
            [PROMPT], max_new_tokens=NEW_TOKENS, sampling=GREEDY, selector=selector,
            config=VegasConfig(num_draft_tokens=4, **SMALL),
        )[0]
        assert out.token_ids == want, f"{arch} / {selector}: {_first_divergence(out.token_ids, want)}"
        rejections += out.stats.num_drafted - out.stats.num_accepted
    assert rejections > 0, f"{arch} loaded, but drafting never differed from full attention: it is not sparse"


def test_soft_capped_vegas_attention_without_a_context_equals_eager(zoo):
    """Plain transformers use of ``attn_implementation="vegas"`` (no ``vegas_ctx``: causal, the
    model's own mask) on a soft-capped model gives eager's logits; without the cap it would not."""
    import vegas.backends.hf  # noqa: F401  registers attn_implementation="vegas"

    path = zoo.dir("gemma2_full")
    ids = torch.tensor([PROMPT[:64]])
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    vegas_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="vegas").eval()
    with torch.no_grad():
        want = eager(ids).logits
        torch.testing.assert_close(vegas_model(ids).logits, want, rtol=1e-4, atol=1e-4)
        _no_softcap(vegas_model)
        assert not torch.allclose(vegas_model(ids).logits, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("arch", ["llama", "mistral", "phi3", "gemma3", "gemma2"])
def test_a_reused_prefill_gives_what_a_full_prefill_gives(zoo, arch, monkeypatch, reused_prefill_chunks):
    """``reuse_prefill`` on Llama, Phi-3 (fused qkv, partial rotary), sliding-window layers (Mistral,
    Gemma 3: the kept slots' positions decide what each query sees) and soft-capping (Gemma 2), with a
    left-padded batch: every selector, γ and plain decoding after the
    first call start from the kept prefix and give the tokens, τ and attended entries of a full
    prefill, sampled."""
    from vegas.backends import hf

    monkeypatch.setattr(hf, "PREFILL_CHUNK_TOKENS", 40)  # 299 prefill slots: 8 chunks
    reusing = Pipeline(model=str(zoo.dir(arch)), selector=None, dtype="float32", device="cpu",
                       backend_options={"reuse_prefill": True})
    chunks = reused_prefill_chunks
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    for i, (selector, gamma) in enumerate([("collect2", 4), ("quest", 4), (None, 1), ("sliding_window", 1),
                                           ("aggregated", 4)]):
        config = VegasConfig(num_draft_tokens=gamma, **(QUEST_SMALL if selector == "quest" else SMALL))
        chunks.clear()
        got, want = (p.backend.generate(BATCH, max_new_tokens=NEW_TOKENS, sampling=sampling, selector=selector,
                                        config=config) for p in (reusing, zoo.pipe(arch)))
        assert chunks == ([19] + [40] * 7 if i == 0 else [40]), (selector, chunks)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, (selector, gamma, _first_divergence(g.token_ids, w.token_ids))
            assert (g.stats.acceptance_length, g.stats.kv_attended) == (w.stats.acceptance_length,
                                                                        w.stats.kv_attended), (selector, gamma)
