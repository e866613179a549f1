#!/usr/bin/env python
"""Benchmark ``vmap=`` presets for opaque kernels (NOTE [vmap presets: the calling convention]).

One kernel, ``f(x, w) = sin(x) * w + x.sum(-1, keepdim=True)`` (x: (B, D),
w: (D,) float32, D = 64 and 1024), with its backward ``(g * w * cos(x) + g.sum(-1), g * sin(x))``,
in two opaque forms (each with a backward of the same form):

  numpy:   the kernel in numpy (``x.numpy()``, ``torch.from_numpy``);
  library: a ``torch.library.Library("...", "DEF")`` op with a CPU kernel
           (no batching rule, no autograd kernel: opaque to vmap).

Each form is wrapped as an op four ways; columns (median microseconds per call):

  (k)  the kernel called directly on the whole batch (forward; for
       ``vmap(grad)``: forward + backward kernels) -- the target;
  (p)  the same math written as a plain torch function, under the same
       transform (not opaque: what torch.func itself costs here);
  (e)  ``torch_autobatch.custom_op(..., vmap="expand_dims")`` + ``register_autograd``;
  (l)  ``torch_autobatch.custom_op(..., vmap="loop")`` + ``register_autograd``;
  (tl) ``torch.library.custom_op`` + ``register_autograd`` (torch's loop fallback).

Rows: ``vmap(op, in_dims=(0, None))(X, w)`` and
``vmap(grad(lambda x, w: op(x, w).sum()), in_dims=(0, None))(X, w)`` at each B.
Every cell is checked against the plain torch math before it is timed (a
cell that raises or is wrong is ``FAIL``); the number of kernel calls per
vmap call is reported for (e). All in one process, one thread.

``--excess``: issue 49's measure of what the preset adds, on a numpy RMS-norm
kernel (B=1000, D=512, float32) with its numpy backward: the excess of
``vmap(op)`` over the kernel called directly on the batch, against vmap's own
fixed cost on the same math as a plain torch function (``vmap(plain)`` minus
``plain`` on the batch); the same for ``vmap(grad)`` against the forward and
backward kernels called directly (and ``vmap(grad(plain))`` against autograd
on the batch). Interleaved rounds, medians.

Usage: python benchmarks/bench_vmap_presets.py [--quick] [--sizes 1000] [--min-run-time S] [--json PATH] [--excess]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch
import torch.utils.benchmark as tbench
from torch.func import grad, vmap

import torch_autobatch

DTYPE = torch.float32
FORMS = ("numpy", "library")
VARIANTS = ("k", "p", "e", "l", "tl")
VARIANT_DESC = {
    "k": "the kernel called directly on the whole batch",
    "p": "the same math as a plain torch function under the same transform (torch.func's own cost)",
    "e": 'torch_autobatch.custom_op(vmap="expand_dims")',
    "l": 'torch_autobatch.custom_op(vmap="loop")',
    "tl": "torch.library.custom_op (loop fallback)",
}
KERNEL_CALLS = {"numpy": 0, "library": 0}


# ---------------------------------------------------------------- kernels
def np_fwd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    KERNEL_CALLS["numpy"] += 1
    xn, wn = x.detach().numpy(), w.detach().numpy()
    return torch.from_numpy(np.sin(xn) * wn + xn.sum(-1, keepdims=True))


def np_bwd(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gn, xn, wn = g.detach().numpy(), x.detach().numpy(), w.detach().numpy()
    gx = gn * wn * np.cos(xn) + gn.sum(-1, keepdims=True)
    gw = gn * np.sin(xn)
    return torch.from_numpy(gx), torch.from_numpy(gw)


_LIB = torch.library.Library("bench_presets_lib", "DEF")  # noqa: TOR901
_LIB.define("fwd(Tensor x, Tensor w) -> Tensor")
_LIB.define("bwd(Tensor g, Tensor x, Tensor w) -> (Tensor, Tensor)")


def _lib_fwd_cpu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    KERNEL_CALLS["library"] += 1
    return torch.sin(x) * w + x.sum(-1, keepdim=True)


def _lib_bwd_cpu(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return g * w * torch.cos(x) + g.sum(-1, keepdim=True), g * torch.sin(x)


_LIB.impl("fwd", _lib_fwd_cpu, "CPU")
_LIB.impl("bwd", _lib_bwd_cpu, "CPU")
lib_fwd = torch.ops.bench_presets_lib.fwd.default
lib_bwd = torch.ops.bench_presets_lib.bwd.default
KERNELS = {"numpy": (np_fwd, np_bwd), "library": (lib_fwd, lib_bwd)}


# -------------------------------------------------------------------- ops
def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def make_op(form: str, variant: str) -> Callable[..., torch.Tensor]:
    fwd, bwd = KERNELS[form]

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fwd(x, w)

    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return bwd(g, x, w)

    name = f"bench_presets::{form}_{variant}"
    if variant == "tl":
        op: Any = torch.library.custom_op(name, fn, mutates_args=())
    else:
        op = torch_autobatch.custom_op(name, fn, mutates_args=(), vmap="expand_dims" if variant == "e" else "loop")
    op.register_autograd(backward, setup_context=_setup_context)
    return op


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * w + x.sum(-1, keepdim=True)


OPS = {(form, v): make_op(form, v) for form in FORMS for v in ("e", "l", "tl")}


# ------------------------------------------------- --excess: a numpy RMS-norm
def rms_fwd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xn, wn = x.detach().numpy(), w.detach().numpy()
    rstd = 1.0 / np.sqrt((xn * xn).mean(-1, keepdims=True) + 1e-6)
    return torch.from_numpy((xn * rstd * wn).astype(np.float32))


def rms_bwd(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gn, xn, wn = g.detach().numpy(), x.detach().numpy(), w.detach().numpy()
    rstd = 1.0 / np.sqrt((xn * xn).mean(-1, keepdims=True) + 1e-6)
    xhat = xn * rstd
    gw = gn * wn
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdims=True))
    return torch.from_numpy(dx.astype(np.float32)), torch.from_numpy((gn * xhat).astype(np.float32))


def rms_plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def excess(rounds: int, mrt: float) -> None:
    """Issue 49's preset excess (the docstring's --excess), printed as a table."""
    op = torch_autobatch.custom_op("bench_presets::rms", rms_fwd, mutates_args=(), vmap="expand_dims")

    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_bwd(g, *ctx.saved_tensors)

    op.register_autograd(backward, setup_context=_setup_context)
    X, w = torch.randn(1000, 512, dtype=DTYPE), torch.randn(512, dtype=DTYPE)
    leaf, ones = X.clone().requires_grad_(), torch.ones(1000, 512, dtype=DTYPE)
    per_example = vmap(grad(lambda x, w: op(x, w).sum()), in_dims=(0, None))
    plain_per_example = vmap(grad(lambda x, w: rms_plain(x, w).sum()), in_dims=(0, None))
    want = vmap(grad(lambda x, w: rms_plain(x, w).sum()), in_dims=(0, None))(X, w)
    assert torch.allclose(per_example(X, w), want, rtol=1e-4, atol=1e-4)

    def kernels() -> Any:
        rms_fwd(X, w)
        return rms_bwd(ones, X, w)

    fns = {
        "kernel": lambda: rms_fwd(X, w),
        "vmap(op)": lambda: vmap(op, in_dims=(0, None))(X, w),
        "plain": lambda: rms_plain(X, w),
        "vmap(plain)": lambda: vmap(rms_plain, in_dims=(0, None))(X, w),
        "kernels fwd+bwd": kernels,
        "vmap(grad(op))": lambda: per_example(X, w),
        "plain fwd+bwd": lambda: torch.autograd.grad(rms_plain(leaf, w), leaf, ones),
        "vmap(grad(plain))": lambda: plain_per_example(X, w),
    }
    t = interleaved(fns, rounds, mrt)
    print(
        "\n| call (numpy RMS-norm, B=1000, D=512, float32) | µs | excess over the direct call | vmap's fixed cost on"
        " plain torch | excess / fixed cost |"
    )
    print("|:---|---:|---:|---:|---:|")
    for ours, direct, plain_v, plain_d in (
        ("vmap(op)", "kernel", "vmap(plain)", "plain"),
        ("vmap(grad(op))", "kernels fwd+bwd", "vmap(grad(plain))", "plain fwd+bwd"),
    ):
        over, fixed = t[ours] - t[direct], t[plain_v] - t[plain_d]
        print(
            f"| `{ours}` (direct: {direct} {t[direct] * 1e6:.0f} µs) | {t[ours] * 1e6:.0f} | {over * 1e6:.0f} | "
            f"{fixed * 1e6:.0f} | {over / fixed:.2f}x |"
        )


# ---------------------------------------------------------------- helpers
def time_call(fn: Callable[[], Any], min_run_time: float, slow_s: float) -> float:
    """Median seconds per call (bench_vmap.py's method: least of three medians; a few single calls if slow)."""
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    if one > slow_s:
        samples = []
        for _ in range(max(1, min(5, int(min_run_time / one)))):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=1)
    return min(timer.blocked_autorange(min_run_time=min_run_time / 3).median for _ in range(3))


