#!/usr/bin/env python
"""Benchmark ``vmap(op)`` traced into a graph: node counts, compile time, run time.

One op, ``f(x, w) = sin(x) * w`` (x, w: (64,) float32 per example), with a
registered backward, against the plain function (its own batching rules):

  (d) plain Python function;
  (t) ``torch_autobatch.custom_op`` + ``register_autograd``: under a graph
      tracer, vmap(op) is one node, its vmapped companion (NOTE [One node for
      vmap(op) in a trace], torch_autobatch/vmap/_traced.py).

Per batch size B:

  - nodes of ``make_fx(vmap(f))`` (real and symbolic) and of aot_eager's
    forward and backward graphs;
  - first call of ``torch.compile(vmap(f), backend="aot_eager")``, median of 3 (after
    ``torch._dynamo.reset()``; a fresh op per measurement, so its companion's
    definition is counted), inference (no grad) and training (inputs requiring
    grad, forward + backward);
  - the compiled program's run time, microseconds per call, best of 5
    repeats (forward; forward + backward).

The targets (issue 37): first call <= 2x the plain function's, run time
<= 1.2x, at B = 1000.

Usage: python benchmarks/bench_traced_vmap.py [--quick] [--min-run-time S]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.utils.benchmark as tbench
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

import torch_autobatch

D = 64
DTYPE = torch.float32
_names = itertools.count()


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * w


def make_op() -> Callable[..., Any]:
    """A fresh op (its companion not defined yet)."""
    op = torch_autobatch.custom_op(
        f"bench_traced_vmap::f{next(_names)}", plain, mutates_args=(), schema="(Tensor x, Tensor w) -> Tensor"
    )

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * torch.cos(x) * w, g * torch.sin(x)

    op.register_autograd(backward, setup_context=setup)
    return op


def inputs(b: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    x, w = torch.randn(b, D, generator=g, dtype=DTYPE), torch.randn(b, D, generator=g, dtype=DTYPE)
    return x.requires_grad_(grad), w.requires_grad_(grad)


def node_counts(fn: Callable[..., Any], b: int) -> dict[str, Any]:
    x, w = inputs(b, False)
    graphs: list[torch.fx.Graph] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm.graph)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    compiled = torch.compile(torch.vmap(fn), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(*inputs(b, True)).sum().backward()
    return {
        "make_fx": len(make_fx(torch.vmap(fn))(x, w).graph.nodes),
        "make_fx_symbolic": len(make_fx(torch.vmap(fn), tracing_mode="symbolic")(x, w).graph.nodes),
        "aot_fw/bw": f"{len(graphs[0].nodes)}/{len(graphs[1].nodes)}",
    }


def first_call(variant: str, b: int, grad: bool) -> tuple[float, Callable[..., Any]]:
    """The median of 3 first calls (each after ``torch._dynamo.reset()``, a fresh op each), and one compiled program."""
    times = []
    for _ in range(3):
        torch._dynamo.reset()
        compiled = torch.compile(torch.vmap(plain if variant == "d" else make_op()), backend="aot_eager")
        x, w = inputs(b, grad)
        start = time.perf_counter()
        out = compiled(x, w)
        if grad:
            out.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times), compiled


def run_time(compiled: Callable[..., Any], b: int, grad: bool, mrt: float) -> float:
    """Microseconds per call: the best of 5 repeats of ``mrt / 5`` seconds each (robust to a busy machine)."""
    x, w = inputs(b, grad)
    stmt = "compiled(x, w).sum().backward()" if grad else "compiled(x, w)"
    timer = tbench.Timer(stmt=stmt, globals={"compiled": compiled, "x": x, "w": w})
    number = max(1, int(mrt / 5 / max(timer.timeit(3).median, 1e-7)))
    return min(timer.timeit(number).median for _ in range(5)) * 1e6


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="B in {10, 1000}, shorter timing")
    p.add_argument("--min-run-time", type=float, default=None, help="seconds per timing (default 0.5, --quick 0.1)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [10, 1000] if args.quick else [10, 100, 1000]
    mrt = args.min_run_time if args.min_run_time is not None else (0.1 if args.quick else 0.5)
    print("# vmap(op) traced into a graph")
    print()
    print(
        f"- torch {torch.__version__}, torch_autobatch {torch_autobatch.__version__}, Python {platform.python_version()}"
    )
    print(f"- f(x, w) = sin(x) * w, x, w: ({D},) {DTYPE} per example; torch.get_num_threads() = 1; min_run_time {mrt}s")
    print("- (d) plain function, (t) torch_autobatch.custom_op; first call in seconds, run time in microseconds")
    print()
    print(
        "| B | variant | make_fx nodes | symbolic nodes | aot fw/bw nodes | first call (inference) | first call (training) "
        "| run fwd (us) | run fwd+bwd (us) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for b in sizes:
        rows = {}
        for variant in ("d", "t"):
            counts = node_counts(plain if variant == "d" else make_op(), b)
            t_inf, compiled_inf = first_call(variant, b, grad=False)
            t_train, compiled_train = first_call(variant, b, grad=True)
            fwd = run_time(compiled_inf, b, False, mrt)
            fwd_bwd = run_time(compiled_train, b, True, mrt)
            rows[variant] = (t_inf, t_train, fwd, fwd_bwd)
            print(
                f"| {b} | {variant} | {counts['make_fx']} | {counts['make_fx_symbolic']} | {counts['aot_fw/bw']} "
                f"| {t_inf:.3f} | {t_train:.3f} | {fwd:.1f} | {fwd_bwd:.1f} |"
            )
        d, t = rows["d"], rows["t"]
        print(
            f"| {b} | t / d | | | | {t[0] / d[0]:.2f}x | {t[1] / d[1]:.2f}x | {t[2] / d[2]:.2f}x | {t[3] / d[3]:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
