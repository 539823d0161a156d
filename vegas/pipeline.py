"""The front door: ``Pipeline(model=..., selector="collect2", backend="hf").generate(...)``."""

from __future__ import annotations

import inspect
import numbers
from contextlib import nullcontext
from typing import Sequence

from .backends.base import Backend, RequestOutput, as_selector
from .config import VegasConfig, VegasConfigError
from .models import DEFAULT_MODEL, resolve_model
from .plugins import PLAIN, blame, create_selector, get_backend_class, is_builtin, owner
from .sampling import SamplingParams

__all__ = ["Pipeline", "DEFAULT_MODEL", "EMPTY_PROMPT", "generation_options"]

#: what is wrong with a prompt of no tokens (``generate`` and ``vegas generate``'s early check)
EMPTY_PROMPT = "is empty; every prompt needs at least one token"


def _is_array(x) -> bool:
    """A numpy array or torch tensor (token ids), by duck typing."""
    return hasattr(x, "tolist") and hasattr(x, "ndim") and not isinstance(x, (str, bytes))


_PIPELINE_ARGUMENTS = ("model", "dtype", "device", "trust_remote_code", "rope_scaling")


def _check_backend_options(name: str, backend_cls: type, options: dict) -> None:
    """Raise VegasConfigError for ``backend_options`` keys that ``backend_cls`` does not take
    (a backend whose constructor takes ``**kwargs`` gets every key)."""
    try:
        params = inspect.signature(backend_cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        allowed = None
    else:
        allowed = [k for k, p in params.items() if k != "self" and k not in _PIPELINE_ARGUMENTS
                   and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    own = sorted(k for k in options if k in _PIPELINE_ARGUMENTS)
    if own:
        raise VegasConfigError.bad("backend_options", f"must not set {own}: pass them as Pipeline arguments")
    unknown = [] if allowed is None else sorted(str(k) for k in options if k not in allowed)
    if unknown:
        known = f"allowed: {', '.join(allowed)}" if allowed else f"backend {name!r} takes none"
        raise VegasConfigError.bad("backend_options", f"has unknown option(s) {unknown} for backend {name!r}; "
                                   f"{known}")


def generation_options(max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                       chat: bool = False) -> SamplingParams:
    """Check :meth:`Pipeline.generate`'s options that need no model (callers check them before
    loading one: ``vegas generate`` does) and return the sampling parameters.

    Raises:
        VegasConfigError: ``max_new_tokens`` not an integer >= 1, bad sampling parameters
            (:class:`~vegas.sampling.SamplingParams`), ``chat`` not a bool; the field is named.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise VegasConfigError.bad("max_new_tokens", f"must be an integer >= 1, got {max_new_tokens!r}")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    if not isinstance(chat, bool):
        raise VegasConfigError.bad("chat", f"must be True or False, got {chat!r}")
    return sampling


class Pipeline:
    """Self-speculative decoding with verification-guided sparse attention.

    Args:
        model: a model name (``"smollm2-135m"``), a ``.gguf`` file (converted once into the
            user cache), a transformers model directory, or a hub id in the local HF cache;
            default the embedded vegas-tiny-code. See :func:`vegas.models.resolve_model`.
        selector: registered selector name (built-ins: ``collect2``, ``aggregated``,
            ``sliding_window``, ``quest``, ``last_token``), or ``"none"`` (or None) for plain
            decoding.
        backend: registered backend name (``hf``, ``vllm``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: ``"cpu"``/``"cuda"``; None picks CUDA when available.
        trust_remote_code: allow model code shipped with the model (off by default).
        rope_scaling: RoPE scaling for contexts beyond the model's, applied before loading,
            e.g. ``{"rope_type": "yarn", "factor": 4.0}`` (types ``yarn``, ``linear``,
            ``llama3``); raises ``backend.max_context`` by the factor. None: the model's own.
        backend_options: further keyword arguments of the backend's constructor, e.g.
            ``{"engine_args": {"max_model_len": 8192}}`` for the vllm backend.
        **config: fields of :class:`~vegas.config.VegasConfig` (``num_draft_tokens``,
            ``sparsity_ratio``, ``kv_budget``, ...).

    Raises:
        VegasConfigError: unknown selector, backend, model name or config field, a field
            outside its allowed values, a model path that does not exist or a GGUF that cannot
            be converted, bad ``rope_scaling``, or ``num_draft_tokens`` too large for the model's
            context.

    Example::

        pipe = Pipeline(selector="collect2", backend="hf", num_draft_tokens=4)
        out = pipe.generate(["def fib(n):"], max_new_tokens=32)
        print(out[0].text, out[0].stats.acceptance_length)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        selector: str | None = "collect2",
        backend: str = "hf",
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,
        rope_scaling: dict | None = None,
        backend_options: dict | None = None,
        **config,
    ) -> None:
        unknown = set(config) - set(VegasConfig.__dataclass_fields__)
        if unknown:
            raise VegasConfigError(
                f"unknown config field(s) {sorted(unknown)}; allowed: {sorted(VegasConfig.__dataclass_fields__)}"
            )
        self.config = VegasConfig(**config)
        if not isinstance(trust_remote_code, bool):
            raise VegasConfigError.bad("trust_remote_code", f"must be True or False, got {trust_remote_code!r}")
        if selector is not None:
            create_selector(selector, self.config)  # fail fast on an unknown name or type
        self.selector = None if selector == PLAIN else selector
        backend_cls = get_backend_class(backend)
        model = resolve_model(model)  # names and .gguf files -> a checkpoint directory
        # rope_scaling only when set: backends from plugins may not take it
        scaled = {} if rope_scaling is None else {"rope_scaling": rope_scaling}
        if backend_options is not None and not isinstance(backend_options, dict):
            raise VegasConfigError(f"backend_options must be a dict of backend arguments, got {backend_options!r}")
        _check_backend_options(backend, backend_cls, backend_options or {})
        builtin = is_builtin(owner("backends", backend))  # its own errors stay as they are
        with nullcontext() if builtin else blame("backends", backend, "failed to build"):
            self.backend: Backend = backend_cls(
                model, dtype=dtype, device=device, trust_remote_code=trust_remote_code, **scaled,
                **(backend_options or {}),
            )
        most = self.backend.max_context - 3  # a prompt token, a new token and γ + 1 verification slots
        if self.config.num_draft_tokens > most:
            raise VegasConfigError.bad(
                "num_draft_tokens", f"(γ) must be at most {most} for this model's context of "
                f"{self.backend.max_context} tokens (γ + 1 verification slots, a prompt token and a new token), "
                f"got {self.config.num_draft_tokens}")

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    def encode(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]], *, chat: bool = False
    ) -> list[list[int]]:
        """Token ids of ``prompts`` (texts are tokenised, token-id lists kept; numpy arrays and
        torch tensors of ids count as lists: 1-D one prompt, 2-D a batch).

        Args:
            prompts: a text, one list of token ids (one prompt), a list of texts, or a list of
                token-id lists.
            chat: wrap each text as one user message and apply the tokenizer's chat template
                with the assistant's generation prompt (texts only).

        Raises:
            VegasConfigError: no prompt, or an empty one; ``chat=True`` with a token-id prompt
                or with a tokenizer that has no chat template.
        """
        kinds = "a text, one list of token ids, a list of texts, or a list of token-id lists"
        if _is_array(prompts):  # numpy / torch token ids: 1-D one prompt, 2-D a batch
            prompts = prompts.tolist()
        if isinstance(prompts, (list, tuple)):
            prompts = [p.tolist() if _is_array(p) else p for p in prompts]
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, numbers.Integral) for t in prompts)
        ):
            prompts = [prompts]  # one text, or one list of token ids
        if not isinstance(prompts, (list, tuple)):
            raise VegasConfigError(f"prompts must be {kinds}, got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise VegasConfigError("prompts must hold at least one prompt, got an empty list")
        vocab = self.backend.vocab_size
        if chat and not getattr(self.tokenizer, "chat_template", None):
            problem = ("needs a tokenizer with a chat template, and this model's has none: leave it off (plain "
                       "text prompts) or use a chat model such as 'smollm2-135m'")
            raise VegasConfigError(f"chat=True {problem}", field="chat", problem=problem)
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str) and chat:
                message = [{"role": "user", "content": p}]
                ids.append(list(self.tokenizer.apply_chat_template(
                    message, add_generation_prompt=True, tokenize=True, return_dict=False
                )))
            elif isinstance(p, str):
                # verbose=False: the length check is generate's, with the model's real context
                # (transformers' own warning names the tokenizer's model_max_length instead)
                ids.append(self.tokenizer(p, add_special_tokens=False, verbose=False).input_ids)
            elif chat:
                raise VegasConfigError(
                    f"prompt {i} is a list of token ids; chat=True takes text prompts only (apply the "
                    "chat template yourself, or pass chat=False)"
                )
            elif isinstance(p, (list, tuple)):
                odd = [t for t in p if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
                if odd:
                    raise VegasConfigError(
                        f"prompt {i} must be a text or a list of int token ids; it holds a {type(odd[0]).__name__}"
                    )
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise VegasConfigError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab})")
                ids.append([int(t) for t in p])
            else:
                raise VegasConfigError(f"prompt {i} must be a text or a list of int token ids, got {type(p).__name__}")
            if not ids[-1]:
                raise VegasConfigError(f"prompt {i} {EMPTY_PROMPT}", field="prompt", problem=EMPTY_PROMPT)
        return ids

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        selector: str | None | type(...) = ...,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Generate up to ``max_new_tokens`` tokens per prompt (a batch, lengths may differ).

        Args:
            prompts: a text, one list of token ids (one prompt), a list of texts, or a list of
                token-id lists.
            max_new_tokens: tokens to generate per prompt (>= 1).
            temperature: 0 = greedy (token-identical to plain greedy decoding), else > 0
                with speculative rejection sampling (the target distribution is kept).
            top_p: nucleus sampling mass in (0, 1].
            seed: seed of the sampling generator.
            selector: override the pipeline's selector for this call: a registered name, a
                :class:`~vegas.interfaces.Selector` built with this pipeline's ``config`` (e.g.
                :class:`~vegas.strategies.OracleSelector`, used once), or ``"none"`` / None
                (plain decoding).
            chat: wrap each text prompt as a user message in the tokenizer's chat template,
                ending with the assistant's generation prompt.

        Returns:
            one :class:`~vegas.backends.base.RequestOutput` per prompt: ``token_ids``,
            ``text`` and ``stats`` (acceptance length τ, drafted/accepted counts, decode
            and selection seconds).

        Raises:
            VegasConfigError: empty prompt list or prompt, a token id outside the
                vocabulary, ``max_new_tokens`` < 1, bad sampling parameters, or a prompt that
                with ``max_new_tokens`` and γ + 1 verification slots exceeds the model's context;
                ``chat=True`` with token-id prompts or a tokenizer without a chat template.
        """
        selector = self.selector if selector is ... else selector
        # built once per call (selectors keep per-request state) and handed to the backend
        selector_obj = as_selector(selector, self.config)
        sampling = generation_options(max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, chat=chat)
        ids = self.encode(prompts, chat=chat)
        slots = self.config.num_draft_tokens + 1
        limit = self.backend.max_context - max_new_tokens - slots
        room = (f"the model context of {self.backend.max_context} tokens, less {max_new_tokens} new tokens and "
                f"γ + 1 = {slots} verification slots")
        if limit < 1:
            raise VegasConfigError.bad("max_new_tokens", f"{max_new_tokens} leaves no room for a prompt in {room}")
        for i, p in enumerate(ids):
            if len(p) > limit:
                problem = f"has {len(p)} tokens; at most {limit} fit in {room}"
                raise VegasConfigError(f"prompt {i} {problem}", field="prompt", problem=problem)
        return self.backend.generate(
            ids, max_new_tokens=max_new_tokens, sampling=sampling, selector=selector_obj, config=self.config
        )
