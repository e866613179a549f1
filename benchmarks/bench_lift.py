#!/usr/bin/env python
"""What a lifted ``autograd.Function`` costs (``torch_autobatch.from_function``), against the anchors.

    python benchmarks/bench_lift.py [--batch B] [--min-run-time S] [--rounds N]

The Function is a legacy RMSNorm that saves ``rstd`` (``forward(ctx, x, w,
eps)``: the shape of a Triton kernel library's), its forward made of torch ops.
All rows in one process, one thread, median of interleaved rounds.

Per-example gradients, ``vmap(grad(loss))`` over B examples of (64,) rows:

1. the plain function (the same math, differentiated by autograd) under ``vmap(grad)``;
2. the lifted Function under ``vmap(grad)`` (its forward once on the batch, its backward once);
3. the original Function, one ``.backward()`` per example (torch.func refuses it);
4. the same class rewritten with ``setup_context`` and ``generate_vmap_rule=True``, under ``vmap(grad)``.

Unbatched, ``f(x, w, eps)`` with ``x`` requiring grad (forward only), and forward + backward:

5. the original ``Function.apply``;  6. the lifted callable;  7. ``FunctionClass.apply`` of a
class lifted in place (``torch_autobatch.autobatch``). Both check first for torch.compile
(NOTE [Dynamo and a lifted Function]).

A class whose backward torch.func cannot run (recompute-style: autograd on detached copies),
per-example gradients over 64 examples of (16,) rows, where the lifted class falls back to one
backward per example (NOTE [A backward torch.func cannot run runs as eager .backward() runs it]):

8. the lifted class under ``vmap(grad)``;  9. the original class, one ``.backward()`` per example.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.utils.benchmark as tbench
from torch.func import grad, vmap

import torch_autobatch


class RowNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):  # type: ignore[no-untyped-def]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return x * rstd * w

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w, rstd = ctx.saved_tensors
        xhat = x * rstd
        gw = g * w
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx, dw, None


class RowNormGenVmap(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w, eps):  # type: ignore[no-untyped-def]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x * rstd * w

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        x, w, eps = inputs
        ctx.save_for_backward(x, w, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    backward = RowNorm.backward


def plain(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


lifted = torch_autobatch.from_function(RowNorm, name="bench_lift::rownorm")


class RowNormInPlace(torch.autograd.Function):  # RowNorm again, lifted in place (autobatch)
    forward = RowNorm.forward
    backward = RowNorm.backward


torch_autobatch.autobatch(RowNormInPlace)


class RecomputeRowNorm(torch.autograd.Function):
    """RowNorm whose backward recomputes the forward and differentiates it (checkpoint-style)."""

    @staticmethod
    def forward(ctx, x, w, eps):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return plain(x, w, eps)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(plain(x, w, ctx.eps), (x, w), g)
        return dx, dw, None


recompute_lifted = torch_autobatch.from_function(RecomputeRowNorm, name="bench_lift::recompute_rownorm")


def loop_of_backward(X: torch.Tensor, w: torch.Tensor, cls: type = RowNorm) -> torch.Tensor:
    out = []
    for x in X:
        leaf = x.detach().requires_grad_()
        cls.apply(leaf, w, 1e-5).sum().backward()
        out.append(leaf.grad)
    return torch.stack(out)


def measure(rows: dict[str, tbench.Timer], rounds: int, min_run_time: float) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(rounds):
        order = list(rows)[r % len(rows) :] + list(rows)[: r % len(rows)]
        for k in order:
            times[k].append(rows[k].blocked_autorange(min_run_time=min_run_time).median)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, w = torch.randn(args.batch, 64), torch.randn(64)

    def per_example(f):  # type: ignore[no-untyped-def]
        return vmap(grad(lambda x: f(x, w, 1e-5).sum()))

    expected = loop_of_backward(X, w)
    for f in (plain, lifted, RowNormGenVmap.apply):
        torch.testing.assert_close(per_example(f)(X), expected)
    env = {"X": X, "w": w, "per_example": per_example, "loop": loop_of_backward}
    rows = {
        "1. plain function, vmap(grad)": tbench.Timer("g(X)", globals={**env, "g": per_example(plain)}),
        "2. lifted Function, vmap(grad)": tbench.Timer("g(X)", globals={**env, "g": per_example(lifted)}),
        "3. original Function, loop of .backward()": tbench.Timer("loop(X, w)", globals=env),
        "4. generate_vmap_rule=True, vmap(grad)": tbench.Timer(
            "g(X)", globals={**env, "g": per_example(RowNormGenVmap.apply)}
        ),
    }
    t = measure(rows, args.rounds, args.min_run_time)
    print(f"per-example gradients, B={args.batch} (torch {torch.__version__}, µs, median of {args.rounds} rounds)")
    base = t["1. plain function, vmap(grad)"]
    for k, us in t.items():
        print(f"  {k:<46} {us:10.1f}  ({us / base:5.2f}x the plain function)")

    x = torch.randn(8, 64, requires_grad=True)
    unbatched = {
        "5. Function.apply, forward": tbench.Timer("f(x, w, 1e-5)", globals={"f": RowNorm.apply, "x": x, "w": w}),
        "6. lifted, forward": tbench.Timer("f(x, w, 1e-5)", globals={"f": lifted, "x": x, "w": w}),
        "5. Function.apply, forward + backward": tbench.Timer(
            "f(x, w, 1e-5).sum().backward()", globals={"f": RowNorm.apply, "x": x, "w": w}
        ),
        "6. lifted, forward + backward": tbench.Timer(
            "f(x, w, 1e-5).sum().backward()", globals={"f": lifted, "x": x, "w": w}
        ),
        "7. autobatch in place, forward": tbench.Timer(
            "f(x, w, 1e-5)", globals={"f": RowNormInPlace.apply, "x": x, "w": w}
        ),
        "7. autobatch in place, forward + backward": tbench.Timer(
            "f(x, w, 1e-5).sum().backward()", globals={"f": RowNormInPlace.apply, "x": x, "w": w}
        ),
    }
    t = measure(unbatched, args.rounds, args.min_run_time)
    print("\nunbatched, x: (8, 64) requiring grad (µs per call)")
    for k, us in t.items():
        ref = t[k.replace("6. lifted", "5. Function.apply").replace("7. autobatch in place", "5. Function.apply")]
        print(f"  {k:<46} {us:10.1f}  ({us / ref:5.2f}x Function.apply)")

    Xs, ws = torch.randn(64, 16), torch.randn(16)
    g = vmap(grad(lambda x: recompute_lifted(x, ws, 1e-5).sum()))
    torch.testing.assert_close(g(Xs), loop_of_backward(Xs, ws, RecomputeRowNorm))
    fallback = {
        "8. lifted, vmap(grad), backward per example": tbench.Timer("g(X)", globals={"g": g, "X": Xs}),
        "9. original, loop of .backward()": tbench.Timer(
            "loop(X, w, cls)", globals={"loop": loop_of_backward, "X": Xs, "w": ws, "cls": RecomputeRowNorm}
        ),
    }
    t = measure(fallback, args.rounds, args.min_run_time)
    print("\na backward torch.func cannot run (recompute-style), B=64, (16,) rows (µs)")
    for k, us in t.items():
        print(f"  {k:<46} {us:10.1f}  ({us / t['9. original, loop of .backward()']:5.2f}x the loop of .backward())")


if __name__ == "__main__":
    main()
