"""The patch table (:mod:`vegas.vllm_plugin.patches`) against fake vLLM modules: the check at
plugin registration refuses another vLLM version, a replaced function that is missing or takes
other parameters, or a module that no longer imports it by name; every ``patch_*`` installs
only table entries; the V1 runner is handed to the proposer by ``load_model``. No vLLM, no GPU.

The fakes' signatures are copied by hand from vLLM 0.24.0's source (not from the table), so a
table entry that drifts from vLLM fails here."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from vegas.vllm_plugin import patches


# ---- vLLM 0.24.0's signatures (vllm/v1/..., vllm/config/vllm.py), copied by hand -------------
def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
             output_block_scale=None):
    return "vllm-forward"


def _scheduler_init(self, vllm_config, kv_cache_config, structured_output_manager, block_size,
                    hash_block_size=None, mm_registry=None, include_finished_set=False, log_stats=False):
    self.vllm_config = vllm_config
    self.num_lookahead_tokens = 0
    self.num_spec_tokens = 4


def _draft_probs(self, spec_decode_metadata):
    return "vllm-probs"


def _bookkeeping_sync(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens):
    return "vllm-bookkeeping"


def _capture_model(self):
    return 0


def _load_model(self, load_dummy_weights=False):
    self.loaded = True
    if self.drafter is not None:
        self.drafter.load_model("model")


def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                   **model_kwargs):
    return None


def _post_init(self):
    pass


def _update_after_schedule(self, scheduler_output):
    self.reserved = scheduler_output.num_spec_tokens_to_schedule


def _update_from_output(self, scheduler_output, model_runner_output):
    return {0: "vllm-outputs"}


def _execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False,
                   skip_attn_for_dummy_run=False, is_profile=False):
    return ("vllm-execute", dummy_run)


def _unsupported(self):
    return []


def _compute_hash(self):
    return repr(getattr(self, "additional_config", None))


def _init_speculator(vllm_config, device):
    return None


def _init_candidates(self):
    self.candidates = "vllm"


def _dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
    return "vllm-desc"


def _capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
    return {}


def _rejection_sample(target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
                      expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps,
                      synthetic_conditional_rates=None, use_fp64=False):
    """Stands in for vLLM's kernel: accepts every draft (its output is what the coupling replaces)."""
    import torch

    num_reqs = cu_num_logits.shape[0] - 1
    sampled = torch.full((num_reqs, num_speculative_steps + 1), -7, dtype=torch.int64)
    for r in range(num_reqs):
        a, b = int(cu_num_logits[r]), int(cu_num_logits[r + 1])
        sampled[r, : b - a - 1] = draft_sampled[a + 1 : b]
        sampled[r, b - a - 1] = 999
    num_sampled = (cu_num_logits[1:] - cu_num_logits[:-1]).to(torch.int32)
    return sampled, num_sampled


def _rejection_call(self, logits, input_batch, draft_logits=None):
    """vLLM 0.24.0's ``RejectionSampler.__call__`` reduced to its call of ``rejection_sample`` (by the
    name its module imported), with processed logits = logits."""
    ib = input_batch
    return sys.modules["vllm.v1.worker.gpu.spec_decode.rejection_sampler"].rejection_sample(
        logits, draft_logits, ib.draft_sampled, ib.cu_num_logits, ib.pos, ib.idx_mapping, ib.expanded_idx_mapping,
        ib.expanded_local_pos, ib.temperature, ib.seeds, 4, None, use_fp64=False)


def _gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature,
                   output_processed_logits=None, output_processed_logits_col=None, use_fp64=False):
    """A reference of vLLM's counter-based Gumbel-max sampler: noise keyed by (seed, pos) only."""
    import torch

    out = []
    for i in range(logits.shape[0]):
        slot = int(expanded_idx_mapping[i])
        g = torch.Generator().manual_seed(int(seed[slot]) * 1_000_003 + int(pos[i]))
        noise = -torch.log(-torch.log(torch.rand(logits.shape[1], generator=g).clamp_min(1e-20)))
        out.append(int(torch.argmax(logits[i] + (noise if float(temperature[slot]) else 0))))
    return torch.tensor(out, dtype=torch.int64)


