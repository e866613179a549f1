"""The ctx object that setup_context and backward receive.

The grad node itself is C++ (``csrc/autograd.cpp``): it turns what
``save_for_backward`` collected into ``SavedVariable`` s, so saving an output
makes no reference cycle, and it hands them back through ``saved_tensors``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class BackwardContext:
    """What ``setup_context(ctx, inputs, output)`` fills and ``backward(ctx, *grads)`` reads.

    Mirrors the ctx of :func:`torch.library.register_autograd`: call
    :meth:`save_for_backward` for tensors, and set plain attributes for
    anything else (``ctx.scale = scale``).
    """

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        #: One bool per operator input: does it need a gradient?
        self.needs_input_grad = needs_input_grad
        self._to_save: Optional[tuple[Optional[torch.Tensor], ...]] = None
        self._to_save_forward: Optional[tuple[Optional[torch.Tensor], ...]] = None
        self._saved_tensors: Optional[tuple[Optional[torch.Tensor], ...]] = None

    def save_for_backward(self, *tensors: Optional[torch.Tensor]) -> None:
        """Saves tensors (or None) for backward, where ``ctx.saved_tensors`` returns them."""
        _check_saveable("save_for_backward", tensors)
        self._to_save = tensors

    def save_for_forward(self, *tensors: Optional[torch.Tensor]) -> None:
        """Saves tensors (or None) for the jvp, where ``ctx.saved_tensors`` returns them.

        Without it, the jvp sees what :meth:`save_for_backward` saved.
        """
        _check_saveable("save_for_forward", tensors)
        self._to_save_forward = tensors

    @property
    def saved_tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        """The tensors given to :meth:`save_for_backward`, inside backward."""
        if self._saved_tensors is None:
            raise RuntimeError(
                "ctx.saved_tensors is only available inside the backward function; "
                "call ctx.save_for_backward(...) in setup_context to save tensors."
            )
        return self._saved_tensors

    def __repr__(self) -> str:
        return f"BackwardContext(needs_input_grad={self.needs_input_grad})"


def _check_saveable(method: str, tensors: tuple[Any, ...]) -> None:
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ctx.{method}: argument {i} is of type {type(t).__name__}; "
                f"it saves tensors or None only. Store other values as "
                f"attributes instead (ctx.name = value)."
            )


def run_jvp(
    jvp_fn: Any, ctx: BackwardContext, tangents: tuple[Any, ...]
) -> Any:
    """Calls the user's jvp with what setup_context saved for it."""
    saved = ctx._to_save_forward if ctx._to_save_forward is not None else ctx._to_save
    ctx._saved_tensors = saved if saved is not None else ()
    try:
        return jvp_fn(ctx, *tangents)
    finally:
        ctx._saved_tensors = None
        ctx._to_save = ctx._to_save_forward = None


def run_backward(
    backward_fn: Any,
    ctx: BackwardContext,
    saved: tuple[Optional[torch.Tensor], ...],
    grads: tuple[Any, ...],
) -> tuple[Any, ...]:
    """Calls the user's backward; the C++ node checks what it returns."""
    ctx._saved_tensors = saved
    try:
        result = backward_fn(ctx, *grads)
    finally:
        ctx._saved_tensors = None
    return result if isinstance(result, tuple) else (result,)
