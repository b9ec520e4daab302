"""hypic's kernels import and run on a machine without triton or fla (the CPU path)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
sys.modules["triton"] = None  # any `import triton` now fails, as on a machine without it
sys.modules["fla"] = None
import torch
from hypic.kernels.conv1d import causal_conv1d
from hypic.kernels.gdn import gated_delta_rule
from hypic.kernels.moe import fused_moe
from hypic.kernels.paged_attention import paged_attention, write_kv

slots, has_state, cu = torch.tensor([0, 1]), torch.tensor([True, False]), torch.tensor([0, 1, 4], dtype=torch.int32)
batch = dict(num_decodes=1, seq_lens_cpu=(1, 3))
y = causal_conv1d(torch.randn(4, 6), torch.randn(6, 4), None, torch.zeros(2, 6, 3), slots, has_state, cu, **batch)
o = gated_delta_rule(torch.randn(4, 1, 8), torch.randn(4, 1, 8), torch.randn(4, 2, 8), -torch.rand(4, 2),
                     torch.rand(4, 2), torch.zeros(2, 2, 8, 8), slots, has_state, cu, scale=0.3, **batch)
k_cache, v_cache = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
write_kv(torch.randn(4, 1, 8), torch.randn(4, 1, 8), k_cache, v_cache, torch.tensor([3, 4, 5, 6]))
a = paged_attention(torch.randn(4, 2, 8), k_cache, v_cache, torch.tensor([[0, 1], [1, 2]], dtype=torch.int32),
                    torch.tensor([4, 3], dtype=torch.int32), torch.tensor([3, 0, 1, 2]), cu, scale=0.3,
                    max_kv_len=4, **batch)
m = fused_moe(torch.randn(3, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3), torch.rand(3, 2),
              torch.tensor([[0, 1], [2, 0], [3, 1]]))
assert all(bool(t.isfinite().all()) for t in (y, o, a, m))
print("ok")
"""


def test_kernels_import_and_run_without_triton_or_fla() -> None:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