def fake_vllm(monkeypatch, tmp_path, version="0.24.0", runner_imports=True, **replace):
    """Install fake ``vllm`` modules holding every object of :data:`patches.PATCHES` with vLLM
    0.24.0's signatures; ``replace`` swaps one by its attribute name (``_bookkeeping_sync=...``)."""
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    def fn(name):
        return replace.get(name, globals()[name if name.startswith("_") else "_" + name])

    mod("vllm", __version__=version)
    for name in ("vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.v1.core",
                 "vllm.v1.core.sched", "vllm.v1.worker", "vllm.v1.worker.gpu"):
        mod(name)
    mod("vllm.v1.attention.backends.flash_attn",
        FlashAttentionImpl=type("FlashAttentionImpl", (), {"forward": fn("_forward")}))
    scheduler = type("Scheduler", (), {"__init__": fn("_scheduler_init"), "update_from_output": fn("_update_from_output")})
    mod("vllm.v1.core.sched.scheduler", Scheduler=scheduler)
    mod("vllm.v1.core.sched.async_scheduler",
        AsyncScheduler=type("AsyncScheduler", (scheduler,), {"_update_after_schedule": fn("_update_after_schedule")}))
    config = type("VllmConfig", (), {
        "__post_init__": fn("_post_init"), "_get_v2_model_runner_unsupported_features": fn("_unsupported"),
        "compute_hash": fn("_compute_hash")})
    mod("vllm.config", VllmConfig=config)  # a package in vLLM: the class lives in vllm.config.vllm
    mod("vllm.config.vllm", VllmConfig=config)
    runner = {"_get_spec_decode_draft_probs": fn("_draft_probs"), "_bookkeeping_sync": fn("_bookkeeping_sync"),
              "capture_model": fn("_capture_model"), "load_model": fn("_load_model"),
              "_model_forward": fn("_model_forward"), "drafter": None}
    mod("vllm.v1.worker.gpu_model_runner", GPUModelRunner=type("GPUModelRunner", (), runner))
    mod("vllm.v1.worker.gpu.spec_decode", init_speculator=fn("_init_speculator"))
    mod("vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils", rejection_sample=fn("_rejection_sample"))
    mod("vllm.v1.worker.gpu.sample")
    mod("vllm.v1.worker.gpu.sample.gumbel", gumbel_sample=_gumbel_sample)
    rs_source = tmp_path / "rejection_sampler.py"  # vLLM's own form of the import, parenthesised
    rs_source.write_text("from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import (\n    rejection_sample,\n)\n")
    rs = mod("vllm.v1.worker.gpu.spec_decode.rejection_sampler", rejection_sample=fn("_rejection_sample"),
             RejectionSampler=type("RejectionSampler", (), {"__call__": fn("_rejection_call")}))
    rs.__spec__ = importlib.util.spec_from_file_location("vllm.v1.worker.gpu.spec_decode.rejection_sampler", rs_source)
    mod("vllm.v1.worker.gpu.cudagraph_utils", CudaGraphManager=type("CudaGraphManager", (), {
        "_init_candidates": fn("_init_candidates"), "dispatch": fn("_dispatch"), "capture": fn("_capture")}))
    source = tmp_path / "model_runner.py"
    source.write_text("from vllm.v1.worker.gpu.spec_decode import init_speculator\n" if runner_imports
                      else "from vllm.v1.worker.gpu.spec_decode import build_speculator\n")
    m = mod("vllm.v1.worker.gpu.model_runner",
            GPUModelRunner=type("GPUModelRunner", (), {"execute_model": fn("_execute_model"), "speculator": None}))
    m.__spec__ = importlib.util.spec_from_file_location("vllm.v1.worker.gpu.model_runner", source)
    return sys.modules


