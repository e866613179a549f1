#!/usr/bin/env python
"""Where an unbatched call's overhead goes: the same body, called through more layers.

    python benchmarks/bench_call_path.py [--min-run-time S] [--rounds N]

Rows (µs per call, median of interleaved rounds, one process, one thread,
each with its cost over the plain function):

1. the plain function;
2. the function through torch's ``register_kernel`` wrapper
   (``op._backend_fns[None]``: ``torch._disable_dynamo`` and the
   ``set_kernel_enabled`` check), as every torch.library op's kernel runs;
3. a bare dispatcher operator whose ``CompositeExplicitAutograd`` kernel is the
   function itself (``torch.library.Library.impl``): the least any Python-kernel
   operator pays (``OpOverload`` call, argument parsing, dispatch, Python kernel
   call, the Autograd fallback);
4. a ``torch_autobatch.custom_op``: 3, plus our Autograd kernel, which calls the
   function itself in place of torch's backend wrapper (NOTE [Calling the
   composite directly] in csrc/run_backend.cpp);
5. a ``torch.library.custom_op`` (torch's Python Autograd kernel), for reference.

Then the same for a call with an input that requires grad (forward only: the op
makes its grad node and runs ``setup_context``), where 3 has no grad node and 5
uses torch's ``autograd.Function``.

Last, a whole step, ``op(x, y).sum().backward()`` with ``x.grad = None``, and the
part of it that is the user's own code: ``user code alone`` runs the function,
``setup_context`` on a plain namespace, the ``.sum()`` and the user's backward
on its gradient, with no autograd at all. What torch_autobatch adds to that
(the call path, the grad node, ``ctx``, the engine running a Python node) is
row 4 minus that row; what autograd adds for the plain function is row 1 minus
the function alone.
"""

from __future__ import annotations

import argparse
import statistics
import types
from collections.abc import Callable

import torch
import torch.utils.benchmark as tbench

import torch_autobatch


def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y


def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, y = ctx.saved_tensors
    return grad * y, grad * x


ours = torch_autobatch.custom_op("bench_call_path::ours", mutates_args=())(body)
ours.register_autograd(backward, setup_context=setup_context)
theirs = torch.library.custom_op("bench_call_path::theirs", mutates_args=())(body)
theirs.register_autograd(backward, setup_context=setup_context)
_lib = torch.library.Library("bench_call_path", "FRAGMENT")
_lib.define("bare(Tensor x, Tensor y) -> Tensor")
_lib.impl("bare", body, "CompositeExplicitAutograd")
bare = torch.ops.bench_call_path.bare.default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = torch.randn(64), torch.randn(64)
    xr = x.clone().requires_grad_()
    layers = {
        "1. plain function": body,
        "2. + torch's register_kernel wrapper": ours._backend_fns[None],
        "3. bare dispatcher op, Python kernel": bare,
        "4. torch_autobatch.custom_op": ours,
        "5. torch.library.custom_op": theirs,
    }
    for title, a in (("inputs need no grad", x), ("x requires grad (forward only)", xr)):
        timers = {
            k: tbench.Timer("f(a, y)", globals={"f": f, "a": a, "y": y}, num_threads=1) for k, f in layers.items()
        }
        times: dict[str, list[float]] = {k: [] for k in layers}
        for r in range(args.rounds):
            order = list(layers)[r % len(layers) :] + list(layers)[: r % len(layers)]
            for k in order:
                times[k].append(timers[k].blocked_autorange(min_run_time=args.min_run_time).median)
        report(title, times, args.rounds)

    def step(op: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            xr.grad = None
            op(xr, y).sum().backward()

        return run

    def user_code_alone() -> None:
        ctx = types.SimpleNamespace(needs_input_grad=(True, False))
        out = body(x, y)
        ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
        setup_context(ctx, (x, y), out)
        out.sum()
        backward(ctx, torch.ones_like(out))

    steps = {
        "0. the function alone": lambda: body(x, y),
        "0. user code alone (no autograd)": user_code_alone,
        "1. plain function": step(body),
        "4. torch_autobatch.custom_op": step(ours),
        "5. torch.library.custom_op": step(theirs),
    }
    timers = {k: tbench.Timer("f()", globals={"f": f}, num_threads=1) for k, f in steps.items()}
    times = {k: [] for k in steps}
    for r in range(args.rounds):
        order = list(steps)[r % len(steps) :] + list(steps)[: r % len(steps)]
        for k in order:
            times[k].append(timers[k].blocked_autorange(min_run_time=args.min_run_time).median)
    report("op(x, y).sum().backward(), x requires grad", times, args.rounds)


def report(title: str, times: dict[str, list[float]], rounds: int) -> None:
    print(f"\n{title} (torch {torch.__version__}, µs per call, median of {rounds} rounds)")
    plain = statistics.median(times["1. plain function"]) * 1e6
    for k, ts in times.items():
        us = statistics.median(ts) * 1e6
        print(f"  {k:<42} {us:7.1f}  ({us - plain:+.1f} against the plain function)")


if __name__ == "__main__":
    main()
