"""Forward mode of a lifted ``autograd.Function`` with no ``jvp`` staticmethod: its backward, transposed.

NOTE [Lifting an autograd.Function] (lift/_lifted.py) maps a class onto an op; this
module gives that op a jvp where the class has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._kinds import restoring_setup_context
from ._rules import (
    FunctionClass,
    OnceDifferentiableError,
    _counted,
    _forward_below_this_level,
    _legacy_backward,
    _mark_as_forward_did,
    _once_message,
    backward_as_eager,
    is_once_differentiable,
    once_checked,
)

_Tensor = torch.Tensor


# NOTE [Forward mode of a lifted class is its backward's transpose]
# A class's backward is what the class declares its derivative to be, and
# real libraries ship backwards that are deliberately not their forward's
# derivative (gradient scaling, straight-through estimators, an identity
# forward with a doubled backward). Forward mode derived from the forward
# would then disagree with reverse mode (jacfwd != jacrev, hessian !=
# jacrev(jacrev)). A class with no jvp staticmethod gets its forward mode
# from its backward instead: the backward is linear in its cotangent g, so
# J t = d/dg <bwd(g), t> (the gradient, with respect to g, of the backward's
# inner product with the input tangents), taken with torch.func.grad at
# g = 0 inside the jvp rule. jacfwd == jacrev and hessian == jacrev(jacrev)
# by construction, and transforms outside differentiate the backward's torch
# ops, as they do in reverse mode. A backward that cannot be differentiated
# (@once_differentiable, one that leaves torch) is an error naming the class
# and the fix: a jvp staticmethod. An output marked non-differentiable gets
# no tangent, and the cotangent of an integer output is zeros (as autograd
# materializes it) or None (set_materialize_grads(False)).
def _is_float(t: Any) -> bool:
    return isinstance(t, _Tensor) and (t.is_floating_point() or t.is_complex())


class _SkippedGradient(RuntimeError):
    """A transposed backward returned None for an input with a tangent (NOTE [A backward that asks requires_grad])."""


def transpose_backward(
    cls: FunctionClass,
    pullback: Callable[..., Any],
    outputs: tuple[Any, ...],
    tangents: tuple[Any, ...],
    non_differentiable: tuple[bool, ...],
    materialize: bool,
) -> tuple[Any, ...]:
    """Output tangents J t from ``pullback(*output_cotangents)`` (the class's backward): its transpose."""
    where = [k for k, o in enumerate(outputs) if _is_float(o) and not non_differentiable[k]]
    if not where or all(t is None for t in tangents):
        return tuple(None for _ in outputs)

    def fixed(k: int, o: Any) -> Any:
        return torch.zeros_like(o) if materialize and isinstance(o, _Tensor) else None

    def inner(*gs: Any) -> _Tensor:
        full = [fixed(k, o) for k, o in enumerate(outputs)]
        for k, g in zip(where, gs):
            full[k] = g
        grads = pullback(*full)
        grads = grads if isinstance(grads, tuple) else (grads,)
        for i, (g, t) in enumerate(zip(grads, tangents)):
            if isinstance(g, _Tensor) and isinstance(t, _Tensor) and not g.requires_grad:
                raise _SkippedGradient(
                    f"torch_autobatch: forward-mode AD through {cls.__qualname__}: the class has no jvp "
                    f"staticmethod, so its forward mode is the transpose of its backward, and the backward's "
                    f"gradient for input {i} does not depend on its cotangent as torch sees it (it ran under "
                    f"no_grad, or on detached tensors): the transpose would be a silent zero. Give "
                    f"{cls.__qualname__} a jvp staticmethod (jvp(ctx, *input_tangents)), or compute the backward "
                    f"with grad mode on."
                )
            if g is None and isinstance(t, _Tensor):  # NOTE [A backward that asks requires_grad] (lift/_rules.py)
                raise _SkippedGradient(
                    f"torch_autobatch: forward-mode AD through {cls.__qualname__}: the class has no jvp "
                    f"staticmethod, so its forward mode is the transpose of its backward, and the backward "
                    f"returned None for input {i}, which has a tangent. That may be a zero derivative, or a "
                    f"backward that skips the gradient of a tensor that does not report requires_grad (tensors "
                    f"inside a transform may not): a silent zero is not given. Give {cls.__qualname__} a jvp "
                    f"staticmethod (jvp(ctx, *input_tangents)), or have its backward return a zero gradient."
                )
        total = gs[0].real.sum() * 0 if gs[0].is_complex() else gs[0].sum() * 0
        for g, t in zip(grads, tangents):
            if isinstance(g, _Tensor) and isinstance(t, _Tensor):
                total = total + ((g.conj() * t).real.sum() if g.is_complex() or t.is_complex() else (g * t).sum())
        return total

    seeds = tuple(torch.zeros_like(outputs[k]) for k in where)
    try:
        got = torch.func.grad(inner, argnums=tuple(range(len(where))))(*seeds)
    except (OnceDifferentiableError, _SkippedGradient):
        raise
    except (RuntimeError, NotImplementedError, TypeError) as e:
        if type(e) not in (RuntimeError, NotImplementedError, TypeError):
            raise  # a user's own exception (a subclass) goes on unchanged; torch's are these types
        raise type(e)(
            f"{e}\ntorch_autobatch: forward-mode AD through {cls.__qualname__}: the class has no jvp "
            f"staticmethod, so its forward mode is the transpose of its backward, which needs the "
            f"backward to be differentiable with torch.func, and that failed (above). Give "
            f"{cls.__qualname__} a jvp staticmethod (jvp(ctx, *input_tangents))."
        ) from e
    out: list[Any] = [None] * len(outputs)
    for k, g in zip(where, got):
        # (a tangent of the output's dtype: the cotangent seeds had it)
        out[k] = g
    return tuple(out)


def _marked(ctx: Any, outs: tuple[Any, ...]) -> tuple[bool, ...]:
    """Per output: did ``ctx.mark_non_differentiable`` name it?"""
    marked = ctx.non_differentiable or ()
    return tuple(any(o is m for m in marked) for o in outs)


def _refuse_once(cls: FunctionClass) -> None:
    raise OnceDifferentiableError(
        _once_message(
            cls,
            "forward-mode AD (jvp, jacfwd, hessian) of a class with no jvp staticmethod is the transpose of "
            "its backward, which differentiates it. Give the class a jvp staticmethod (jvp(ctx, *input_tangents)) "
            "for forward mode",
        )
    )


def legacy_transposed_jvp(
    cls: FunctionClass, backward: Callable[..., Any], fwd: Callable[..., Any], n_in: int
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """register_jvp's (jvp, setup_context) for a legacy class with no jvp: its backward, transposed."""
    once = is_once_differentiable(backward)
    bwd = _legacy_backward(backward, n_in, cls)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        if once:
            _refuse_once(cls)
        # (forward mode only: reverse mode never pays this second forward)
        residuals = _forward_below_this_level(fwd, inputs)
        _mark_as_forward_did(ctx, output, residuals)
        flat = residuals[0] if isinstance(residuals[0], tuple) else residuals
        ctx.transposed = (residuals, output if isinstance(output, tuple) else (output,), bool(flat[3]))

    def jvp(ctx: Any, *tangents: Any) -> Any:
        residuals, outs, materialize = ctx.transposed
        needs = tuple(isinstance(t, _Tensor) for t in tangents)
        result = transpose_backward(
            cls,
            lambda *gs: bwd(residuals, *gs, needs_input_grad=needs),
            outs,
            tangents,
            _marked(ctx, outs),
            materialize,
        )
        return result if len(outs) > 1 else result[0]

    jvp.__qualname__ = f"{cls.__qualname__}.backward (transposed)"
    return jvp, setup_context


def new_style_transposed_jvp(
    cls: FunctionClass, backward: Callable[..., Any], n_in: int, kinds: tuple[Any, ...]
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """register_jvp's (jvp, setup_context) for a class with setup_context and no jvp: its backward, transposed."""
    once = is_once_differentiable(backward)
    counted = _counted(backward_as_eager(once_checked(backward, cls), f"{cls.__qualname__}.backward"), n_in)
    user_setup = restoring_setup_context(cls.setup_context, kinds)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        if once:
            _refuse_once(cls)
        user_setup(ctx, inputs, output)
        ctx.transposed_outputs = output if isinstance(output, tuple) else (output,)

    def jvp(ctx: Any, *tangents: Any) -> Any:
        outs = ctx.transposed_outputs
        ctx.needs_input_grad = tuple(isinstance(t, _Tensor) for t in tangents)
        result = transpose_backward(
            cls, lambda *gs: counted(ctx, *gs), outs, tangents, _marked(ctx, outs), ctx.materialize_grads
        )
        return result if len(outs) > 1 else result[0]

    jvp.__qualname__ = f"{cls.__qualname__}.backward (transposed)"
    return jvp, setup_context
