import importlib.metadata
import inspect
import subprocess
import sys

import pytest

from vegas import Pipeline, VegasConfig, VegasConfigError, VegasPluginError, hookspecs, plugins
from vegas.strategies import Collect2Selector

from .plugins.fixture_plugins import (
    BadNamePlugin,
    BadSelectionPlugin,
    FactoryRaisingBackendPlugin,
    FailingSelectorsPlugin,
    GoodPlugin,
    NotAClassPlugin,
    NotADictPlugin,
    RaisingPlugin,
    ShadowingPlugin,
)


@pytest.fixture
def registered():
    names = []

    def add(plugin, name):
        plugins.register(plugin, name=name)
        names.append(name)

    yield add
    for name in names:
        plugins.unregister(name)


def test_builtins_are_registered_through_the_hooks():
    assert {"collect2", "aggregated", "sliding_window", "quest", "last_token"} <= set(plugins.selector_names())
    assert {"hf", "vllm"} <= set(plugins.backend_names())


def test_every_hook_is_documented():
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("vegas_")]
    assert specs
    for spec in specs:
        assert spec.__doc__ and "Returns" in spec.__doc__, spec.__name__


def test_fixture_plugin_selector_runs_through_pipeline(pipe, code_prompts, registered):
    registered(GoodPlugin(), "good")
    out = pipe.generate([code_prompts[1][:300]], max_new_tokens=8, selector="sinks_only")
    ref = pipe.generate([code_prompts[1][:300]], max_new_tokens=8, selector=None)
    assert out[0].token_ids == ref[0].token_ids
    assert out[0].stats.iterations > 0


def test_raising_plugin_is_reported_and_others_still_work(registered, caplog):
    registered(RaisingPlugin(), "raising")
    registered(GoodPlugin(), "good")
    with caplog.at_level("WARNING"):
        names = plugins.selector_names()
    assert "sinks_only" in names and "collect2" in names
    assert any("'raising'" in m and "boom" in m for m in caplog.messages)


def test_a_selector_name_no_flag_could_choose_is_refused_and_the_report_names_the_hook(registered, caplog):
    """A name with a comma or a space is refused (``--selectors`` splits on commas); the report
    names the hook that failed, since the plugin's other hooks still count (its backend loads)."""
    registered(BadNamePlugin(), "badname")
    with caplog.at_level("WARNING"):
        names, backends = plugins.selector_names(), plugins.backend_names()
    assert "bad name,x" not in names and "collect2" in names and "hf_again" in backends
    assert any("plugin 'badname': its vegas_selectors() failed and was skipped" in m
               and "letters, digits" in m and "'bad name,x'" in m for m in caplog.messages), caplog.messages


def test_plugin_returning_no_dict_or_no_classes_is_skipped(registered, caplog):
    """A hook that returns a list, or maps names to non-classes, is logged by name and skipped;
    plain decoding and the built-ins keep working."""
    registered(NotADictPlugin(), "notadict")
    registered(NotAClassPlugin(), "notaclass")
    registered(GoodPlugin(), "good")
    with caplog.at_level("WARNING"):
        names = plugins.selector_names()
        backends = plugins.backend_names()
    assert "sinks_only" in names and "badvalue" not in names and "notabackend" not in backends
    assert any("'notadict'" in m and "must return a dict" in m for m in caplog.messages)
    assert any("'notaclass'" in m and "Selector subclass" in m for m in caplog.messages)
    with pytest.raises(VegasConfigError, match="selector must be one of"):
        plugins.create_selector("badvalue", VegasConfig())


