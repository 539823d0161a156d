"""Each bad input of the developers guide (empty prompt, too long, γ < 1, sparsity outside (0, 1], negative budget, unknown names, failing plugins) gets a clear error naming the parameter."""

import pytest
import torch

from vegas import Pipeline, VegasConfigError


@pytest.mark.parametrize(
    "prompts, match",
    [([], "at least one prompt"), ([""], "prompt 0 is empty"), (["ok", []], "prompt 1 is empty")],
)
def test_empty_prompts(pipe, prompts, match):
    with pytest.raises(VegasConfigError, match=match):
        pipe.generate(prompts, max_new_tokens=4)


def test_prompt_longer_than_context(pipe):
    too_long = [[5] * pipe.backend.max_context]
    with pytest.raises(VegasConfigError, match=r"prompt 0 has 32768 tokens.*at most"):
        pipe.generate(too_long, max_new_tokens=4, selector="collect2")


def test_bad_max_new_tokens(pipe):
    with pytest.raises(VegasConfigError, match="max_new_tokens"):
        pipe.generate(["x = 1"], max_new_tokens=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1"),
        ({"sparsity_ratio": 0}, r"sparsity_ratio must be a number in \(0, 1\]"),
        ({"sparsity_ratio": 2}, r"sparsity_ratio must be a number in \(0, 1\]"),
        ({"kv_budget": -5}, "kv_budget must be an integer >= 1"),
        ({"kv_budget": 0}, "kv_budget must be an integer >= 1"),
        ({"selector": "nope"}, "selector must be one of"),
        ({"backend": "nope"}, "backend must be one of"),
        ({"gamma": 3}, r"unknown config field\(s\) \['gamma'\]"),
    ],
)
def test_bad_pipeline_arguments(kwargs, match):
    with pytest.raises(VegasConfigError, match=match):
        Pipeline(**kwargs)


def test_bad_sampling_arguments(pipe):
    with pytest.raises(VegasConfigError, match="temperature"):
        pipe.generate(["x = 1"], max_new_tokens=2, temperature=-0.5)
    with pytest.raises(VegasConfigError, match="top_p"):
        pipe.generate(["x = 1"], max_new_tokens=2, temperature=1.0, top_p=1.5)


def test_unknown_selector_in_generate(pipe):
    with pytest.raises(VegasConfigError, match="selector must be one of"):
        pipe.generate(["x = 1"], max_new_tokens=2, selector="nope")


@pytest.mark.parametrize("selector", [object(), 3, ["collect2"]])
def test_a_selector_neither_name_none_nor_instance_in_generate(pipe, selector):
    with pytest.raises(VegasConfigError, match=r"^selector must be a registered name \(none, .*collect2.*\), None "
                                               r"\(plain decoding\) or a vegas.interfaces.Selector instance, got "):
        pipe.generate(["x = 1"], max_new_tokens=2, selector=selector)


@pytest.mark.parametrize("selector", ["collect2", "aggregated", "sliding_window", "quest", "last_token"])
@pytest.mark.parametrize("prompts", [[[42]], [[42], [7, 8, 9]], ["   "]], ids=["one", "batch", "whitespace"])
def test_single_token_prompts_work(pipe, selector, prompts):
    out = pipe.generate(prompts, max_new_tokens=6, selector=selector)
    ref = pipe.generate(prompts, max_new_tokens=6, selector=None)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_the_none_selector_is_plain_decoding(pipe):
    out = Pipeline(selector="none").generate(["def f(x):"], max_new_tokens=3)[0]
    assert out.token_ids == pipe.generate(["def f(x):"], max_new_tokens=3, selector=None)[0].token_ids
    assert out.stats.num_drafted == 0 and out.stats.kv_budget == 0
    assert pipe.generate(["def f(x):"], max_new_tokens=3, selector="none")[0].token_ids == out.token_ids


@pytest.mark.parametrize(
    "prompts, match",
    [
        (None, "prompts must be a text"),
        (5, "prompts must be a text"),
        ([[1, 2], "x", 3.5], "prompt 2 must be a text or a list of int token ids"),
        ([[-5, 3]], r"token id -5, outside the vocabulary \[0, 8192\)"),
        ([[10**9]], "outside the vocabulary"),
        ([[1.0, 2.0]], "it holds a float"),
    ],
)
def test_bad_prompt_types_and_token_ids(pipe, prompts, match):
    with pytest.raises(VegasConfigError, match=match):
        pipe.generate(prompts, max_new_tokens=2)


