"""What an op's user code closes over, for the kernels' check (NOTE [What the function closes over], csrc/closure.cpp)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from ._kernel_side import KernelSide


def _closure_of(fn: Optional[Callable[..., Any]]) -> list[tuple[str, str, Any]]:
    """``fn``'s closure cells, tensor defaults and tensor globals, as (function, variable, cell, value or globals)."""
    fn = getattr(fn, "__func__", fn)  # a bound method's function
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "its function"))
    entries = [(name, var, cell) for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ())]
    defaults = getattr(fn, "__defaults__", None) or ()
    positional = code.co_varnames[: code.co_argcount]
    for var, value in zip(positional[len(positional) - len(defaults) :], defaults):
        if isinstance(value, torch.Tensor):
            entries.append((name, var, value))
    # Globals are read by name at each call: the module's dict is handed over,
    # for the names that hold a tensor now.
    module_globals = getattr(fn, "__globals__", None) or {}
    for var in code.co_names:
        if isinstance(module_globals.get(var), torch.Tensor):
            entries.append((name, var, module_globals))
    return entries


def refresh(op: KernelSide) -> None:
    """Hands the C++ check what the op's function, fwd and vmap rule close over now."""
    entries = [e for fn in (op._init_fn, op._ab.vjp_fwd, op._vmap_fn) for e in _closure_of(fn)]
    op._ab.registration.set_closure(tuple(entries))
