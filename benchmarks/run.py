#!/usr/bin/env python
"""Run every benchmark of torch_autobatch, write docs/benchmarks.md and plots.

    python benchmarks/run.py                 # everything (~10 min on 2 cores)
    python benchmarks/run.py --quick         # smoke test: fewer sizes, short timing
    python benchmarks/run.py --only vmap jac --out /tmp/bench

Each measurement group runs in a subprocess of its own (a crash or a leak in one
does not touch the others) and hands its cells back as JSON; this process prints
one line per group as it finishes and then writes ``DIR/benchmarks.md`` (one
table per group), ``DIR/benchmarks.json`` (every round's median) and, for the
groups over a batch size, ``DIR/bench_<group>.png`` (time vs B, log-log).

The op is ``bench_vmap.py``'s ``f(x, y) = sin(x) * y + x.sum(-1, keepdim=True)``
((64,) float32 per example, custom VJP), imported from there in its variants:
plain function; ``torch.library.custom_op`` + ``register_autograd`` (vmap: the
per-example loop); the same + a hand-written ``register_vmap`` (vmap and
per-sample-grad groups); ``autograd.Function(generate_vmap_rule=True)``;
``torch_autobatch.custom_op`` + ``register_autograd``. The ``tracer`` group
reuses ``bench_tracer.py``'s MLPs.

Timing (NOTE [Interleaved medians]): each cell is checked against the plain
function once, then timed with ``torch.utils.benchmark.Timer.blocked_autorange``;
the variants of one row take turns over several rounds, and a cell is the fastest
of its rounds' medians. A variant that raises gets a ``FAIL (n)`` cell (note n
under the table quotes the error), one that returns a wrong result ``FAIL
(wrong result)``, and one whose call takes longer than 2 s ``skipped (>2 s/call)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.utils.benchmark as tbench
from torch.func import grad, hessian, jacfwd, jacrev, vmap

import torch_autobatch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# NOTE [Interleaved medians]
# The machine is shared and its speed drifts over seconds (other jobs, turbo).
# Timing variant A for 5 s and then variant B for 5 s would put that drift into
# the ratio. So every row's variants are timed in turns: in round r each
# variant gets one blocked_autorange (rotating which variant goes first).
# A cell is the fastest of its rounds' medians: on this machine the noise is a
# slowdown of the whole process, often 2x for seconds at a time (a round of the
# plain function at 7.8 us, the next at 15.5), never a speed-up, so the fastest
# round is the one least disturbed, and a ratio of two cells compares the two
# variants each at their least disturbed. (A median over rounds mixed the two
# speeds: 7.9 plain against 29.8 ours, where their fastest rounds were 7.8 and
# 16.1.)

CAP_S = 2.0  # a call slower than this is not timed: "skipped (>2 s/call)"


@dataclasses.dataclass(frozen=True)
class Config:
    quick: bool
    threads: int
    min_run_time: float  # seconds per blocked_autorange
    rounds: int

    @staticmethod
    def make(quick: bool, threads: int) -> Config:
        if quick:
            return Config(quick=True, threads=threads, min_run_time=0.04, rounds=3)
        return Config(quick=False, threads=threads, min_run_time=0.5, rounds=7)


# ------------------------------------------------------------------- cells
# A cell is JSON: {"s": seconds (fastest round), "rounds": [each round's median]} | {"fail": message}
# | {"wrong": message} | {"skipped": reason}.
Cell = dict[str, Any]


def _fail_cell(exc: BaseException) -> Cell:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > 240:
        first = first[:237] + "..."
    return {"fail": f"{type(exc).__name__}: {first}" if first else type(exc).__name__}


def _check(out: Any, expected: Any, tol: Optional[float] = None) -> Optional[Cell]:
    """None if ``out`` matches ``expected`` (within ``tol``, default assert_close's), else a "wrong" cell."""
    if expected is None:
        return None
    try:
        torch.testing.assert_close(out, expected, **({} if tol is None else {"rtol": tol, "atol": tol}))
    except AssertionError as exc:
        zeros = isinstance(out, torch.Tensor) and not bool(out.any())
        detail = "all zeros" if zeros else str(exc).strip().splitlines()[0]
        return {"wrong": detail}
    return None


def measure_row(
    makers: dict[str, Callable[[], Callable[[], Any]]],
    expected: Any,
    cfg: Config,
    counters: Optional[dict[str, int]] = None,
    tol: Optional[float] = None,
) -> tuple[dict[str, Cell], dict[str, int]]:
    """Checks then times one row's variants, interleaved (NOTE [Interleaved medians]).

    ``makers[v]()`` builds the zero-argument callable to time (building it is
    where a transform can raise, too). Returns the cells and, if ``counters``
    (bench_vmap.CALLS) is given, how many times each variant's Python body ran
    during its checked call.
    """
    cells: dict[str, Cell] = {}
    calls: dict[str, int] = {}
    timers: dict[str, Any] = {}
    for v, make in makers.items():
        try:
            fn = make()
            if counters is not None:
                counters[v] = 0
            t0 = time.perf_counter()
            out = fn()
            first = time.perf_counter() - t0
            if counters is not None:
                calls[v] = counters[v]
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result
            cells[v] = _fail_cell(exc)
            continue
        wrong = _check(out, expected, tol)
        if wrong is not None:
            cells[v] = wrong
            continue
        if first > CAP_S:  # the first call may pay one-time costs: ask once more
            t0 = time.perf_counter()
            fn()
            if time.perf_counter() - t0 > CAP_S:
                cells[v] = {"skipped": f">{CAP_S:g} s/call"}
                continue
        timers[v] = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=cfg.threads)

    order = list(timers)
    rounds: dict[str, list[float]] = {v: [] for v in order}
    for r in range(cfg.rounds):
        k = r % len(order) if order else 0
        for v in order[k:] + order[:k]:
            if v in cells:  # raised in an earlier round
                continue
            try:
                rounds[v].append(timers[v].blocked_autorange(min_run_time=cfg.min_run_time).median)
            except Exception as exc:  # noqa: BLE001
                cells[v] = _fail_cell(exc)
    for v in order:
        if v not in cells:
            cells[v] = {"s": min(rounds[v]), "rounds": rounds[v]}
    return {v: cells[v] for v in makers}, calls