def test_the_table_matches_vllm_0_24_0(monkeypatch, tmp_path):
    fake_vllm(monkeypatch, tmp_path)
    patches.check_vllm()
    assert len(patches.PATCHES) == len({p.target for p in patches.PATCHES}) == 19
    assert all(p.why and p.params for p in patches.PATCHES)


def test_another_vllm_version_is_refused_at_registration(monkeypatch, tmp_path):
    from vegas.vllm_plugin import register

    modules = fake_vllm(monkeypatch, tmp_path, version="0.25.0")
    with pytest.raises(patches.VllmVersionError, match=r"supports vLLM 0\.24\.0 only, found 0\.25\.0"):
        register()
    forward = modules["vllm.v1.attention.backends.flash_attn"].FlashAttentionImpl.forward
    assert not getattr(forward, "_vegas", False)  # refused before anything was replaced


@pytest.mark.parametrize("name,changed,match", [
    ("_bookkeeping_sync", lambda self, scheduler_output, sampler_output: None,
     r"GPUModelRunner\._bookkeeping_sync has parameters \('self', 'scheduler_output', 'sampler_output'\)"),
    ("_forward", lambda self, layer, query, key, value, kv_cache, attn_metadata, output: None,
     r"FlashAttentionImpl\.forward has parameters"),
    ("_init_speculator", lambda vllm_config, device, extra: None, r"spec_decode:init_speculator has parameters"),
    ("_unsupported", lambda self, extra: [], r"_get_v2_model_runner_unsupported_features has parameters"),
    ("_load_model", lambda self: None, r"GPUModelRunner\.load_model has parameters"),
    ("_dispatch", lambda self, num_reqs, num_tokens, uniform_token_count: None,
     r"CudaGraphManager\.dispatch has parameters"),
])
def test_a_changed_signature_is_refused_naming_the_function(monkeypatch, tmp_path, name, changed, match):
    fake_vllm(monkeypatch, tmp_path, **{name: changed})
    with pytest.raises(patches.VllmVersionError, match=match + r".*vLLM 0\.24\.0"):
        patches.check_vllm()


def test_a_missing_function_or_import_is_refused(monkeypatch, tmp_path):
    modules = fake_vllm(monkeypatch, tmp_path)
    del modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner.capture_model
    with pytest.raises(patches.VllmVersionError, match=r"GPUModelRunner\.capture_model is missing.*0\.24\.0"):
        patches.check_vllm()
    fake_vllm(monkeypatch, tmp_path, runner_imports=False)
    with pytest.raises(patches.VllmVersionError, match=r"model_runner no longer imports .*init_speculator"):
        patches.check_vllm()


def test_every_patch_installs_a_table_entry_once(monkeypatch, tmp_path):
    from vegas.vllm_plugin import _build_v2_speculator, register

    modules = fake_vllm(monkeypatch, tmp_path)
    register()
    register()  # idempotent, and the check still passes on the wrapped functions
    for install in (patches.patch_draft_probs_gather, patches.patch_bookkeeping,
                    patches.patch_draft_graph_capture, patches.patch_runner_binding, patches.patch_v2_execute_model,
                    patches.patch_plain_step_graphs, patches.patch_v2_coupled_verification):
        install()
        install()
    patches.patch_v2_runner(_build_v2_speculator)
    patches.check_vllm()
    for patch in patches.PATCHES:
        owner, attr, obj = patches._resolve(patch.target)
        if attr == "_model_forward":  # replaced per runner instance (time_runner_forward)
            assert not getattr(obj, "_vegas", False)
            continue
        assert obj._vegas and not getattr(obj._vegas_original, "_vegas", False), patch.target
    with pytest.raises(AssertionError, match="not in PATCHES"):
        patches._install("vllm.config.vllm:VllmConfig.__init__", lambda original: original)
    assert modules["vllm.config"].VllmConfig.__init__ is object.__init__


