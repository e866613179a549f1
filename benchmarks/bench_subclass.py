#!/usr/bin/env python
"""An op on a DTensor with no sharding rule: forward + backward, against the plain function.

    python benchmarks/bench_subclass.py [--min-run-time S] [--rounds N] [--sizes 64x64 1024x1024]

The op is bench_vmap.py's ``f(x, y) = sin(x) * y + x.sum(-1, keepdim=True)``
with its exact backward registered (``register_vjp``, saving ``sin(x)`` as
autograd does for the plain function); no sharding rule
is written, so DTensor receives the op's function (NOTE [Subclasses receive
the function] in torch_autobatch/graphs/_subclass.py). Inputs: ``Shard(0)``
DTensors on a one-process gloo mesh (world size 1: the local compute of a
real mesh, without its communication), ``x`` requiring grad.

Rows (µs per ``op(x, y).sum().backward()``, the fastest of interleaved
rounds' medians, one thread: a shared machine only ever slows a round down): the plain function on the same DTensors, the op, and
their ratio (target: at most 1.3x). The op pays, per call, our Autograd
kernel and grad node, the default rule's check that DTensor still has no
rule for it (NOTE [Asking DTensor once]) and one redispatch; the per-op cost
of DTensor itself (~20 µs an aten op) is the same on both sides, so the
ratio falls as the tensors grow.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.utils.benchmark as tbench
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import torch_autobatch


def plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


op = torch_autobatch.custom_op("bench_subclass::f", mutates_args=())(plain)


def fwd(x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    s = torch.sin(x)
    return s * y + x.sum(-1, keepdim=True), (s, x, y)


def bwd(residuals, grad, needs_input_grad):  # type: ignore[no-untyped-def]
    s, x, y = residuals
    gx = grad * y * torch.cos(x) + grad.sum(-1, keepdim=True) if needs_input_grad[0] else None
    return gx, grad * s if needs_input_grad[1] else None


# The backward autograd derives for the plain function, written out: it
# saves sin(x) and skips the gradients not needed, as autograd does, so
# that both sides do the same work.
op.register_vjp(fwd, bwd)


def step(fn, x, y):  # type: ignore[no-untyped-def]
    fn(x, y).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes", nargs="+", default=["64x64", "1024x1024"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            print(
                f"forward + backward on Shard(0) DTensors, no sharding rule (torch {torch.__version__}, "
                f"µs per call, fastest median of {args.rounds} rounds)"
            )
            for size in args.sizes:
                shape = tuple(int(n) for n in size.split("x"))
                gen = torch.Generator().manual_seed(0)
                x = distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)]).requires_grad_()
                y = distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)])
                out, ref = op(x, y), plain(x, y)
                assert out.placements == ref.placements, (out.placements, ref.placements)
                torch.testing.assert_close(out.full_tensor(), ref.full_tensor())
                ((g,),) = (torch.autograd.grad(out.sum(), x),)
                ((g_ref,),) = (torch.autograd.grad(ref.sum(), x),)
                torch.testing.assert_close(g.full_tensor(), g_ref.full_tensor())
                variants = {"plain function": plain, "torch_autobatch.custom_op": op}
                timers = {
                    k: tbench.Timer("step(f, x, y)", globals={"step": step, "f": f, "x": x, "y": y}, num_threads=1)
                    for k, f in variants.items()
                }
                times: dict[str, list[float]] = {k: [] for k in variants}
                for r in range(args.rounds):
                    for k in list(variants)[r % 2 :] + list(variants)[: r % 2]:
                        times[k].append(timers[k].blocked_autorange(min_run_time=args.min_run_time).median)
                us = {k: min(v) * 1e6 for k, v in times.items()}  # NOTE [Interleaved medians]
                ratio = us["torch_autobatch.custom_op"] / us["plain function"]
                print(f"  {size:>10}  " + "  ".join(f"{k} {v:9.1f}" for k, v in us.items()) + f"  ratio {ratio:.2f}x")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