def check(fn: Callable[[], Any], expected: Any) -> Optional[str]:
    """None if ``fn()`` gives ``expected``; else a ``FAIL: ...`` cell."""
    try:
        torch.testing.assert_close(fn(), expected, rtol=1e-4, atol=1e-4)
        return None
    except Exception as exc:  # noqa: BLE001 - a failing variant is a result
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"FAIL: {type(exc).__name__}: {first[:50]}"


def fmt(v: Any) -> str:
    if not isinstance(v, float):
        return str(v)
    us = v * 1e6
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def _x(r: Any) -> str:
    return f"{r:.2f}x" if isinstance(r, float) else "n/a"


def ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "n/a"


# ------------------------------------------------------------- benchmarks
def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, mrt: float) -> dict[str, Any]:
    """Median seconds per call of each fn, timed in alternation (k, p, e, k, p, e, ...).

    The machine is shared and its speed drifts over seconds: cells timed one
    after the other can differ by 2x for the same code. Alternating short
    timings and taking the median of each fn's, and of the per-round ratios,
    compares them under the same conditions (benchmarks/ab.py's method).
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=1)
            times[k].append(timer.blocked_autorange(min_run_time=mrt / rounds).median)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    for a, b in (("e", "k"), ("e", "p")):
        if a in times and b in times:
            out[f"{a} / {b}"] = statistics.median(x / y for x, y in zip(times[a], times[b]))
    return out


def run(sizes: list[int], dims: list[int], mrt: float, slow_s: float, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for bsz, dim in ((b, d) for b in sizes for d in dims):
        g = torch.Generator().manual_seed(bsz)
        X = torch.randn(bsz, dim, generator=g, dtype=DTYPE)
        w = torch.randn(dim, generator=g, dtype=DTYPE)
        y_ref = torch.sin(X) * w + X.sum(-1, keepdim=True)
        gx_ref = w * torch.cos(X) + dim
        gw_ref = torch.sin(X)
        for form in FORMS:
            fwd, bwd = KERNELS[form]
            ones = torch.ones(bsz, dim, dtype=DTYPE)
            for transform in ("vmap", "vmap(grad x)", "vmap(grad w)"):
                row: dict[str, Any] = {"B": bsz, "D": dim, "kernel": form, "transform": transform}
                fns: dict[str, Callable[[], Any]] = {}
                expected: dict[str, Any] = {}
                if transform == "vmap":
                    fns["k"], expected["k"] = (lambda: fwd(X, w)), y_ref
                else:
                    # What a hand-batched per-sample gradient runs: the forward
                    # kernel (grad computes the value too) and the backward one.
                    which = 0 if transform == "vmap(grad x)" else 1
                    fns["k"] = lambda which=which: (fwd(X, w), bwd(ones, X, w))[1][which]
                    expected["k"] = gx_ref if which == 0 else gw_ref
                for v in ("p", "e", "l", "tl"):
                    op = plain if v == "p" else OPS[(form, v)]
                    if transform == "vmap":
                        fns[v] = lambda op=op: vmap(op, in_dims=(0, None))(X, w)
                        expected[v] = y_ref
                    else:
                        argnums = 0 if transform == "vmap(grad x)" else 1
                        per = grad(lambda x, w, op=op: op(x, w).sum(), argnums=argnums)
                        fns[v] = lambda per=per: vmap(per, in_dims=(0, None))(X, w)
                        expected[v] = gx_ref if argnums == 0 else gw_ref
                KERNEL_CALLS[form] = 0
                try:
                    fns["e"]()
                except Exception:  # noqa: BLE001 - reported below
                    pass
                row["e kernel calls"] = KERNEL_CALLS[form]
                fast = {}
                for v, fn in fns.items():
                    failed = check(fn, expected[v])
                    if failed is not None:
                        row[v] = failed
                    elif v in ("k", "p", "e"):
                        fast[v] = fn
                    else:
                        row[v] = time_call(fn, mrt, slow_s)
                row.update(interleaved(fast, rounds, mrt * len(fast)))
                rows.append(row)
                print_row(row)
    return rows


HEADER = [
    "B",
    "D",
    "kernel",
    "transform",
    *(f"({v})" for v in VARIANTS),
    "e / k",
    "e / p",
    "l / e",
    "tl / e",
    "(e) kernel calls",
]


def print_row(row: dict[str, Any]) -> None:
    cells = [str(row["B"]), str(row["D"]), row["kernel"], row["transform"], *(fmt(row[v]) for v in VARIANTS)]
    cells += [
        ratio(row["e"], row["k"]),
        ratio(row["e"], row["p"]),
        ratio(row["l"], row["e"]),
        ratio(row["tl"], row["e"]),
    ]
    cells.append(str(row.get("e kernel calls", "-")))
    print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--quick", action="store_true", help="B=1000 only, short timing")
    p.add_argument("--sizes", type=int, nargs="*", default=[10, 1000], help="batch sizes B")
    p.add_argument("--dims", type=int, nargs="*", default=[64, 1024], help="per-example sizes D")
    p.add_argument("--min-run-time", type=float, default=1.0)
    p.add_argument("--slow-s", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds for (k), (p), (e)")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--excess", action="store_true", help="only issue 49's preset excess (the docstring)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.excess:
        excess(args.rounds, args.min_run_time * 4)
        return 0
    # (l) and (tl) are torch's loop fallback on purpose: no warning per call.
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    sizes, mrt = ([1000], 0.3) if args.quick else (args.sizes, args.min_run_time)
    print(f"torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()}, 1 thread")
    print("Columns: " + "; ".join(f"({v}) {d}" for v, d in VARIANT_DESC.items()))
    print("\nMedian microseconds per call.\n")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "|".join(":---" if i < 4 else "---:" for i in range(len(HEADER))) + "|")
    rows = run(sizes, args.dims, mrt, args.slow_s, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [{k: (round(v * 1e6, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
