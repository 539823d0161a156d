"""Full CUDA graphs for the plain steps of the V2 runner (vegas.vllm_plugin.plain_graphs and
patches.patch_plain_step_graphs) against a fake of vLLM 0.24.0's V2 CUDA-graph manager.

The fake (``vllm/v1/worker/gpu/cudagraph_utils.py``: ``BatchExecutionDescriptor``,
``_is_compatible``, ``CudaGraphManager._init_candidates`` / ``dispatch`` / ``capture``, and
``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`` from ``vllm/config/compilation.py``)
is copied by hand from vLLM's source, without torch, LoRA and data parallelism; capturing a graph
runs the forward and records it. No vLLM, no GPU."""

from __future__ import annotations

import enum
import logging
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from vegas.vllm_plugin import patches, plain_graphs
from vegas.vllm_plugin.plain_graphs import plain_sizes, plain_step_graphs
from vegas.vllm_plugin.selection.state import SelectionState


# ---- vLLM 0.24.0, copied by hand (vllm/config/compilation.py, vllm/v1/worker/gpu/cudagraph_utils.py) ----
class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def decode_mode(self):
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self):
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def __bool__(self) -> bool:
        return self != CUDAGraphMode.NONE


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    num_active_loras: int = 0


def _is_compatible(desc, num_reqs, num_tokens, uniform_token_count, num_active_loras) -> bool:
    return (
        (desc.uniform_token_count is None or desc.uniform_token_count == uniform_token_count)
        and (desc.num_reqs is None or desc.num_reqs >= num_reqs)
        and desc.num_tokens >= num_tokens
        and desc.num_active_loras == num_active_loras
    )


