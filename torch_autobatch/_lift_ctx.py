"""The ``ctx`` objects of a lifted legacy ``autograd.Function``: recorded in forward, rebuilt for backward.

NOTE [Lifting an autograd.Function] (_lift.py): what ``forward`` leaves on its ctx is its residuals.
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
        self.needs_input_grad = needs_input_grad

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return tuple(self.to_save or ())


class _Residuals(NamedTuple):
    """What a legacy ``forward`` left on its ctx (a pytree: its tensors are saved by our grad node)."""

    saved: tuple[Any, ...]
    saved_for_forward: Optional[tuple[Any, ...]]
    attributes: dict[str, Any]
    non_differentiable: tuple[int, ...]  # output indices
    materialize_grads: bool
    input_dtypes: tuple[Optional[torch.dtype], ...]  # a gradient is cast to its input's dtype, as autograd does


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


def _residuals(ctx: _RecordingCtx, outs: tuple[Any, ...], args: tuple[Any, ...]) -> _Residuals:
    nondiff = ctx.non_differentiable or ()
    return _Residuals(
        saved=tuple(ctx.to_save or ()),
        saved_for_forward=None if ctx.saved_for_forward is None else tuple(ctx.saved_for_forward),
        attributes={k: v for k, v in vars(ctx).items() if k not in _CTX_INTERNALS},
        non_differentiable=tuple(i for i, o in enumerate(outs) if any(o is t for t in nondiff)),
        materialize_grads=ctx.materialize_grads,
        input_dtypes=tuple(a.dtype if isinstance(a, _Tensor) else None for a in args),
    )


class _MarkDirty(RuntimeError):
    pass


def _mark_dirty_message(cls: type) -> str:
    return (
        f"torch_autobatch: {cls.__qualname__} marks inputs dirty (ctx.mark_dirty: its forward modifies "
        f"them in place), which a lifted Function cannot do: an operator's outputs are new tensors. "
        f"Lift an out-of-place version, or make it an op with torch_autobatch.custom_op(..., mutates_args=...)."
    )