# ------------------------------------------------------------------ groups
# Variant keys shared by the op groups; the tracer group has its own labels.
OP_LABELS = {
    "d": "plain",
    "a": "`torch.library.custom_op`",
    "b": "custom_op + `register_vmap`",
    "c": "`autograd.Function`",
    "t": "**torch_autobatch**",
}
# The groups where something is differentiated also time register_vjp.
GRAD_LABELS = {**OP_LABELS, "v": "torch_autobatch + `register_vjp`"}
COMPILED_LABELS = {
    "d": "plain",
    "a": "`torch.library.custom_op`",
    "c": "`autograd.Function`",
    "t": "**torch_autobatch**",
    "tf": "torch_autobatch + `register_fake`",
    "v": "torch_autobatch + `register_vjp`",
}
# One colour per variant in every plot, whichever variants have points there.
COLORS = {
    "d": "tab:blue",
    "a": "tab:orange",
    "b": "tab:purple",
    "c": "tab:red",
    "t": "tab:green",
    "p": "tab:gray",
    "v": "tab:olive",
}
TRACER_LABELS = {
    "d": "untraced",
    "p": "Python dispatch mode (records nothing)",
    "t": "**`torch_autobatch.trace()`**",
}


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    title: str
    about: str
    first_col: str
    labels: dict[str, str]  # variant key -> column header, in column order
    by_batch: bool  # rows are batch sizes (plotted)