class CompilationConfig:
    def __init__(self, capture_sizes, max_size, enable_sp=False):
        self.cudagraph_capture_sizes = list(capture_sizes)
        self.max_cudagraph_capture_size = max_size
        self.pass_config = SimpleNamespace(enable_sp=enable_sp)

    def adjust_cudagraph_sizes_for_spec_decode(self, uniform_decode_query_len, tensor_parallel_size):
        multiple_of = uniform_decode_query_len
        if not self.cudagraph_capture_sizes or multiple_of <= 1:
            return
        up = [-(-s // multiple_of) * multiple_of for s in self.cudagraph_capture_sizes]
        rounded = sorted({s for s in up if s <= self.max_cudagraph_capture_size})
        if not rounded and multiple_of <= self.max_cudagraph_capture_size:
            rounded = [multiple_of]
        self.max_cudagraph_capture_size = rounded[-1]
        self.cudagraph_capture_sizes = rounded


class CudaGraphManager:
    def __init__(self, vllm_config, device, cudagraph_mode, decode_query_len, lora_capture_cases=None):
        self.vllm_config = vllm_config
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.compilation_config = vllm_config.compilation_config
        self.cudagraph_mode = cudagraph_mode
        self.decode_query_len = decode_query_len
        self.dp_size = vllm_config.parallel_config.data_parallel_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.lora_capture_cases = lora_capture_cases or [0]
        self.graphs = {}
        self._graphs_captured = False
        self._candidates = {}
        self._capture_descs = {}
        self.compilation_config.adjust_cudagraph_sizes_for_spec_decode(self.decode_query_len, self.tp_size)
        self._init_candidates()

    def _resolve_effective_loras(self, num_active_loras):
        return num_active_loras

    def _init_candidates(self) -> None:
        capture_sizes = self.compilation_config.cudagraph_capture_sizes
        if not (self.cudagraph_mode and capture_sizes):
            return
        capture_sizes = sorted(capture_sizes)
        max_decode_tokens = self.max_num_reqs * self.decode_query_len
        decode_mode = self.cudagraph_mode.decode_mode()
        mixed_mode = self.cudagraph_mode.mixed_mode()
        separate_decode_routine = self.cudagraph_mode.separate_routine()
        descs_by_token_lora = defaultdict(list)
        descs_by_mode = defaultdict(list)
        for num_tokens in capture_sizes:
            for num_active_loras in self.lora_capture_cases:
                if separate_decode_routine and decode_mode and self.decode_query_len <= num_tokens <= max_decode_tokens:
                    desc = BatchExecutionDescriptor(
                        cg_mode=decode_mode, num_tokens=num_tokens, num_reqs=num_tokens // self.decode_query_len,
                        uniform_token_count=self.decode_query_len, num_active_loras=num_active_loras)
                    descs_by_mode[decode_mode].append(desc)
                    descs_by_token_lora[(num_tokens, num_active_loras)].append(desc)
                if mixed_mode:
                    num_reqs = min(num_tokens, self.max_num_reqs) if mixed_mode == CUDAGraphMode.FULL else None
                    desc = BatchExecutionDescriptor(cg_mode=mixed_mode, num_tokens=num_tokens, num_reqs=num_reqs,
                                                    num_active_loras=num_active_loras)
                    descs_by_mode[mixed_mode].append(desc)
                    descs_by_token_lora[(num_tokens, num_active_loras)].append(desc)
        if not descs_by_token_lora:
            return
        current_range_start = 0
        for token_cg_size in sorted({k[0] for k in descs_by_token_lora}):
            for i in range(current_range_start, token_cg_size + 1):
                for num_active_loras in self.lora_capture_cases:
                    staging_key = (token_cg_size, num_active_loras)
                    if staging_key in descs_by_token_lora:
                        self._candidates[(i, num_active_loras)] = descs_by_token_lora[staging_key]
            current_range_start = token_cg_size + 1
        for mode, descs in descs_by_mode.items():
            descs.sort(key=lambda d: d.num_tokens, reverse=True)
            self._capture_descs[mode] = descs

    def needs_capture(self) -> bool:
        return len(self._capture_descs) > 0

    def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        attn_states = {}
        for mode in [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL]:
            for desc in self._capture_descs.get(mode, []):
                forward_fn, warmup_attn_state = create_forward_fn(desc, warmup=True)
                forward_fn(CUDAGraphMode.NONE)
                if desc.cg_mode == CUDAGraphMode.PIECEWISE:
                    attn_states[desc] = (warmup_attn_state, warmup_attn_state)
                    forward_fn(CUDAGraphMode.PIECEWISE)
                else:
                    forward_fn, capture_attn_state = create_forward_fn(desc, warmup=False)
                    attn_states[desc] = (warmup_attn_state, capture_attn_state)
                    assert desc not in self.graphs
                    forward_fn(CUDAGraphMode.NONE)  # inside torch.cuda.graph(...) in vLLM
                    self.graphs[desc] = "graph"
        self._graphs_captured = True
        return attn_states

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
        key = (num_tokens, num_active_loras)
        if self._graphs_captured and num_tokens > 0 and key in self._candidates:
            for desc in self._candidates[key]:
                if _is_compatible(desc, num_reqs, num_tokens, uniform_token_count, num_active_loras):
                    return desc
        return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs,
                                        num_active_loras=num_active_loras)


class ModelCudaGraphManager(CudaGraphManager):
    pass


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture
def vllm(monkeypatch):
    """Fake vLLM modules with the manager above; ``patch_plain_step_graphs`` installed on it."""
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    # fresh classes per test: the patch replaces their methods
    base = type("CudaGraphManager", (CudaGraphManager,), {
        "_init_candidates": CudaGraphManager._init_candidates, "dispatch": CudaGraphManager.dispatch,
        "capture": CudaGraphManager.capture})
    model = type("ModelCudaGraphManager", (base,), {})
    for name in ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu"):
        mod(name)
    mod("vllm.config")
    mod("vllm.config.compilation", CUDAGraphMode=CUDAGraphMode)
    mod("vllm.v1.worker.gpu.cudagraph_utils", CudaGraphManager=base, ModelCudaGraphManager=model,
        BatchExecutionDescriptor=BatchExecutionDescriptor)
    patches.patch_plain_step_graphs()
    return SimpleNamespace(base=base, model=model)


def engine(max_num_seqs=8, capture_sizes=(1, 2, 4, 8, 16, 24, 32), max_size=32, dp=1, tp=1, enable_sp=False):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, async_scheduling=True),
        compilation_config=CompilationConfig(capture_sizes, max_size, enable_sp),
        parallel_config=SimpleNamespace(data_parallel_size=dp, tensor_parallel_size=tp),
    )