def test_gamma_larger_than_context_names_it():
    with pytest.raises(VegasConfigError, match=r"num_draft_tokens \(γ\) must be at most 32765 for this model's context of 32768"):
        Pipeline(num_draft_tokens=10**9, device="cpu")
    assert Pipeline(num_draft_tokens=32765, device="cpu").config.num_draft_tokens == 32765


def test_max_new_tokens_larger_than_context_names_it(pipe):
    with pytest.raises(VegasConfigError, match="max_new_tokens 1000000 leaves no room for a prompt"):
        pipe.generate(["x = 1"], max_new_tokens=10**6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan"), "temperature": 1.0}, "top_p"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be an integer in"),
    ],
)
def test_bad_sampling_values(pipe, kwargs, match):
    with pytest.raises(VegasConfigError, match=match):
        pipe.generate(["x = 1"], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"model": "/nonexistent/model"}, "model path '/nonexistent/model' does not exist"),
        ({"model": "no-such-org/no-such-model"}, "is neither a local transformers model directory"),
        ({"model": 5}, "model must be None or a str or path naming a model name"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be True or False, got 'yes'"),
        ({"backend_options": {"bogus": 1}}, r"backend_options has unknown option\(s\) \['bogus'\] for backend 'hf'"),
        ({"backend_options": {"dtype": "float32"}}, "backend_options must not set"),
    ],
)
def test_bad_backend_arguments(kwargs, match):
    with pytest.raises(VegasConfigError, match=match):
        Pipeline(selector=None, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_gpu_and_vllm_without_vllm():
    with pytest.raises(VegasConfigError, match="no CUDA GPU"):
        Pipeline(selector=None, device="cuda")
    with pytest.raises(VegasConfigError, match="backend 'vllm' needs"):
        Pipeline(selector="collect2", backend="vllm")


def test_remote_code_is_off_by_default(monkeypatch):
    """Model and tokenizer load with trust_remote_code=False unless the user asks for it."""
    import vegas.backends.hf as hf

    seen = []

    class Spy:
        def __init__(self, real):
            self.real = real

        def from_pretrained(self, *args, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return self.real.from_pretrained(*args, **kwargs)

    monkeypatch.setattr(hf, "AutoTokenizer", Spy(hf.AutoTokenizer))
    monkeypatch.setattr(hf, "AutoModelForCausalLM", Spy(hf.AutoModelForCausalLM))
    Pipeline(selector=None)
    assert seen == [False, False]
    Pipeline(selector=None, trust_remote_code=True)
    assert seen[2:] == [True, True]


def test_model_with_its_own_code_is_refused_without_running_it(tmp_path):
    """A model directory whose config.json names its own code (auto_map) is refused with a message
    saying how to allow it, and none of that code runs."""
    import json
    import shutil

    from vegas.models import DEFAULT_MODEL

    model = tmp_path / "custom"
    shutil.copytree(DEFAULT_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="vegas_custom_xyz", auto_map={"AutoConfig": "configuration_xyz.XyzConfig",
                                                           "AutoModelForCausalLM": "modeling_xyz.XyzModel"})
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    for name in ("configuration_xyz.py", "modeling_xyz.py"):
        (model / name).write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(VegasConfigError, match=r"model .* needs its own code .*trust_remote_code=True"):
        Pipeline(str(model), selector=None)
    assert not marker.exists()


def test_integer_temperature_and_numpy_token_ids_work(pipe):
    """Token ids as numpy arrays (one prompt, or a 2-D batch), numpy integers or a torch tensor."""
    import numpy as np

    out = pipe.generate([np.array([5, 7, 9]), [np.int64(5), np.int64(7)], torch.tensor([3, 4])],
                        max_new_tokens=3, temperature=1, selector="collect2")
    assert all(o.stats.num_generated == 3 for o in out)
    one = pipe.generate(np.array([5, 7, 9]), max_new_tokens=3, selector=None)
    batch = pipe.generate(np.array([[5, 7, 9], [5, 7, 9]]), max_new_tokens=3, selector=None)
    assert len(one) == 1 and len(batch) == 2 and batch[0].token_ids == one[0].token_ids


def test_acceptance_length_counts_emitted_tokens(pipe, code_prompts):
    out = pipe.generate([code_prompts[0][:200]], max_new_tokens=1, selector="collect2")[0]
    assert out.stats.num_generated == 1 and out.stats.acceptance_length == 1.0


def test_selector_of_wrong_type():
    with pytest.raises(VegasConfigError, match="selector must be one of"):
        Pipeline(selector=["collect2"])


def test_tiny_temperature_decodes_greedily(pipe, code_prompts):
    """Temperatures below 1e-5 (as in vLLM) decode greedily instead of overflowing the logits."""
    prompt = [code_prompts[0][:200]]
    ref = pipe.generate(prompt, max_new_tokens=8, selector=None)
    for t in (1e-40, 5e-324, 1e-6):
        assert pipe.generate(prompt, max_new_tokens=8, temperature=t, selector="collect2")[0].token_ids == ref[0].token_ids


def test_a_prompt_folder_skips_entries_that_cannot_be_looked_at(tmp_path, monkeypatch):
    """An entry of a prompt folder that cannot even be stat'ed (a link into ``/proc``, a folder
    without permission: ``PermissionError`` from ``is_file``) is skipped, not a traceback; a folder
    of nothing else is refused by name."""
    from pathlib import Path

    from vegas.prompts import read_text_source

    (tmp_path / "a.py").write_text("print(1)\n")
    (tmp_path / "locked.py").write_text("secret\n")
    real_is_file = Path.is_file

    def is_file(self):
        if self.name == "locked.py":
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    text = read_text_source(tmp_path)
    assert "print(1)" in text and "secret" not in text
    (tmp_path / "a.py").unlink()
    with pytest.raises(VegasConfigError, match="is not a file or a directory with text files"):
        read_text_source(tmp_path)


@pytest.mark.parametrize(("content", "problem"), [
    ('{"text": "a"}\n\nnot json at all\n', "line 3: JSONDecodeError"),
    ('{"text": "a"}\n{"body": "b"}\n', "line 2: KeyError: 'text'"),
    ('{"text": 7}\n', "line 1: 'text' is int, not a string"),
], ids=["not-json", "no-text-field", "text-not-a-string"])
def test_a_bad_json_lines_file_names_its_line(tmp_path, content, problem):
    """A malformed .jsonl prompt file is refused with the number of the first bad line."""
    from vegas.prompts import read_text_source

    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(VegasConfigError, match="is not JSON lines with a 'text' field per line") as err:
        read_text_source(path)
    assert problem in str(err.value)
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert read_text_source(path) == "a\n\nb"


@pytest.mark.parametrize("config", [{"model_type": "no_such_type"}, {"model_type": "qwen3"}],
                         ids=["unknown-model-type", "no-weights-no-tokenizer"])
def test_a_local_directory_that_does_not_load_is_named_as_one(tmp_path, config):
    """A local folder with a config transformers cannot use (an unknown ``model_type``, no
    weights, no tokenizer) is said to be a directory that does not load, not "neither a local
    directory nor in the cache"."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(VegasConfigError, match=r"model directory .* does not load as a transformers causal LM") as err:
        Pipeline(model=str(tmp_path), selector=None)
    assert "neither" not in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("selector", ["collect2", "quest"])
def test_gamma_above_the_tokens_left_drafts_only_what_can_be_emitted(pipe, selector):
    """γ = 1,000 with 4 new tokens drafts at most 3 + 2 + 1 tokens (each iteration at most the
    tokens left less the bonus token, at least one), not 1,000 an iteration; output as plain."""
    out = Pipeline(selector=selector, num_draft_tokens=1000).generate(["def f(x):"], max_new_tokens=4)[0]
    ref = pipe.generate(["def f(x):"], max_new_tokens=4, selector=None)[0]
    assert out.token_ids == ref.token_ids
    assert 1 <= out.stats.num_drafted <= 6
