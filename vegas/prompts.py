"""Long-context prompts: built at run time from installed source the model never saw.

The embedded model was trained on Python source without docutils, jinja2 and click
(design notes (docs/design-notes.md) §7). ``click`` is vegas's CLI library, so it is always installed: its
modules, concatenated in a fixed order, form one long document from which contexts of
the requested length are cut. Users pass their own file or directory instead; files are
read as text, never executed. A ``.jsonl`` / ``.jsonl.xz`` file is a document set (one JSON
object with a ``text`` field per line), such as the repository's held-out code
(:func:`heldout_path`).

:func:`retrieval_prompts` builds copy-task prompts whose continuation sits thousands of
tokens back (``vegas ablate``'s retrieval study).
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
import lzma
import os
from pathlib import Path

from .config import VegasConfigError

__all__ = ["package_source", "prompt_text", "read_text_source", "cut_contexts", "heldout_path", "retrieval_prompts",
           "RETRIEVAL_CUE", "RETRIEVAL_MIN_CONTEXT"]

#: held-out code documents of a repository checkout (click, docutils, jinja2; unseen by the
#: embedded model), relative to the repository root
HELDOUT = Path("benchmarks") / "data" / "heldout_code_dev.jsonl.xz"

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".toml", ".cfg", ".yaml", ".yml")


def package_source(package: str = "click") -> str:
    """All ``.py`` files of an installed package, sorted by path, each headed by its name."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise VegasConfigError(f"prompt package {package!r} is not an installed package")
    root = Path(next(iter(spec.submodule_search_locations)))
    return _concatenate(sorted(root.rglob("*.py")), root.parent)


def _readable_file(path: Path) -> bool:
    """A regular file this process can open; an entry that cannot even be looked at (a link into
    ``/proc``, a folder without permission) is not one."""
    try:
        return path.is_file() and os.access(path, os.R_OK)
    except OSError:
        return False


def read_text_source(path: str | Path, *, what: str = "prompts path", max_bytes: int | None = None) -> str:
    """Text of a file, or of every text file under a directory (sorted), concatenated.

    Args:
        path: a file or a directory.
        what: how error messages name the path (e.g. the CLI option).
        max_bytes: refuse, before reading anything, files that together hold more bytes.

    Raises:
        VegasConfigError: the path does not exist, is a binary file, holds no text file, or
            holds more than ``max_bytes`` bytes.
    """
    path = Path(path)
    if path.is_file() and path.name.endswith((".jsonl", ".jsonl.xz")):
        return _read_documents(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and _readable_file(p))
    else:
        files = []
    if max_bytes is not None:
        size = sum(f.stat().st_size for f in files)
        if size > max_bytes:
            raise VegasConfigError(
                f"{what} {str(path)!r} holds {size} bytes of text; at most {max_bytes} bytes can fit "
                "the model's context"
            )
    if path.is_file():
        if _is_binary(path):
            raise VegasConfigError(f"{what} {str(path)!r} is a binary file, not text")
        return path.read_text(encoding="utf-8", errors="replace")
    files = [f for f in files if not _is_binary(f)]
    if files:
        return _concatenate(files, path)
    raise VegasConfigError(f"{what} {str(path)!r} is not a file or a directory with text files")


def prompt_text(source: str | Path | None, *, what: str = "prompts path") -> str:
    """The prompts' text: :func:`read_text_source` of ``source`` (``what`` names it in its errors),
    or for None the fallback, the installed click source (:func:`package_source`).

    Raises:
        VegasConfigError: as :func:`read_text_source`, or ``source`` holds no text (field ``prompts``).
    """
    if not source:
        return package_source("click")
    text = read_text_source(source, what=what)
    if not text.strip():
        raise VegasConfigError.bad("prompts", f"{str(source)!r} holds no text (empty or only whitespace)")
    return text