def state(frozen=True, in_draft=False) -> SelectionState:
    return SelectionState(gamma=4, enabled=True, frozen=frozen, select_in_draft=in_draft)


#: (select_in_draft, vllm.fallback) of engines whose q-len-1 graphs do not select: captured
#: skipped, replayed for skipped steps only
SKIPPED_ONLY = pytest.mark.parametrize("in_draft, fallback", [(False, False), (True, True), (False, True)],
                                       ids=["separate", "in_draft_fallback", "separate_fallback"])


def manager(cls, config, mode=CUDAGraphMode.FULL_AND_PIECEWISE, gamma=4):
    return cls(config, "cpu", mode, decode_query_len=gamma + 1)


def full(m) -> list:
    return m._capture_descs.get(CUDAGraphMode.FULL, [])


def q1(m) -> list:
    return [d for d in full(m) if d.uniform_token_count == 1]


def capture(m, forwards=None):
    """vLLM's capture with forwards that record their descriptor and pass."""
    def create_forward_fn(desc, warmup):
        def forward_fn(cg_mode):
            if forwards is not None:
                forwards.append((desc, warmup, cg_mode))
        return forward_fn, ("attn", desc)

    return m.capture(create_forward_fn, "test")


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, max_num_seqs, multiple, expected", [
    ([5, 10, 20, 25], 8, 1, [5, 8]),  # γ = 4: capture sizes are multiples of 5; 8 covers batches of 6..8
    ([5, 10, 20, 25], 10, 1, [5, 10]),
    ([5, 10, 20], 256, 1, [5, 10, 20]),  # the capture sizes stop below max_num_seqs: so do these
    ([5, 10], 4, 1, [4]),  # every capture size above max_num_seqs
    ([6, 12, 18], 16, 4, [12, 16]),  # sequence parallelism at TP 4: multiples of 4 only
    ([], 8, 1, []),
    (None, 8, 1, []),
])
def test_plain_sizes(sizes, max_num_seqs, multiple, expected):
    assert plain_sizes(sizes, max_num_seqs, multiple) == expected


def test_without_plain_steps_the_manager_is_vllms(vllm):
    config = engine()
    assert plain_step_graphs(state(), config, scheduled_switch=False) is None  # the default: no step switch
    reference = manager(CudaGraphManager, engine())  # the unpatched manager
    m = manager(vllm.model, config)
    assert m._candidates == reference._candidates and m._capture_descs == reference._capture_descs
    assert not q1(m) and not hasattr(m, "_vegas_plain")
    seen, ref_seen = [], []
    capture(m, seen)
    capture(reference, ref_seen)
    assert [f[0] for f in seen] == [f[0] for f in ref_seen] and set(m.graphs) == set(reference.graphs)
    for num_reqs, num_tokens, uniform in [(3, 3, 1), (8, 8, 1), (2, 10, 5), (3, 7, None), (40, 40, 1)]:
        assert m.dispatch(num_reqs, num_tokens, uniform, 0) == reference.dispatch(num_reqs, num_tokens, uniform, 0)


@pytest.mark.parametrize("mode, gamma, dp, frozen, base, wanted", [
    (CUDAGraphMode.FULL_AND_PIECEWISE, 4, 1, True, False, True),
    (CUDAGraphMode.FULL_DECODE_ONLY, 4, 1, True, False, True),
    (CUDAGraphMode.PIECEWISE, 4, 1, True, False, False),  # no full graphs at all
    (CUDAGraphMode.FULL, 4, 1, True, False, False),  # no separate decode routine (vLLM's mixed FULL graphs)
    (CUDAGraphMode.FULL_AND_PIECEWISE, 0, 1, True, False, False),  # γ = 0: vLLM's decode graphs are q-len 1
    (CUDAGraphMode.FULL_AND_PIECEWISE, 4, 2, True, False, False),  # data parallel
    (CUDAGraphMode.FULL_AND_PIECEWISE, 4, 1, False, False, False),  # piecewise verification (state.frozen off)
    (CUDAGraphMode.FULL_AND_PIECEWISE, 4, 1, True, True, False),  # not the runner's ModelCudaGraphManager
])
def test_plain_step_graphs_only_where_they_apply(vllm, mode, gamma, dp, frozen, base, wanted):
    config = engine(dp=dp)
    graphs = plain_step_graphs(state(frozen), config, scheduled_switch=True)
    m = manager(vllm.base if base else vllm.model, config, mode, gamma)
    reference = manager(CudaGraphManager, engine(dp=dp), mode, gamma)
    assert (len(q1(m)) > len(q1(reference))) == wanted  # at γ = 0 vLLM's own decode graphs are q-len 1
    assert getattr(m, "_vegas_plain", None) is (graphs if wanted else None)
    if not wanted:
        assert m._capture_descs == reference._capture_descs


