"""The whole engine on CUDA against the CPU path on the same weights: plain and PIC requests,
continuous batching with CUDA-graph decodes, cold and warm segments."""
from __future__ import annotations

import pytest
from pic_util import assert_gpu_engine_matches_cpu_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["none", "hypic", "naive"])
def test_gpu_engine_matches_cpu_engine(slow_decay_model_dir, mode):
    assert_gpu_engine_matches_cpu_engine(slow_decay_model_dir, mode)
