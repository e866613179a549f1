"""A lifted ``autograd.Function``'s outputs as its operator's: new tensors, aliasing nothing.

NOTE [A lifted op's outputs alias nothing]
An operator's schema ``(Tensor x) -> (Tensor, Tensor)`` promises outputs that
share memory with no input and with no other output: torch.library checks it
on every call (its "must not alias" error), our kernels check it under vmap,
and functionalization, compile and the grad node's version counters rely on
it. A ``forward`` may break it where an ``autograd.Function`` is allowed to:
return an input, a view of one (``x[0]``, ``x.view(...)``), the same tensor
twice, or two views of one buffer (``y[:, 0].contiguous()`` and
``y[:, 1:].contiguous()``, where the first is already contiguous, so
``.contiguous()`` returns a view). A view's output would need a view grad
node of its base at every level, which the kernels do not make, so such an
output is copied (``clone()``) as the forward returns it: the outputs are
new tensors with the same values, and every path (eager forward and
backward, every torch.func transform, vmap, compile) sees what it would see
for any op. The first of several outputs that share a buffer is kept, the
later ones are copied.

The consequence: such an output no longer shares memory with its input (or
with the other output). An in-place write to it changes it alone, never the
input, and a later in-place write to the input does not show in it; nor is it
a view (``out._base`` is None). (torch's own class refuses the in-place write
to a view it returns where a gradient is tracked.) A copy costs memory and
time only where the forward returned an alias; other calls pay torch's own
check of storages (in C++; under vmap a loop through the BatchedTensors to
the tensors they hold).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_Tensor = torch.Tensor
_is_alias_of = torch._C._is_alias_of  # type: ignore[attr-defined]
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_get_unwrapped = torch._C._functorch.get_unwrapped
# (torch.library's C++ check; where a torch release lacks it, every call takes the loop)
_any_alias = getattr(torch._C, "_any_output_is_alias_to_input_or_output", None)
_NO_KWARGS: dict[str, Any] = {}


def _physical(t: Any) -> Any:
    """``t`` without functorch's wrappers (a BatchedTensor has no storage of its own to compare)."""
    while _is_wrapped(t):
        t = _get_unwrapped(t)
    return t


def fresh_outputs(
    outs: tuple[Any, ...], args: tuple[Any, ...], tensors: tuple[int, ...], tensor_lists: tuple[int, ...]
) -> tuple[Any, ...]:
    """``outs`` with each output that aliases an input or an earlier output copied (NOTE above).

    ``args`` as the schema passes them (lists, not tuples: torch's check
    looks into lists only); ``tensors``: the positions of the Tensor
    arguments, ``tensor_lists``: those of lists of (optional) tensors.
    """
    for o in outs:
        if not isinstance(o, _Tensor) or _is_wrapped(o):
            break
    else:
        # Plain tensors (every call but vmap's): torch.library's own check, in C++, clears the
        # common call (nothing aliases) at less cost than the loop below.
        if _any_alias is not None and not _any_alias(args, _NO_KWARGS, outs):
            return outs
    return _copied(outs, args, tensors, tensor_lists)


def _copied(
    outs: tuple[Any, ...], args: tuple[Any, ...], tensors: tuple[int, ...], tensor_lists: tuple[int, ...]
) -> tuple[Any, ...]:
    """fresh_outputs, tensor by tensor: also through functorch's wrappers (a BatchedTensor has no storage)."""
    inputs = [_physical(args[k]) for k in tensors]
    inputs += [_physical(e) for k in tensor_lists for e in args[k] if isinstance(e, _Tensor)]
    fresh = None
    kept: list[Any] = []
    for i, o in enumerate(outs):
        if not isinstance(o, _Tensor):
            continue
        p = _physical(o)
        if any(_is_alias_of(p, a) for a in inputs) or any(_is_alias_of(p, q) for q in kept):
            fresh = fresh or list(outs)
            fresh[i] = o.clone()
        else:
            kept.append(p)
    return outs if fresh is None else tuple(fresh)


def fresh_vmap_rule(
    rule: Callable[..., Any], tensors: tuple[int, ...], tensor_lists: tuple[int, ...]
) -> Callable[..., Any]:
    """A ``vmap`` staticmethod whose outputs alias none of its arguments nor each other (NOTE above).

    Its outputs are the op's, batched: a rule that returns a view of an
    argument (``x.movedim(d, 0)``) is as legitimate as a forward that does.
    """

    def fresh_rule(info: Any, in_dims: Any, *args: Any) -> Any:
        out, out_dims = rule(info, in_dims, *args)
        if isinstance(out, tuple):
            return fresh_outputs(out, args, tensors, tensor_lists), out_dims
        return fresh_outputs((out,), args, tensors, tensor_lists)[0], out_dims

    fresh_rule.__qualname__ = getattr(rule, "__qualname__", "vmap")
    return fresh_rule


# NOTE [Attributes a forward sets on its outputs]
# A forward may hang Python attributes on what it returns (pyro's straight-
# through distributions: ``hard._unquantize = soft``, read back by
# ``log_prob``). Under a transform the op's output the user gets is another
# tensor object (a functorch wrapper, or a copy), which would lack them, and
# the library would silently take its fallback. The kernel notes them
# (:func:`note_attributes`, in a thread-local slot the call empties first) and
# the call sets them on the outputs it returns (:func:`apply_attributes`): an
# input of the forward as the call's own argument (the user's tensor, at the
# user's levels), any other value unchanged. A tensor that is neither cannot be
# handed across the transform's levels: an error naming the class there.
pending = threading.local()


def note_attributes(returned: tuple[Any, ...], args: tuple[Any, ...]) -> None:
    """Notes the Python attributes ``forward`` set on its outputs (``args``: the forward's own arguments)."""
    spec = []
    for k, out in enumerate(returned):
        for name, value in out.__dict__.items():
            where = next((j for j, a in enumerate(args) if a is value), None) if isinstance(value, _Tensor) else None
            if where is not None:
                spec.append((k, name, "argument", where))
            else:
                spec.append((k, name, "tensor" if isinstance(value, _Tensor) else "value", value))
    pending.spec = (returned, spec)


def apply_attributes(noted: Any, out: Any, args: tuple[Any, ...], who: str) -> None:
    """Sets the attributes :func:`note_attributes` noted on the outputs the call returns."""
    returned, spec = noted
    outs = out if isinstance(out, tuple) else (out,)
    for k, name, kind, value in spec:
        if outs[k] is returned[k]:
            continue  # the forward's own tensor: it has them
        if kind == "argument":
            value = args[value]
        elif kind == "tensor" and torch._C._are_functorch_transforms_active():
            raise RuntimeError(
                f"torch_autobatch: {who}'s forward sets the attribute {name!r} on its output {k} to a tensor "
                f"that is not one of its inputs; under a torch.func transform the output is another tensor "
                f"object, and that tensor cannot be handed across the transform's levels "
                f"(NOTE [Attributes a forward sets on its outputs]). Return the tensor as an output instead."
            )
        setattr(outs[k], name, value)
