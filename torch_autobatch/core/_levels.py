"""functorch's dynamic layers taken off the stack and put back, on every exit (NOTE [Popping levels, interruptibly])."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

from torch._C import _functorch as _ft

__all__ = ["Popped", "restore"]


# NOTE [Popping levels, interruptibly]
# Running user code one level down (a preset's call, a rule's tangents) pops
# functorch's dynamic layers and must push exactly those back on every exit:
# a layer lost, or pushed twice, makes functorch's C++ guards (the vmap's
# exit, DynamicLayer.cpp's SaveLocalDispatchKeySet) throw from a destructor
# while unwinding, which aborts the process. An exception can land at any
# point Python checks for one, not only where code raises: a KeyboardInterrupt
# (any signal handler) arrives after a C call returns to Python code, at a
# function's entry, at a loop's back edge. ``layer = pop(); try: ...
# finally: push(layer)`` loses the layer when it lands between the pop and
# the ``try``, and so does ``try: layer = pop()`` (between the call's return
# and the store), or a ``finally`` whose restore calls a Python function
# first. So a :class:`Popped` is made before the ``try`` (nothing popped yet);
# inside it, each layer is popped and stored by one C call (``list.extend``
# of a ``starmap`` of the pop: no Python code runs between the two); and the
# ``finally`` is one C call, ``restore(popped.back)``, that pushes back what
# was stored, last popped first, and nothing else (an iterator built with the
# ``Popped``, consumed in C). The exception then propagates with the stack as
# the op found it.
_END = object()
_ONCE = ((),)

#: ``finally: restore(popped.back)``: pushes back what a :class:`Popped` took, in one C call.
restore: Callable[[Any], None] = collections.deque(maxlen=0).extend


class Popped:
    """Dynamic layers taken off the stack, for :data:`restore` (NOTE [Popping levels, interruptibly])."""

    __slots__ = ("_layers", "back")

    def __init__(self) -> None:
        self._layers: list[Any] = [_END]
        # Consumed once, in C, by restore: pushes each stored layer, last popped first.
        self.back = map(_ft.push_dynamic_layer_stack, iter(self._layers.pop, _END))

    def above(self, floor: int) -> None:
        """Pops every level above ``floor``."""
        n = sum(1 for i in _ft.get_interpreter_stack() or () if i.level() > floor)
        self._layers.extend(itertools.starmap(_ft.pop_dynamic_layer_stack, itertools.repeat((), n)))

    def one(self) -> None:
        """Pops the top level (the interpreter's ``lower()``)."""
        self._layers.extend(itertools.starmap(_ft.pop_dynamic_layer_stack, _ONCE))
