#!/usr/bin/env python
"""Benchmark vmap / per-sample-grad / call overhead of ``torch_autobatch.custom_op``.

One op, ``f(x, y) = sin(x) * y + x.sum(-1, keepdim=True)`` (x, y: (64,) float32
per example), written five ways:

  (d) plain Python function (the reference; torch's own batching rules);
  (a) ``torch.library.custom_op`` + ``register_autograd`` (vmap: per-example loop fallback);
  (b) ``torch.library.custom_op`` + ``register_autograd`` + hand-written ``register_vmap``;
  (c) ``torch.autograd.Function`` with ``generate_vmap_rule=True``;
  (t) ``torch_autobatch.custom_op`` + ``register_autograd`` (whatever vmap path is installed).

Tables (median microseconds per call, one row per batch size B):

  1. ``vmap(op)(X, Y)``;
  2. ``vmap(grad(loss, argnums=0|1), in_dims=(0, None))(X, w)`` with
     ``loss(x, w) = op(x, w).sum()`` -- per-sample gradients w.r.t. x and w;
  3. unbatched ``op(x, y)`` and ``op(x, y).sum().backward()``.

Every variant's result is checked against the plain function before it is
timed; a variant that raises gets a ``FAIL: ...`` cell. For each vmap call the
number of times the op's Python body ran is reported (1 = one batched call,
B = the per-example loop).

Usage: python benchmarks/bench_vmap.py [--quick] [--json PATH] [--min-run-time S]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.utils.benchmark as tbench
from torch.func import grad, jvp, vmap

import torch_autobatch

D = 64  # per-example feature size
DTYPE = torch.float32
VARIANTS = ("d", "a", "b", "c", "t")
VARIANT_DESC = {
    "d": "plain Python function",
    "a": "torch.library.custom_op + register_autograd (loop fallback)",
    "b": "torch.library.custom_op + register_autograd + register_vmap",
    "c": "autograd.Function(generate_vmap_rule=True)",
    "t": "torch_autobatch.custom_op + register_autograd",
}

# Number of times each variant's Python body has run (a plain int increment,
# done identically in every variant so the overhead is the same for all).
CALLS = {v: 0 for v in VARIANTS}
# Off for torch.compile: a counter bumped inside a compiled function is a
# side effect Dynamo guards on (a recompile per call).
COUNT = True


def _count(v: str) -> None:
    if COUNT:
        CALLS[v] += 1


# --------------------------------------------------------------------- the op
def _body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


def _vjp(grad_out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, needs=(True, True)):
    # Computes only the gradients asked for, as autograd does for the plain function.
    gx = grad_out * y * torch.cos(x) + grad_out.sum(-1, keepdim=True).expand_as(x) if needs[0] else None
    gy = grad_out * torch.sin(x) if needs[1] else None
    return gx, gy


def _setup_context(ctx, inputs, output):
    x, y = inputs
    ctx.save_for_backward(x, y)


def _backward(ctx, grad_out):
    x, y = ctx.saved_tensors
    return _vjp(grad_out, x, y, ctx.needs_input_grad)


# (d) plain function
def f_plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _count("d")
    return _body(x, y)


# (a) torch.library.custom_op, no vmap rule -> loop fallback
@torch.library.custom_op("bench_lib::f_loop", mutates_args=())
def f_loop(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _count("a")
    return _body(x, y)


f_loop.register_autograd(_backward, setup_context=_setup_context)


# (b) torch.library.custom_op + hand-written vmap rule
@torch.library.custom_op("bench_lib::f_rule", mutates_args=())
def f_rule(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _count("b")
    return _body(x, y)


f_rule.register_autograd(_backward, setup_context=_setup_context)


@f_rule.register_vmap
def _f_rule_vmap(info, in_dims, x, y):
    # Move batch dims to 0 and broadcast unbatched inputs, then compute batched:
    # the body only reduces over the last dim, so it is batch-agnostic.
    bsz = info.batch_size
    x_bdim, y_bdim = in_dims
    x = x.movedim(x_bdim, 0) if x_bdim is not None else x.expand(bsz, *x.shape)
    y = y.movedim(y_bdim, 0) if y_bdim is not None else y.expand(bsz, *y.shape)
    return f_rule(x, y), 0


# (c) autograd.Function with a generated vmap rule
class FFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, y):
        _count("c")
        return _body(x, y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y = inputs
        ctx.save_for_backward(x, y)
        ctx.save_for_forward(x, y)

    @staticmethod
    def backward(ctx, grad_out):
        x, y = ctx.saved_tensors
        return _vjp(grad_out, x, y, ctx.needs_input_grad)

    @staticmethod
    def jvp(ctx, tx, ty):
        x, y = ctx.saved_tensors
        out = torch.zeros_like(x)
        if tx is not None:
            out = out + tx * y * torch.cos(x) + tx.sum(-1, keepdim=True)
        if ty is not None:
            out = out + ty * torch.sin(x)
        return out


def f_func(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return FFunction.apply(x, y)


# (t) torch_autobatch.custom_op
@torch_autobatch.custom_op("bench_lib::f_tab", mutates_args=())
def f_tab(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _count("t")
    return _body(x, y)


f_tab.register_autograd(_backward, setup_context=_setup_context)


# (tf) the same with an explicit fake kernel (torch.compile's "slower with
# register_fake" question), and fake kernels for torch.library's ops, which
# torch.compile needs.
@torch_autobatch.custom_op("bench_lib::f_tab_fake", mutates_args=())
def f_tab_fake(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _count("tf")
    return _body(x, y)


f_tab_fake.register_autograd(_backward, setup_context=_setup_context)
for _op in (f_loop, f_rule, f_tab_fake):
    _op.register_fake(lambda x, y: torch.empty_like(torch.broadcast_tensors(x, y)[0]))
CALLS["tf"] = 0


# (v) torch_autobatch.custom_op + register_vjp: fwd hands sin(x) to the
# backward, which then recomputes nothing the forward had.
@torch_autobatch.custom_op("bench_lib::f_vjp", mutates_args=())
def f_vjp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if not x.is_meta:  # not the once-per-shape check of fwd's output (it runs on meta tensors)
        _count("v")
    return _body(x, y)


def _vjp_fwd(x: torch.Tensor, y: torch.Tensor):
    _count("v")
    s = torch.sin(x)
    return s * y + x.sum(-1, keepdim=True), (x, s, y)


def _vjp_bwd(residuals, grad_out, *, needs_input_grad):
    x, s, y = residuals
    gx = grad_out * y * torch.cos(x) + grad_out.sum(-1, keepdim=True).expand_as(x) if needs_input_grad[0] else None
    gy = grad_out * s if needs_input_grad[1] else None
    return gx, gy


f_vjp.register_vjp(_vjp_fwd, _vjp_bwd)
CALLS["v"] = 0

OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "d": f_plain,
    "a": f_loop,
    "b": f_rule,
    "c": f_func,
    "t": f_tab,
    "tf": f_tab_fake,
    "v": f_vjp,
}


# ------------------------------------------------------------------ helpers
# Known long error messages -> a short cell text (the full first line is
# printed once as a footnote under the tables).
_SHORT_MESSAGES = {
    "must override the setup_context staticmethod": "must override setup_context",
    "forward-mode AD": "forward-mode AD not supported",
}
FAIL_FOOTNOTES: dict[str, str] = {}


class Fail:
    """A cell for a variant that raised (or gave a wrong answer)."""

    def __init__(self, exc: BaseException) -> None:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        short = next((v for k, v in _SHORT_MESSAGES.items() if k in text), None)
        if short is None:
            short = first if len(first) <= 40 else first[:37] + "..."
        self.msg = f"{type(exc).__name__}: {short}" if short else type(exc).__name__
        FAIL_FOOTNOTES.setdefault(self.msg, f"{type(exc).__name__}: {first}")

    def __str__(self) -> str:
        return f"FAIL: {self.msg}"


def short_exc(exc: BaseException) -> str:
    return str(Fail(exc))


def time_call(fn: Callable[[], Any], min_run_time: float, slow_s: float) -> float:
    """Median seconds per ``fn()`` call (``fn`` has already been run once).

    Fast calls: ``torch.utils.benchmark.Timer.blocked_autorange``. Calls slower
    than ``slow_s`` (the per-example loop at large B) get a few single-call
    measurements instead, so one cell never takes more than ~``min_run_time``
    (at least one call is always measured).
    """
    t0 = time.perf_counter()
    fn()  # second warm-up, also sizes the call
    one = time.perf_counter() - t0
    if one > slow_s:
        n = max(1, min(5, int(min_run_time / one)))
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    # The machine is shared and noisy: the least of three medians, each over
    # a third of the time budget, is the most repeatable number.
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=1)
    return min(timer.blocked_autorange(min_run_time=min_run_time / 3).median for _ in range(3))


def fmt_us(v: Any) -> str:
    if isinstance(v, Fail):
        return str(v)
    if v is None:
        return "-"
    us = v * 1e6
    if us >= 1000:
        return f"{us:,.0f}"
    if us >= 100:
        return f"{us:.0f}"
    return f"{us:.1f}"


def ratio(num: Any, den: Any) -> str:
    if isinstance(num, float) and isinstance(den, float) and den > 0:
        return f"{num / den:.2f}x"
    return "n/a"


def json_cell(v: Any) -> Any:
    if isinstance(v, Fail):
        return str(v)
    if isinstance(v, float):
        return round(v * 1e6, 3)  # microseconds
    return v


def print_table(title: str, first_col: str, rows: list[dict], extra_cols: list[str]) -> None:
    print(f"\n### {title}\n")
    header = [first_col] + [f"({v})" for v in VARIANTS] + ["t / d", "t / c"] + extra_cols
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if i else ":---" for i in range(len(header))) + "|")
    for row in rows:
        cells = [str(row["key"])] + [fmt_us(row[v]) for v in VARIANTS]
        cells += [ratio(row["t"], row["d"]), ratio(row["t"], row["c"])]
        cells += [str(row.get(c, "-")) for c in extra_cols]
        print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


def measure_cell(
    variant: str,
    make_fn: Callable[[], Callable[[], Any]],
    expected: Optional[Any],
    min_run_time: float,
    slow_s: float,
) -> tuple[Any, Optional[float]]:
    """Checks then times one cell; returns (median seconds | Fail, body calls per call)."""
    try:
        fn = make_fn()
        CALLS[variant] = 0
        out = fn()  # warm-up + correctness
        calls = CALLS[variant]
        if expected is not None:
            torch.testing.assert_close(out, expected)
    except Exception as exc:  # noqa: BLE001 - a failing variant is a result
        return Fail(exc), None
    try:
        return time_call(fn, min_run_time, slow_s), calls
    except Exception as exc:  # noqa: BLE001
        return Fail(exc), calls


def calls_label(calls: Optional[int], bsz: int) -> str:
    if calls is None:
        return "-"
    if bsz == 1:
        return "1"
    if calls == 1:
        return "1 (batched)"
    if calls == bsz:
        return f"{calls} (loop)"
    return f"{calls} (?)"


# ---------------------------------------------------------------- self-check
def sanity_checks() -> list[str]:
    """Unbatched checks: forward, .backward() grads, and (c)'s jvp, vs the plain op."""
    notes = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(D, generator=g, dtype=DTYPE)
    y = torch.randn(D, generator=g, dtype=DTYPE)
    gout = torch.randn(D, generator=g, dtype=DTYPE)
    ref = _body(x, y)
    # The hand-written VJP matches autograd of the plain body.
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    gx_ref, gy_ref = torch.autograd.grad(_body(xr, yr), (xr, yr), gout)
    gx, gy = _vjp(gout, x, y)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gy, gy_ref)
    for v, op in OPS.items():
        try:
            torch.testing.assert_close(op(x, y), ref)
            xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
            (op(xr, yr) * gout).sum().backward()
            torch.testing.assert_close(xr.grad, gx_ref)
            torch.testing.assert_close(yr.grad, gy_ref)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"({v}) unbatched forward/backward check: {short_exc(exc)}")
    tx = torch.randn(D, generator=g, dtype=DTYPE)
    ty = torch.randn(D, generator=g, dtype=DTYPE)
    _, t_ref = jvp(_body, (x, y), (tx, ty))
    try:
        _, t_out = jvp(OPS["c"], (x, y), (tx, ty))
        torch.testing.assert_close(t_out, t_ref)
    except Exception as exc:  # noqa: BLE001
        notes.append(f"(c) torch.func.jvp check: {short_exc(exc)}")
    info = []
    try:  # informational only: torch_autobatch may not support forward mode
        _, t_out = jvp(OPS["t"], (x, y), (tx, ty))
        torch.testing.assert_close(t_out, t_ref)
        info.append("(t) torch.func.jvp: matches")
    except Exception as exc:  # noqa: BLE001
        info.append(f"(t) torch.func.jvp (info only, not benchmarked): {short_exc(exc)}")
    return notes, info


