"""``vegas serve``: the ``vllm serve`` command line of an OpenAI-compatible server with Vegas (or
plain vLLM with the same arguments), checked before any process starts.

Vegas reaches vLLM through two serve arguments, no environment variable:

* ``--speculative-config '{"method": "custom_class", "model": "vegas.vllm_plugin.proposer.VegasProposer",
  "num_speculative_tokens": γ}'`` switches the proposer on;
* ``--additional-config '{"vegas": {"selector": ..., <VegasConfig fields>}}'`` carries the settings:
  vLLM keeps ``additional_config`` in ``VllmConfig`` and hands it to every worker, where the proposer
  reads it (:func:`vegas.vllm_plugin.settings.read_settings`; the only channel, no environment
  variable).

The model is resolved as everywhere in vegas (:func:`vegas.models.resolve_model`): a model name
(``smollm2-135m``) or a ``.gguf`` file becomes its converted checkpoint directory (converted once into
the user cache), a directory stays itself, a hub id ``org/name`` is passed on; a missing path or an
unknown name fails here with the message ``Pipeline`` gives.

The engine arguments come from :func:`vegas.backends.vllm.vllm_engine_kwargs` (the one place they are
made), turned into ``vllm serve`` options. Arguments after ``--`` go to ``vllm serve`` last, so they win
(``--max-model-len``, ``--gpu-memory-utilization``, ``--dtype``...); for plain vLLM
(``selector="none"``) they may carry vLLM's own ``--speculative-config`` (ngram, for instance).

Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .config import (
    DRAFT_POLICY_FIELDS,
    VegasConfig,
    VegasConfigError,
    parse_json_object,
)
from .models import in_local_cache, resolve_model

__all__ = [
    "PLUGIN_ENTRY_POINT",
    "ServePlan",
    "ServerError",
    "ServerProcess",
    "free_port",
    "plan_serve",
    "plugin_entry_point_installed",
    "raise_if_vllm_missing",
    "read_config",
    "vllm_command",
    "vllm_installed",
]

#: the ``vllm.general_plugins`` entry point vLLM's processes must find (``pyproject.toml``)
PLUGIN_ENTRY_POINT = "vegas.vllm_plugin:register"
#: ``vllm serve`` options that ``vegas serve`` sets itself when Vegas is on
_OWNED = ("--speculative-config", "-sc")
#: vllm serve arguments that are vegas serve options of the same name (one place to set each)
_OWN_OPTIONS = ("--port", "--host", "--dtype")
_ADDITIONAL = "--additional-config"


@dataclass
class ServePlan:
    """What ``vegas serve`` runs: ``argv`` with ``env`` added to the current environment."""

    argv: list[str]
    #: environment variables set on top of the caller's (empty: Vegas needs none)
    env: dict[str, str] = field(default_factory=dict)
    #: the Vegas settings object passed in ``additional_config["vegas"]`` (None: plain vLLM)
    settings: dict[str, Any] | None = None
    #: the model the server serves
    model: str = ""
    port: int = 8000
    #: things the caller should know (printed before the server starts)
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """The command as one shell line, environment assignments first."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)

    def describe(self) -> list[str]:
        """Lines that say what runs: the method, the settings, the environment and the command."""
        lines = [f"vegas serve: {'plain vLLM' if self.settings is None else 'Vegas'} on port {self.port}"]
        if self.settings is not None:
            lines.append(f"  settings (--additional-config 'vegas'): {json.dumps(self.settings)}")
        lines.append("  environment added: " + (" ".join(f"{k}={v}" for k, v in self.env.items()) or "none"))
        lines += [f"  note: {n}" for n in self.notes]
        lines.append("  command: " + self.shell())
        return lines


def vllm_command() -> list[str]:
    """``["vllm"]`` when the ``vllm`` executable is on PATH, else this Python running vLLM's CLI
    module (vLLM on ``PYTHONPATH`` without its console script)."""
    exe = shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def vllm_installed() -> bool:
    """Whether ``vllm serve`` can run: a ``vllm`` executable on PATH or an importable ``vllm``
    (:func:`vegas.backends.vllm.vllm_installed`)."""
    from .backends.vllm import vllm_installed as importable

    return shutil.which("vllm") is not None or importable()


def raise_if_vllm_missing() -> None:
    """Raise, with the install hint the vLLM backend gives, unless :func:`vllm_installed`.

    Raises:
        VegasConfigError: ``vegas serve needs vLLM 0.24.0 and a CUDA GPU: vllm is not installed
            (pip install 'vegas[vllm]')``.
    """
    from .backends.vllm import vllm_missing_message

    if not vllm_installed():
        raise VegasConfigError(vllm_missing_message("vegas serve"))