def test_the_runner_is_handed_to_the_proposer_before_it_loads_the_model(monkeypatch, tmp_path):
    modules = fake_vllm(monkeypatch, tmp_path)
    patches.patch_runner_binding()
    seen = []

    class Drafter:  # what VegasProposer does with the two calls
        runner = None

        def bind_runner(self, runner):
            self.runner = runner

        def load_model(self, model):
            seen.append((self.runner, model))

    runner = modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner()
    runner.drafter = Drafter()
    runner.load_model()
    assert seen == [(runner, "model")] and runner.loaded
    plain = modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner()  # no drafter: vLLM's load only
    plain.load_model()
    assert plain.loaded


def test_the_attention_override_selects_into_the_state_on_its_layer(monkeypatch, tmp_path):
    """patch_attention: vLLM's FA3 call runs for every layer; a layer that carries an enabled
    selection state (``LAYER_ATTR``, attached by the drafter) then hands the forward to that
    state's ``on_layer``, unless its ``verify_layer`` ran the layer instead; a layer without
    one (an engine without the Vegas drafter) or with a disabled one runs vLLM's call only."""
    from types import SimpleNamespace

    import torch

    from vegas.vllm_plugin.selection.state import LAYER_ATTR

    modules = fake_vllm(monkeypatch, tmp_path)
    utils = types.ModuleType("vllm.model_executor.models.utils")
    utils.extract_layer_index = lambda name: int(name.split(".")[1])
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.utils", utils)
    patches.patch_attention()
    impl_cls = modules["vllm.v1.attention.backends.flash_attn"].FlashAttentionImpl
    impl = impl_cls()
    impl.scale, impl.logits_soft_cap = 0.5, 0.0

    class State:  # the two calls the override makes on a SelectionState
        def __init__(self, enabled=True, verifies=False):
            self.enabled, self.verifies, self.calls = enabled, verifies, []

        def verify_layer(self, impl_, layer_idx, query, kv_cache, attn_metadata, output):
            self.calls.append(("verify_layer", layer_idx))
            return self.verifies

        def on_layer(self, layer_idx, query, kv_cache, attn_metadata, scale, softcap=0.0):
            self.calls.append(("on_layer", layer_idx, scale, softcap))

    def forward(layer):
        q, kv, out = torch.zeros(2, 1, 4), torch.zeros(1, 2, 16, 1, 4), torch.ones(2, 1, 4)
        return impl.forward(layer, q, None, None, kv, SimpleNamespace(), out)

    plain = SimpleNamespace(layer_name="layers.0.attn")
    assert forward(plain) == "vllm-forward"
    states = {i: State(**kw) for i, kw in enumerate([{}, {"verifies": True}, {"enabled": False}], start=1)}
    layers = {i: SimpleNamespace(layer_name=f"layers.{i}.attn", **{LAYER_ATTR: st})
              for i, st in states.items()}
    assert forward(layers[1]) == "vllm-forward"
    assert states[1].calls == [("verify_layer", 1), ("on_layer", 1, 0.5, 0.0)]
    assert torch.equal(forward(layers[2]), torch.ones(2, 1, 4))  # verify_layer ran it: its output, no vLLM call
    assert states[2].calls == [("verify_layer", 2)]
    assert forward(layers[3]) == "vllm-forward" and states[3].calls == []


