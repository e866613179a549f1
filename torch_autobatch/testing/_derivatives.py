"""Checks of an op's derivatives: its rules against finite differences, the function and each other, and torch.func's transforms against eager.

Each ``_check_<name>(case, exhaustive)`` returns when the check passes and
raises ``_Skip(why)`` where it does not apply or ``_Fail(why, argument,
max_error)``; any other exception is a failure too (``testing.check``
reports it). NOTE [How check compares] (``testing/_case.py``) says what is
compared with what.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ._case import (
    _FD_FULL_MAX,
    _Case,
    _compare,
    _compare_scalar,
    _differentiable_backward,
    _Fail,
    _first_line,
    _forward_mode,
    _fresh,
    _function_grads,
    _need_backward,
    _need_diff,
    _need_values,
    _Skip,
)


# ------------------------------------------------------------------ checks
def _check_opcheck(case: _Case, exhaustive: bool) -> None:
    from torch.testing._internal.optests.generate_tests import DEFAULT_TEST_UTILS

    utils = list(DEFAULT_TEST_UTILS)  # opcheck's own default set
    given = case.given
    runs = [(given.args, given.kwargs, "")]
    if case.op.has_backward and case.diff:
        rg = lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        runs.append((tree_map(rg, given.args), tree_map(rg, given.kwargs), " with inputs that require grad"))
    for args, kwargs, note in runs:
        args, kwargs = _fresh(case.op, args), _fresh(case.op, kwargs)  # the sample stays as given
        result = torch.library.opcheck(case.op.op, args, kwargs, test_utils=utils, raise_exception=False)
        for util, outcome in result.items():
            if outcome != "SUCCESS":
                why = _first_line(outcome) if isinstance(outcome, BaseException) else str(outcome)
                raise _Fail(f"torch.library.opcheck {util}{note}: {why}")


def _check_backward_fd(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    grads = case.eager_vjp()
    names = case.diff_names()
    g = torch.Generator().manual_seed(99 + case.index)
    for j, (p, grad) in enumerate(zip(case.primals(), grads)):
        if p.numel() <= _FD_FULL_MAX:
            numerical = torch.zeros_like(p).reshape(-1)
            for k in range(p.numel()):
                e = torch.zeros_like(p).reshape(-1)
                e[k] = 1
                numerical[k] = case.dot_u(case.numerical_jvp(j, e.reshape(p.shape)))
            _compare(
                [grad],
                [numerical.reshape(p.shape)],
                [names[j]],
                case.fd_atol,
                case.fd_rtol,
                "backward vs finite differences (gradient)",
            )
        else:
            for _ in range(2):
                d = torch.randn(p.shape, generator=g, dtype=p.dtype)
                num = case.dot_u(case.numerical_jvp(j, d))
                _compare_scalar(
                    float((grad * d).sum()),
                    num,
                    names[j],
                    case.fd_atol,
                    case.fd_rtol,
                    "backward vs finite differences (<J^T u, v> vs <u, J v>)",
                )


def _check_backward_function(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    expected = _function_grads(case)
    _compare(
        case.eager_vjp(),
        expected,
        case.diff_names(),
        case.atol,
        case.rtol,
        "registered backward vs autograd of the op's function",
    )


def _check_jvp_fd(case: _Case, exhaustive: bool) -> None:
    _forward_mode(case)
    names = case.diff_names()
    for j, v in enumerate(case.v):
        tangents: list[Optional[torch.Tensor]] = [None] * len(case.diff)
        tangents[j] = v
        got = case.eager_jvp(tangents)
        num = case.numerical_jvp(j, v)
        try:
            _compare(got, num, [f"output {i}" for i in range(len(got))], case.fd_atol, case.fd_rtol, "jvp")
        except _Fail as f:
            raise _Fail(
                f"jvp (tangent on {names[j]}) vs finite differences: {f.why.split(': ', 1)[1]}",
                argument=names[j],
                max_error=f.max_error,
            ) from None


def _check_jvp_function(case: _Case, exhaustive: bool) -> None:
    _need_values(case)
    _need_diff(case)
    if not case.op.registered_jvp:
        raise _Skip("no registered jvp: forward mode is the function's own forward-mode AD")
    try:
        expected = case.eager_jvp(case.v, fn=case.op.fn)
    except Exception as e:
        raise _Skip(f"opaque forward: forward-mode AD of the function failed ({_first_line(e)})") from e
    _compare(
        case.eager_jvp(case.v),
        expected,
        [f"output {i}" for i in range(len(expected))],
        case.atol,
        case.rtol,
        "registered jvp vs forward-mode AD of the op's function",
    )


def _check_jvp_backward(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    _forward_mode(case)
    grads = case.eager_vjp()
    names = case.diff_names()
    what = "forward vs reverse mode: <J v, u> (jvp) vs <v, J^T u> (backward)"
    if not case.op.registered_jvp:
        # NOTE [Forward mode of a lifted class is its backward's transpose] covers lifted classes; an
        # op's forward mode without register_jvp is its function's derivative, which the backward may
        # deliberately not be
        name = case.op.qualname.split("::")[-1]
        what += (
            f". The op has no register_jvp, so its forward mode is derived from its function; a backward "
            f"that is not the function's derivative (gradient scaling, a straight-through estimator) makes "
            f"the two disagree. Register a jvp that matches the backward ({name}.register_jvp(jvp)), or, if "
            f"the backward is wrong, fix it"
        )
    for j, v in enumerate(case.v):
        tangents: list[Optional[torch.Tensor]] = [None] * len(case.diff)
        tangents[j] = v
        forward = case.dot_u(case.eager_jvp(tangents))
        reverse = float((grads[j].double() * v.double()).sum())
        _compare_scalar(forward, reverse, names[j], case.atol, case.rtol, what)


def _check_double_backward(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    h = _differentiable_backward(case)
    ps = [p.detach().requires_grad_() for p in case.primals()]
    analytic = torch.autograd.grad(h(ps), ps, allow_unused=True)
    names = case.diff_names()
    for j, v in enumerate(case.v):
        plus = [p.detach() for p in case.primals()]
        minus = list(plus)
        plus[j] = plus[j] + case.eps * v
        minus[j] = minus[j] - case.eps * v
        hi = h([p.requires_grad_() for p in plus], create_graph=False)
        lo = h([p.requires_grad_() for p in minus], create_graph=False)
        num = float((hi - lo) / (2 * case.eps))
        a = analytic[j]
        got = 0.0 if a is None else float((a * v).sum())
        _compare_scalar(
            got,
            num,
            names[j],
            case.fd_atol,
            case.fd_rtol,
            "second derivative (backward of the backward) vs finite differences",
        )


def _check_grad(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    argnums = tuple(range(len(case.diff)))
    got = torch.func.grad(lambda *p: case.loss(case.floats_of(p)), argnums=argnums)(*case.primals())
    _compare(
        list(got), case.eager_vjp(), case.diff_names(), case.atol, case.rtol, "torch.func.grad vs eager .backward()"
    )


def _check_vjp(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    _, pullback = torch.func.vjp(lambda *p: case.floats_of(p), *case.primals())[:2]
    got = pullback(tuple(case.u))
    _compare(
        list(got), case.eager_vjp(), case.diff_names(), case.atol, case.rtol, "torch.func.vjp vs eager .backward()"
    )


def _check_jvp(case: _Case, exhaustive: bool) -> None:
    _forward_mode(case)
    got = torch.func.jvp(lambda *p: case.floats_of(p), tuple(case.primals()), tuple(case.v))[1]
    expected = case.eager_jvp(case.v)
    names = [f"output {i}" for i in range(len(expected))]
    _compare(list(got), expected, names, case.atol, case.rtol, "torch.func.jvp vs eager dual tensors")


def _contract_out(jac: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sum over the output dims of J * u (J: out.shape + in.shape)."""
    extra = jac.dim() - u.dim()
    return (jac * u.reshape(*u.shape, *([1] * extra))).sum(dim=tuple(range(u.dim()))) if u.dim() else jac * u


