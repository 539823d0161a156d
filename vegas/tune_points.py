"""Measured points of ``vegas tune`` and ``vegas ablate``: the resumable ``points.json`` store,
how sparsities are rounded and how points are picked out (shared by :mod:`vegas.tune`,
:mod:`vegas.ablate` and :mod:`vegas.plots`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path

from .config import VegasConfigError, check_device_name

__all__ = ["PointStore", "points_of", "round_sparsity", "same_setting", "settings_device", "source_settings",
           "spread"]

FORMAT_VERSION = 1

#: settings that name a source (a model, a prompt set): compared by what they name, not by how
#: (an absolute path on another machine, a relative path, a model name or its GGUF file)
SOURCE_SETTINGS = ("model", "prompts")


def _source_file(key: str, value, strict: bool = False) -> Path | None:
    """The file a source setting names here, or None (a directory, a hub id, a package source,
    a path absent on this machine, a named model whose package is not installed: with ``strict``,
    that raises :class:`~vegas.config.VegasConfigError` with the install command)."""
    from .models import NAMED_MODELS, named_model_gguf

    if not isinstance(value, str):
        return None
    if key == "model" and value in NAMED_MODELS:
        try:
            return named_model_gguf(value)
        except VegasConfigError:
            if strict:
                raise
            return None
    path = Path(value).expanduser()
    return path if path.is_file() else None


def _content(key: str, value, strict: bool = False) -> str | None:
    """:func:`vegas.models.content_key` of the file a source setting names here (:func:`_source_file`),
    or None."""
    from .models import content_key

    found = _source_file(key, value, strict)
    return content_key(found) if found is not None else None


def source_settings(settings: dict) -> dict:
    """``settings`` with ``<source>_content`` (:func:`vegas.models.content_key` of the file each
    source setting names here, or None) beside each of :data:`SOURCE_SETTINGS`, so that a rerun
    from another place or machine is matched by content.

    Raises:
        VegasConfigError: a named model whose package is not installed (the install command).
    """
    out = dict(settings)
    for key in SOURCE_SETTINGS:
        if key in settings:
            out[f"{key}_content"] = _content(key, settings[key], strict=True)
    return out


def _same_source(key: str, old: dict, new: dict) -> bool:
    """Whether two source settings name the same source: the same content where both are known
    (stored, or read here from the file the value names); else the same value; else, for a file
    of an older points file measured elsewhere (an absolute path absent here, no content stored),
    a file here of the same name. Hub ids, directories and package sources compare whole."""
    from .models import DEFAULT_MODEL, EMBEDDED_MODEL_NAME

    a, b = old.get(key), new.get(key)
    if key == "model" and {a, b} <= {None, EMBEDDED_MODEL_NAME, DEFAULT_MODEL}:
        return True
    if key == "prompts":  # tune's None: the installed click source, as ablate writes it
        a, b = a or "package:click", b or "package:click"
    ca = old.get(f"{key}_content") or _content(key, a)
    cb = new.get(f"{key}_content") or _content(key, b)
    if ca and cb:
        return ca == cb
    if a == b:
        return True
    elsewhere = isinstance(a, str) and a.startswith("/") and not Path(a).exists()
    found = _source_file(key, b)
    return bool(elsewhere and ca is None and found is not None and Path(a).name == found.name)


def same_setting(key: str, old: dict, new: dict) -> bool:
    """Whether ``old[key]`` and ``new[key]`` measure alike: equal; for a source setting,
    :func:`_same_source` (its ``_content`` key is judged with it)."""
    base = key[: -len("_content")] if key.endswith("_content") else None
    if base in SOURCE_SETTINGS:
        return True
    if key in SOURCE_SETTINGS:
        return _same_source(key, old, new)
    return old.get(key) == new.get(key)


def spread(values: list[float], seed: int = 0, resamples: int = 2000) -> dict:
    """Mean of ``values`` with a 95 % percentile-bootstrap interval and the min and max."""
    mean = sum(values) / len(values)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(resamples))
    return {"mean": mean, "ci95": [means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]],
            "min": min(values), "max": max(values), "n": len(values)}


def round_sparsity(s: float) -> float:
    """A sparsity to 4 significant digits: the form points are stored and matched in."""
    return float(f"{s:.4g}")


def points_of(points: list[dict], step: int, selector: str | None, gamma: int | None = None,
        sparsity: float | None = None) -> list[dict]:
    """The points of ``step`` and ``selector`` (None: plain decoding), at ``gamma`` and
    ``sparsity`` when given."""
    return [p for p in points if p["step"] == step and p["selector"] == selector
            and (gamma is None or p["num_draft_tokens"] == gamma)
            and (sparsity is None or p["sparsity_ratio"] == round_sparsity(sparsity))]


class PointStore:
    """``points.json``: the measurement settings and every measured point (dicts), rewritten
    atomically after each point, so that a rerun with the same settings resumes.

    Args:
        path: the JSON file.
        settings: the options whose change alters what a point measures.
        fresh: discard the points already in ``path``.
        command: names the command in error messages (e.g. ``"vegas tune"``).
        same: ``same(key, old, new) -> bool``, whether the stored and the new settings agree on
            ``key`` (default: equal values, sources by :func:`_same_source`).

    Raises:
        VegasConfigError: ``path`` is not a file (a directory), not a points file, or holds points measured with other
            settings (the message lists them and says how to resume or start over).
    """

    def __init__(self, path: Path, settings: dict, fresh: bool, command: str, same=None) -> None:
        self.path = path
        self.settings = settings
        self.points: list[dict] = []
        if self.path.exists() and not self.path.is_file():
            raise VegasConfigError(f"{self.path} exists and is not a file: {command} keeps its points there; "
                                   "remove it or choose another --out")
        if self.path.exists() and not fresh:
            try:
                data = json.loads(self.path.read_text())
                old, points = data["settings"], data["points"]
            except (ValueError, KeyError, TypeError) as exc:
                raise VegasConfigError(
                    f"{self.path} is not a {command} points file ({exc}); pass --fresh to overwrite it "
                    "or choose another --out"
                ) from None
            same = same or same_setting
            changed = sorted(k for k in set(old) | set(settings) if not same(k, old, settings))
            if changed:
                diff = "; ".join(f"--{k.replace('_', '-')}: {old.get(k)!r} -> {settings.get(k)!r}"
                                 + (" (other content)" if old.get(k) == settings.get(k) else "") for k in changed)
                raise VegasConfigError(
                    f"{self.path} holds points measured with other settings ({diff}); rerun with the same "
                    "settings to resume, pass --fresh to discard them, or choose another --out"
                )
            self.points = points
            self.settings = {**settings, **old}  # the points' own settings stay (the paths they were measured with)

    def find(self, **key) -> dict | None:
        """The first point whose fields equal ``key`` (values as stored), or None."""
        return next((p for p in self.points if all(p.get(k) == v for k, v in key.items())), None)

    def add(self, point: dict) -> None:
        self.points.append(point)
        self.save()

    def save(self) -> None:
        """Write the file (its directory made here, with the first point: a run that fails a
        check before measuring leaves no directory behind).

        Raises:
            VegasConfigError: the file or its directory cannot be written (the message names it)."""
        tmp = self.path.with_suffix(".json.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": FORMAT_VERSION, "settings": self.settings, "points": self.points},
                                      indent=2))
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # leave no half-written temporary file
                tmp.unlink(missing_ok=True)
            raise VegasConfigError(f"cannot write {self.path} ({exc.strerror or exc}); choose another --out") from None


def settings_device(device: str | None) -> str:
    """The device a run measures on, as its stored settings name it: ``device``, or for None (the
    default) the one the HF backend then picks (``"cuda"`` when available, else ``"cpu"``), so that
    a rerun that leaves ``--device`` out resumes points measured with it given, and the reverse.

    Raises:
        VegasConfigError: ``device`` is not ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if device is not None:
        check_device_name(device)
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