def test_the_config_hash_leaves_the_vegas_settings_out(monkeypatch, tmp_path):
    """Engines that differ only in additional_config["vegas"] hash alike (one compilation);
    other additional_config keys still count, and the config keeps its settings."""
    from vegas.vllm_plugin import register

    modules = fake_vllm(monkeypatch, tmp_path)
    register()
    config_cls = modules["vllm.config.vllm"].VllmConfig

    def config(extra):
        c = config_cls()
        c.additional_config = extra
        return c

    a = config({"vegas": {"selector": "collect2"}, "other": 1})
    b = config({"vegas": {"selector": "quest", "kv_budget": 64}, "other": 1})
    assert a.compute_hash() == b.compute_hash() == config({"other": 1}).compute_hash()
    assert a.compute_hash() != config({"vegas": {"selector": "collect2"}, "other": 2}).compute_hash()
    assert a.additional_config == {"vegas": {"selector": "collect2"}, "other": 1}  # restored
    assert config(None).compute_hash() == "None"


@pytest.mark.parametrize("method,asked,want", [
    ("custom_class", None, True),    # Vegas, the user did not decide: one KV-cache group
    ("custom_class", False, False),  # the user asked for the hybrid manager: kept (the drafter refuses two groups)
    ("custom_class", True, True),
    ("ngram", None, None),           # not Vegas: vLLM decides
])
def test_vegas_asks_for_one_kv_cache_group_unless_the_user_decided(method, asked, want):
    from types import SimpleNamespace

    model = "vegas.vllm_plugin.proposer.VegasProposer" if method == "custom_class" else None
    config = SimpleNamespace(speculative_config=SimpleNamespace(method=method, model=model),
                             scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=asked))
    patches.one_kv_group(config)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is want
    plain = SimpleNamespace(speculative_config=None, scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=None))
    patches.one_kv_group(plain)
    assert plain.scheduler_config.disable_hybrid_kv_cache_manager is None


def test_vegas_log_lines_go_where_vllms_go(monkeypatch):
    """vLLM configures only its own logger: Vegas' INFO lines ("vegas: asynchronous scheduling
    on") reached no vllm serve log. register() hands vLLM's handlers and level to ``vegas.vllm``,
    unless logging was configured by the program (root handlers) or for vegas already."""
    import io
    import logging

    from vegas.vllm_plugin import log_with_vllm

    ours, theirs, root = logging.getLogger("vegas.vllm"), logging.getLogger("vllm"), logging.getLogger()
    for logger in (ours, theirs, root):
        monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(ours, "propagate", True)
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(theirs, "level", logging.INFO)
    log_with_vllm()  # vLLM has no handler (VLLM_CONFIGURE_LOGGING=0): nothing to share
    assert ours.handlers == []
    out = io.StringIO()
    theirs.handlers = [logging.StreamHandler(out)]
    root.handlers = [logging.NullHandler()]
    log_with_vllm()  # the program configured logging: left alone
    assert ours.handlers == []
    root.handlers = []
    log_with_vllm()
    log_with_vllm()  # idempotent
    ours.info("vegas: asynchronous scheduling on")
    ours.debug("not at vLLM's level")
    assert out.getvalue() == "vegas: asynchronous scheduling on\n" and ours.handlers == theirs.handlers
    assert not ours.propagate