def plugin_entry_point_installed() -> bool:
    """Whether vLLM will run :data:`PLUGIN_ENTRY_POINT` in every process (there the API server's
    config check keeps async scheduling on): a ``vllm.general_plugins`` entry point names it, and
    ``VLLM_PLUGINS``, when set, names that entry point (vLLM loads only the plugins it lists; an
    empty string: none)."""
    import os
    from importlib.metadata import entry_points

    allowed = os.environ.get("VLLM_PLUGINS")
    return any(ep.value.replace(" ", "") == PLUGIN_ENTRY_POINT
               and (allowed is None or ep.name in allowed.split(","))
               for ep in entry_points(group="vllm.general_plugins"))


def read_config(raw: str) -> tuple[dict[str, Any], VegasConfig]:
    """``--config``: a JSON object, or the path of a file holding one, of Vegas settings (a
    ``selector`` name plus :class:`~vegas.config.VegasConfig` fields).

    Returns:
        ``(values as given, selector included; the VegasConfig they make)``.

    Raises:
        VegasConfigError: a message starting ``--config``: no such file, not a JSON object, an
            unknown field (the allowed ones listed, ``selector`` among them) or a bad value.
    """
    text = raw.strip()
    if not text.startswith(("{", "[", '"')) and not text[:1].isdigit():
        path = Path(text)
        if not path.is_file():
            what = "a directory" if path.is_dir() else "no such file"
            raise VegasConfigError(f"--config must be a JSON object or a JSON file, got {raw!r} ({what})")
        text = path.read_text()
    values = parse_json_object(text, "--config")
    known = {f.name for f in fields(VegasConfig)}
    unknown = sorted(set(values) - known - {"selector"})
    if unknown:
        raise VegasConfigError(f"--config: unknown field(s) {', '.join(unknown)}; allowed: selector, "
                               f"{', '.join(sorted(known))}")
    try:
        cfg = VegasConfig.from_dict({k: v for k, v in values.items() if k != "selector"}, "--config")
    except VegasConfigError as exc:  # a field of --config's JSON, not the option of that name
        raise VegasConfigError(str(exc) if str(exc).startswith("--config") else f"--config: {exc}") from exc
    return values, cfg


