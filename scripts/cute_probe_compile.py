#!/usr/bin/env python3
"""Compile check of the CuTe probe kernel (:mod:`vegas.kernels.cute_probe`, issue 22) for sm_90a, without a GPU.

    CUTE_DSL_ARCH=sm_90a nice -n 19 python3.12 scripts/cute_probe_compile.py --compile-only --vllm-site /tmp/vsite

compiles :func:`~vegas.kernels.cute_probe.probe_attention` for sm_90a under torch's
``FakeTensorMode`` (nothing is launched) for the SmolLM2 and Qwen3-8B shapes, the 64-row tile,
unsplit and split, through :func:`~vegas.kernels.cute_probe.warm_up` (what an engine with
``vllm.score_path="cute"`` runs before CUDA-graph capture). The CuTe kernel is the same for every
row mode; the Triton packing kernel (the only part the row mode changes) is not compiled here: it
needs a launch (Triton's interpreter checks it on the CPU, ``tests/test_probe_queries.py``); ``--vllm-site`` is a folder holding an unpacked vLLM 0.24 wheel's
``vllm/`` (only ``vllm/vllm_flash_attn/cute`` is imported: ``vllm`` and ``vllm.vllm_flash_attn``
become bare namespace packages, so vLLM's own imports do not run). The kernel's design is in the
module's docstring; it is timed by ``scripts/cute_decode_bench.py``.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vegas.kernels import cute_probe  # noqa: E402

#: (q heads, kv heads, head_dim): SmolLM2-135M and Qwen3-8B
SHAPES = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}


def _namespace_vllm(site: Path) -> None:
    """``vllm`` and ``vllm.vllm_flash_attn`` as bare packages over ``site``'s folders (their
    ``__init__`` needs all of vLLM; the CuTe package needs none of it)."""
    for name, path in (("vllm", site / "vllm"), ("vllm.vllm_flash_attn", site / "vllm" / "vllm_flash_attn")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod


def _plain(hq, hkv, d, num_splits, qlen=5, ctx=7680, block_size=16):
    """vLLM's unmodified kernel, the same call without the score buffer (to compare registers)."""
    import torch
    from vllm.vllm_flash_attn.cute.interface import _flash_attn_fwd

    pages = -(-(ctx + qlen) // block_size)
    k, v = torch.empty(pages + 1, 2, block_size, hkv, d, dtype=torch.bfloat16, device="cuda").unbind(1)
    q = torch.empty(qlen, hq, d, dtype=torch.bfloat16, device="cuda")
    _flash_attn_fwd(q, k, v, cu_seqlens_q=torch.empty(2, dtype=torch.int32, device="cuda"),
                    seqused_k=torch.empty(1, dtype=torch.int32, device="cuda"), max_seqlen_q=qlen,
                    max_seqlen_k=ctx + qlen, page_table=torch.empty(1, pages, dtype=torch.int32, device="cuda"),
                    softmax_scale=d**-0.5, causal=True, num_splits=num_splits, out=torch.empty_like(q),
                    tile_mn=cute_probe.SCORE_TILE, _arch=90)


def compile_check(cases, splits, plain=False) -> int:
    """Compiles the probe kernel (``plain``: vLLM's unmodified kernel) for sm_90a under
    ``FakeTensorMode``; returns the failures."""
    import traceback

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    failed = 0
    for case in cases:
        hq, hkv, d = SHAPES[case]
        name = f"{'plain' if plain else 'probe'} {case} ({hq} q / {hkv} kv x {d}), tile 64x128, splits {splits}"
        t0 = time.perf_counter()
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                if plain:
                    for n in splits:
                        _plain(hq, hkv, d, n)
                else:
                    cute_probe.warm_up(hq, hkv, d, torch.bfloat16, 16, "cuda", splits=splits, _arch=90)
            layout = "" if plain else f"; layout {cute_probe.LAYOUT_CHECK[-1]}"
            print(f"compiled: {name} in {time.perf_counter() - t0:.0f} s{layout}", flush=True)
        except Exception:
            failed += 1
            print(f"FAILED: {name}\n{traceback.format_exc()[-3000:]}", flush=True)
    return failed


def main() -> int:
    import argparse
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true", required=True,
                    help="compile for sm_90a under FakeTensorMode (the only mode of this entry point)")
    ap.add_argument("--vllm-site", type=Path,
                    help="folder holding vllm/ of a vLLM 0.24 wheel, imported without vLLM's __init__ "
                         "(default: the installed vllm)")
    ap.add_argument("--case", action="append", choices=list(SHAPES), help="default: both")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--plain", action="store_true", help="compile vLLM's unmodified kernel instead (to compare)")
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if args.vllm_site is not None:
        if not (args.vllm_site / "vllm" / "vllm_flash_attn" / "cute" / "interface.py").is_file():
            ap.error(f"--vllm-site: no vllm/vllm_flash_attn/cute/interface.py under {args.vllm_site}")
        _namespace_vllm(args.vllm_site)
    return 1 if compile_check(args.case or list(SHAPES), args.splits, plain=args.plain) else 0


if __name__ == "__main__":
    sys.exit(main())
