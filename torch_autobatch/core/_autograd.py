"""The ctx object that setup_context, backward and jvp receive.

The grad node itself is C++ (``csrc/grad_node.cpp``): it turns what
``save_for_backward`` collected into ``SavedVariable`` s, so saving an output
makes no reference cycle, and it hands them back through ``saved_tensors``.

NOTE [ctx is torch's FunctionCtx]
torch.library's contract gives ``setup_context`` "the same ctx object used by
autograd.Function". :class:`BackwardContext` subclasses torch's
``FunctionCtx``, so its methods (``save_for_backward``, ``save_for_forward``,
``mark_non_differentiable``, ``set_materialize_grads``, ``mark_dirty``) are
torch's own and keep up with it; we read back what they record (``to_save``,
``saved_for_forward``, ``non_differentiable``, ``materialize_grads``) and
provide what autograd.Function's C++ base provides: ``saved_tensors`` and
``needs_input_grad``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.autograd.function import FunctionCtx

from .. import _C


class BackwardContext(FunctionCtx):
    """What ``setup_context(ctx, inputs, output)`` fills and ``backward(ctx, *grads)`` reads.

    The ctx of :func:`torch.library.register_autograd` (torch's ``FunctionCtx``):
    call :meth:`save_for_backward` for tensors, set plain attributes for
    anything else (``ctx.scale = scale``), :meth:`mark_non_differentiable` for
    outputs without a gradient, and :meth:`set_materialize_grads` to get None
    instead of zeros for unused outputs' gradients::

        >>> @torch_autobatch.custom_op("doc_BackwardContext::scale", mutates_args=())
        ... def scale(x: torch.Tensor, s: float) -> torch.Tensor:
        ...     return x * s
        >>> def setup_context(ctx, inputs, output):
        ...     print(ctx)
        ...     ctx.s = inputs[1]  # a non-tensor: a plain attribute
        >>> @scale.register_autograd(setup_context=setup_context)
        ... def backward(ctx, grad):
        ...     return grad * ctx.s, None
        >>> torch.func.grad(lambda x: scale(x, 3.0).sum())(torch.ones(2))
        BackwardContext(needs_input_grad=(True, False))
        tensor([3., 3.])
    """

    # What FunctionCtx's methods record, at the values meaning "not called":
    # the C++ node reads them after setup_context, and a class default makes
    # that a plain lookup rather than a failed one (an AttributeError built
    # and dropped per call, NOTE [The Python side of the kernels] in csrc/python_interop.h).
    # (FunctionCtx's annotations omit the None that means "not called".)
    to_save: Optional[tuple[Optional[torch.Tensor], ...]] = None  # type: ignore[assignment]
    saved_for_forward: Optional[tuple[Optional[torch.Tensor], ...]] = None  # type: ignore[assignment]
    non_differentiable: Optional[tuple[torch.Tensor, ...]] = None  # type: ignore[assignment]
    dirty_tensors: Optional[tuple[torch.Tensor, ...]] = None  # type: ignore[assignment]
    materialize_grads: bool = True
    #: The tensors given to :meth:`save_for_backward`, readable inside the
    #: backward (and jvp) call only, read-only: each call's own, on its own
    #: thread (NOTE [Saved tensors belong to the call] in csrc/grad_node.cpp).
    saved_tensors: tuple[Optional[torch.Tensor], ...] = _C._SavedTensors()  # type: ignore[assignment]

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        #: One bool per operator input: does it need a gradient?
        self.needs_input_grad = needs_input_grad

    # save_for_backward is torch's: the C++ node checks what it recorded
    # (call_setup_context in csrc/autograd_kernel.cpp), one Python frame less per call.

    def save_for_forward(self, *tensors: Optional[torch.Tensor]) -> None:
        """Saves tensors (or None) for the jvp, where ``ctx.saved_tensors`` returns them.

        Without it, the jvp sees what :meth:`save_for_backward` saved.
        """
        check_saveable("save_for_forward", tensors)
        super().save_for_forward(*tensors)  # type: ignore[arg-type]  # torch takes None too

    def __repr__(self) -> str:
        return f"BackwardContext(needs_input_grad={self.needs_input_grad})"


# NOTE [needs_input_grad counts the arguments passed]
# torch.library's ctx.needs_input_grad has one entry per argument its
# autograd.Function got, and that is what torch's boxed-to-Python conversion
# passes (NOTE [The function gets its arguments as torch passes them],
# csrc/python_interop.h): the positional arguments up to the last one that
# differs from its schema default. So for f(x, y, scale=2.0, flag=False),
# f(x, y) and f(x, y, 2.0) have 2 entries, f(x, y, 3.0) 3, f(x, y, flag=True)
# 4, in backward (torch's setup_context sees one more, for an argument of
# its own: not copied). Ours are the same, in setup_context, backward and a
# jvp's ctx, under every transform; a backward may return that many
# gradients or more, up to one per input, the rest None (as torch's extra
# Nones are dropped): KernelSide._run_backward fills the rest with None. Not
# changed: an op with keyword-only arguments (they may be tensors with
# gradients, and keep their schema positions in needs_input_grad), and
# register_vjp's ``needs_input_grad=`` (a bool per input). A default that is
# a dtype, layout or memory format (stored as an int) ends the trailing run
# compared, as does a value that is not a plain Python value (a SymInt is
# never compared: that would guard on it).
_PLAIN = (bool, int, float, str, torch.device)


def trailing_defaults(schema: Any) -> tuple[Any, ...]:
    """The trailing positional arguments' defaults, last first: NOTE [needs_input_grad counts the arguments passed]."""
    args = schema.arguments
    if any(a.kwarg_only for a in args):
        return ()
    out = []
    for a in reversed(args):
        if not a.has_default_value():
            break
        default = a.default_value
        if default is not None and (
            any(kind in str(a.real_type) for kind in ("ScalarType", "Layout", "MemoryFormat"))
            or not isinstance(default, (*_PLAIN, list))
        ):
            break
        out.append(default)
    return tuple(out)


def num_passed(inputs: tuple[Any, ...], defaults: tuple[Any, ...]) -> int:
    """How many of ``inputs`` torch passes: the trailing ones equal to ``defaults`` (last first) left out."""
    n = len(inputs)
    for default in defaults:
        if not _is_default(inputs[n - 1], default):
            break
        n -= 1
    return n


def _is_default(value: Any, default: Any) -> bool:
    if default is None or value is None:
        return value is default
    if type(value) is not type(default):
        return False
    if type(value) is list:
        return len(value) == len(default) and all(
            type(v) is type(d) and type(v) in _PLAIN and v == d for v, d in zip(value, default)
        )
    return bool(value == default)


def check_saveable(method: str, tensors: tuple[Any, ...]) -> None:
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ctx.{method}: argument {i} is of type {type(t).__name__}; "
                f"it saves tensors or None only. Store other values as "
                f"attributes instead (ctx.name = value)."
            )
