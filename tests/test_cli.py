import json
from pathlib import Path

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


def test_greedy_tau_cap():
    from vegas.bench import greedy_tau_cap

    assert greedy_tau_cap(16, 4) == 4.0  # 4 iterations: 5 + 5 + 5 + 1
    assert greedy_tau_cap(64, 4) == 64 / 13
    assert greedy_tau_cap(5, 4) == 5.0


def test_bench_rejects_bad_options():
    result = CliRunner().invoke(main, ["bench", "--selectors", "nope", "--context", "64"])
    assert result.exit_code == 2 and "selector must be one of" in result.output
    result = CliRunner().invoke(main, ["bench", "--sparsity-ratio", "1.5", "--context", "64"])
    assert result.exit_code == 2 and "sparsity_ratio" in result.output


def test_generate_prints_text_and_stats(tmp_path):
    prompt = tmp_path / "p.py"
    prompt.write_text("import os\n\n\ndef main():\n")
    result = CliRunner().invoke(main, ["generate", f"@{prompt}", "--max-new-tokens", "6", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert "τ=" in result.output


def test_bench_names_bad_options(tmp_path):
    cases = [
        (["--batch-size", "0"], "batch_size (--batch-size)"),
        (["--check-tokens", "0"], "check_tokens (--check-tokens)"),
        (["--context", "40000"], "context (--context) must be in"),
        (["--selectors", ","], "must name at least one selector"),
        (["--json", str(tmp_path)], "must be a file path in an existing directory"),
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


def test_bench_checks_sampling_options_and_json_path_before_the_run(tmp_path, monkeypatch):
    import vegas.bench

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(vegas.bench, "Pipeline", no_model)
    for args, match in ((["--temperature", "-0.5"], "temperature must be"), (["--top-p", "0"], "top_p must be")):
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
        assert set(data["skipped"]) == {"initraise", "selectraise"}
        assert "failed to build" in data["skipped"]["initraise"] and "select boom" in data["skipped"]["selectraise"]
        assert "collect2" in data["selectors"] and "initraise" not in data["selectors"]
        assert len(data["plain"]["tokens_per_second_runs"]) == 2
        assert all(len(r["tokens_per_second_runs"]) == 2 for r in data["selectors"].values())
        assert "skipped (plugin error)" in result.output
        result = CliRunner().invoke(main, ["bench", "--context", "128", "--selectors", "initraise"])
        assert result.exit_code == 2 and "selector 'initraise' (plugin 'failing') failed to build" in result.output
    finally:
        plugins.unregister("failing")