GROUPS: dict[str, Group] = {
    g.name: g
    for g in [
        Group(
            "vmap",
            "`vmap(op)(X, Y)`",
            "X, Y: (B, 64). custom_op's vmap is torch's per-example loop; + `register_vmap` "
            "moves batch dims to 0 and calls the op once.",
            "B",
            OP_LABELS,
            True,
        ),
        Group(
            "per_sample_grad_x",
            "Per-sample gradients w.r.t. the batched input",
            "`vmap(grad(lambda x, w: op(x, w).sum(), argnums=0), in_dims=(0, None))(X, w)`, X: (B, 64), w: (64,).",
            "B",
            GRAD_LABELS,
            True,
        ),
        Group(
            "per_sample_grad_w",
            "Per-sample gradients w.r.t. an unbatched weight",
            "`vmap(grad(lambda x, w: op(x, w).sum(), argnums=1), in_dims=(0, None))(X, w)`, X: (B, 64), w: (64,).",
            "B",
            GRAD_LABELS,
            True,
        ),
        Group(
            "backward",
            "Forward + backward, no transform",
            "`op(X, w).sum().backward()` w.r.t. X: (B, 64) and w: (64,), both requiring grad "
            "(`X.grad = w.grad = None` before each step). A `register_autograd` backward "
            "recomputes `sin(x)` for w's gradient; `register_vjp`'s gets it from `fwd`.",
            "B",
            {k: GRAD_LABELS[k] for k in "dactv"},
            True,
        ),
        Group(
            "jac",
            "Jacobians and Hessian, x, y: (64,)",
            "w.r.t. x. Forward mode: `autograd.Function` uses its `jvp` staticmethod, "
            "torch_autobatch the forward-mode AD of the function (no `register_jvp`).",
            "transform",
            {k: OP_LABELS[k] for k in "dact"},
            False,
        ),
        Group(
            "overhead",
            "Unbatched call, x, y: (64,)",
            "No transform. The backward row includes `x.grad = None` before each step.",
            "call",
            {k: OP_LABELS[k] for k in "dact"},
            False,
        ),
        Group(
            "compiled",
            "`torch.compile` (Inductor), X, Y: (B, 64)",
            "Every variant compiled with `torch.compile(fn, fullgraph=True)` (one compile per "
            "row and variant), then timed. `torch.library.custom_op` and the last column have "
            "a `register_fake`; torch_autobatch's default fake kernel is the op's function. "
            "AOTAutograd's and Inductor's graph caches are off; Inductor's C++ kernel cache is "
            "not, so variants whose fused kernels come out identical share one kernel build, "
            "paid by the first of them compiled in a row (plain). "
            "The forward + backward row is `op(op(x, y), y).sum().backward()` w.r.t. x; "
            "`grad` and `vmap(grad)` differentiate `op(x, y).sum()` w.r.t. x; `jvp` pushes "
            "a tangent of x. The second table is each compile's time (the first call).",
            "row",
            COMPILED_LABELS,
            False,
        ),
        Group(
            "tracer",
            "Tracer: one MLP training step, traced vs untraced",
            "`model.zero_grad(set_to_none=True); model(x).sum().backward()` (zero_grad "
            "inside the timing for every variant); traced: the forward inside `with "
            "torch_autobatch.trace():`, the backward after the block (recorded through the "
            "autograd nodes' hooks); the ratio column is traced / untraced. The dispatch-mode column is the least a tracer built "
            "on a Python `TorchDispatchMode` pays (`bench_tracer.py`).",
            "model",
            TRACER_LABELS,
            False,
        ),
    ]
}


def _sizes(group: str, cfg: Config) -> list[int]:
    if group == "vmap":
        return [1, 100, 1000] if cfg.quick else [1, 10, 100, 1000, 10000]
    return [1, 100] if cfg.quick else [1, 10, 100, 1000]


Row = dict[str, Any]  # {"key": ..., "cells": {variant: Cell}, "calls": {variant: int}}


def run_vmap(cfg: Config) -> list[Row]:
    import bench_vmap as b

    rows = []
    for bsz in _sizes("vmap", cfg):
        g = torch.Generator().manual_seed(bsz)
        X = torch.randn(bsz, b.D, generator=g, dtype=b.DTYPE)
        Y = torch.randn(bsz, b.D, generator=g, dtype=b.DTYPE)
        makers = {v: (lambda op=b.OPS[v]: lambda: vmap(op)(X, Y)) for v in OP_LABELS}
        cells, calls = measure_row(makers, b._body(X, Y), cfg, b.CALLS)
        rows.append({"key": bsz, "cells": cells, "calls": calls})
    return rows


