"""Python objects as arguments of a lifted ``autograd.Function``: constants of the call, kept out of the schema.

NOTE [Python objects as arguments of a lifted Function]
Kernel libraries pass objects no schema holds next to their tensors: an
operator object whose tensors travel separately as ``*args``, a module with
its parameters as ``*args`` and a dict of solver options, a callable, an
index tuple such as ``(..., i)``. They are constants of the call: autograd
itself connects only the tensor arguments of ``apply`` (a tensor reached
through such an object gets no gradient from the unlifted class either).

Where no torch.func transform is active, such a call runs the class's own
``apply`` (exactly what it did unlifted). Under a transform it runs the op:
each object's place in the schema is an ``int``, a handle to the call's
:class:`Constants`, and the kernels (``forward``, ``setup_context``, a
``vmap`` rule, a legacy class's residual re-run) get the objects back,
unchanged, from it (``_lift_kinds._restore``). The handles are never
reused, and the registry holds the constants weakly: the call holds them
while it runs, and a legacy class's residuals (which our grad node saves)
while its backward may run ``forward`` again (NOTE [Second derivatives
through residuals], op/_vjp.py). A graph that recorded the op (``make_fx``)
and replays it later finds the constants gone: a clear error, never another
call's objects. ``torch.compile`` breaks the graph at such a call, with the
reason (NOTE [Dynamo and a lifted Function], lift/_dynamo.py).

A tensor inside an object is invisible to the op's derivatives and batching,
as a closure's is (NOTE [What the function closes over], csrc/closure.cpp).
Under a transform, every tensor reachable from an object (a module's
parameters and buffers, an instance's attributes, a container's items, a
function's closure cells, one level into tuples, lists and dicts) that a
transform is tracking (a functorch wrapper: differentiated or batched) and
that is not itself an argument of the call is an error naming the class,
the argument, the path and the fix. One that is an argument (a module's
parameters swapped in by ``functional_call`` and passed as ``*params``) is
read by ``forward`` as the argument it is; but a ``ctx`` that keeps such an
object for ``backward`` is refused: by the time backward reads it, the
transform has swapped its tensors back or our kernels have unwrapped the
saved ones, so a backward that differentiates through the object would lose
those derivatives (a silent zero where a library fills None with zeros).
Checked only while a transform is active: an eager call runs the class's own
``apply``, and pays nothing.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..core._closure import vars_of

__all__ = ["Constants", "call_with_objects", "constants_of", "resolve"]

_Tensor = torch.Tensor
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_handles = itertools.count(1)  # next() is atomic under the GIL: a handle is never given twice
_NOTE = "NOTE [Python objects as arguments of a lifted Function]"
_LIVE: weakref.WeakValueDictionary[int, Constants] = weakref.WeakValueDictionary()


class Constants:
    """The Python objects of one call, by argument position."""

    __slots__ = ("objects", "tracked", "__weakref__")

    def __init__(self, objects: dict[int, Any], tracked: dict[int, str]) -> None:
        self.objects = objects
        self.tracked = tracked  # position -> the path of a tracked tensor inside it that is also an argument

    def check_kept(self, ctx: Any, who: str) -> None:
        """Refuses a ctx that keeps an object holding tracked tensors (its backward would read them later)."""
        kept = {id(v) for v in getattr(ctx, "__dict__", {}).values()}
        for i, path in self.tracked.items():
            if id(self.objects[i]) in kept:
                obj = self.objects[i]
                raise RuntimeError(
                    f"torch_autobatch: {who} was called under a torch.func transform with a Python object "
                    f"argument ({type(obj).__name__}) holding {path}, a tensor the transform tracks, and "
                    f"keeps that object on its ctx for backward. The transform's tensors inside it are swapped "
                    f"back (functional_call) or unwrapped by the time backward reads it, so the derivatives "
                    f"through them would silently be lost ({_NOTE}). Differentiate these tensors with "
                    f".backward(), or call apply with the object holding plain tensors and differentiate the "
                    f"tensors passed as arguments."
                )


def resolve(handle: int, position: int, what: str) -> Any:
    """The object at ``position`` of the call whose constants are ``handle``."""
    constants = _LIVE.get(handle)
    if constants is None:
        raise RuntimeError(
            f"torch_autobatch: {what} is being run again with argument {position} given as the handle "
            f"{handle} of a Python object of an earlier call, which is gone ({_NOTE}): a graph that "
            f"recorded the op (make_fx) cannot replay a call whose arguments include Python objects. Trace "
            f"the function that calls apply with torch.compile (which runs such a call eagerly), or pass "
            f"tensors, numbers and lists of those only."
        )
    return constants.objects[position]


def constants_of(args: tuple[Any, ...], positions: tuple[int, ...]) -> Any:
    """The :class:`Constants` the handles at ``positions`` of a kernel's arguments name (None if stale)."""
    return _LIVE.get(args[positions[0]]) if type(args[positions[0]]) is int else None


