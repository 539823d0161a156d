import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from vegas.cli import main


def test_bench_small_writes_json(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, [
        "bench", "--context", "512", "--new-tokens", "8", "--check-tokens", "6", "--batch-size", "2",
        "--selectors", "collect2,sliding_window", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["selectors"]) == {"collect2", "sliding_window"}
    for row in data["selectors"].values():
        assert row["lossless"] is True
        for key in ("acceptance_length", "tokens_per_second", "speedup", "selection_overhead"):
            assert isinstance(row[key], float)
        assert row["acceptance_length"] >= 1.0
        # γ = 4 over a 6-token check: at most 6 / ceil(6 / 5) = 3 tokens per iteration
        assert 1.0 <= row["greedy_acceptance_length"] <= 3.0
    assert "collect2" in result.output
    assert "cannot exceed 3.00" in " ".join(result.output.split())
    # sampled τ is capped the same way by --new-tokens (8 at γ = 4: 8 / ceil(8 / 5) = 4)
    assert "run of 8 new tokens cannot exceed 4.00" in " ".join(result.output.split())
    assert "τ ≤ γ+1 = 5" in result.output and "selection (% decode)" in result.output
    verdict = next(line for line in result.output.splitlines() if "recommended: " in line)
    assert "plain decoding (--selector none)" in verdict or "× plain decoding" in verdict


def test_bench_says_when_the_kv_budget_covers_the_whole_context():
    """At a short --context the default floor (min_kv_budget 256) is the whole prompt: the
    table says that drafting attended to everything instead of passing it off as sparse."""
    args = ["bench", "--new-tokens", "2", "--check-tokens", "2", "--batch-size", "1", "--selectors", "collect2"]
    result = CliRunner().invoke(main, [*args, "--context", "128"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "the KV budget (256) covers the whole 128-token context, so drafting attended to everything" in text
    result = CliRunner().invoke(main, [*args, "--context", "128", "--min-kv-budget", "16"])
    assert result.exit_code == 0 and "covers the whole" not in result.output, result.output


def test_bench_of_plain_decoding_only_at_temperature_0():
    result = CliRunner().invoke(main, ["bench", "--selectors", "none", "--context", "64", "--new-tokens", "2",
                                       "--check-tokens", "2", "--batch-size", "1", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert "plain: timed greedy decoding done in" in result.output and "sampling" not in result.output
    assert "plain decoding only: no selector was measured" in result.output


def test_greedy_tau_cap():
    from vegas.bench import greedy_tau_cap

    assert greedy_tau_cap(16, 4) == 4.0  # 4 iterations: 5 + 5 + 5 + 1
    assert greedy_tau_cap(64, 4) == 64 / 13
    assert greedy_tau_cap(5, 4) == 5.0


def test_bench_rejects_bad_options():
    result = CliRunner().invoke(main, ["bench", "--selectors", "nope", "--context", "64"])
    assert result.exit_code == 2 and "Invalid value for '--selectors': must be one of none, " in result.output
    result = CliRunner().invoke(main, ["bench", "--sparsity-ratio", "1.5", "--context", "64"])
    assert result.exit_code == 2 and "Invalid value for '--sparsity-ratio'" in result.output


def test_cli_errors_name_the_flag_the_user_typed():
    cases = [
        (["generate", "x", "-g", "0"], "Invalid value for '--num-draft-tokens' / '-g': must be an integer >= 1"),
        (["generate", "x", "--kv-budget", "0"], "Invalid value for '--kv-budget': must be an integer >= 1"),
        (["generate", "x", "--device", "bogus"], "Invalid value for '--device': must be 'cpu', 'cuda' or 'cuda:N'"),
        (["bench", "--device", "bogus"], "Invalid value for '--device': must be 'cpu', 'cuda' or 'cuda:N'"),
        (["generate", "x", "--rope-scaling", '{"rope_type":"yarn","factor":2,"bogus":1}'],
         "unknown key(s) ['bogus'] for rope_type 'yarn'"),
        (["serve", "vegas/model", "--kv-budget", "0"], "Invalid value for '--kv-budget': must be an integer >= 1"),
        (["bench", "--kv-budget", "0"], "Invalid value for '--kv-budget': must be an integer >= 1"),
        (["generate", "x", "--chat"], "Invalid value for '--chat': needs a tokenizer with a chat template"),
        (["generate", "x", "--selector", "nope"], "Invalid value for '--selector': must be one of none, "),
        (["generate", "x", "--temperature", "-1"], "Invalid value for '--temperature'"),
        (["generate", "x", "--max-new-tokens", "40000"], "Invalid value for '--max-new-tokens': 40000 leaves no room"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_generate_leaves_special_tokens_out_of_the_text(pipe, monkeypatch):
    from vegas.backends import hf
    from vegas.outputs import RequestStats

    eos = sorted(pipe.backend.eos_token_ids)[0]
    ids = pipe.tokenizer("x = 1", add_special_tokens=False).input_ids + [eos]
    monkeypatch.setattr(hf, "plain_decode", lambda *args, **kwargs: ([ids], [RequestStats()]))
    out = pipe.generate(["y"], max_new_tokens=len(ids))[0]
    assert out.token_ids == ids and out.text == "x = 1"
    assert pipe.tokenizer.decode([eos]) not in out.text


def test_generate_logs_in_one_format_and_shows_the_budget_used(tmp_path):
    """A subprocess: one process, one log line (INFO, with -v) about the budget above the context;
    the stats line shows the budget used."""
    import re
    import subprocess
    import sys

    argv = [sys.executable, "-c", "from vegas.cli import main; main()", "-v", "generate", "def f(x):", "--max-new-tokens", "4",
            "--temperature", "0", "--sparsity-ratio", "0.01"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    said = [line for line in done.stderr.splitlines() if line.startswith("vegas: ")]
    assert len(said) == 1 and said[0].startswith("vegas: KV budget 256 >= context 4 tokens"), done.stderr
    used = int(re.search(r"KV budget (\d+) tokens, decode", done.stderr).group(1))
    assert 4 <= used <= 4 + 5  # the context at the last selection, not the 256-token minimum
    attended = float(re.search(r"([\d.]+) KV entries attended per layer and draft", done.stderr).group(1))
    assert 3 <= attended <= 4 + 5  # the whole committed context: the budget covers it
    assert "(≤ γ+1 = 5: the bonus token counts)" in done.stderr


def test_generate_prints_text_and_stats(tmp_path):
    prompt = tmp_path / "p.py"
    prompt.write_text("import os\n\n\ndef main():\n")
    result = CliRunner().invoke(main, ["generate", f"@{prompt}", "--max-new-tokens", "6", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert "τ=" in result.output


def test_generate_stats_line_shows_plain_fallback_steps():
    """τ = tokens / iterations with plain steps counted: the line shows both, so that it adds up."""
    import re

    result = CliRunner().invoke(main, ["generate", "def fibonacci(n):", "--selector", "collect2", "--temperature", "0",
                                       "--max-new-tokens", "40", "--kv-budget", "4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())
    found = re.search(r"\[(\d+) tokens, τ=([\d.]+) tokens/iteration over (\d+) iterations .*?, (\d+) plain steps "
                      r"\(fallback: no draft, 1 token each\), accepted (\d+)/(\d+) drafts", line)
    assert found, result.output
    tokens, tau, iterations, plain, accepted, drafted = (float(v) for v in found.groups())
    assert plain > 0 and abs(tau - tokens / iterations) < 0.01
    assert drafted == 4 * (iterations - plain)  # γ drafts per drafting iteration


def test_bench_names_bad_options(tmp_path):
    cases = [
        (["--batch-size", "0"], "Invalid value for '--batch-size': must be an integer >= 1"),
        (["--check-tokens", "0"], "Invalid value for '--check-tokens'"),
        (["--context", "40000"], "Invalid value for '--context': must be in"),
        (["--context", "40000"], """(a longer context: --rope-scaling, e.g. '{"rope_type": "yarn", "factor": 4}')"""),
        (["--selectors", ","], "Invalid value for '--selectors': must name at least one selector"),
        (["--selectors", "collect2,collect2"], "Invalid value for '--selectors': names a selector twice"),
        (["--selectors", "collect2,ngram"], "'ngram' is vLLM's n-gram proposer: it runs with --backend vllm only"),
        (["--json", str(tmp_path)], "is a directory; it must be a file path, such as"),
        (["--plot", str(tmp_path / "no_such_dir" / "a.png")], "must be a file path in an existing directory"),
    ]
    for args, match in cases:
        result = CliRunner().invoke(main, ["bench", *args])
        assert result.exit_code == 2 and match in result.output, result.output
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x7fELF\0\0\1binary")
    result = CliRunner().invoke(main, ["bench", "--prompts", str(binary), "--context", "64"])
    assert result.exit_code == 2 and "binary file" in result.output


def test_generate_prompt_files_and_literal_at_sign(tmp_path):
    """'@@' starts a literal '@' (a decorator); '@path' of a missing file says how to escape;
    a file too large for the model's context is refused from its size, before it is read."""
    result = CliRunner().invoke(main, ["generate", "@@dataclass\nclass Point:", "--max-new-tokens", "4",
                                       "--temperature", "0"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["generate", "@dataclass\nclass Point:", "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "'@@' starts a literal '@'" in result.output
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * 2_000_000)  # 12 MB: more tokens than the 32K context can hold
    result = CliRunner().invoke(main, ["generate", f"@{big}", "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "bytes can fit the model's context" in " ".join(result.output.split())


def test_generate_refuses_an_at_sign_without_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # '@' must not read the current directory
    (tmp_path / "a.py").write_text("x = 1\n")
    for prompt in ("@", "@ "):
        result = CliRunner().invoke(main, ["generate", prompt, "--max-new-tokens", "2"])
        assert result.exit_code == 2 and f"PROMPT {prompt!r} needs a path after '@'" in result.output, result.output


@pytest.mark.parametrize("command, runner", [("tune", "vegas.tune.run_tune"), ("ablate", "vegas.ablate.run_ablate")])
def test_tune_and_ablate_check_the_out_directory_before_the_run(command, runner, tmp_path, monkeypatch):
    """An --out that cannot be made or written fails in one line before any point is measured
    (it used to raise a traceback after the first point), and nothing is left behind."""
    module, name = runner.rsplit(".", 1)

    def no_run(*args, **kwargs):
        raise AssertionError("the run started before --out was checked")

    monkeypatch.setattr(__import__(module, fromlist=[name]), name, no_run)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, reason in ((Path("/proc/vegas-out"), "No such file or directory"),  # nobody can make it
                        (a_file / "sub", "Not a directory")):
        result = CliRunner().invoke(main, [command, "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert f"Error: --out {str(out)!r} cannot be written: {reason}" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    fresh = tmp_path / "new" / "dir"  # a writable place is not refused, and not made by the check
    result = CliRunner().invoke(main, [command, "--out", str(fresh)])
    assert "the run started" in repr(result.exception) and not (tmp_path / "new").exists()


def test_bench_checks_sampling_options_and_json_path_before_the_run(tmp_path, monkeypatch):
    import vegas.bench

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(vegas.bench, "Pipeline", no_model)
    for args, match in ((["--temperature", "-0.5"], "Invalid value for '--temperature': must be"),
                        (["--top-p", "0"], "Invalid value for '--top-p': must be")):
        result = CliRunner().invoke(main, ["bench", "--selectors", "collect2", *args])
        assert result.exit_code == 2 and match in result.output, result.output
    target = Path("/proc/vegas-bench-results.json")  # an existing directory nobody can write to
    assert not _writable(target)
    result = CliRunner().invoke(main, ["bench", "--selectors", "collect2", "--json", str(target)])
    assert result.exit_code == 2 and "cannot be written" in result.output, result.output
    assert not target.exists()


def _writable(path):
    try:
        path.open("a").close()
    except OSError:
        return False
    path.unlink()
    return True


def test_bench_repeats_interleave_and_failing_plugin_selectors_are_skipped(tmp_path):
    """--repeats N times every method N times (median row, every run kept); with every
    selector, a plugin selector that fails is skipped and reported, the others still run."""
    from vegas import plugins

    from .plugins.fixture_plugins import FailingSelectorsPlugin

    plugins.register(FailingSelectorsPlugin(), name="failing")
    try:
        out = tmp_path / "r.json"
        result = CliRunner().invoke(main, [
            "bench", "--context", "128", "--new-tokens", "4", "--check-tokens", "4", "--batch-size", "1",
            "--repeats", "2", "--json", str(out),
        ])
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        assert set(data["skipped"]) == {"initraise", "selectraise", "selectnone"}
        assert "failed to build" in data["skipped"]["initraise"] and "select boom" in data["skipped"]["selectraise"]
        assert "select() returned NoneType" in data["skipped"]["selectnone"]
        assert "collect2" in data["selectors"] and "initraise" not in data["selectors"]
        assert len(data["plain"]["tokens_per_second_runs"]) == 2
        assert all(len(r["tokens_per_second_runs"]) == 2 for r in data["selectors"].values())
        assert "skipped (plugin error)" in result.output
        result = CliRunner().invoke(main, ["bench", "--context", "128", "--selectors", "initraise"])
        assert result.exit_code == 2 and "selector 'initraise' (plugin 'failing') failed to build" in result.output
        assert "Usage:" not in result.output  # a plugin's failure is not a usage error: one line, no banner
        result = CliRunner().invoke(main, ["generate", "def f(x):", "--selector", "selectraise", "--max-new-tokens", "4"])
        assert result.exit_code == 2 and "Usage:" not in result.output, result.output
        assert result.output.strip().splitlines()[-1].startswith("Error: selector 'selectraise' (plugin 'failing')")
    finally:
        plugins.unregister("failing")


def test_bench_reports_a_skipped_plugin_selector_verbatim_and_logs_no_done_line_for_it(tmp_path):
    """A plugin error whose text holds brackets ('[i]', '[/x]': rich markup) is printed as it
    is, on one line, instead of losing text or crashing the run with rich's MarkupError; the
    selector that raised gets no 'greedy exactness check done' line, and the run count adds up."""
    import vegas
    from vegas import plugins

    from .plugins.fixture_plugins import SelectRaisingSelector

    class Brackets(SelectRaisingSelector):
        name = "brackets"

        def select(self, inputs):
            raise IndexError("index [i] out of range for shape [/x] " + "y" * 80)

    class Plugin:
        @vegas.hookimpl
        def vegas_selectors(self):
            return {"brackets": Brackets}

    plugins.register(Plugin(), name="brackets_plugin")
    try:
        out = tmp_path / "r.json"
        result = CliRunner().invoke(main, [
            "bench", "--context", "96", "--new-tokens", "2", "--check-tokens", "2", "--batch-size", "1",
            "--json", str(out),
        ])
        assert result.exit_code == 0, result.output
        message = "IndexError: index [i] out of range for shape [/x] " + "y" * 80
        assert message in json.loads(out.read_text())["skipped"]["brackets"]
        assert f"skipped: selector 'brackets' (plugin 'brackets_plugin') raised in select(): {message}" in result.output
        assert "brackets: greedy exactness check done" not in result.output
        done = [line for line in result.output.splitlines() if " done in " in line]
        last = done[-1].split("(")[1].split(",")[0]  # e.g. '13/13'
        assert last.split("/")[0] == last.split("/")[1] and len(done) == int(last.split("/")[0]) - 1, done
    finally:
        plugins.unregister("brackets_plugin")


def test_import_and_help_do_not_load_torch():
    """``import vegas`` and ``vegas --help`` stay light: torch and transformers load on first use
    of what needs them (``vegas.Pipeline`` ...)."""
    import subprocess
    import sys

    code = ("import sys, vegas, vegas.cli; from click.testing import CliRunner; "
            "r = CliRunner().invoke(vegas.cli.main, ['--help']); assert r.exit_code == 0, r.output; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy; "
            "vegas.Pipeline; assert 'torch' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("args, message", [
    (["", "--max-new-tokens", "4"], "Invalid value for 'PROMPT': is empty; every prompt needs at least one token"),
    (["hi", "--max-new-tokens", "0"], "Invalid value for '--max-new-tokens': must be an integer >= 1, got 0"),
    (["hi", "--temperature", "-1"], "Invalid value for '--temperature': must be a finite number >= 0"),
    (["hi", "--top-p", "2"], "Invalid value for '--top-p': must be in (0, 1], got 2.0"),
])
def test_generate_checks_what_needs_no_model_before_loading_one(args, message, monkeypatch):
    import vegas.pipeline

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(vegas.pipeline, "Pipeline", no_model)
    result = CliRunner().invoke(main, ["generate", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_an_over_long_prompt_gets_vegas_error_only(tmp_path, caplog):
    """transformers' tokenizer warning (it names the tokenizer's model_max_length, not the
    model's context) is not printed before vegas' own one-line error."""
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * 40000)
    result = CliRunner().invoke(main, ["generate", f"@{long}", "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "Invalid value for 'PROMPT': has " in result.output, result.output
    assert "Token indices sequence length is longer" not in result.output + caplog.text


def test_off_a_terminal_transformers_progress_bars_are_off(monkeypatch):
    import os

    from transformers.utils import logging as transformers_logging

    transformers_logging.enable_progress_bar()
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    try:
        result = CliRunner().invoke(main, ["generate", "", "--max-new-tokens", "1"])  # stderr is not a terminal
        assert result.exit_code == 2
        assert not transformers_logging.is_progress_bar_enabled()
        # and tqdm's own bars (transformers' GGUF conversion uses tqdm directly) in a process that imports it later
        assert os.environ.get("TQDM_DISABLE") == "1"
    finally:
        transformers_logging.enable_progress_bar()
        os.environ.pop("TQDM_DISABLE", None)


def test_ablate_names_its_own_flag_when_the_prompt_source_is_too_short(tmp_path):
    """A prompt source shorter than the context: the error names ablate's --contexts (bench and
    tune have --context)."""
    short = tmp_path / "short.py"
    short.write_text("def f(x):\n    return x + 1\n")
    result = CliRunner().invoke(main, ["ablate", "--quick", "--studies", "budget", "--selectors", "collect2",
                                       "--contexts", "1024", "--prompts", str(short), "--device", "cpu",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "(--contexts) of 1024 tokens is longer than the prompt source" in text
    assert "shorter --contexts" in text and "(--context)" not in text