def _run_per_sample_grad(argnums: int, cfg: Config) -> list[Row]:
    import bench_vmap as b

    rows = []
    for bsz in _sizes("per_sample_grad", cfg):
        g = torch.Generator().manual_seed(1000 + bsz)
        X = torch.randn(bsz, b.D, generator=g, dtype=b.DTYPE)
        w = torch.randn(b.D, generator=g, dtype=b.DTYPE)
        expected = b._vjp(torch.ones_like(X), X, w.expand_as(X))[argnums]

        def make(op: Callable) -> Callable[[], Any]:
            per_sample = vmap(grad(lambda x, w: op(x, w).sum(), argnums=argnums), in_dims=(0, None))
            return lambda: per_sample(X, w)

        labels = GROUPS[f"per_sample_grad_{'xw'[argnums]}"].labels
        makers = {v: (lambda op=b.OPS[v]: make(op)) for v in labels}
        cells, calls = measure_row(makers, expected, cfg, b.CALLS)
        rows.append({"key": bsz, "cells": cells, "calls": calls})
    return rows


def run_per_sample_grad_x(cfg: Config) -> list[Row]:
    return _run_per_sample_grad(0, cfg)


def run_per_sample_grad_w(cfg: Config) -> list[Row]:
    return _run_per_sample_grad(1, cfg)


def run_backward(cfg: Config) -> list[Row]:
    import bench_vmap as b

    rows = []
    for bsz in _sizes("backward", cfg):
        g = torch.Generator().manual_seed(2000 + bsz)
        X = torch.randn(bsz, b.D, generator=g, dtype=b.DTYPE, requires_grad=True)
        w = torch.randn(b.D, generator=g, dtype=b.DTYPE, requires_grad=True)
        gx, gw = b._vjp(torch.ones_like(X), X.detach(), w.detach().expand_as(X))

        def make(op: Callable) -> Callable[[], Any]:
            def step() -> tuple[torch.Tensor, torch.Tensor]:
                X.grad = w.grad = None
                op(X, w).sum().backward()
                return X.grad, w.grad  # type: ignore[return-value]

            return step

        makers = {v: (lambda op=b.OPS[v]: make(op)) for v in GROUPS["backward"].labels}
        cells, calls = measure_row(makers, (gx, gw.sum(0)), cfg, b.CALLS)
        rows.append({"key": bsz, "cells": cells, "calls": calls})
    return rows


def run_jac(cfg: Config) -> list[Row]:
    import bench_vmap as b

    g = torch.Generator().manual_seed(3)
    x = torch.randn(b.D, generator=g, dtype=b.DTYPE)
    y = torch.randn(b.D, generator=g, dtype=b.DTYPE)
    cases: dict[str, Callable[[Callable], Callable[[], Any]]] = {
        "`jacrev(op)(x, y)`": lambda op: lambda: jacrev(op)(x, y),
        "`jacfwd(op)(x, y)`": lambda op: lambda: jacfwd(op)(x, y),
        "`hessian(lambda x: op(x, y).sum())(x)`": lambda op: lambda: hessian(lambda x: op(x, y).sum())(x),
    }
    rows = []
    for key, case in cases.items():
        expected = case(b._body)()  # torch.func on the plain body: the reference
        makers = {v: (lambda op=b.OPS[v]: case(op)) for v in GROUPS["jac"].labels}
        cells, _ = measure_row(makers, expected, cfg)
        rows.append({"key": key, "cells": cells})
    return rows


def run_overhead(cfg: Config) -> list[Row]:
    import bench_vmap as b

    g = torch.Generator().manual_seed(7)
    x = torch.randn(b.D, generator=g, dtype=b.DTYPE)
    y = torch.randn(b.D, generator=g, dtype=b.DTYPE)
    variants = GROUPS["overhead"].labels
    rows = []
    makers = {v: (lambda op=b.OPS[v]: lambda: op(x, y)) for v in variants}
    cells, _ = measure_row(makers, b._body(x, y), cfg)
    rows.append({"key": "`op(x, y)`, no grad", "cells": cells})

    def make_backward(op: Callable) -> Callable[[], Any]:
        xr = x.clone().requires_grad_()

        def step() -> torch.Tensor:
            xr.grad = None
            op(xr, y).sum().backward()
            return xr.grad

        return step

    makers = {v: (lambda op=b.OPS[v]: make_backward(op)) for v in variants}
    cells, _ = measure_row(makers, b._vjp(torch.ones_like(x), x, y)[0], cfg)
    rows.append({"key": "`op(x, y).sum().backward()`", "cells": cells})
    return rows


