#!/usr/bin/env python3
"""Compile vLLM's CuTe-DSL sm90 attention with the score writer, on a machine without a GPU (issue 22).

``scripts/cute_decode_bench.py`` times FlashAttention's CuTe-DSL forward (shipped in vLLM 0.24 as
``vllm/vllm_flash_attn/cute/``) with a ``score_mod`` that writes the verification logits
(:func:`vegas.kernels.cute_scores.score_writer`). Device time is scarce; this catches what can be caught
before it: it compiles that kernel for sm_90a under torch's ``FakeTensorMode`` (the package's own
fake mode: ``cute.compile`` runs, nothing is launched) for the shapes the bench times — decode
verification (γ + 1 = 5 queries per request), paged KV with page size 16 read without TMA,
PackGQA, split and unsplit, the default and the 64-row query tile, with and without the writer.

Needs Python 3.12 with ``nvidia-cutlass-dsl==4.5.2`` (+ ``-libs-base``, ``-libs-cu13``),
``quack-kernels``, ``cuda-bindings`` 13, ``apache-tvm-ffi``, ``torch-c-dlpack-ext``, ``einops``,
``pluggy`` and torch (the CPU build does), and the ``cute`` folder of a vLLM 0.24 wheel; it is
copied to a temporary package ``fcute`` with its imports renamed, so vLLM itself is not imported.

    CUTE_DSL_ARCH=sm_90a python3.12 scripts/cute_compile_check.py --vllm-cute /tmp/vsite/vllm/vllm_flash_attn/cute

Each configuration takes 20-50 s of CPU. Exit status 1 if any configuration fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (q heads, kv heads, head_dim): SmolLM2-135M and Qwen3-8B
SHAPES = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}


def renamed_copy(src: Path, dest: Path) -> None:
    """``src`` (vLLM's ``vllm_flash_attn/cute``) as the package ``dest`` / ``fcute``."""
    pkg = dest / "fcute"
    pkg.mkdir(parents=True)
    for f in src.glob("*.py"):
        text = re.sub(r"vllm\.vllm_flash_attn\.cute", "fcute", f.read_text())
        (pkg / f.name).write_text(text)


def compile_one(fwd, torch, writer, hq, hkv, d, tile_mn, num_splits, seqs=8, qlen=5, ctx=7680, block_size=16):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        pages = -(-(ctx + qlen) // block_size)
        cache = torch.empty(seqs * pages + 1, 2, block_size, hkv, d, dtype=torch.bfloat16, device="cuda")
        k, v = cache.unbind(1)
        q = torch.empty(seqs * qlen, hq, d, dtype=torch.bfloat16, device="cuda")
        fwd(q, k, v, cu_seqlens_q=torch.empty(seqs + 1, dtype=torch.int32, device="cuda"),
            seqused_k=torch.empty(seqs, dtype=torch.int32, device="cuda"), max_seqlen_q=qlen,
            max_seqlen_k=ctx + qlen, page_table=torch.empty(seqs, pages, dtype=torch.int32, device="cuda"),
            softmax_scale=d**-0.5, causal=True, num_splits=num_splits, out=torch.empty_like(q), tile_mn=tile_mn,
            score_mod=writer, _arch=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-cute", required=True, type=Path, help="vllm/vllm_flash_attn/cute of a vLLM 0.24 wheel")
    ap.add_argument("--case", action="append", choices=list(SHAPES), help="default: both")
    args = ap.parse_args()
    if not args.vllm_cute.is_dir():
        print(f"--vllm-cute: no such directory: {args.vllm_cute}", file=sys.stderr)
        return 2
    if not (args.vllm_cute / "interface.py").is_file():
        print(f"--vllm-cute: no interface.py in {args.vllm_cute} (give vllm/vllm_flash_attn/cute of a vLLM 0.24 wheel)",
              file=sys.stderr)
        return 2
    try:
        import cutlass.cute  # noqa: F401
        import einops  # noqa: F401
        import quack  # noqa: F401
        import tvm_ffi  # noqa: F401
    except ImportError as e:
        print(f"needs Python 3.12 with nvidia-cutlass-dsl==4.5.2, quack-kernels, cuda-bindings 13, apache-tvm-ffi, "
              f"torch-c-dlpack-ext, einops, pluggy and torch: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    tmp = Path(tempfile.mkdtemp(prefix="fcute-"))
    try:
        renamed_copy(args.vllm_cute, tmp)
        sys.path[:0] = [str(tmp), str(ROOT)]
        import torch

        from fcute.interface import _flash_attn_fwd
        from vegas.kernels.cute_scores import score_writer

        failed = 0
        for case in args.case or list(SHAPES):
            hq, hkv, d = SHAPES[case]
            buffer = torch.zeros(8, 2, hq, 7685)  # a real buffer: the writer bakes its address in
            for tile_mn in (None, (64, 128)):
                for scores in (False, True):
                    for num_splits in (1, 4):
                        name = f"{case} tile {tile_mn or 'default'} {'scores' if scores else 'plain'} splits {num_splits}"
                        try:
                            compile_one(_flash_attn_fwd, torch, score_writer(buffer) if scores else None, hq, hkv,
                                        d, tile_mn, num_splits)
                            print(f"compiled: {name}", flush=True)
                        except Exception:
                            failed += 1
                            print(f"FAILED: {name}\n{traceback.format_exc()[-1500:]}", flush=True)
        return 1 if failed else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
