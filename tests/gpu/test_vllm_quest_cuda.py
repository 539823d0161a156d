"""Quest on the vLLM backend, CUDA part: the Triton page-score kernel against the reference for
every head shape (the CPU tests of Quest on vLLM: tests/test_vllm_quest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import HEAD_SHAPES, check_quest_kernel, shape_id


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=shape_id)
def test_triton_page_scores_match_the_reference(shape):
    """The Triton page-score kernel against the reference for every head shape (on the CPU
    under Triton's interpreter: tests/test_kernels_interpreted.py)."""
    check_quest_kernel("cuda", shape, 1100 if shape[1] * shape[2] <= 1024 else 300)