# ---------------------------------------------------------------- benchmarks
def bench_vmap_forward(sizes, mrt, slow_s) -> list[dict]:
    rows = []
    for bsz in sizes:
        g = torch.Generator().manual_seed(bsz)
        X = torch.randn(bsz, D, generator=g, dtype=DTYPE)
        Y = torch.randn(bsz, D, generator=g, dtype=DTYPE)
        expected = _body(X, Y)
        row: dict[str, Any] = {"key": bsz}
        calls_all = {}
        for v in VARIANTS:
            op = OPS[v]
            row[v], calls = measure_cell(v, lambda op=op: lambda: vmap(op)(X, Y), expected, mrt, slow_s)
            calls_all[v] = calls
        row["t body calls"] = calls_label(calls_all["t"], bsz)
        row["body_calls"] = calls_all
        rows.append(row)
    return rows


def bench_vmap_grad(sizes, argnums, mrt, slow_s) -> list[dict]:
    rows = []
    for bsz in sizes:
        g = torch.Generator().manual_seed(1000 + bsz)
        X = torch.randn(bsz, D, generator=g, dtype=DTYPE)
        w = torch.randn(D, generator=g, dtype=DTYPE)
        # Analytic per-sample gradients (grad_out = 1).
        ones = torch.ones_like(X)
        gx, gy = _vjp(ones, X, w.expand_as(X))
        expected = gx if argnums == 0 else gy
        row: dict[str, Any] = {"key": bsz}
        calls_all = {}
        for v in VARIANTS:
            op = OPS[v]

            def make(op=op):
                per_sample = vmap(grad(lambda x, w: op(x, w).sum(), argnums=argnums), in_dims=(0, None))
                return lambda: per_sample(X, w)

            row[v], calls = measure_cell(v, make, expected, mrt, slow_s)
            calls_all[v] = calls
        row["t body calls"] = calls_label(calls_all["t"], bsz)
        row["body_calls"] = calls_all
        rows.append(row)
    return rows


