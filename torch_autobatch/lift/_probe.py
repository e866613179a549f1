"""What a lifted ``autograd.Function`` returns for a combination of argument kinds, learned before its overload.

NOTE [Lifting an autograd.Function] (lift/_lifted.py): ``forward`` runs once on
meta copies of the arguments, or on one example's real values where that fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from ._ctx import _mark_dirty_message, _MarkDirty, _RecordingCtx
from ._kinds import _restore

if TYPE_CHECKING:
    from ._lifted import LiftedFunction

_Tensor = torch.Tensor


class _Probe(NamedTuple):
    num_outputs: int
    returns_tuple: bool
    torch_ops: bool  # forward ran on meta tensors
    sets_attributes: (
        bool  # forward hangs Python attributes on its outputs (NOTE [Attributes a forward sets on its outputs])
    )


def _one_example(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of one example of ``t``'s values (functorch wrappers peeled, batch dims indexed at 0)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            bdim = functorch.maybe_get_bdim(t)
            t = functorch.get_unwrapped(t).select(bdim, 0)
        else:
            t = functorch.get_unwrapped(t)
    return t.detach().clone()


def _run_recorded(lifted: LiftedFunction, args: tuple[Any, ...]) -> Any:
    """``forward`` (and a new-style class's ``setup_context``) on a recording ctx; refuses ``mark_dirty``."""
    cls = lifted._cls
    ctx = _RecordingCtx(tuple(isinstance(a, _Tensor) for a in args))
    if lifted._new_style:
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
    else:
        out = cls.forward(ctx, *args)
    if ctx.dirty_tensors:
        raise _MarkDirty(_mark_dirty_message(cls))
    return out


def _probe(lifted: LiftedFunction, kinds: tuple[Any, ...], args: tuple[Any, ...]) -> _Probe:
    args = _restore(kinds, args)

    def meta(t: Any) -> Any:
        return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, _Tensor) else t

    # Below every torch.func level (functorch would wrap what the forward makes).
    torch_ops = True
    try:
        with torch.no_grad(), torch._C._DisableFuncTorch():
            out = _run_recorded(lifted, pytree.tree_map(meta, args))
    except _MarkDirty:
        raise
    except Exception:  # noqa: BLE001  (any failure: the forward does not run on meta tensors)
        torch_ops = False
        try:
            with torch.no_grad(), torch._C._DisableFuncTorch():
                out = _run_recorded(lifted, pytree.tree_map_only(_Tensor, _one_example, args))
        except _MarkDirty:
            raise
        except Exception as e:
            raise RuntimeError(
                f"torch_autobatch: {lifted._cls.__qualname__}.forward failed when run on one example of "
                f"the call's arguments (to learn what it returns before defining its op): {e}"
            ) from e
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or not all(isinstance(o, _Tensor) for o in outs):
        raise TypeError(
            f"torch_autobatch: {lifted._cls.__qualname__}.forward returned "
            f"{type(out).__name__ if not isinstance(out, tuple) else tuple(type(o).__name__ for o in outs)}; "
            f"a lifted autograd.Function must return a tensor or a tuple of tensors (an operator "
            f"returns tensors). Return the other values from a wrapper around apply."
        )
    sets_attributes = any(type(o) is _Tensor and o.__dict__ for o in outs)
    return _Probe(len(outs), isinstance(out, tuple), torch_ops, sets_attributes)
