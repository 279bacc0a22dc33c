"""`import shardspec` costs little more than `import torch`: heavy modules load on first use."""

import subprocess
import sys
import time


def _import_seconds(module: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - start


def test_import_shardspec_loads_neither_dtensor_nor_the_compiler():
    code = (
        "import sys, shardspec\n"
        "heavy = [m for m in ('torch.distributed.tensor', 'torch.distributed.checkpoint', 'compiler')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ""


def test_import_shardspec_within_one_second_of_import_torch():
    # best of two each, alternating, so a burst of load on a shared machine does not decide it
    torch_s, ours_s = [], []
    for _ in range(2):
        torch_s.append(_import_seconds("torch"))
        ours_s.append(_import_seconds("shardspec"))
    assert min(ours_s) - min(torch_s) < 1.0, (torch_s, ours_s)