def test_failing_selectors_and_backends_name_themselves_and_their_plugin(pipe, code_prompts, registered):
    """A selector that raises when built or when selecting, one whose select() returns no
    Selection, and a backend factory that raises, give a VegasPluginError naming the
    selector/backend and the plugin (the CLI prints it)."""
    registered(FailingSelectorsPlugin(), "failing")
    registered(FactoryRaisingBackendPlugin(), "boomplugin")
    with pytest.raises(VegasPluginError, match="selector 'initraise' \\(plugin 'failing'\\) failed to build: RuntimeError: init boom"):
        pipe.generate([code_prompts[0][:100]], max_new_tokens=4, selector="initraise")
    with pytest.raises(VegasPluginError, match="selector 'selectraise' \\(plugin 'failing'\\) raised in select\\(\\): RuntimeError: select boom"):
        pipe.generate([code_prompts[0][:100]], max_new_tokens=4, selector="selectraise")
    with pytest.raises(VegasPluginError, match="selector 'selectnone' \\(plugin 'failing'\\) select\\(\\) returned NoneType; "
                                               "it must return a vegas.interfaces.Selection"):
        pipe.generate([code_prompts[0][:100]], max_new_tokens=4, selector="selectnone")
    with pytest.raises(VegasPluginError, match="backend 'boombackend' \\(plugin 'boomplugin'\\) failed to load"):
        Pipeline(selector=None, backend="boombackend")
    assert pipe.generate([code_prompts[0][:100]], max_new_tokens=4, selector="collect2")[0].token_ids


def test_plugin_selections_outside_the_context_name_the_selector_and_plugin(pipe, code_prompts, registered):
    """Indices past the context, negative ones, or a Selection of the wrong shape from a plugin
    selector: a VegasPluginError naming it and its plugin, not an indexing error in the model."""
    registered(BadSelectionPlugin(), "badsel")
    prompt = [code_prompts[0][:200]]
    with pytest.raises(VegasPluginError, match=r"selector 'outofrange' \(plugin 'badsel'\) select\(\) returned a "
                                               r"Selection whose indices span \[\d+, \d+\]: real entries \(mask "
                                               r"True\) must be in \[0, \d+\)"):
        pipe.generate(prompt, max_new_tokens=4, selector="outofrange")
    with pytest.raises(VegasPluginError, match=r"selector 'wrongshape' \(plugin 'badsel'\) select\(\) returned a "
                                               r"Selection whose indices \(1, \d+\) and mask \(1, \d+\) are not both"):
        pipe.generate(prompt, max_new_tokens=4, selector="wrongshape")
    with pytest.raises(VegasPluginError, match=r"selector 'wronggroups' \(plugin 'badsel'\) select\(\) returned a "
                                               r"Selection whose groups dimension is \d+; it must be one of \[1"):
        pipe.generate(prompt, max_new_tokens=4, selector="wronggroups")
    with pytest.raises(VegasPluginError, match=r"selector 'overbudget' \(plugin 'badsel'\) select\(\) returned a "
                                               r"Selection with \d+ entries for sequence 0, over its KV budget of \d+"):
        Pipeline(selector="overbudget", kv_budget=32, min_kv_budget=0).generate(prompt, max_new_tokens=4)
    with pytest.raises(VegasPluginError, match=r"selector 'queryoutofrange' \(plugin 'badsel'\) select_for_query\(\) "
                                               r"returned a Selection whose indices span \[-\d+, -?\d+\]"):
        pipe.generate(prompt, max_new_tokens=4, selector="queryoutofrange")


def test_plugin_cannot_shadow_a_builtin(registered):
    registered(ShadowingPlugin(), "shadow")
    assert isinstance(plugins.create_selector("collect2", VegasConfig()), Collect2Selector)


def test_unknown_names_list_the_allowed_values():
    with pytest.raises(VegasConfigError, match=r"selector must be one of .*collect2"):
        plugins.create_selector("nope", VegasConfig())
    with pytest.raises(VegasConfigError, match=r"backend must be one of .*hf"):
        plugins.get_backend_class("nope")


def _run(code, **env):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VEGAS_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, check=True)


LIST = "from vegas import plugins; print(','.join(plugins.selector_names()))"