# ---- the per-step draft switch (vegas.vllm_plugin.step_switch) --------------------------------
def test_the_scheduler_reserves_no_draft_slots_after_a_prefill_heavy_step(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from vegas.vllm_plugin.step_switch import StepSwitch

    modules = fake_vllm(monkeypatch, tmp_path)
    patches.patch_scheduler_switch()
    cls = modules["vllm.v1.core.sched.async_scheduler"].AsyncScheduler
    sched = cls.__new__(cls)

    def step(tokens, spec):
        out = SimpleNamespace(num_scheduled_tokens=tokens, scheduled_spec_decode_tokens=spec,
                              num_spec_tokens_to_schedule=4)
        sched._update_after_schedule(out)
        return sched.reserved

    decode = {"a": 5, "b": 5}
    spec = {"a": [-1] * 4, "b": [-1] * 4}
    assert step({**decode, "c": 3000}, spec) == 4  # no switch: vLLM's γ stands
    sched.vegas_switch = StepSwitch.of(4, prefill_skip_tokens=2048, fallback=False)
    assert step({**decode, "c": 3000}, spec) == 0  # a 3000-token chunk: the next step verifies no drafts
    assert step({**decode, "c": 2000}, spec) == 4  # 1999 prompt tokens < 2048
    assert step(decode, spec) == 4
    assert step({"a": 1, "b": 1}, {}) == 4  # a plain step after a skip drafts again


def test_every_step_output_reaches_the_measured_fallback(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from vegas.vllm_plugin.step_switch import StepSwitch

    modules = fake_vllm(monkeypatch, tmp_path)
    patches.patch_scheduler_switch()
    cls = modules["vllm.v1.core.sched.async_scheduler"].AsyncScheduler
    sched = cls.__new__(cls)
    out = SimpleNamespace(num_scheduled_tokens={"a": 5}, scheduled_spec_decode_tokens={"a": [-1] * 4},
                          num_spec_tokens_to_schedule=4)
    assert sched.update_from_output(out, SimpleNamespace(sampled_token_ids=[[1, 2, 3]])) == {0: "vllm-outputs"}
    sched.vegas_switch = StepSwitch.of(4, prefill_skip_tokens=0, fallback=True)
    seen = []
    sched.vegas_switch.fallback.observe = lambda drafts, tokens, decode_only: seen.append((drafts, tokens, decode_only))
    assert sched.update_from_output(out, SimpleNamespace(sampled_token_ids=[[1, 2, 3]])) == {0: "vllm-outputs"}
    assert seen == [(4, 3, True)]


def test_a_vegas_scheduler_switches_on_v2_with_async_scheduling_only():
    from types import SimpleNamespace

    def cfg(async_scheduling, limit, fallback=False):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                               speculative_config=SimpleNamespace(num_speculative_tokens=4),
                               additional_config={"vegas": {"vllm": {"prefill_skip_tokens": limit,
                                                                     "fallback": fallback}}})

    switch = patches.scheduler_switch(cfg(True, 2048), use_v2_model_runner=True)
    assert switch.prefill_skip_tokens == 2048 and switch.gamma == 4 and switch.fallback is None
    assert patches.scheduler_switch(cfg(True, 2048), use_v2_model_runner=False) is None  # V1 decides itself
    assert patches.scheduler_switch(cfg(False, 2048), use_v2_model_runner=True) is None  # no placeholders
    assert patches.scheduler_switch(cfg(True, 0), use_v2_model_runner=True) is None  # nothing to decide
    assert patches.scheduler_switch(cfg(True, 0, fallback=True), use_v2_model_runner=True).fallback is not None
    # unset (None): 2,048 where the scheduler decides (the default since 2026-12-03), nothing elsewhere
    assert patches.scheduler_switch(cfg(True, None), use_v2_model_runner=True).prefill_skip_tokens == 2048
    assert patches.scheduler_switch(cfg(False, None), use_v2_model_runner=True) is None


def test_prefill_skip_default_applies_only_where_the_scheduler_decides():
    from vegas.config import VegasConfig, VegasConfigError
    from vegas.vllm_plugin.step_switch import prefill_skip_tokens

    assert VegasConfig().vllm.prefill_skip_tokens is None
    assert prefill_skip_tokens(None, scheduler_decides=True) == 2048
    assert prefill_skip_tokens(None, scheduler_decides=False) == 0  # V1, synchronous: not measured, off
    assert prefill_skip_tokens(0, scheduler_decides=True) == 0 and prefill_skip_tokens(512, False) == 512
    with pytest.raises(VegasConfigError, match="vllm.prefill_skip_tokens"):
        VegasConfig(vllm={"prefill_skip_tokens": -1})


def test_a_real_v2_step_hands_its_schedule_and_runner_to_the_speculator_first(monkeypatch, tmp_path):
    modules = fake_vllm(monkeypatch, tmp_path)
    patches.patch_v2_execute_model()
    seen = []

    class Speculator:
        def on_schedule(self, scheduler_output):
            seen.append(scheduler_output)

        def on_runner(self, runner):
            seen.append(runner)

    runner = modules["vllm.v1.worker.gpu.model_runner"].GPUModelRunner()
    runner.speculator = Speculator()
    assert runner.execute_model("step-1") == ("vllm-execute", False)
    assert runner.execute_model("dummy", None, True) == ("vllm-execute", True)  # dummy runs: not handed over
    assert seen == ["step-1", runner]
    plain = modules["vllm.v1.worker.gpu.model_runner"].GPUModelRunner()  # no Vegas speculator
    assert plain.execute_model("step") == ("vllm-execute", False)


def test_coupled_engines_emit_the_targets_seeded_samples_and_others_are_untouched(monkeypatch, tmp_path):
    """The V2 rejection sampler of a Vegas engine with ``seeded_verification="coupled"``: rows with an
    explicit seed emit the target's own samples (vLLM's gumbel_sample at each logit) up to the first
    draft that differs; rows without a seed, and other engines, keep vLLM's output."""
    import numpy as np
    import torch

    from vegas.vllm_plugin import coupling

    modules = fake_vllm(monkeypatch, tmp_path)
    monkeypatch.setattr(coupling, "_ENGINES", {})
    patches.patch_v2_coupled_verification()
    rs_mod = modules["vllm.v1.worker.gpu.spec_decode.rejection_sampler"]
    assert rs_mod.rejection_sample._vegas  # the name the sampler's module imported is replaced too
    vocab, cu = 11, torch.tensor([0, 5, 10, 11], dtype=torch.int32)  # two requests verifying 4 drafts, one prefill
    logits = torch.randn(11, vocab, generator=torch.Generator().manual_seed(0))
    ib = types.SimpleNamespace(cu_num_logits=cu, pos=torch.tensor([20, 21, 22, 23, 24, 7, 8, 9, 10, 11, 3]),
                               idx_mapping=torch.tensor([2, 0, 1]), idx_mapping_np=np.array([2, 0, 1]),
                               expanded_idx_mapping=torch.tensor([2] * 5 + [0] * 5 + [1]),
                               expanded_local_pos=torch.zeros(11, dtype=torch.int64),
                               temperature=torch.tensor([0.8, 0.8, 0.8]), seeds=torch.tensor([5, 6, 123]))
    target = _gumbel_sample(logits, ib.expanded_idx_mapping, ib.temperature, ib.seeds, ib.pos, False)
    drafts = torch.randint(0, vocab, (11,), generator=torch.Generator().manual_seed(1))
    drafts[1:3] = target[0:2]  # request 0 (slot 2): drafts 1 and 2 equal the target's tokens, draft 3 not
    drafts[3] = (target[2] + 1) % vocab
    ib.draft_sampled = drafts
    sampler = rs_mod.RejectionSampler()
    sampler.sampler = types.SimpleNamespace(sampling_states=types.SimpleNamespace(seeds_set=np.array([False, True, True])))
    engine_logits = torch.zeros(4, 4, vocab)
    state = coupling.CoupledRows(3, "cpu")
    coupling.register_engine(engine_logits, state)

    plain_out = sampler(logits, ib, torch.zeros(4, 4, vocab))  # another engine: vLLM's output
    sampled, num_sampled = sampler(logits, ib, engine_logits)
    assert torch.equal(plain_out[0][1], sampled[1]) and int(num_sampled[1]) == int(plain_out[1][1])  # slot 0: no seed
    assert num_sampled.tolist() == [3, 5, 1]
    assert sampled[0, :3].tolist() == target[0:3].tolist()  # 2 accepted drafts, then the target's own token
    assert sampled[2, :1].tolist() == target[10:11].tolist()  # a request without drafts: its plain sample
    assert coupling.active_rows() is None  # marked only while its call runs