def test_no_plain_step_graphs_with_lora_capture_cases(vllm):
    """Vegas refuses LoRA; were a manager built with LoRA cases, it would stay vLLM's."""
    config = engine()
    graphs = plain_step_graphs(state(), config, scheduled_switch=True)
    m = vllm.model(config, "cpu", CUDAGraphMode.FULL_AND_PIECEWISE, decode_query_len=5, lora_capture_cases=[0, 1])
    assert not graphs.descs and not hasattr(m, "_vegas_plain") and not q1(m)


def test_with_plain_steps_q1_full_graphs_are_captured_and_vllms_stay(vllm):
    config = engine()
    graphs = plain_step_graphs(state(), config, scheduled_switch=True)
    reference = manager(CudaGraphManager, engine())
    m = manager(vllm.model, config)
    assert config.compilation_config.cudagraph_capture_sizes == [5, 10, 20, 25]  # multiples of γ + 1
    want = [BatchExecutionDescriptor(CUDAGraphMode.FULL, n, n, uniform_token_count=1) for n in (5, 8)]
    assert graphs.descs == want and sorted(q1(m), key=lambda d: d.num_tokens) == want
    assert [d for d in full(m) if d.uniform_token_count != 1] == full(reference)  # vLLM's FULL graphs, all kept
    assert [d.num_tokens for d in full(m)] == sorted((d.num_tokens for d in full(m)), reverse=True)
    assert m._candidates == reference._candidates  # vLLM's dispatch lists untouched
    assert m._capture_descs[CUDAGraphMode.PIECEWISE] == reference._capture_descs[CUDAGraphMode.PIECEWISE]
    capture(m)
    assert all(d in m.graphs for d in want)


@SKIPPED_ONLY
def test_dispatch_replays_q1_graphs_only_for_skipped_steps(vllm, in_draft, fallback):
    config = engine()
    st = state(in_draft=in_draft)
    graphs = plain_step_graphs(st, config, scheduled_switch=True, fallback=fallback)
    assert not graphs.selects
    reference = manager(CudaGraphManager, engine())
    m = manager(vllm.model, config)
    st.scheduled_skip = True
    assert m.dispatch(3, 3, 1, 0).cg_mode == CUDAGraphMode.NONE  # nothing captured yet: eager, as vLLM
    capture(m)
    capture(reference)
    five, eight = graphs.descs
    # a skipped step of 3 one-token requests: the 5-request q-len-1 graph, padded as vLLM pads
    assert m.dispatch(3, 3, 1, 0) == five and _is_compatible(five, 3, 3, 1, 0)
    assert m.dispatch(1, 1, 1, 0) == five and m.dispatch(6, 6, 1, 0) == eight and m.dispatch(8, 8, 1, 0) == eight
    assert graphs.steps == 4
    # vLLM's path without a q-len-1 graph: 9 requests (above max_num_seqs' graph), or a step that verifies drafts
    # (query length γ + 1: its FULL decode graph, selection included), or a mixed batch
    for args in [(9, 9, 1, 0), (2, 10, 5, 0), (3, 7, None, 0)]:
        assert m.dispatch(*args) == reference.dispatch(*args)
    assert m.dispatch(2, 10, 5, 0).cg_mode == CUDAGraphMode.FULL and m.dispatch(2, 10, 5, 0).uniform_token_count == 5
    assert graphs.steps == 4
    # a q-len-1 batch that selects (the first drafting step after plain steps), or a step without the
    # scheduler's decision: vLLM's dispatch, i.e. its piecewise graph, never the graph without selection
    for decision in (False, None):
        st.scheduled_skip = decision
        desc = m.dispatch(3, 3, 1, 0)
        assert desc == reference.dispatch(3, 3, 1, 0) and desc.cg_mode == CUDAGraphMode.PIECEWISE
    assert graphs.steps == 4 and graphs.select_steps == 0


