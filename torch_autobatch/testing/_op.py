"""Checks of the op as a real op: ``torch.compile``, ``torch.ops`` identity, graphs that keep it whole, memory.

The same contract as ``testing/_derivatives.py``: ``_check_<name>(case, exhaustive)``
passes, or raises ``_Skip`` / ``_Fail``. torch._dynamo, make_fx and
torch.export are imported inside the checks that use them (NOTE [Lazy heavy
imports] in ``__init__.py``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._case import (
    _Case,
    _compare,
    _Fail,
    _first_line,
    _floats,
    _need_backward,
    _need_values,
    _Skip,
)

_COMPILED = itertools.count()


def _fresh_function(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` behind a function with a code object of its own (NOTE [A fresh code object per compile])."""
    # NOTE [A fresh code object per compile]
    # Dynamo caches compiled code per code object and, after
    # cache_size_limit recompiles of one, silently runs it eagerly: every
    # check of every op compiling the same lambda would soon test eager code.
    # Each compile check compiles a function made here, whose code object is new.
    namespace: dict[str, Any] = {"_body": body}
    source = "def compiled_op_call(*tensors):\n    return _body(*tensors)\n"
    exec(compile(source, f"<torch_autobatch.testing.check #{next(_COMPILED)}>", "exec"), namespace)
    fn: Callable[..., Any] = namespace["compiled_op_call"]
    return fn


