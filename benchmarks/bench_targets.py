"""The free batching rule's performance targets, measured interleaved.

On a shared, noisy machine, a cell of ``bench_vmap.py`` can move by 30% between
runs. This script measures the few numbers the targets are about with the
variants interleaved (each repetition times every variant back to back) and
reports the least time per call over the repetitions, which is repeatable.

Run: python benchmarks/bench_targets.py [--reps 7]
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.func import grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vmap as b  # noqa: E402  (the op variants)


def interleaved(fns: dict[str, Callable[[], object]], reps: int, budget_s: float) -> dict[str, float]:
    """Least microseconds per call of each fn, timing them in turns."""
    for fn in fns.values():
        fn()
    calls = {}
    for k, fn in fns.items():  # size each loop to ~budget_s / reps
        t0 = time.perf_counter()
        fn()
        calls[k] = max(1, int(budget_s / reps / max(time.perf_counter() - t0, 1e-6)))
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[k]):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / calls[k] * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    print(f"torch {torch.__version__}, 1 thread, least of {args.reps} interleaved repetitions, µs/call\n")
    ops = {"plain": b.f_plain, "custom_op loop": b.f_loop, "autograd.Function": b.f_func, "torch_autobatch": b.f_tab}

    print(
        "| measurement | B | plain | custom_op (loop) | autograd.Function | torch_autobatch | ours / plain | target |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for bsz, target in [(1, "<= 1.5x"), (100, "<= 1.2x"), (1000, "<= 1.2x; >= 100x faster than loop")]:
        x, y = torch.randn(bsz, 64), torch.randn(bsz, 64)
        fns = {k: (lambda op=op: vmap(op)(x, y)) for k, op in ops.items()}
        if bsz == 1000:
            fns["custom_op loop"] = lambda: vmap(b.f_loop)(x, y)
        t = interleaved(fns, args.reps if bsz < 1000 else 3, 2.0)
        print(
            f"| vmap(op) | {bsz} | {t['plain']:.0f} | {t['custom_op loop']:.0f} | "
            f"{t['autograd.Function']:.0f} | {t['torch_autobatch']:.0f} | "
            f"{t['torch_autobatch'] / t['plain']:.2f}x | {target} |"
        )
    x, w = torch.randn(1000, 64), torch.randn(64)
    for argnums, what in [(0, "x"), (1, "w (unbatched)")]:
        fns = {
            k: (lambda op=op: vmap(grad(lambda x, w: op(x, w).sum(), argnums=argnums), in_dims=(0, None))(x, w))
            for k, op in ops.items()
            if k != "custom_op loop"
        }
        t = interleaved(fns, args.reps, 2.0)
        print(
            f"| vmap(grad) w.r.t. {what} | 1000 | {t['plain']:.0f} | FAIL | {t['autograd.Function']:.0f} | "
            f"{t['torch_autobatch']:.0f} | {t['torch_autobatch'] / t['plain']:.2f}x | <= 1.3x |"
        )
    x, y = torch.randn(64), torch.randn(64)
    t = interleaved({k: (lambda op=op: op(x, y)) for k, op in ops.items()}, args.reps, 1.0)
    print(
        f"| unbatched call | - | {t['plain']:.1f} | {t['custom_op loop']:.1f} | {t['autograd.Function']:.1f} | "
        f"{t['torch_autobatch']:.1f} | {t['torch_autobatch'] / t['plain']:.2f}x | <= custom_op's |"
    )


if __name__ == "__main__":
    main()