def test_example_plugin_is_installed_and_autoloaded():
    eps = {ep.name for ep in importlib.metadata.entry_points(group="vegas")}
    assert "h2o" in eps, "install the example plugin: pip install ./plugins/vegas-h2o"
    assert "h2o" in _run(LIST).stdout.split(",")[0:10] or "h2o" in _run(LIST).stdout
    assert "h2o" not in _run(LIST, VEGAS_DISABLE_PLUGIN_AUTOLOAD="1").stdout
    assert "h2o" not in _run(LIST, VEGAS_PLUGINS="some_other").stdout
    assert "h2o" in _run(LIST, VEGAS_PLUGINS="h2o").stdout


def test_broken_entry_point_is_reported(tmp_path):
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vegas]\nbroken = no_such_module_xyz\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {LIST}; print(plugins.plugin_errors)"
    out = _run(code).stdout
    assert "collect2" in out and "'broken'" in out and "ModuleNotFoundError" in out


def test_plugin_that_exits_or_takes_a_builtin_name_is_reported(tmp_path):
    """An entry point whose module calls sys.exit() on import, one named like a built-in plugin
    module, and one that loads a built-in plugin module under another name, are each skipped with a
    message naming them; the built-ins still load."""
    dist = tmp_path / "bad_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vegas]\nexiter = vegas_exiter_xyz\nvegas.strategies = vegas_harmless_xyz\n"
                                          "shadow = vegas.strategies\n")
    (tmp_path / "vegas_exiter_xyz.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "vegas_harmless_xyz.py").write_text("X = 1\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {LIST}; print(plugins.plugin_errors)"
    out = _run(code).stdout
    assert "collect2" in out and "sliding_window" in out
    assert "'exiter' failed and was skipped: SystemExit: 3" in out
    assert "'vegas.strategies' failed and was skipped: ValueError: its entry-point name is that of a built-in" in out
    assert "'shadow' failed and was skipped: ValueError: it loads 'vegas.strategies', which is already registered" in out


def test_unknown_name_in_vegas_plugins_is_reported():
    out = _run("import logging; logging.basicConfig(); " + LIST, VEGAS_PLUGINS="doesnotexist")
    assert "VEGAS_PLUGINS names ['doesnotexist']" in out.stderr


def test_unknown_selector_hints_at_disabled_autoload(monkeypatch):
    monkeypatch.setenv("VEGAS_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.raises(VegasConfigError, match="VEGAS_DISABLE_PLUGIN_AUTOLOAD is set"):
        plugins.create_selector("h2o", VegasConfig())


def test_example_plugin_selector_runs_through_pipeline_and_bench(pipe, code_prompts, registered, tmp_path):
    import json

    from click.testing import CliRunner

    import vegas_h2o
    from vegas.cli import main

    registered(vegas_h2o, "h2o")
    prompts = [p[:500] for p in code_prompts]
    out = pipe.generate(prompts, max_new_tokens=12, selector="h2o")
    ref = pipe.generate(prompts, max_new_tokens=12, selector=None)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    path = tmp_path / "h2o.json"
    result = CliRunner().invoke(main, [
        "bench", "--selectors", "h2o", "--context", "256", "--new-tokens", "6", "--check-tokens", "6",
        "--json", str(path),
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text())["selectors"]["h2o"]["lossless"] is True


def test_an_unregistered_selector_instance_is_named_as_such_when_it_fails():
    """A Selector instance no plugin registered (as OracleSelector is passed) is checked like a
    plugin's, and the error says it is not registered rather than naming plugin '?'."""

    class Unregistered(Collect2Selector):
        name = "handmade"

        def select(self, inputs):
            raise RuntimeError("boom")

    with pytest.raises(VegasPluginError, match=r"^selector 'handmade' \(not registered\) raised in select\(\): "
                                               r"RuntimeError: boom$"):
        plugins.run_selector(Unregistered(VegasConfig()), "select", None)
