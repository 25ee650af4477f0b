"""How much the old CPU "peak" probe varied (why MFU on a CPU is now n/a; andrea/train/flops.py).

The probe MFU used to divide by: after one warm-up, the best of 5 matmuls of 1024 x 1024 in the
run's precision, 2*1024^3 FLOPs over the time. This repeats that probe ROUNDS times, a pause
apart (as separate runs would meet the machine), and prints the spread per dtype. The MFU of
one and the same run scales with 1 / probe, so max/min is how far MFU could move.

    python scripts/cpu_peak_probe_spread.py [ROUNDS] [PAUSE_S]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from andrea.resources import cpu_name


def old_probe(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    pause = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    dtypes = (torch.float32, torch.bfloat16)
    rates: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
    for _ in range(rounds):  # dtypes alternate within a round: same conditions for both
        for dtype in dtypes:
            rates[dtype].append(old_probe(dtype) / 1e9)
        time.sleep(pause)
    for dtype, r in rates.items():
        print(f"{str(dtype):<15} GFLOP/s over {rounds} probes: min {min(r):.1f}, median "
              f"{statistics.median(r):.1f}, max {max(r):.1f}; max/min {max(r) / min(r):.2f}")


if __name__ == "__main__":
    main()
