"""`import shardspec` costs little more than `import torch`: heavy modules load on first use."""

import subprocess
import sys


def _extra_seconds() -> float:
    """In a fresh process: seconds ``import shardspec`` takes after ``import torch``."""
    code = (
        "import time\n"
        "import torch\n"
        "t1 = time.perf_counter()\n"
        "import shardspec\n"
        "print(time.perf_counter() - t1)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout)


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
    # best of three fresh processes, so a burst of load on a shared machine does not decide it
    extra = [_extra_seconds() for _ in range(3)]
    assert min(extra) < 1.0, extra
