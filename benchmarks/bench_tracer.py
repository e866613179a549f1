#!/usr/bin/env python
"""Cost of ``torch_autobatch.trace``: one forward + backward step, traced vs untraced.

Models (``torch.set_num_threads(1)``, float32, CPU):

  - small: MLP 64-128-128-10 (Linear/ReLU), batch 32;
  - large: MLP 64-1024-1024-10 (Linear/ReLU), batch 256.

One step is ``model(x).sum().backward()``, with ``zero_grad(set_to_none=True)``
before it (outside the timing); the traced step is the same with the forward
inside ``with torch_autobatch.trace():`` and the backward after the block (so
the backward is recorded through the autograd nodes' hooks, the path that
costs more). For reference, a third variant runs the step under a
``TorchDispatchMode`` that records nothing: the least any tracer built on a
Python dispatch mode pays (ours records in C++, below that). The variants alternate step by step in one
process, so that machine load hits all alike; the table reports medians of
the wall time (``time.perf_counter``) and, as a check against a loaded
machine, of the thread's CPU time (``time.thread_time``).

Targets (from the issue): traced/untraced at most 2.5x (small), 1.05x (large).

Usage: python benchmarks/bench_tracer.py [--steps-small N] [--steps-large N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_autobatch

# The public name once torch_autobatch/__init__.py exports it.
trace = (
    getattr(torch_autobatch, "trace", None) or __import__("torch_autobatch.tracing._tracer", fromlist=["trace"]).trace
)

TARGETS = {"small": 2.5, "large": 1.05}
MODELS = {
    "small": ((64, 128, 128, 10), 32),
    "large": ((64, 1024, 1024, 10), 256),
}


def mlp(sizes: tuple[int, ...]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


class PassThrough(TorchDispatchMode):
    """A mode that records nothing: what any TorchDispatchMode-based tracer pays at least."""

    def __init__(self) -> None:
        pass

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def steps(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    def untraced() -> None:
        model(x).sum().backward()

    def pass_through() -> None:
        # Forward and backward both see the mode (the engine copies the caller's modes).
        torch._C._push_on_torch_dispatch_stack(PassThrough())
        try:
            model(x).sum().backward()
        finally:
            torch._C._pop_torch_dispatch_stack(None)

    def traced() -> None:
        with trace():
            loss = model(x).sum()
        loss.backward()

    return {"untraced": untraced, "pass_through": pass_through, "traced": traced}


def measure(name: str, n: int, warmup: int) -> dict[str, dict[str, float]]:
    sizes, batch = MODELS[name]
    torch.manual_seed(0)
    model = mlp(sizes)
    x = torch.randn(batch, sizes[0])
    fns = steps(model, x)
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + n):
        for k, fn in fns.items():
            model.zero_grad(set_to_none=True)
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            w1, c1 = time.perf_counter(), time.thread_time()
            if i >= warmup:
                wall[k].append(w1 - w0)
                cpu[k].append(c1 - c0)
    return {k: {"wall_us": statistics.median(wall[k]) * 1e6, "cpu_us": statistics.median(cpu[k]) * 1e6} for k in fns}


def distinct_addresses(traced: bool, n: int = 30) -> int:
    """How many addresses a 4 MB temporary, freed and remade ``n`` times, gets.

    Untraced, the allocator reuses a few. A record that keeps a small heap
    block per op splits the freed block, and each new temporary needs fresh
    memory (about ``n``): NOTE [The record allocates little] in csrc/trace_record.h.
    """
    a = torch.ones(1024, 1024)
    seen = set()
    with trace() if traced else contextlib.nullcontext():
        for _ in range(n):
            seen.add((a * 2).data_ptr())
    return len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-small", type=int, default=2000)
    parser.add_argument("--steps-large", type=int, default=60)
    parser.add_argument("--json", type=str, default=None, help="also write the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    gc.collect()
    results = {
        "small": measure("small", args.steps_small, warmup=50),
        "large": measure("large", args.steps_large, warmup=5),
    }
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"torch.set_num_threads(1); medians of {args.steps_small} / {args.steps_large} steps\n"
    )
    print(
        "| model | batch | untraced (us) | traced (us) | traced / untraced (wall) "
        "| same, CPU time | target | met | pass-through mode / untraced |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        sizes, batch = MODELS[name]
        base = r["untraced"]
        ratio = r["traced"]["wall_us"] / base["wall_us"]
        ratio_cpu = r["traced"]["cpu_us"] / base["cpu_us"]
        floor = r["pass_through"]["wall_us"] / base["wall_us"]
        r["ratio_wall"], r["ratio_cpu"], r["ratio_pass_through"] = ratio, ratio_cpu, floor
        met = "yes" if ratio <= TARGETS[name] else "no"
        print(
            f"| {'-'.join(map(str, sizes))} | {batch} | {base['wall_us']:.0f} "
            f"| {r['traced']['wall_us']:.0f} | {ratio:.2f}x | {ratio_cpu:.2f}x "
            f"| <= {TARGETS[name]}x | {met} | {floor:.2f}x |"
        )
    reuse = {"untraced": distinct_addresses(False), "traced": distinct_addresses(True)}
    results["distinct_addresses_of_30_temporaries"] = reuse
    print(
        f"\nA 4 MB temporary freed and remade 30 times: {reuse['traced']} distinct addresses "
        f"traced, {reuse['untraced']} untraced."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