def heldout_path() -> Path | None:
    """The held-out code set of a checkout: the one vegas is installed from (an editable
    install), else the one in the current directory (a checkout run from after ``pip install .``),
    or None."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        path = root / HELDOUT
        if path.is_file():
            return path
    return None


def source_label(source: str | None) -> str:
    """How a prompt source reads in titles and tables: ``"held-out code"`` for the held-out set,
    the file or folder name for another ``--prompts``, and for None (the fallback)
    ``"click source (held-out set not found)"``."""
    if source is None:
        return "click source (held-out set not found)"
    path = Path(source)
    return "held-out code" if path.name == HELDOUT.name else path.name


def _read_documents(path: Path) -> str:
    """The ``text`` fields of a JSON-lines file (xz-compressed when it ends in ``.xz``),
    joined by blank lines."""
    opener = lzma.open if path.suffix == ".xz" else open
    bad = f"{str(path)!r} is not JSON lines with a 'text' field per line"
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.readlines()
    except (ValueError, lzma.LZMAError) as exc:  # not UTF-8, or not xz
        raise VegasConfigError(f"{bad} ({type(exc).__name__}: {exc})") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError) as exc:
            raise VegasConfigError(f"{bad} (line {number}: {type(exc).__name__}: {exc})") from None
        if not isinstance(text, str):
            raise VegasConfigError(f"{bad} (line {number}: 'text' is {type(text).__name__}, not a string)")
        texts.append(text)
    return "\n\n".join(texts)


def _is_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB: the test git and grep use."""
    with path.open("rb") as f:
        return b"\0" in f.read(8192)


def _concatenate(files: list[Path], root: Path) -> str:
    parts = [f"# file: {f.relative_to(root)}\n{f.read_text(encoding='utf-8', errors='replace')}" for f in files]
    return "\n".join(parts)


def cut_contexts(token_ids: list[int], context: int, count: int, flag: str = "--context") -> list[list[int]]:
    """``count`` windows of ``context`` tokens, spread evenly over ``token_ids``.

    Windows overlap when the document is shorter than ``count * context`` tokens. ``flag``: the
    command-line option that set ``context``, for the error message.

    Raises:
        VegasConfigError: ``context`` < 1, ``count`` < 1, or the document is shorter than
            ``context`` tokens.
    """
    if context < 1 or count < 1:
        raise VegasConfigError(f"context and count must be >= 1, got context={context}, count={count}")
    if len(token_ids) < context:
        raise VegasConfigError(
            f"context ({flag}) of {context} tokens is longer than the prompt source ({len(token_ids)} tokens); "
            f"give a shorter {flag} or a longer --prompts source"
        )
    span = len(token_ids) - context
    starts = [span * i // max(count - 1, 1) if count > 1 else span for i in range(count)]
    return [token_ids[s : s + context] for s in starts]


#: tokens of the passage repeated at the end of a copy prompt (:func:`retrieval_prompts`)
RETRIEVAL_CUE = 16
#: the shortest context of a copy prompt: the cue after a body whose first half holds the passage
RETRIEVAL_MIN_CONTEXT = 4 * RETRIEVAL_CUE


def retrieval_prompts(
    token_ids: list[int], context: int, count: int, anchor_ids: set[int], *, cue: int = RETRIEVAL_CUE,
    answer: int = 64,
) -> list[dict]:
    """Copy-task prompts: ``count`` windows of held-out text whose last ``cue`` tokens repeat
    the start of a passage far back, so the continuation copies the passage.

    Each window body (``context - cue`` tokens, :func:`cut_contexts`) has its passage at an
    anchor token (e.g. ``def``: a function defined thousands of tokens earlier) in its first
    half, at least ``(context - cue) / 2`` tokens back, whose first ``cue`` tokens occur nowhere
    else in the body (so the passage to copy is unambiguous: not one of many ``def
    __init__(self``); the first such position of the first half if no anchor qualifies.

    Args:
        anchor_ids: token ids a passage may start at.
        cue: tokens of the passage repeated at the end of the prompt.
        answer: tokens of the passage after the cue kept as the expected continuation.

    Returns:
        per prompt ``{"prompt": ids (context), "expected": ids (<= answer), "distance": tokens
        from the passage to the cue}``.
    """
    bodies = cut_contexts(token_ids, context - cue, count, "--contexts")  # vegas ablate's retrieval study
    out = []
    for i, body in enumerate(bodies):
        half = len(body) // 2
        lo = max(1, half * i // max(count, 1) // 2)  # spread the passages over the first half
        counts = Counter(tuple(body[j : j + cue]) for j in range(len(body) - cue + 1))
        unique = [a for a in range(lo, max(lo + 1, half - cue - answer)) if counts[tuple(body[a : a + cue])] == 1]
        a = next((a for a in unique if body[a] in anchor_ids), unique[0] if unique else lo)
        out.append({
            "prompt": body + body[a : a + cue],
            "expected": body[a + cue : a + cue + answer],
            "distance": len(body) - a,
        })
    return out