def call_with_objects(
    overload: Any, args: tuple[Any, ...], positions: tuple[int, ...], names: list[str], who: str
) -> tuple[Any, Constants]:
    """``overload(*args)`` with the objects at ``positions`` replaced by handles to them (and checked)."""
    objects = {i: args[i] for i in positions}
    tracked = _check_reachable(objects, args, names, who) if torch._C._are_functorch_transforms_active() else {}
    constants = Constants(objects, tracked)
    handle = next(_handles)
    _LIVE[handle] = constants
    call = list(args)
    for i in positions:
        call[i] = handle
    return overload(*call), constants


def _check_reachable(objects: dict[int, Any], args: tuple[Any, ...], names: list[str], who: str) -> dict[int, str]:
    """Refuses a tracked tensor inside an object that is not an argument; the paths of those that are."""
    tracked: dict[int, str] = {}
    arguments = {id(a) for a in args if isinstance(a, _Tensor)}
    arguments.update(id(t) for a in args if isinstance(a, (tuple, list)) for t in a if isinstance(t, _Tensor))
    for i, obj in objects.items():
        name = names[i] if i < len(names) else f"args[{i}]"
        for path, t in _tensors_in(obj, name):
            if not _wrapped(t):
                continue
            if id(t) in arguments:
                tracked.setdefault(i, path)
            else:
                raise RuntimeError(
                    f"torch_autobatch: {who} was called under a torch.func transform with a Python object "
                    f"argument, {name} ({type(obj).__name__}), that holds a tensor the transform tracks "
                    f"(differentiated or batched): {path}. The op's derivatives and batching see only "
                    f"the tensors passed to apply, so this one's would silently be lost ({_NOTE}). Pass "
                    f"that tensor to apply as an argument too (as the class's own autograd needs), or make it "
                    f"a constant of the transformed function."
                )
    return tracked


def _tensors_in(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for each tensor reachable from ``obj`` through stored data (no property runs)."""
    if isinstance(obj, torch.nn.Module):
        for name, t in itertools.chain(obj.named_parameters(), obj.named_buffers()):
            yield f"{path}.{name}", t
        return
    if isinstance(obj, types.FunctionType):
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield from _one_level(cell.cell_contents, f"{path} (its closure's {var})")
            except ValueError:  # an empty cell
                pass
        return
    if isinstance(obj, types.MethodType):
        yield from _tensors_in(obj.__self__, f"{path}.__self__")
        return
    if isinstance(obj, (tuple, list, dict)):
        yield from _one_level(obj, path)
        return
    stored = vars_of(obj)
    if stored is not None and not isinstance(obj, type):
        for k, v in list(stored.items()):
            yield from _one_level(v, f"{path}.{k}")


def _one_level(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, _Tensor):
        yield path, value
    elif isinstance(value, torch.nn.Module):
        yield from _tensors_in(value, path)
    elif isinstance(value, (tuple, list)):
        for j, v in enumerate(value):
            if isinstance(v, _Tensor):
                yield f"{path}[{j}]", v
    elif isinstance(value, dict):
        for k, v in list(value.items()):
            if isinstance(v, _Tensor):
                yield f"{path}[{k!r}]", v