def _compiled_call(body: Callable[..., Any], backend: str, args: Sequence[Any], what: str) -> Any:
    """``torch.compile(body, backend=backend, fullgraph=True)(*args)``: a failure, or nothing compiled, is a _Fail."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(_fresh_function(body), backend=counter, fullgraph=True)
    # A failing compile logs its whole traceback at ERROR level: the report has it in one line.
    quiet = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor", "torch._dynamo")]
    levels = [logger.level for logger in quiet]
    try:
        for logger in quiet:
            logger.setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compiled(*args)
    except Exception as e:
        raise _Fail(f"torch.compile(backend={backend!r}, fullgraph=True) {what} raised {_first_line(e)}") from e
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    if counter.frame_count == 0:
        raise _Fail(f"torch.compile(backend={backend!r}) compiled nothing (ran eagerly)")
    return out


def _compile_check(case: _Case, backend: str) -> None:
    _need_values(case)
    if not case.tensors:
        raise _Skip("no tensor arguments")
    backward = case.op.has_backward and bool(case.diff) and bool(case.float_outs)

    def body(*ts: torch.Tensor) -> Any:
        leaves = list(case.leaves)
        for i, t in zip(case.tensors, ts):
            leaves[i] = t
        return case.call(leaves)

    ins = [case.leaves[i].detach() for i in case.tensors]
    if backward:
        ins = [t.requires_grad_() if i in case.diff else t for t, i in zip(ins, case.tensors)]
    out = _compiled_call(body, backend, ins, "forward")
    got, expected = tree_flatten(out)[0], tree_flatten(case.out)[0]
    names = [f"output {i}" for i in range(len(expected))]
    _compare(got, expected, names, case.atol, case.rtol, f"torch.compile(backend={backend!r}) forward vs eager")
    if not backward:
        return
    outs = _floats(out)
    pairs = [(o, u) for o, u in zip(outs, case.u) if o.requires_grad]
    diff_ins = [t for t, i in zip(ins, case.tensors) if i in case.diff]
    if not pairs:
        raise _Fail(f"torch.compile(backend={backend!r}): the outputs do not require grad (the backward was dropped)")
    try:
        grads = torch.autograd.grad([o for o, _ in pairs], diff_ins, [u for _, u in pairs], allow_unused=True)
    except Exception as e:
        raise _Fail(f"torch.compile(backend={backend!r}) backward raised {_first_line(e)}") from e
    got_g = [torch.zeros_like(p) if g is None else g for p, g in zip(diff_ins, grads)]
    _compare(
        got_g,
        case.eager_vjp(),
        case.diff_names(),
        case.atol,
        case.rtol,
        f"torch.compile(backend={backend!r}) backward vs eager .backward()",
    )


def _check_compile_grad(case: _Case, exhaustive: bool) -> None:
    """``torch.compile(torch.func.grad(loss))``: the rules traced through a transform (a path that can bypass them)."""
    _need_backward(case)
    argnums = tuple(range(len(case.diff)))
    g = torch.func.grad(lambda *p: case.loss(case.floats_of(p)), argnums=argnums)
    got = _compiled_call(g, "aot_eager", case.primals(), "torch.func.grad")
    what = "torch.compile(torch.func.grad, backend='aot_eager') vs eager .backward()"
    _compare(list(got), case.eager_vjp(), case.diff_names(), case.atol, case.rtol, what)


def _check_compile_aot_eager(case: _Case, exhaustive: bool) -> None:
    _compile_check(case, "aot_eager")


def _check_compile_eager(case: _Case, exhaustive: bool) -> None:
    _compile_check(case, "eager")


def _check_compile_inductor(case: _Case, exhaustive: bool) -> None:
    _compile_check(case, "inductor")


def _check_op_identity(case: _Case, exhaustive: bool) -> None:
    from torch._library import custom_ops, utils

    overload = utils.lookup_op(case.op.qualname)
    if overload is not case.op.overload:
        raise _Fail(f"torch.ops lookup of {case.op.qualname} gives {overload}, not the op's overload")
    if custom_ops._maybe_get_opdef(case.op.qualname) is not case.op.op:
        raise _Fail(f"{case.op.qualname} is registered to another op object (redefined?)")
    if case.random:
        return
    args, kwargs = tree_unflatten(list(case.leaves), case.spec)
    got = tree_flatten(overload(*args, **kwargs))[0]
    expected = tree_flatten(case.out)[0]
    _compare(got, expected, [f"output {i}" for i in range(len(expected))], 0, 0, "torch.ops call vs the op")


def _one_node(case: _Case, gm: Any, how: str) -> None:
    import operator

    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    ours = [n for n in nodes if n.target is case.op.overload]
    others = sorted(
        {str(n.target) for n in nodes if n.target is not case.op.overload and n.target is not operator.getitem}
    )
    if len(ours) != 1 or others:
        raise _Fail(f"{how}: expected one node {case.op.qualname}, got {len(ours)} and other ops {others}")


def _graph_fn(case: _Case) -> Callable[..., Any]:
    def flat(*ts: torch.Tensor) -> Any:
        leaves = list(case.leaves)
        for i, t in zip(case.tensors, ts):
            leaves[i] = t
        return case.call(leaves)

    return flat


def _check_make_fx(case: _Case, exhaustive: bool) -> None:
    if not case.tensors:
        raise _Skip("no tensor arguments")
    if case.op.mutable:
        raise _Skip("the op mutates its arguments (the graph holds copies)")
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_graph_fn(case))(*[case.leaves[i] for i in case.tensors])
    _one_node(case, gm, "make_fx")


def _check_export(case: _Case, exhaustive: bool) -> None:
    if not case.tensors:
        raise _Skip("no tensor arguments")
    if case.op.mutable:
        raise _Skip("the op mutates its arguments")

    flat = _graph_fn(case)

    class M(torch.nn.Module):
        def forward(self, *ts: torch.Tensor) -> Any:
            return flat(*ts)

    ep = torch.export.export(M(), tuple(case.leaves[i] for i in case.tensors), strict=False)
    _one_node(case, ep.graph_module, "torch.export")
    got = tree_flatten(ep.module()(*[case.leaves[i] for i in case.tensors]))[0]
    expected = tree_flatten(case.out)[0]
    if not case.random:
        _compare(
            got,
            expected,
            [f"output {i}" for i in range(len(expected))],
            case.atol,
            case.rtol,
            "exported program vs eager",
        )


def _run_and_drop(case: _Case, backward: bool) -> list[tuple[str, weakref.ref]]:
    """Runs the op (and its backward) on fresh inputs, drops every reference, returns weakrefs to what must die."""
    ps = [p.detach().clone().requires_grad_() for p in case.primals()]
    refs = [(name, weakref.ref(p)) for name, p in zip(case.diff_names(), ps)]
    outs = case.floats_of(ps)
    refs += [(f"output {i}", weakref.ref(o)) for i, o in enumerate(outs)]
    if backward:
        pairs = [(o, u) for o, u in zip(outs, case.u) if o.requires_grad]
        if pairs:
            torch.autograd.grad([o for o, _ in pairs], ps, [u for _, u in pairs], allow_unused=True)
    del outs, ps
    return refs


def _check_saved_tensors_freed(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for backward in (True, False):
            refs = _run_and_drop(case, backward)
            alive = [name for name, r in refs if r() is not None]
            if not alive:
                continue
            gc.collect()
            still = [name for name, r in refs if r() is not None]
            when = "after forward and backward" if backward else "after a forward whose graph was dropped unused"
            if still:
                raise _Fail(
                    f"{', '.join(still)} still alive {when} and a gc.collect(): something (a global, a cache, "
                    f"ctx stored elsewhere) keeps the op's inputs alive",
                    argument=still[0],
                )
            raise _Fail(
                f"{', '.join(alive)} freed only by the garbage collector {when}: a reference cycle "
                f"(e.g. ctx or a saved tensor referring back to the graph) keeps them alive until gc runs",
                argument=alive[0],
            )
    finally:
        if enabled:
            gc.enable()