def _option_values(args: list[str], names: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """``(start, end, value)`` of each ``--name value`` / ``--name=value`` in ``args``; a long
    option spelled with underscores (``--speculative_config``) counts as its dashed name, since
    vLLM's argument parser reads it so."""
    found = []
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag.startswith("--"):  # vLLM's parser reads --speculative_config as --speculative-config
            flag = flag.replace("_", "-")
        if flag in names:
            if eq:
                found.append((i, i + 1, value))
            elif i + 1 >= len(args):
                raise VegasConfigError(f"vllm serve argument {args[i]} needs a value")
            else:
                found.append((i, i + 2, args[i + 1]))
                i += 1
        i += 1
    return found


def _cli(kwargs: dict[str, Any]) -> list[str]:
    """``vllm.LLM`` keyword arguments as ``vllm serve`` options (``model`` excluded; False and None
    left out: they are vLLM's defaults for the keys :func:`vllm_engine_kwargs` makes)."""
    out: list[str] = []
    for key, value in kwargs.items():
        if key == "model" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def plan_serve(
    model: str,
    *,
    selector: str | None = None,
    num_draft_tokens: int | None = None,
    sparsity_ratio: float | None = None,
    kv_budget: int | None = None,
    config: str | None = None,
    port: int = 8000,
    host: str | None = None,
    dtype: str = "bfloat16",
    extra_args: list[str] | tuple[str, ...] = (),
    check_model: bool = True,
) -> ServePlan:
    """The ``vllm serve`` command for ``model``: Vegas with ``selector`` (None: the one in
    ``config``, else collect2), or plain vLLM for ``selector="none"``, everything checked here.

    Args:
        model: a model name (``smollm2-135m``), a ``.gguf`` file, a model directory or a hub id
            (:func:`vegas.models.resolve_model`; names and GGUF files are converted once, and
            the command serves the converted checkpoint directory).
        num_draft_tokens: γ (default: ``config``'s ``num_draft_tokens``, else 4).
        sparsity_ratio, kv_budget: override ``config``'s fields when given.
        config: the settings JSON (``{"selector": ..., <VegasConfig fields>, "vllm": {...}}``) or a
            file holding it.
        extra_args: further ``vllm serve`` arguments, placed last.
        check_model: refuse a model whose every layer is sliding-window (Vegas only).

    Raises:
        VegasConfigError: naming the bad option and its allowed values: a missing model path or
            an unknown model name (``Pipeline``'s message), an unknown selector or field, a value
            out of range, settings the vLLM backend refuses, an all-sliding-window model, or
            ``extra_args`` that set what ``vegas serve`` sets.
    """
    from .backends.vllm import raise_if_only_sliding_window, verify_cuda_graphs, vllm_engine_kwargs, vllm_missing_message
    from .vllm_plugin.settings import ADDITIONAL_CONFIG_KEY, build_selector, settings_json

    extra = list(extra_args)
    if not isinstance(port, int) or not 0 < port < 65536:
        raise VegasConfigError(f"--port must be an integer in 1..65535, got {port!r}")
    for start, _, _ in _option_values(extra, _OWN_OPTIONS):
        flag = extra[start].split("=", 1)[0]
        raise VegasConfigError(f"vllm serve argument {flag} after -- would contradict vegas serve's own "
                               f"{flag}; give it as vegas serve {flag}")
    model = resolve_model(model)  # names and .gguf files -> a checkpoint directory, as Pipeline does
    plain = selector == "none"
    if plain:
        if config is not None:
            raise VegasConfigError("--config sets Vegas settings; it cannot go with --selector none (plain vLLM)")
        given = [flag for flag, value in (("--num-draft-tokens", num_draft_tokens), ("--sparsity-ratio", sparsity_ratio),
                                          ("--kv-budget", kv_budget)) if value is not None]
        if given:
            raise VegasConfigError(f"{', '.join(given)} set(s) Vegas settings; it cannot go with --selector none "
                                   "(plain vLLM)")
        kw = vllm_engine_kwargs(model, dtype=dtype)
        settings = None
    else:
        values, cfg = read_config(config) if config else ({}, VegasConfig())
        given_fields = set(values)  # what --config named (values grows to every field below)
        from_config = selector is None and "selector" in values
        name = selector or values.get("selector") or "collect2"
        if name == "none":  # only --config can name it here: --selector none is the plain branch above
            raise VegasConfigError("--config: selector 'none' is plain decoding; for plain vLLM use "
                                   "vegas serve --selector none (without --config)")
        gamma = cfg.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if not isinstance(gamma, int) or gamma < 1:
            raise VegasConfigError.bad("num_draft_tokens", f"must be an integer >= 1 (γ), got {gamma!r}")
        values = cfg.to_dict()
        if sparsity_ratio is not None:
            values["sparsity_ratio"] = sparsity_ratio
        if kv_budget is not None:
            values["kv_budget"] = kv_budget
        cfg = VegasConfig.from_dict(values, "vegas serve options")
        try:
            sel = build_selector(name, cfg, gamma, _block_size(extra))
        except VegasConfigError as exc:
            if from_config and exc.field == "selector":  # the name came from --config, not --selector
                raise VegasConfigError(f"--config: {exc}") from exc
            raise
        for start, end, _ in _option_values(extra, _OWNED):
            raise VegasConfigError(
                f"vllm serve argument {extra[start]} is set by vegas serve for Vegas; use --selector none "
                "for vLLM's own speculative methods"
            )
        if check_model:  # a window covering --max-model-len (a plain integer there) drops no key
            max_len = next((int(v) for _, _, v in _option_values(extra, ("--max-model-len",)) if v.isdigit()), None)
            raise_if_only_sliding_window(model, max_len)
        settings = json.loads(settings_json(name, sel.config))
        kw = vllm_engine_kwargs(model, dtype=dtype, num_draft_tokens=gamma,
                                verify_cuda_graphs=verify_cuda_graphs(sel, sel.config))
        additional: dict[str, Any] = {}
        for start, end, value in reversed(_option_values(extra, (_ADDITIONAL,))):
            theirs = parse_json_object(value, f"vllm serve argument {_ADDITIONAL}")
            if ADDITIONAL_CONFIG_KEY in theirs:
                raise VegasConfigError(
                    f"vllm serve argument {_ADDITIONAL} must not hold {ADDITIONAL_CONFIG_KEY!r}: give the Vegas "
                    "settings as vegas serve options or --config"
                )
            additional = {**theirs, **additional}
            del extra[start:end]
        kw["additional_config"] = {**additional, ADDITIONAL_CONFIG_KEY: settings}
    kw.pop("disable_log_stats", None)  # vllm serve logs stats by default
    argv = [*vllm_command(), "serve", model, *_cli(kw)]
    if host is not None:
        argv += ["--host", host]
    argv += ["--port", str(port), *extra]
    notes = []
    hf_only = sorted(given_fields & set(DRAFT_POLICY_FIELDS)) if not plain else []
    if hf_only:  # top-level fallback* fields are the HF backend's draft policy
        notes.append(f"--config field(s) {', '.join(hf_only)}: the HF backend's draft policy, unused on vLLM; "
                     'the measured fallback on vLLM is {"vllm": {"fallback": true}}')
    if not vllm_installed():
        notes.append(vllm_missing_message("the command below"))
    if not Path(model).is_dir() and not in_local_cache(model):
        notes.append(f"model {model!r} is not a local directory and not in the local Hugging Face cache, so it "
                     "was not checked here: vllm serve will look it up on the hub (HF_HUB_OFFLINE=1 makes it fail "
                     "at once instead)")
    if not plain and not plugin_entry_point_installed():
        notes.append(
            f"no vllm.general_plugins entry point {PLUGIN_ENTRY_POINT} that vLLM will load here (vegas not "
            "pip-installed, or VLLM_PLUGINS set without naming it): vLLM's API-server process turns async "
            "scheduling off; install vegas (pip install -e .) and leave VLLM_PLUGINS unset, or add vegas "
            "to it, for the full speed"
        )
    return ServePlan(argv=argv, env={}, settings=settings, model=model, port=port, notes=notes)


#: vLLM's KV block size with FlashAttention when ``--block-size`` is not given (vLLM 0.24.0)
VLLM_DEFAULT_BLOCK_SIZE = 16


def _block_size(extra: list[str]) -> int:
    """The engine's KV block size: ``--block-size`` among the ``vllm serve`` arguments, else
    :data:`VLLM_DEFAULT_BLOCK_SIZE` (Quest's pages are vLLM's blocks).

    Raises:
        VegasConfigError: ``--block-size`` is not a positive integer.
    """
    for start, end, value in _option_values(extra, ("--block-size",)):
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise VegasConfigError(f"vllm serve argument --block-size must be a positive integer, got {value!r}")
        return size
    return VLLM_DEFAULT_BLOCK_SIZE


def exec_plan(plan: ServePlan) -> None:  # pragma: no cover - replaces the process
    """Replace this process by the server (signals then reach vLLM directly)."""
    os.execvpe(plan.argv[0], plan.argv, {**os.environ, **plan.env})


class ServerError(RuntimeError):
    """A server that exited before it was ready, was not ready in time, or did not stop cleanly
    (the message ends with the tail of its log)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of a log file ("" when it does not exist)."""
    text = Path(path).read_text(errors="replace").splitlines() if Path(path).exists() else []
    return "\n".join(text[-lines:])


class ServerProcess:
    """An OpenAI-compatible server started from ``argv`` in its own process group, its output in
    ``log``: :meth:`wait_ready` polls ``/health``; :meth:`stop` sends SIGTERM and waits for the
    whole group (API server, engine core, workers) to be gone."""

    def __init__(self, label: str, argv: list[str], log: Path, port: int, env: dict | None = None,
                 cwd: str | Path | None = None):
        self.label, self.argv, self.log, self.port = label, list(argv), Path(log), port
        self.url = f"http://127.0.0.1:{port}"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=cwd, start_new_session=True)

    def _fail(self, why: str) -> ServerError:
        return ServerError(f"{self.label} server {why}; log {self.log}, tail:\n{log_tail(self.log)}")

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``/health`` answers 200.

        Raises:
            ServerError: the server exited first, or was not ready within ``timeout`` (then it
                is stopped).
        """
        import urllib.error
        import urllib.request

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.kill()
        raise self._fail(f"was not ready within {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL to the whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self, timeout: float = 60, group_timeout: float = 30) -> int:
        """SIGTERM (as a service manager sends it); the exit status.

        Raises:
            ServerError: not stopped within ``timeout`` s, or processes of its group still alive
                ``group_timeout`` s after it exited (both then killed).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self._fail(f"did not stop within {timeout:.0f} s of SIGTERM") from None
        end = time.monotonic() + group_timeout
        while time.monotonic() < end:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return rc
            time.sleep(0.5)
        self.kill()
        raise self._fail(f"left processes behind {group_timeout:.0f} s after it exited")
