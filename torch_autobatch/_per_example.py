"""A Python function run once per example of the vmap levels its arguments are batched at.

NOTE [Once per example, in Python]
Some user code cannot run on batched tensors (a register_vjp ``fwd`` that
leaves torch under vmap="loop"; a lifted Function's ``backward`` that uses
boolean-mask indexing, which vmap cannot batch). :func:`per_example` runs it
the way functorch's loop fallback runs an op: the arguments' torch.func
grad/jvp wrappers are peeled (it runs below autograd: first derivatives
only), the innermost vmap level's batch dims are moved to the front, the
function is called once per example below every level (``_DisableFuncTorch``,
so no level wraps what it makes), recursively for the vmap levels outside,
and each tensor of the results is stacked into one batched at that level.
A Python value in the results must be the same for every example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["per_example"]


def _peel(t: Any) -> Any:
    """``t`` without the torch.func grad/jvp wrappers around its vmap levels."""
    functorch = torch._C._functorch
    while (
        isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t) and not functorch.is_batchedtensor(t)
    ):
        t = functorch.get_unwrapped(t)
    return t


def per_example(fn: Callable[..., Any], args: tuple[Any, ...], what: str) -> Any:
    """``fn(*args)`` once per example of the innermost vmap level (recursively), results stacked.

    ``what`` names ``fn`` in errors. With no batched argument it is ``fn(*args)`` on the peeled arguments.
    """
    functorch = torch._C._functorch
    flat, spec = pytree.tree_flatten(args)
    flat = [_peel(t) for t in flat]
    levels = [
        functorch.maybe_get_level(t) for t in flat if isinstance(t, torch.Tensor) and functorch.is_batchedtensor(t)
    ]
    if not levels:
        return fn(*pytree.tree_unflatten(flat, spec))
    level = max(levels)  # the innermost vmap
    physical: list[Any] = []
    size = 0
    for t in flat:
        if isinstance(t, torch.Tensor) and functorch.is_batchedtensor(t) and functorch.maybe_get_level(t) == level:
            value, bdim = functorch._unwrap_batched(t, level)
            assert bdim is not None  # batched at this level
            value = value.movedim(bdim, 0)
            size = value.shape[0]
            physical.append((value, True))
        else:
            physical.append((t, False))
    examples = []
    with torch._C._DisableFuncTorch():  # each example runs below every level, as the loop runs it
        for b in range(size):
            example = pytree.tree_unflatten([v.select(0, b) if batched else v for v, batched in physical], spec)
            examples.append(pytree.tree_flatten(per_example(fn, example, what)))
    leaves, out_spec = examples[0]
    if any(e[1] != out_spec for e in examples[1:]):
        raise RuntimeError(
            f"torch_autobatch: {what} returned results of different structures for the examples of a vmap."
        )
    out = []
    for j, leaf in enumerate(leaves):
        column = [e[0][j] for e in examples]
        if isinstance(leaf, torch.Tensor):
            with torch._C._DisableFuncTorch():  # a plain stack: no level may wrap it
                stacked = torch.stack(column)
            out.append(functorch._add_batch_dim(stacked, 0, level))
        elif any(v != leaf for v in column[1:]):
            raise RuntimeError(
                f"torch_autobatch: {what} returned a Python value ({type(leaf).__name__}) that differs between "
                f"the examples of a vmap; it must be a tensor or the same for every example."
            )
        else:
            out.append(leaf)
    return pytree.tree_unflatten(out, out_spec)