def capture_selecting(m, st) -> tuple[list, list]:
    """vLLM's capture with forwards that run the attention override's selection hook
    (``SelectionState.on_layer``) at their first layer; returns the descriptors of the forwards that
    began a selection (``_begin_forward``) and every forward's ``(desc, warmup)``."""
    st.layers_ready, st.path = True, object()
    began, forwards = [], []
    st._begin_forward = lambda query, kv_cache, meta, fa3_heads=0: began.append(meta.desc)

    def create_forward_fn(desc, warmup):
        q_len = desc.uniform_token_count or 1
        meta = SimpleNamespace(desc=desc, max_query_len=q_len, num_actual_tokens=desc.num_tokens,
                               query_start_loc=torch.arange(0, desc.num_tokens + 1, q_len))

        def forward_fn(cg_mode):
            forwards.append((desc, warmup))
            st.on_layer(0, torch.zeros(desc.num_tokens, 1, 8), torch.zeros(1), meta, 1.0)

        return forward_fn, None

    m.capture(create_forward_fn, "test")
    return began, forwards


@SKIPPED_ONLY
def test_capture_runs_the_q1_forwards_with_the_selection_skipped(vllm, in_draft, fallback):
    """Each captured forward runs the attention override's selection hook (SelectionState.on_layer):
    vLLM's γ + 1 graphs and piecewise graphs select, the q-len-1 graphs (warm-up and captured
    forward alike) do not; the capture leaves no decision behind."""
    config = engine()
    st = state(in_draft=in_draft)
    graphs = plain_step_graphs(st, config, scheduled_switch=True, fallback=fallback)
    m = manager(vllm.model, config)
    began, forwards = capture_selecting(m, st)
    plain = set(graphs.descs)
    for desc in plain:  # warm-up and capture pass, both skipped
        assert [w for d, w in forwards if d == desc] == [True, False] and desc not in began
    others = {d for d, _ in forwards} - plain
    assert others and all(d in began for d in others)
    assert st.scheduled_skip is None and st.skipped is False and not st.take_skip()


@pytest.mark.parametrize("in_draft, fallback, selects", [
    (True, False, True),  # the selection deferred to the draft phase, the prefill skip alone
    (True, True, False),  # the measured fallback: its plain steps must cost what plain vLLM's cost
    (False, False, False),  # the selection inside the verification: a score pass in every plain step
    (False, True, False),
])
def test_q1_graphs_select_only_under_select_in_draft_without_the_fallback(vllm, in_draft, fallback, selects):
    graphs = plain_step_graphs(state(in_draft=in_draft), engine(), scheduled_switch=True, fallback=fallback)
    assert graphs.selects is selects


def test_selecting_q1_graphs_replay_every_q1_batch(vllm):
    """With select_in_draft and no fallback every uniform query-length-1 batch that fits replays a
    q-len-1 graph, whatever the scheduler decided; ``steps`` counts the skipped ones,
    ``select_steps`` the others; mixed and γ + 1 batches keep vLLM's dispatch."""
    config = engine()
    st = state(in_draft=True)
    graphs = plain_step_graphs(st, config, scheduled_switch=True, fallback=False)
    reference = manager(CudaGraphManager, engine())
    m = manager(vllm.model, config)
    st.scheduled_skip = False
    assert m.dispatch(3, 3, 1, 0).cg_mode == CUDAGraphMode.NONE  # nothing captured yet: eager, as vLLM
    capture(m)
    capture(reference)
    five, eight = graphs.descs
    assert graphs.steps == graphs.select_steps == 0
    for decision, steps, select_steps in [(True, 1, 0), (False, 1, 1), (None, 1, 2)]:
        st.scheduled_skip = decision
        assert m.dispatch(3, 3, 1, 0) == five
        assert (graphs.steps, graphs.select_steps) == (steps, select_steps)
    st.scheduled_skip = False  # the first drafting step after a skipped one
    assert m.dispatch(1, 1, 1, 0) == five and m.dispatch(6, 6, 1, 0) == eight and m.dispatch(8, 8, 1, 0) == eight
    assert (graphs.steps, graphs.select_steps) == (1, 5)
    for decision in (True, False, None):
        st.scheduled_skip = decision
        for args in [(9, 9, 1, 0), (2, 10, 5, 0), (3, 7, None, 0)]:  # too many requests, γ + 1, mixed
            assert m.dispatch(*args) == reference.dispatch(*args)
        assert m.dispatch(2, 10, 5, 0).cg_mode == CUDAGraphMode.FULL and m.dispatch(2, 10, 5, 0).uniform_token_count == 5
    assert (graphs.steps, graphs.select_steps) == (1, 5)


