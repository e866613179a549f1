"""The ``ctx`` objects of a lifted legacy ``autograd.Function``: recorded in forward, rebuilt for backward.

NOTE [Lifting an autograd.Function] (lift/_lifted.py): what ``forward`` leaves on its ctx is its residuals.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch.autograd.function import FunctionCtx

_Tensor = torch.Tensor

_CTX_INTERNALS = frozenset(
    {
        "to_save",
        "saved_for_forward",
        "non_differentiable",
        "dirty_tensors",
        "materialize_grads",
        "needs_input_grad",
    }
)


class _RecordingCtx(FunctionCtx):
    """The ``ctx`` a legacy ``forward`` fills: torch's FunctionCtx, read back afterwards."""

    to_save: Optional[tuple[Any, ...]] = None  # type: ignore[assignment]
    saved_for_forward: Optional[tuple[Any, ...]] = None  # type: ignore[assignment]
    non_differentiable: Optional[tuple[Any, ...]] = None  # type: ignore[assignment]
    dirty_tensors: Optional[tuple[Any, ...]] = None  # type: ignore[assignment]
    materialize_grads: bool = True

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        # True for every tensor argument: the forward runs below autograd, where
        # what will be differentiated is not known yet (a forward that skips
        # work for an input it thinks needs no gradient would be wrong later).
        self.needs_input_grad = needs_input_grad

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return tuple(self.to_save or ())


# NOTE [A lifted Function's residuals are flat]
# Our grad node saves register_vjp's residuals on every differentiated call;
# a flat tuple of tensors and atoms (None, numbers, strings, dtypes, devices)
# takes its C++ fast path, any other pytree torch's Python pytree (which cost
# more than a small forward). So what a legacy forward left on its ctx is
# encoded as one flat tuple: a header of counts and flags, the saved tensors,
# those saved for forward, the attribute names, their values. An attribute
# holding anything else (a torch.Size, a list, an object) goes in a dict
# after it, and the residuals are (flat, dict). A forward that only saved
# tensors (the common case) is read back without building anything but its
# ctx: both ends test for it first. (A gradient's dtype is not a residual:
# the node casts it to its input's, set_cast_grad_dtypes.)
Residuals = Any
_HEADER = 5  # n_saved, n_saved_for_forward (-1: None), non-differentiable output mask, materialize, n_attributes
_ATOMS = frozenset((type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout))


class Unpacked(NamedTuple):
    saved: tuple[Any, ...]
    saved_for_forward: Optional[tuple[Any, ...]]
    attributes: dict[str, Any]


class _ReplayCtx:
    """The ``ctx`` a legacy ``backward`` (or ``jvp``) reads: the forward's ctx, rebuilt from its residuals."""

    def __init__(self, saved: tuple[Any, ...], attributes: dict[str, Any], needs_input_grad: tuple[bool, ...]) -> None:
        self.__dict__.update(attributes)
        self.saved_tensors = saved
        self.saved_variables = saved  # the deprecated spelling some libraries use
        self.needs_input_grad = needs_input_grad

    def mark_non_differentiable(self, *args: Any) -> None:  # called by some backwards; nothing to do
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _residuals(ctx: _RecordingCtx, outs: tuple[Any, ...]) -> Residuals:
    """``forward``'s ctx as residuals (NOTE [A lifted Function's residuals are flat])."""
    d = ctx.__dict__
    saved = d.get("to_save") or ()
    if len(d) == 1 + ("to_save" in d):  # needs_input_grad, and the saved tensors: nothing else recorded
        return (len(saved), -1, 0, True, 0, *saved)
    names: list[str] = []
    values: list[Any] = []
    other: dict[str, Any] = {}
    for k, v in d.items():
        if k in _CTX_INTERNALS:
            continue
        if type(v) in _ATOMS or isinstance(v, _Tensor):
            names.append(k)
            values.append(v)
        else:
            other[k] = v
    sff = ctx.saved_for_forward
    nondiff = ctx.non_differentiable or ()
    mask = sum(1 << i for i, o in enumerate(outs) if any(o is t for t in nondiff)) if nondiff else 0
    flat = (
        len(saved),
        -1 if sff is None else len(sff),
        mask,
        ctx.materialize_grads,
        len(names),
        *saved,
        *(sff or ()),
        *names,
        *values,
    )
    return (flat, other) if other else flat


def _only_saved(residuals: Residuals) -> Optional[tuple[Any, ...]]:
    """The saved tensors, where the forward recorded nothing else on its ctx; else None."""
    if type(residuals[0]) is int and residuals[1] < 0 and not residuals[4]:
        return residuals[_HEADER:]
    return None


def _unpack(residuals: Residuals) -> Unpacked:
    flat, other = residuals if isinstance(residuals[0], tuple) else (residuals, None)
    n_saved, n_sff, _, _, n_attr = flat[:_HEADER]
    i = _HEADER
    saved = flat[i : i + n_saved]
    i += n_saved
    sff = None if n_sff < 0 else flat[i : i + n_sff]
    i += max(n_sff, 0)
    attributes = dict(zip(flat[i : i + n_attr], flat[i + n_attr : i + 2 * n_attr]))
    if other:
        attributes.update(other)
    return Unpacked(saved, sff, attributes)


class _MarkDirty(RuntimeError):
    pass


def _mark_dirty_message(cls: type) -> str:
    return (
        f"torch_autobatch: {cls.__qualname__} marks inputs dirty (ctx.mark_dirty: its forward modifies "
        f"them in place), which a lifted Function cannot do: an operator's outputs are new tensors. "
        f"Lift an out-of-place version, or make it an op with torch_autobatch.custom_op(..., mutates_args=...)."
    )
