"""CPU tests of the CuTe probe score path (``vllm.score_path="cute"``, issue 22; no vLLM, no GPU,
no CuTe DSL): the option and its settings check, the row modes and weights, the coverage
decision, that the package imports without the DSL, and that a forward routed through
:meth:`SelectionState.verify_layer` — the real probe packing and gather around a PyTorch
stand-in of the CuTe kernel — selects what today's path selects."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vegas.config import VegasConfig, VegasConfigError, VllmOptions
from vegas.kernels import cute_probe
from vegas.kernels.cute_probe import EDGES, FIRST
from vegas.vllm_plugin.selection import cute_verify
from vegas.vllm_plugin.settings import build_selector, parse_settings

from .test_fa3_scores import _impl, assert_same_selection
from .test_vllm_state import BS, _block_table, _state


def test_score_path_option_is_validated():
    assert VllmOptions().score_path == "auto" and VllmOptions(score_path="cute").score_path == "cute"
    with pytest.raises(VegasConfigError, match=r"vllm\.score_path must be one of 'auto', 'cute', got 'fa4'") as e:
        VegasConfig(vllm={"score_path": "fa4"})
    assert e.value.field == "vllm.score_path"
    _, config = parse_settings('{"selector": "collect2", "vllm": {"score_path": "cute"}}')
    assert config.vllm.score_path == "cute"


@pytest.mark.parametrize("selector", ["collect2", "last_token"])
def test_cute_serves_the_first_and_last_row_selectors(selector):
    sel = build_selector(selector, VegasConfig(vllm={"score_path": "cute"}), 4, block_size=16)
    assert sel.name == selector


@pytest.mark.parametrize("selector,block_size,match", [
    ("aggregated", 16, "aggregated"),  # scores every row of the chunk
    ("sliding_window", 16, "does not select by those scores"),
    ("quest", 16, "does not select by those scores"),
    ("collect2", 128, "block_size 128"),  # the kernel's TMA paged path
])
def test_cute_is_refused_where_it_can_never_run(selector, block_size, match):
    config = VegasConfig(vllm={"score_path": "cute"}, page_size=block_size)
    with pytest.raises(VegasConfigError, match=match) as e:
        build_selector(selector, config, 4, block_size=block_size)
    assert e.value.field == "vllm.score_path"
    build_selector(selector, VegasConfig(page_size=block_size), 4, block_size=block_size)  # "auto" runs them


def test_row_modes_and_weights():
    assert cute_probe.row_mode([[], [0], [0, 1], [0, 2], [0, 3], [0, 4]]) == EDGES  # collect2, γ = 4
    assert cute_probe.row_mode([[], [0], [0], [0], [0], [0]]) == FIRST  # last_token
    with pytest.raises(ValueError, match=r"3: \[0, 1, 2\]"):
        cute_probe.row_mode([[], [0], [0, 1], [0, 1, 2]])  # aggregated
    with pytest.raises(ValueError):
        cute_probe.row_mode([[], [0], [1]])  # the last row alone
    assert cute_probe.row_weights(EDGES, 5) == {0: 1.0, 4: 1.0}
    assert cute_probe.row_weights(EDGES, 1) == {0: 2.0}  # a one-query chunk counts its row twice
    assert cute_probe.row_weights(FIRST, 5) == {0: 1.0} == cute_probe.row_weights(FIRST, 1)
    assert cute_probe.padded_len(7) == 8 and cute_probe.padded_len(8) == 8


@pytest.mark.parametrize("kw,match", [
    (dict(), None),
    (dict(num_q_heads=9, num_kv_heads=3, head_dim=64), None),  # SmolLM2
    (dict(dtype=torch.float16), None),
    (dict(dtype=torch.float32), "dtype"),
    (dict(head_dim=96), "head_dim 96"),
    (dict(max_query_len=6), "max_query_len 6"),  # longer than γ + 1: a prefill chunk
    (dict(max_query_len=0), "max_query_len 0"),
    (dict(num_q_heads=96, num_kv_heads=4), "max_query_len 5"),  # 5 x 24 rows > one 64-row tile
    (dict(num_q_heads=28, num_kv_heads=4), None),  # G = 7: 2 probe tokens + 5 queries = 49 rows
    (dict(num_q_heads=64, num_kv_heads=4), "after 1 probe tokens"),  # G = 16: (1 + 5) x 16 rows > 64
    (dict(num_q_heads=64, num_kv_heads=4, max_query_len=3, max_chunk=3), None),
    (dict(block_size=128), "block_size 128"),
    (dict(sliding_window=(127, 0)), "sliding window"),
    (dict(softcap=30.0), "soft-capping"),
    (dict(sinks=torch.zeros(1)), "sinks"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(num_q_heads=30, num_kv_heads=8), "query heads"),
])
def test_unsupported_reason(kw, match):
    args = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, max_query_len=5, max_chunk=5)
    args.update(kw)
    reason = cute_probe.unsupported_reason(**args)
    assert (reason is None) if match is None else (match in reason), reason


def test_the_package_imports_without_the_dsl_or_vllm():
    code = (
        "import sys\n"
        "for m in ('cutlass', 'quack', 'vllm'): sys.modules[m] = None  # any import of them fails\n"
        "import vegas.kernels.cute_probe as c, vegas.vllm_plugin.selection.cute_verify\n"
        "import vegas.vllm_plugin.settings\n"
        "print(c.unavailable_reason())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip()  # a reason: no CUDA device here, or the DSL missing


def test_the_settings_check_needs_no_triton():
    """``vegas serve --dry-run`` checks ``score_path="cute"`` on machines without Triton (the README's
    install has none): the check imports no Triton."""
    code = (
        "import sys\n"
        "for m in ('triton', 'cutlass', 'quack', 'vllm'): sys.modules[m] = None  # any import of them fails\n"
        "from vegas.config import VegasConfig, VegasConfigError\n"
        "from vegas.vllm_plugin.settings import build_selector\n"
        "config = VegasConfig(vllm={'score_path': 'cute'})\n"
        "print(build_selector('collect2', config, 4, block_size=16).name)\n"
        "try:\n"
        "    build_selector('sliding_window', config, 4, block_size=16)\n"
        "except VegasConfigError as e:\n"
        "    print(e.field)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["collect2", "vllm.score_path"], out.stderr[-2000:]


def _fake_kernel(calls):
    """A stand-in for the CuTe probe kernel under the real :func:`cute_probe.probe_attention` (the
    packing, the call, the gather back): on the packed batch it stores rows 0 + 8 of each KV head's
    PackGQA tile times each key before the chunk (the kernel's pre-softmax logits) into
    ``aux_tensors[0]`` and writes each row's query as its attention output."""
    from vegas.kernels.probe_queries import PROBE_ROWS, probe_tokens

    @contextlib.contextmanager
    def installed():
        def fwd(q, k, v, *, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, softmax_scale,
                causal, num_splits, out, tile_mn, aux_tensors, pack_gqa, _arch):
            calls.append("probe")
            hq, hkv, block = q.shape[1], k.shape[2], k.shape[1]
            group = hq // hkv
            probes, scores = probe_tokens(group), aux_tensors[0]
            for s in range(scores.shape[0]):
                a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
                ctx = int(seqused_k[s]) - (b - a - probes)
                if b - a == probes:
                    continue
                pos = torch.arange(ctx)
                keys = k[page_table[s, pos // block].long(), pos % block].float()  # [ctx, hkv, d]
                for kv in range(hkv):
                    rows = [q[a + r // group, kv * group + r % group].float() for r in PROBE_ROWS]
                    scores[s, kv, :ctx] = sum(keys[:, kv] @ row for row in rows)
            out.copy_(q)  # each row's own query: the gather back must bring every token's row
            return out, None

        yield fwd

    return installed


def _cute_available(monkeypatch, calls, warm=True):
    monkeypatch.setattr(cute_probe, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cute_probe, "_probe_kernel_installed", _fake_kernel(calls))
    monkeypatch.setattr(cute_probe, "_WARM", set())
    compiled = []

    def warm_up(*shape, mode=EDGES, **kw):
        compiled.append((*shape[:5], mode))
        cute_probe._WARM.add((shape[3], *shape[:3], shape[4]))

    monkeypatch.setattr(cute_probe, "warm_up", warm_up)
    return compiled


def _batch(chunks, lens, hq=9, hkv=3, d=64, layers=3):
    bt, nb = _block_table(lens, 3)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    md = SimpleNamespace(query_start_loc=cu, seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=max(lens),
                         max_query_len=max(chunks), num_actual_tokens=n, block_table=bt, scheduler_metadata=None,
                         max_num_splits=0, use_cascade=False, causal=True)
    torch.manual_seed(0)
    kvs = [torch.randn(nb, 2, BS, hkv, d).to(torch.bfloat16) for _ in range(layers)]
    queries = [torch.randn(n + 2, hq, d).to(torch.bfloat16) for _ in range(layers)]  # 2 padding tokens
    return md, kvs, queries


def _run(st, md, kvs, queries, hkv, bad_layer=None):
    """One forward through verify_layer (and on_layer where it declines); returns the declined layers."""
    declined = []
    for layer, (q, kv) in enumerate(zip(queries, kvs)):
        impl = _impl(hkv, window=(31, 0) if layer == bad_layer else None)
        out = torch.zeros_like(q)
        if st.verify_layer(impl, layer, q, kv, md, out):
            n = md.num_actual_tokens
            assert torch.equal(out[:n], q[:n]) and out[n:].eq(0).all()
        else:
            declined.append(layer)
            st.on_layer(layer, q, kv, md, 0.5)
    return declined


@pytest.mark.parametrize("selector,bad_layer", [("collect2", None), ("collect2", 1), ("last_token", None)])
def test_verify_layer_selects_what_todays_path_selects(monkeypatch, selector, bad_layer):
    """SmolLM2's heads, a verification chunk of 5 and a one-query chunk, three layers: the probe
    path (the real packing and gather around a stand-in kernel) selects the same slots as today's
    path (the one-query chunk's row counted twice changes no top-k); a layer with a sliding
    window runs vLLM's attention and is scored alone; the stats name the path."""
    calls = []
    compiled = _cute_available(monkeypatch, calls)
    hq, hkv, d = 9, 3, 64
    md, kvs, queries = _batch([5, 1], [70, 40])
    today = _state(selector, kv_budget=7, first_layer=0, last_layer=2, layers_ready=True)
    for layer in range(3):
        today.on_layer(layer, queries[layer], kvs[layer], md, 0.5)

    st = _state(selector, kv_budget=7, first_layer=0, last_layer=2, layers_ready=True, vllm={"score_path": "cute"})
    declined = _run(st, md, kvs, queries, hkv, bad_layer)
    assert isinstance(st.fa3, cute_verify.CuteProbeVerify)
    mode = EDGES if selector == "collect2" else FIRST
    assert compiled == [(hq, hkv, d, torch.bfloat16, BS, mode)]  # compiled once, outside capture
    assert declined == ([] if bad_layer is None else [bad_layer])
    assert calls == ["probe"] * (3 - len(declined)) and not st.fa3.active
    assert_same_selection(st, today)
    # the next forward knows every layer; the engine's score_path stat (runners.v2._score_path) is
    # "cute" once a forward ran through it with every layer covered
    assert _run(st, md, kvs, queries, hkv, bad_layer) == ([] if bad_layer is None else [0, 1, 2])
    assert st.fa3.KIND == "cute" and st.fa3.in_use == (bad_layer is None)


def test_capture_takes_todays_path_for_a_shape_not_compiled(monkeypatch):
    calls = []
    compiled = _cute_available(monkeypatch, calls)
    md, kvs, queries = _batch([5, 5], [70, 40])
    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=2, layers_ready=True, vllm={"score_path": "cute"})
    monkeypatch.setattr(type(st), "capturing", staticmethod(lambda query: True))
    assert _run(st, md, kvs, queries, 3) == [0, 1, 2] and not calls and not compiled
    monkeypatch.setattr(type(st), "capturing", staticmethod(lambda query: False))
    st.fa3.warm(st, 9, 3, 64, torch.bfloat16, BS, "cpu")  # what reserve_selection_buffers does before capture
    monkeypatch.setattr(type(st), "capturing", staticmethod(lambda query: True))
    assert _run(st, md, kvs, queries, 3) == [] and len(calls) == 3 and len(compiled) == 1


def test_uncovered_batches_take_todays_path(monkeypatch):
    calls = []
    _cute_available(monkeypatch, calls)
    # G = 16 at five queries: one probe token and the chunk are 96 rows, more than one 64-row tile
    md, kvs, queries = _batch([5, 5], [70, 40], hq=16, hkv=1)
    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=2, layers_ready=True, vllm={"score_path": "cute"})
    assert _run(st, md, kvs, queries, 1) == [0, 1, 2] and not calls
    # a prefill chunk of 6 > γ + 1 queries
    md, kvs, queries = _batch([6, 5], [70, 40])
    assert _run(st, md, kvs, queries, 3) == [0, 1, 2] and not calls


def test_unavailable_cute_falls_back_to_auto_and_says_why_once(monkeypatch, caplog):
    monkeypatch.setattr(cute_probe, "unavailable_reason", lambda: "no CUDA device (test)")
    with caplog.at_level("INFO", logger="vegas.vllm"):
        verify = cute_verify.make_score_verify("cute")
    assert type(verify).__name__ == "FA3ScoreVerify"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["vegas: vllm.score_path=cute is unavailable (no CUDA device (test)); verification scores as "
                     "with 'auto'"]
    assert type(cute_verify.make_score_verify("auto")).__name__ == "FA3ScoreVerify"


def test_a_failed_compile_turns_the_path_off(monkeypatch, caplog):
    calls = []
    _cute_available(monkeypatch, calls)

    def broken(*a, **k):
        raise RuntimeError("ptxas failed (test)")

    monkeypatch.setattr(cute_probe, "warm_up", broken)
    md, kvs, queries = _batch([5, 5], [70, 40])
    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=2, layers_ready=True, vllm={"score_path": "cute"})
    with caplog.at_level("INFO", logger="vegas.vllm"):
        assert _run(st, md, kvs, queries, 3) == [0, 1, 2]
        assert _run(st, md, kvs, queries, 3) == [0, 1, 2]
    assert "ptxas failed (test)" in st.fa3.kernel_unavailable() and not calls
    assert sum("ptxas failed" in r.getMessage() for r in caplog.records) == 2  # the warning, then the path line


def test_reserve_compiles_before_capture(monkeypatch):
    """``reserve_selection_buffers`` compiles the model's shape per rank (query and KV heads of the rank)."""
    from vegas.vllm_plugin.runners.start import reserve_selection_buffers

    compiled = _cute_available(monkeypatch, [])
    st = _state("collect2", kv_budget=7, first_layer=0, last_layer=2, layers_ready=True, vllm={"score_path": "cute"})
    model = SimpleNamespace(get_num_attention_heads=lambda p: 16, get_num_kv_heads=lambda p: 4,
                            get_head_size=lambda: 128, max_model_len=4096, dtype=torch.bfloat16)
    vllm_config = SimpleNamespace(model_config=model, parallel_config=None, cache_config=SimpleNamespace(block_size=16))
    reserve_selection_buffers(st, vllm_config, st.path.selector, 4, 8, torch.device("cpu"))
    assert compiled == [(16, 4, 128, torch.bfloat16, 16, EDGES)]
    auto = _state("collect2", kv_budget=7, first_layer=0, last_layer=2, layers_ready=True)
    reserve_selection_buffers(auto, vllm_config, auto.path.selector, 4, 8, torch.device("cpu"))
    assert len(compiled) == 1 and auto.fa3 is None