def _contract_in(jac: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum over the input dims of J * v (J: out.shape + in.shape)."""
    if not v.dim():
        return jac * v
    return (jac * v).sum(dim=tuple(range(jac.dim() - v.dim(), jac.dim())))


def _check_jacrev(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    argnums = tuple(range(len(case.diff)))
    jac = torch.func.jacrev(lambda *p: case.floats_of(p), argnums=argnums)(*case.primals())
    got = [sum(_contract_out(jac[i][j], u) for i, u in enumerate(case.u)) for j in range(len(case.diff))]
    _compare(
        got,
        case.eager_vjp(),
        case.diff_names(),
        case.atol,
        case.rtol,
        "torch.func.jacrev (times u) vs eager .backward()",
    )


def _check_jacfwd(case: _Case, exhaustive: bool) -> None:
    _forward_mode(case)
    argnums = tuple(range(len(case.diff)))
    jac = torch.func.jacfwd(lambda *p: case.floats_of(p), argnums=argnums)(*case.primals())
    got = [sum(_contract_in(jac[i][j], v) for j, v in enumerate(case.v)) for i in range(len(case.float_outs))]
    expected = case.eager_jvp(case.v)
    names = [f"output {i}" for i in range(len(expected))]
    _compare(got, expected, names, case.atol, case.rtol, "torch.func.jacfwd (times v) vs eager dual tensors")


def _check_hessian(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    _forward_mode(case)  # hessian is jacfwd(jacrev): forward mode through the backward
    _differentiable_backward(case)
    argnums = tuple(range(len(case.diff)))
    hess = torch.func.hessian(lambda *p: case.loss(case.floats_of(p)), argnums=argnums)(*case.primals())
    got = [sum(_contract_in(hess[j][k], v) for k, v in enumerate(case.v)) for j in range(len(case.diff))]
    ps = [p.detach().requires_grad_() for p in case.primals()]
    grads = torch.autograd.grad(case.loss(case.floats_of(ps)), ps, create_graph=True, allow_unused=True)
    gv = sum(((g * v).sum() for g, v in zip(grads, case.v) if g is not None), torch.zeros((), dtype=torch.float64))
    hv = torch.autograd.grad(gv, ps, allow_unused=True) if gv.requires_grad else [None] * len(ps)
    expected = [torch.zeros_like(p) if h is None else h for p, h in zip(ps, hv)]
    _compare(
        got, expected, case.diff_names(), case.atol, case.rtol, "torch.func.hessian (times v) vs eager double backward"
    )