def run_compiled(cfg: Config) -> list[Row]:
    import bench_vmap as b
    import torch._functorch.config
    import torch._inductor.config
    from torch.func import jvp

    b.COUNT = False
    # Compile times are cold ones: no cache (the variants whose graphs come out
    # the same, plain and fused ones, would share one compile).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    for name in ("recompile_limit", "cache_size_limit"):  # one code object per case, compiled per B
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)

    def backward(op: Callable, X: torch.Tensor, Y: torch.Tensor) -> Callable[[], Any]:
        step = torch.compile(lambda x, y: op(op(x, y), y).sum(), fullgraph=True)
        xr = X.clone().requires_grad_()

        def run() -> torch.Tensor:
            xr.grad = None
            step(xr, Y).backward()
            return xr.grad

        return run

    def plain_grad_twice(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        xr = X.clone().requires_grad_()
        b._body(b._body(xr, Y), Y).sum().backward()
        return xr.grad

    def compiled(fn: Callable, *args: Any) -> Callable[[], Any]:
        c = torch.compile(fn, fullgraph=True)
        return lambda: c(*args)

    cases: dict[str, tuple[Callable[..., Callable[[], Any]], Callable[..., Any]]] = {
        "forward, `op(op(x, y), y)`": (
            lambda op, X, Y, T: compiled(lambda x, y: op(op(x, y), y), X, Y),
            lambda X, Y, T: b._body(b._body(X, Y), Y),
        ),
        "forward + `.backward()`": (lambda op, X, Y, T: backward(op, X, Y), lambda X, Y, T: plain_grad_twice(X, Y)),
        "`vmap(op)`": (lambda op, X, Y, T: compiled(vmap(op), X, Y), lambda X, Y, T: b._body(X, Y)),
        "`grad`": (
            lambda op, X, Y, T: compiled(grad(lambda x, y: op(x, y).sum()), X, Y),
            lambda X, Y, T: b._vjp(torch.ones_like(X), X, Y)[0],
        ),
        "`vmap(grad)`": (
            lambda op, X, Y, T: compiled(vmap(grad(lambda x, y: op(x, y).sum())), X, Y),
            lambda X, Y, T: b._vjp(torch.ones_like(X), X, Y)[0],
        ),
        "`jvp` w.r.t. x": (
            lambda op, X, Y, T: compiled(lambda x, y, t: jvp(lambda x: op(x, y), (x,), (t,))[1], X, Y, T),
            lambda X, Y, T: T * Y * torch.cos(X) + T.sum(-1, keepdim=True),
        ),
    }
    rows = []
    for case, (make_case, reference) in cases.items():
        for bsz in [100] if cfg.quick else [1, 100, 1000]:
            g = torch.Generator().manual_seed(bsz)
            X, Y, T = (torch.randn(bsz, b.D, generator=g, dtype=b.DTYPE) for _ in range(3))
            compile_s: dict[str, float] = {}

            def make(v: str, make_case=make_case, X=X, Y=Y, T=T) -> Callable[[], Any]:
                fn = make_case(b.OPS[v], X, Y, T)
                t0 = time.perf_counter()
                try:
                    fn()  # compiles
                finally:
                    compile_s[v] = time.perf_counter() - t0
                return fn

            makers = {v: (lambda v=v: make(v)) for v in COMPILED_LABELS}
            # Inductor reorders the sums: float32 results differ in the 5th digit.
            cells, _ = measure_row(makers, reference(X, Y, T), cfg, tol=1e-3)
            rows.append({"key": f"{case}, B={bsz}", "cells": cells, "compile_s": compile_s})
            torch._dynamo.reset()
    return rows


def run_tracer(cfg: Config) -> list[Row]:
    import bench_tracer as bt

    rows = []
    for name, (sizes, batch) in bt.MODELS.items():
        torch.manual_seed(0)
        model = bt.mlp(sizes)
        x = torch.randn(batch, sizes[0])
        steps = bt.steps(model, x)
        weight = model[0].weight

        def make(step: Callable[[], None]) -> Callable[[], Any]:
            def train_step() -> torch.Tensor:
                model.zero_grad(set_to_none=True)
                step()
                return weight.grad

            return train_step

        expected = make(steps["untraced"])().clone()
        makers = {
            "d": lambda: make(steps["untraced"]),
            "p": lambda: make(steps["pass_through"]),
            "t": lambda: make(steps["traced"]),
        }
        # Large steps are few per second: more time per blocked_autorange.
        step_cfg = dataclasses.replace(cfg, min_run_time=cfg.min_run_time * (2 if name == "small" else 5))
        cells, _ = measure_row(makers, expected, step_cfg)
        rows.append({"key": f"{name}: {'-'.join(map(str, sizes))}, batch {batch}", "cells": cells})
    return rows


RUNNERS: dict[str, Callable[[Config], list[Row]]] = {
    "vmap": run_vmap,
    "per_sample_grad_x": run_per_sample_grad_x,
    "per_sample_grad_w": run_per_sample_grad_w,
    "backward": run_backward,
    "jac": run_jac,
    "overhead": run_overhead,
    "compiled": run_compiled,
    "tracer": run_tracer,
}
assert RUNNERS.keys() == GROUPS.keys()


def worker(group: str, result: Path, cfg: Config) -> int:
    """Runs one group in this process and writes its rows to ``result``."""
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(cfg.threads)
    # The loop fallback warns once per call ("There is a performance drop ...").
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    warnings.filterwarnings("ignore", message=".*performance drop.*")
    rows = RUNNERS[group](cfg)
    result.write_text(json.dumps({"group": group, "rows": rows}))
    return 0


# ----------------------------------------------------------------- reports
def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_autobatch": getattr(torch_autobatch, "__version__", "unknown"),
        "commit": commit,
        "default_num_threads": torch.get_num_threads(),
        "load_average": [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def _fmt_us(seconds: float) -> str:
    sys.path.insert(0, str(HERE))
    import bench_vmap as b

    return b.fmt_us(seconds)


def _render_cell(cell: Optional[Cell], notes: list[str]) -> str:
    if cell is None:
        return "-"
    if "s" in cell:
        return _fmt_us(cell["s"])
    if "skipped" in cell:
        return f"skipped ({cell['skipped']})"
    if "wrong" in cell:
        return "FAIL (wrong result)" if cell["wrong"] != "all zeros" else "FAIL (wrong: all zeros)"
    if cell["fail"] not in notes:
        notes.append(cell["fail"])
    return f"FAIL ({notes.index(cell['fail']) + 1})"


def ratio_to_plain(cells: dict[str, Cell], variant: str = "t") -> Optional[float]:
    """``variant`` (default torch_autobatch) / plain, each at its fastest round (NOTE [Interleaved medians])."""
    t, d = cells.get(variant, {}), cells.get("d", {})
    if "s" not in t or "s" not in d or d["s"] <= 0:
        return None
    return t["s"] / d["s"]


def _ratio(cells: dict[str, Cell], variant: str = "t") -> str:
    r = ratio_to_plain(cells, variant)
    return "n/a" if r is None else f"{r:.2f}x"


# The ratio columns: torch_autobatch / plain, and + register_vjp / plain where timed.
RATIO_COLUMNS = {"t": "torch_autobatch / plain", "v": "+ `register_vjp` / plain"}


def _calls_note(group: Group, rows: list[Row]) -> Optional[str]:
    if not group.by_batch or not all(row.get("calls") for row in rows):
        return None
    parts = []
    for v, label in group.labels.items():
        counts = [str(row["calls"][v]) if v in row["calls"] else "-" for row in rows]
        parts.append(f"{label.strip('*')}: {', '.join(counts)}")
    bs = ", ".join(str(row["key"]) for row in rows)
    return f"Python body runs per call (counted during the checked call; B = {bs}): " + "; ".join(parts) + "."


def render_markdown(meta: dict[str, Any], results: dict[str, Any]) -> str:
    m = meta["machine"]
    cfg = meta["config"]
    out = [
        "# torch_autobatch benchmarks",
        "",
        "Generated by `benchmarks/run.py`; do not edit by hand.",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}` ({'quick' if cfg['quick'] else 'full'}; wall time {meta['wall_s']:.0f} s)",
        f"- machine: {m['platform']}, {m['cpu']}, {m['cpu_count']} CPUs; load average at start {m['load_average']}",
        f"- versions: Python {m['python']}, torch {m['torch']}, torch_autobatch "
        f"{m['torch_autobatch']} (commit {m['commit']})",
        f"- threads: torch.get_num_threads() = {m['default_num_threads']} by default; "
        f"measured with {cfg['threads']} (`torch.set_num_threads`, `Timer(num_threads=...)`)",
        f"- timing: `torch.utils.benchmark.Timer.blocked_autorange(min_run_time={cfg['min_run_time']})`"
        f" per variant per round; the variants of a row take turns over {cfg['rounds']} rounds; a cell "
        "is the fastest of its rounds' medians (the machine's noise only slows a round down), in "
        "µs per call (tracer rows: 2x / 5x the time per round). Each group ran in a subprocess of "
        "its own.",
        "- cells: FAIL (n) = raised (note n under the table); FAIL (wrong result) = returned a result "
        f"that differs from the plain function's; skipped = one call took over {CAP_S:g} s.",
        "- op: `f(x, y) = sin(x) * y + x.sum(-1, keepdim=True)`, (64,) float32 per example, with a "
        "custom VJP (`benchmarks/bench_vmap.py`). The machine is shared and noisy: differences "
        "under ~20% are within run-to-run variation.",
        "",
    ]
    for name, res in results.items():
        group = GROUPS[name]
        out += [f"## `{name}`: {group.title}", "", group.about, ""]
        if "error" in res:
            out += [
                f"The group's subprocess failed ({res['error']}):",
                "",
                "```",
                res.get("stderr_tail", "").rstrip(),
                "```",
                "",
            ]
            continue
        notes: list[str] = []
        ratios = [v for v in RATIO_COLUMNS if v in group.labels]
        header = [group.first_col] + list(group.labels.values()) + [RATIO_COLUMNS[v] for v in ratios]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|")
        for row in res["rows"]:
            cells = [str(row["key"])]
            cells += [_render_cell(row["cells"].get(v), notes) for v in group.labels]
            cells += [_ratio(row["cells"], v) for v in ratios]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        for i, note in enumerate(notes, 1):
            out.append(f"({i}) {note}  ")
        if any("compile_s" in row for row in res["rows"]):
            out += ["", "Compile time of each cell (s, the first call):", ""]
            out.append("| " + " | ".join([group.first_col] + list(group.labels.values())) + " |")
            out.append("|" + "|".join([":---"] + ["---:"] * len(group.labels)) + "|")
            for row in res["rows"]:
                times = [f"{row['compile_s'][v]:.1f}" if v in row.get("compile_s", {}) else "-" for v in group.labels]
                out.append("| " + " | ".join([str(row["key"])] + times) + " |")
            out.append("")
        calls = _calls_note(group, res["rows"])
        if calls:
            out.append(calls)
        if notes or calls:
            out.append("")
        if group.by_batch:
            out += [f"![{name}](bench_{name}.png)", ""]
    return "\n".join(out)


def plot(name: str, rows: list[Row], path: Path, meta: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = GROUPS[name]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v, label in group.labels.items():
        pts = [(row["key"], row["cells"][v]["s"] * 1e6) for row in rows if "s" in row["cells"].get(v, {})]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", color=COLORS[v], label=label.replace("*", "").replace("`", ""))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("µs per call (median)")
    m = meta["machine"]
    ax.set_title(
        f"{name}: {group.title.replace('`', '')}\n"
        f"torch {m['torch']}, {meta['config']['threads']} thread(s), {meta['date'][:10]}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and shorter timing (smoke test)")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", choices=list(GROUPS), help=f"run only these groups, of: {' '.join(GROUPS)}"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs",
        help="where benchmarks.md, benchmarks.json and the plots go (default: docs/)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads to measure with (default 1)")
    parser.add_argument("--group-timeout", type=float, default=1800, help="seconds before a group is killed")
    parser.add_argument(
        "--render", action="store_true", help="only write DIR/benchmarks.md again from DIR/benchmarks.json (no runs)"
    )
    parser.add_argument("--worker", choices=list(GROUPS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be a positive integer, got {args.threads}")
    cfg = Config.make(args.quick, args.threads)
    if args.worker:
        return worker(args.worker, args.result, cfg)
    if args.render:
        saved = json.loads((args.out / "benchmarks.json").read_text())
        (args.out / "benchmarks.md").write_text(render_markdown(saved["meta"], saved["results"]) + "\n")
        print(f"wrote {args.out / 'benchmarks.md'}")
        return 0

    t_start = time.perf_counter()
    machine = _machine()
    print(
        f"machine: {machine['platform']}, {machine['cpu']}, {machine['cpu_count']} CPUs, "
        f"load average {machine['load_average']}"
    )
    print(
        f"versions: Python {machine['python']}, torch {machine['torch']}, "
        f"torch_autobatch {machine['torch_autobatch']} (commit {machine['commit']})"
    )
    print(f"threads: torch.get_num_threads() = {machine['default_num_threads']}; measuring with {cfg.threads}")
    print(
        f"mode: {'quick' if cfg.quick else 'full'}, {cfg.rounds} rounds x "
        f"blocked_autorange(min_run_time={cfg.min_run_time})",
        flush=True,
    )

    groups = args.only or list(GROUPS)
    if any(GROUPS[g].by_batch for g in groups) and importlib.util.find_spec("matplotlib") is None:
        parser.error("the groups over a batch size are plotted: pip install matplotlib (or --only the others)")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="torch_autobatch_bench_") as tmp:
        for name in groups:
            result = Path(tmp) / f"{name}.json"
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                name,
                "--result",
                str(result),
                "--threads",
                str(cfg.threads),
            ] + (["--quick"] if cfg.quick else [])
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.group_timeout)
                rc: Any = proc.returncode
                stderr = proc.stderr
            except subprocess.TimeoutExpired as exc:
                err = exc.stderr or b""  # bytes here, even with text=True
                rc = f"timed out after {args.group_timeout:g} s"
                stderr = err.decode(errors="replace") if isinstance(err, bytes) else err
            secs = time.perf_counter() - t0
            if rc == 0 and result.exists():
                results[name] = json.loads(result.read_text())
                results[name]["seconds"] = secs
                print(f"  {name:<20} {secs:6.1f} s", flush=True)
            else:
                tail = "\n".join(stderr.strip().splitlines()[-15:])
                results[name] = {"error": f"rc={rc}", "stderr_tail": tail, "seconds": secs}
                print(f"  {name:<20} {secs:6.1f} s  FAILED (rc={rc})\n{tail}", flush=True)

    argv0 = sys.argv[0]
    try:
        argv0 = os.path.relpath(argv0)
    except ValueError:
        pass
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["python", argv0] + sys.argv[1:]),
        "machine": machine,
        "config": dataclasses.asdict(cfg),
        "wall_s": time.perf_counter() - t_start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    written = [args.out / "benchmarks.md", args.out / "benchmarks.json"]
    written[0].write_text(render_markdown(meta, results) + "\n")
    written[1].write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    for name, res in results.items():
        if GROUPS[name].by_batch and "rows" in res:
            path = args.out / f"bench_{name}.png"
            plot(name, res["rows"], path, meta)
            written.append(path)
    print(f"total {time.perf_counter() - t_start:.1f} s; wrote " + ", ".join(map(str, written)))
    return 0 if all("rows" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