def test_capture_runs_selecting_q1_forwards_with_the_selection(vllm):
    """With select_in_draft and no fallback the q-len-1 forwards (warm-up and captured) select as
    vLLM's γ + 1 ones do; the capture leaves no decision behind."""
    config = engine()
    st = state(in_draft=True)
    graphs = plain_step_graphs(st, config, scheduled_switch=True, fallback=False)
    m = manager(vllm.model, config)
    began, forwards = capture_selecting(m, st)
    for desc in graphs.descs:
        assert [w for d, w in forwards if d == desc] == [True, False] and began.count(desc) == 2
    assert {d for d, _ in forwards} <= set(began)  # every forward selected
    assert st.scheduled_skip is None and st.skipped is False and not st.take_skip()


def test_capture_log_says_the_q1_graphs_select(vllm, monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vegas.vllm"), "propagate", True)
    config = engine(max_num_seqs=8)
    graphs = plain_step_graphs(state(in_draft=True), config, scheduled_switch=True)  # noqa: F841
    m = manager(vllm.model, config)
    with caplog.at_level(logging.INFO, logger="vegas.vllm"):
        capture(m)
    lines = [r.getMessage() for r in caplog.records if "plain steps" in r.getMessage()]
    assert lines == ["vegas: full CUDA graphs for plain steps (query length 1) up to 8 requests "
                     "(2 graphs, with the selection: select_in_draft)"]


def test_skipping_restores_the_decision(vllm):
    st = state()
    st.scheduled_skip, st.skipped = False, False
    with st.skipping():
        assert st.skips(None) and st.skipped
    assert st.scheduled_skip is False and st.skipped is False


def test_capture_logs_what_the_plain_step_graphs_cover(vllm, monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vegas.vllm"), "propagate", True)
    config = engine(max_num_seqs=8)
    graphs = plain_step_graphs(state(), config, scheduled_switch=True)  # noqa: F841 (the speculator holds it)
    m = manager(vllm.model, config)
    with caplog.at_level(logging.INFO, logger="vegas.vllm"):
        capture(m)
    lines = [r.getMessage() for r in caplog.records if "plain steps" in r.getMessage()]
    assert lines == ["vegas: full CUDA graphs for plain steps (query length 1) up to 8 requests (2 graphs)"]
    caplog.clear()
    plain = manager(vllm.model, engine())  # another engine, without plain steps: says nothing
    with caplog.at_level(logging.INFO, logger="vegas.vllm"):
        capture(plain)
    assert not [r for r in caplog.records if "plain steps" in r.getMessage()]


def test_the_registry_keys_by_the_engines_config_object():
    config = engine()
    graphs = plain_step_graphs(state(), config, scheduled_switch=True)
    assert plain_graphs.lookup(config) is graphs
    assert plain_graphs.lookup(engine()) is None and plain_graphs.lookup(None) is None
    other = engine()
    plain_graphs._ENGINES[id(other)] = graphs  # a recycled id of a config that is gone
    assert plain_graphs.lookup(other) is None
    del plain_graphs._ENGINES[id(other)]
    del graphs  # the speculator owns it: gone with the speculator
    import gc

    gc.collect()
    assert plain_graphs.lookup(config) is None