def bench_unbatched(mrt, slow_s) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(D, generator=g, dtype=DTYPE)
    y = torch.randn(D, generator=g, dtype=DTYPE)
    expected = _body(x, y)
    rows = []
    row: dict[str, Any] = {"key": "op(x, y), no grad"}
    for v in VARIANTS:
        op = OPS[v]
        row[v], _ = measure_cell(v, lambda op=op: lambda: op(x, y), expected, mrt, slow_s)
    rows.append(row)

    row = {"key": "op(x, y).sum().backward()"}
    for v in VARIANTS:
        op = OPS[v]

        def make(op=op):
            xr = x.clone().requires_grad_()

            def step():
                op(xr, y).sum().backward()
                return xr.grad

            return step

        # .grad accumulates across calls, so only the first result is checked.
        gx_expected = _vjp(torch.ones_like(x), x, y)[0]
        row[v], _ = measure_cell(v, make, gx_expected, mrt, slow_s)
    rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="B in {1, 100, 1000}, shorter timing")
    p.add_argument("--json", metavar="PATH", help="also write the tables as JSON to PATH")
    p.add_argument(
        "--min-run-time",
        type=float,
        default=None,
        help="seconds per cell for blocked_autorange (default 0.5, --quick 0.1)",
    )
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    # The functorch per-call "performance drop ... no batching rule" warning would
    # print once per loop-fallback call (thousands of lines); the body-call
    # counts below report the same thing.
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)

    sizes = [1, 100, 1000] if args.quick else [1, 10, 100, 1000, 10000]
    mrt = args.min_run_time if args.min_run_time is not None else (0.1 if args.quick else 0.5)
    slow_s = 0.02  # calls slower than this get a few single-call measurements

    t_start = time.perf_counter()
    print("# torch_autobatch vmap benchmark")
    print()
    print(
        f"- torch {torch.__version__}, torch_autobatch {torch_autobatch.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(f"- torch.get_num_threads() = {torch.get_num_threads()}, os.cpu_count() = {os.cpu_count()}")
    print(f"- op: f(x, y) = sin(x) * y + x.sum(-1, keepdim=True), x, y: ({D},) {DTYPE} per example")
    print(
        f"- mode: {'quick' if args.quick else 'full'}, B in {sizes}, min_run_time = {mrt}s; "
        f"calls slower than {slow_s * 1e3:.0f} ms: median of <= 5 single calls (>= 1)"
    )
    print("- cells: median microseconds per call; FAIL = raised or wrong answer")
    print("- NOTE: medians are noisy on a shared 2-core machine; treat differences < ~20% as noise.")
    for v in VARIANTS:
        print(f"- ({v}) {VARIANT_DESC[v]}")
    notes, info = sanity_checks()
    print(
        "- unbatched correctness checks (forward + .backward() for all, jvp for c): "
        + ("all pass" if not notes else "; ".join(notes))
    )
    for line in info:
        print(f"- {line}")
    sys.stdout.flush()

    tables: dict[str, list[dict]] = {}
    tables["1. vmap(op)(X, Y) forward"] = bench_vmap_forward(sizes, mrt, slow_s)
    print_table("1. vmap(op)(X, Y) forward", "B", tables["1. vmap(op)(X, Y) forward"], ["t body calls"])
    key = "2a. vmap(grad(loss, argnums=0), in_dims=(0, None))(X, w): per-sample grad wrt x"
    tables[key] = bench_vmap_grad(sizes, 0, mrt, slow_s)
    print_table(key, "B", tables[key], ["t body calls"])
    key = "2b. vmap(grad(loss, argnums=1), in_dims=(0, None))(X, w): per-sample grad wrt w"
    tables[key] = bench_vmap_grad(sizes, 1, mrt, slow_s)
    print_table(key, "B", tables[key], ["t body calls"])
    key = "3. unbatched call overhead, x, y: (64,)"
    tables[key] = bench_unbatched(mrt, slow_s)
    print_table(key, "call", tables[key], [])

    print("\nBody calls per vmap call (1 = batched, B = per-example loop):")
    for name, rows in tables.items():
        if not name.startswith(("1.", "2")):
            continue
        parts = []
        for row in rows:
            bc = row["body_calls"]
            parts.append(
                f"B={row['key']}: " + ", ".join(f"{v}={bc[v] if bc[v] is not None else '-'}" for v in VARIANTS)
            )
        print(f"- {name.split(':')[0].split(' ')[0]} " + "; ".join(parts))
    if FAIL_FOOTNOTES:
        print("\nFAIL cells, full messages:")
        for short, full in FAIL_FOOTNOTES.items():
            if not short.startswith("NotImplementedError: forward-mode"):
                print(f"- {short}  <-  {full}")
    elapsed = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {elapsed:.1f} s")

    if args.json:
        out = {
            "torch_version": torch.__version__,
            "torch_autobatch_version": torch_autobatch.__version__,
            "num_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "mode": "quick" if args.quick else "full",
            "batch_sizes": sizes,
            "min_run_time_s": mrt,
            "units": "microseconds (median per call)",
            "variants": VARIANT_DESC,
            "sanity_notes": notes,
            "sanity_info": info,
            "fail_messages": FAIL_FOOTNOTES,
            "elapsed_s": round(elapsed, 2),
            "tables": {
                name: [
                    {
                        "key": row["key"],
                        **{v: json_cell(row[v]) for v in VARIANTS},
                        "t/d": ratio(row["t"], row["d"]),
                        "t/c": ratio(row["t"], row["c"]),
                        **({"body_calls": row["body_calls"]} if "body_calls" in row else {}),
                    }
                    for row in rows
                ]
                for name, rows in tables.items()
            },
        }
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
