"""Shared fixtures. Plugin autoload is off: tests register their fixture plugins explicitly."""

import os

os.environ["VEGAS_DISABLE_PLUGIN_AUTOLOAD"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from vegas import Pipeline  # noqa: E402
from vegas.prompts import package_source  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def pipe() -> Pipeline:
    """The embedded model, float32 on the CPU, plain decoding by default."""
    return Pipeline(selector=None, dtype="float32", device="cpu")


@pytest.fixture
def counted(pipe, monkeypatch):
    """The session pipeline, counting ``generate`` calls."""
    calls = []
    original = pipe.generate

    def generate(*args, **kwargs):
        calls.append(kwargs.get("selector"))
        return original(*args, **kwargs)

    monkeypatch.setattr(pipe, "generate", generate)
    return pipe, calls


@pytest.fixture(scope="session")
def click_ids(pipe) -> list[int]:
    """Token ids of the installed click source (held out of the model's training)."""
    return pipe.tokenizer(package_source("click"), add_special_tokens=False).input_ids


@pytest.fixture(scope="session")
def code_prompts(click_ids) -> list[list[int]]:
    """Two real prompts of different lengths (900 and 611 tokens)."""
    return [click_ids[20000:20900], click_ids[60000:60611]]


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def reused_prefill_chunks(monkeypatch) -> list[int]:
    """The prefill chunk lengths (tokens) that sessions with ``reuse_prefill`` run, in order (clear
    it between calls); other sessions' chunks are not recorded."""
    from vegas.backends import hf

    chunks: list[int] = []
    forward = hf.HFSession._forward

    def counted(self, ids, *args, **kwargs):
        if kwargs.get("num_logits") == -1 and self.reuse_prefill:
            chunks.append(ids.shape[1])
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(hf.HFSession, "_forward", counted)
    return chunks
