"""Mean next-token loss of a model on held-out Python code at growing context lengths,
with and without RoPE scaling (YaRN by default): does the model use a context beyond its own?

Each document's first max(L) tokens are run once through the plain transformers model
(``attn_implementation="sdpa"``, float32, CPU by default) in chunks that append to a
``DynamicCache``, so memory stays bounded by one chunk's attention. The model is causal, so the
losses of the first L positions of that run are those of a run on the first L tokens alone:
every length is read off the same run. Two figures per cell, in nats/token:

* ``all``: mean loss over the L - 1 predicted positions;
* ``tail``: mean loss over the last ``--tail`` positions (what the far end of a long context
  costs; below the native context it should fall as L grows, beyond it it rises when the model
  does not generalise).

Usage::

    python scripts/long_context_loss.py --model smollm2-135m --lengths 2048,8192,16384,32768 \\
        --rope-scaling '{"rope_type": "yarn", "factor": 4}' --docs 1

Documents come from ``--data`` (JSON lines with a ``text`` field, xz or plain; default
``benchmarks/data/heldout_code_dev.jsonl.xz`` in the checkout) or, without
it, from the installed source of click, jinja2 and docutils (one document each); the
``--docs`` longest documents are used (a document shorter than L does not count at L).
"""

from __future__ import annotations

import argparse
import inspect
import json
import lzma
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from vegas.models import resolve_model, rope_scaled_config
from vegas.prompts import package_source

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "heldout_code_dev.jsonl.xz"  # in the checkout


def documents(data: Path | None) -> list[tuple[str, str]]:
    """(name, text) pairs from a JSON-lines file, or from installed package sources."""
    if data is None:
        return [(name, package_source(name)) for name in ("click", "jinja2", "docutils")]
    opener = lzma.open if data.suffix == ".xz" else open
    with opener(data, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(str(r.get("id", i)), r["text"]) for i, r in enumerate(rows)]


@torch.inference_mode()
def token_losses(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-position next-token losses (nats) of ``ids`` ``(L,)``: a float64 tensor ``(L - 1,)``."""
    cache = DynamicCache(config=model.config)
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    losses = []
    for start in range(0, ids.numel() - 1, chunk):
        piece = ids[start:start + chunk + 1]  # the chunk and the token after it
        inputs = piece[:-1][None]
        positions = torch.arange(start, start + inputs.shape[1])[None]
        logits = model(input_ids=inputs, position_ids=positions, use_cache=True, **{cache_kwarg: cache}).logits[0]
        losses.append(torch.nn.functional.cross_entropy(logits.float(), piece[1:], reduction="none").double())
    return torch.cat(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="vegas model name, .gguf or model directory")
    parser.add_argument("--lengths", default="2048,8192,16384,32768", help="context lengths in tokens")
    parser.add_argument("--rope-scaling", default='{"rope_type": "yarn", "factor": 4}',
                        help="JSON RoPE scaling compared with none; '' measures the plain model only")
    parser.add_argument("--data", default=str(DEFAULT_DATA) if DEFAULT_DATA.exists() else None,
                        help="JSON lines (.jsonl or .jsonl.xz) with a 'text' field; default held-out code")
    parser.add_argument("--docs", type=int, default=1, help="documents (the longest first)")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per forward")
    parser.add_argument("--tail", type=int, default=1024, help="last positions of the 'tail' figure")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.tail < 1 or not lengths or min(lengths) <= args.tail:
        parser.error(f"each of --lengths must exceed --tail ({args.tail}, >= 1): the tail figure is the mean over "
                     f"the last --tail positions; got --lengths {args.lengths}")
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = documents(Path(args.data) if args.data else None)
    tokenized = sorted(
        ((name, torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)) for name, text in docs),
        key=lambda d: -d[1].numel(),
    )
    settings = {"none": None}
    if args.rope_scaling:
        settings[json.dumps(json.loads(args.rope_scaling))] = json.loads(args.rope_scaling)
    results = []
    for label, scaling in settings.items():
        kwargs = {} if scaling is None else {"config": rope_scaled_config(model_dir, scaling)}
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa", **kwargs
        ).eval()
        for name, ids in tokenized[: args.docs]:
            start = time.perf_counter()
            losses = token_losses(model, ids[: max(lengths)], args.chunk)
            seconds = round(time.perf_counter() - start, 1)
            for length in (n for n in lengths if n <= ids.numel()):
                row = {
                    "rope_scaling": label, "length": length, "doc": name,
                    "loss_all": losses[: length - 1].mean().item(),
                    "loss_tail": losses[length - 1 - args.tail: length - 1].mean().item(),
                    "seconds_whole_run": seconds,
                }
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        del model
    print(f"\nmodel {args.model}; nats/token; tail = last {args.tail} positions\n")
    print("| RoPE | " + " | ".join((f"{n // 1024}K" if n >= 1024 else str(n)) + " all / tail" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for label in settings:
        cells = []
        for length in lengths:
            rows = [r for r in results if r["rope_scaling"] == label and r["length"] == length]
            cells.append(
                " / ".join(f"{sum(r[k] for r in rows) / len(rows):.3f}" for k in ("loss_all", "loss_tail"))
                if rows else "n/a"
            )
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(math.isfinite(r["loss_all"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
