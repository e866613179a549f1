"""The oracles torch_autobatch's tests compare against, written once.

Three kinds of oracle, and the small helpers they need:

- **Derivative-scaled plain functions.** A test op registers a backward (or a
  jvp) that is deliberately k times the true derivative (k = 2, or 3 for a
  jvp), so that a transform which ignored the registered rule and
  differentiated the op's function instead is off by k. The oracle is the same
  math as a plain function whose derivative is k times the true one:
  :func:`twice` / :func:`thrice` / :func:`scale_derivative` on a value,
  :func:`twice_grad` / :func:`thrice_grad` / :func:`scaled_derivative_fn` on a
  function. Finite values are unchanged (an infinite one becomes NaN).
- **The same transform on the plain function.** :func:`check_same_as_plain`
  runs one transform on the op and on its plain oracle.
- **vmap equals a per-example loop.** :func:`vmap_loop` runs ``f`` once per
  example and stacks the results (:func:`stack_examples`), which is what
  ``vmap(f, in_dims, out_dims)`` must give; :func:`vmap_equals_loop` runs both.

Ops whose registered backward is k x the true one are made by
:func:`make_scaled_rule_op`; :func:`unique_op_name` gives a name no other test
in the process uses.

The comparing helpers return ``(actual, expected)`` and leave the comparison
to the caller, so that a test keeps its own assertion and tolerances::

    self.assertEqual(*vmap_equals_loop(f, (0, None), x, w))
    self.assertEqual(*check_same_as_plain(jacrev, op, twice_grad(plain), x), atol=0, rtol=0)

Import them as ``from oracles import ...`` (``test/`` is on ``sys.path`` when
pytest or ``python test/test_x.py`` runs a test file; ``conftest.py`` makes
sure of it and re-exports these names too).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch.utils._pytree import _broadcast_to_and_flatten, tree_flatten, tree_map, tree_unflatten

import torch_autobatch

__all__ = [
    "DTYPE",
    "InDims",
    "OutDims",
    "check_same_as_plain",
    "make_scaled_rule_op",
    "randn",
    "scale_derivative",
    "scaled_derivative_fn",
    "stack_examples",
    "thrice",
    "thrice_grad",
    "twice",
    "twice_grad",
    "unique_op_name",
    "vmap_equals_loop",
    "vmap_loop",
]

DTYPE = torch.float64

# vmap's in_dims/out_dims: an int or None for everything, or a pytree (a tuple
# for in_dims; for out_dims a tuple or list like the output) matching the
# inputs/outputs, whose int/None leaves apply to whole subtrees.
InDims = Union[int, None, tuple]
OutDims = Union[int, None, tuple, list]


# ----------------------------------------------- derivative-scaled functions
def scale_derivative(y: Any, k: float) -> Any:
    """``y`` with the same value and a derivative ``k`` times the true one.

    Forward and reverse derivatives both scale (``y.detach() + k * (y -
    y.detach())`` is linear in the tangent). Only floating (and complex)
    tensors are touched; anything else, integer tensors included, is returned
    as is.
    """
    if isinstance(y, torch.Tensor) and (y.is_floating_point() or y.is_complex()):
        return y.detach() + k * (y - y.detach())
    return y


def twice(y: Any) -> Any:
    """``y`` with a derivative 2x the true one (the oracle of a 2x backward)."""
    return scale_derivative(y, 2)


def thrice(y: Any) -> Any:
    """``y`` with a derivative 3x the true one (the oracle of a 3x jvp)."""
    return scale_derivative(y, 3)


def scaled_derivative_fn(f: Callable[..., Any], k: float, name: Optional[str] = None) -> Callable[..., Any]:
    """``f`` with the same values and every derivative of every floating output scaled by ``k``.

    Outputs may be any pytree (a tensor, a tuple or list of tensors, ...);
    non-floating leaves (integer outputs) pass through.
    """

    def oracle(*args: Any, **kwargs: Any) -> Any:
        return tree_map(lambda y: scale_derivative(y, k), f(*args, **kwargs))

    oracle.__name__ = name or f"scaled_derivative_fn({getattr(f, '__name__', 'f')}, {k})"
    return oracle


def twice_grad(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with the same values and every derivative doubled (per floating output)."""
    return scaled_derivative_fn(f, 2, name=f"twice_grad({getattr(f, '__name__', 'f')})")


def thrice_grad(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with the same values and every derivative tripled (per floating output)."""
    return scaled_derivative_fn(f, 3, name=f"thrice_grad({getattr(f, '__name__', 'f')})")


# ------------------------------------------ the same transform, op and plain
def check_same_as_plain(
    transform: Callable[[Callable[..., Any]], Callable[..., Any]],
    op: Callable[..., Any],
    plain: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``(transform(op)(*args, **kwargs), transform(plain)(*args, **kwargs))``.

    ``transform`` maps a function to a function, as torch.func's transforms do
    (``vmap``, ``jacrev``, ``lambda g: vmap(grad(g))``, ...), so that the op and
    its oracle go through literally the same transform. The op runs first.
    ``plain`` is usually a derivative-scaled oracle (:func:`twice_grad`) where
    the transform differentiates the op's registered rule.
    """
    return transform(op)(*args, **kwargs), transform(plain)(*args, **kwargs)


# --------------------------------------------------- vmap against a loop
def _flat_in_dims(in_dims: InDims, args: tuple[Any, ...]) -> tuple[list[Any], Any, list[Optional[int]]]:
    if not isinstance(in_dims, (int, tuple)) and in_dims is not None:
        raise ValueError(f"in_dims must be an int, None or a tuple, got {type(in_dims).__name__}")
    if not isinstance(in_dims, tuple):
        in_dims = (in_dims,) * len(args)
    flat_args, spec = tree_flatten(args)
    flat_dims = _broadcast_to_and_flatten(in_dims, spec)
    if flat_dims is None:
        raise ValueError(f"in_dims {in_dims} do not match the structure of the inputs {spec}")
    for a, d in zip(flat_args, flat_dims):
        if d is not None and not isinstance(a, torch.Tensor):
            raise ValueError(f"in_dim {d} for a {type(a).__name__} input: only tensors can be batched")
    return flat_args, spec, flat_dims


def _batch_size(flat_args: Sequence[Any], flat_dims: Sequence[Optional[int]]) -> int:
    sizes = {a.size(d) for a, d in zip(flat_args, flat_dims) if d is not None}
    if not sizes:
        raise ValueError("no input is batched: in_dims are all None")
    if len(sizes) > 1:
        raise ValueError(f"batched inputs of different sizes {sorted(sizes)}")
    return sizes.pop()


def stack_examples(outputs: Sequence[Any], out_dims: OutDims = 0) -> Any:
    """Per-example results stacked as vmap stacks its batch: leaf by leaf, along ``out_dims``.

    ``outputs`` are pytrees of one structure. A tensor leaf with an int
    out_dim is ``torch.stack``-ed along it. A leaf whose out_dim is None is
    not batched (as under vmap): every example must give the same value, which
    is returned once. A non-tensor leaf needs out_dim None, as for vmap.
    """
    if not outputs:
        raise ValueError("no examples to stack (a batch of size 0)")
    flats = [tree_flatten(o) for o in outputs]
    spec = flats[0][1]
    for _, s in flats[1:]:
        if s != spec:
            raise ValueError(f"examples returned different structures: {spec} and {s}")
    if isinstance(out_dims, int) or out_dims is None:
        flat_dims = [out_dims] * len(flats[0][0])
    else:
        flat_dims = _broadcast_to_and_flatten(out_dims, spec)
        if flat_dims is None:
            raise ValueError(f"out_dims {out_dims} do not match the structure of the outputs {spec}")
    stacked = []
    for j, d in enumerate(flat_dims):
        leaves = [flat[j] for flat, _ in flats]
        if d is None:
            first = leaves[0]
            same = (torch.equal(first, x) if isinstance(first, torch.Tensor) else first == x for x in leaves[1:])
            if not all(same):
                raise ValueError(f"output leaf {j} differs between examples but its out_dim is None")
            stacked.append(first)
        elif not isinstance(leaves[0], torch.Tensor):
            raise ValueError(f"output leaf {j} is a {type(leaves[0]).__name__}: only tensors can be batched")
        else:
            stacked.append(torch.stack(leaves, dim=d))
    return tree_unflatten(stacked, spec)


def vmap_loop(f: Callable[..., Any], in_dims: InDims, *args: Any, out_dims: OutDims = 0) -> Any:
    """What ``vmap(f, in_dims=in_dims, out_dims=out_dims)(*args)`` must equal, by a loop.

    ``f`` runs once per example, on each batched input's slice
    ``a.select(in_dim, i)`` (unbatched inputs, in_dim None, as they are), and
    the results are stacked by :func:`stack_examples`. ``in_dims`` is vmap's:
    an int or None for every input, or a tuple with one entry per input, each
    an int, None or a nested tuple matching that input (``((0, None), None)``
    for ``f((x, bias), scale)``). For functions without randomness: a loop
    cannot give vmap's ``randomness="same"``/``"different"`` draws.
    """
    flat_args, spec, flat_dims = _flat_in_dims(in_dims, args)
    outputs = []
    for i in range(_batch_size(flat_args, flat_dims)):
        example = [a if d is None else a.select(d, i) for a, d in zip(flat_args, flat_dims)]
        outputs.append(f(*tree_unflatten(example, spec)))
    return stack_examples(outputs, out_dims)


def vmap_equals_loop(
    f: Callable[..., Any], in_dims: InDims, *args: Any, out_dims: OutDims = 0, **vmap_kwargs: Any
) -> tuple[Any, Any]:
    """``(vmap(f, in_dims, out_dims, **vmap_kwargs)(*args), vmap_loop(f, in_dims, *args, out_dims))``.

    ``vmap_kwargs`` (e.g. ``chunk_size``) go to ``torch.func.vmap`` only.
    vmap runs first.
    """
    got = torch.func.vmap(f, in_dims=in_dims, out_dims=out_dims, **vmap_kwargs)(*args)
    return got, vmap_loop(f, in_dims, *args, out_dims=out_dims)


# ------------------------------------------------------------- test ops
_OP_COUNTER = itertools.count()


def unique_op_name(namespace: str = "tab_oracles", stem: str = "op") -> str:
    """``"namespace::stemN"`` with an N no other call in this process got, whatever the namespace.

    For tests that define ops in a loop or per parametrization: one counter
    for the whole test process, so no two tests (or test files) clash.
    """
    return f"{namespace}::{stem}{next(_OP_COUNTER)}"


def make_scaled_rule_op(
    qualname: Optional[str],
    fn: Callable[..., torch.Tensor],
    derivative: Callable[..., torch.Tensor],
    *,
    scale: float = 2,
    save_for_backward: bool = False,
    define: Callable[..., Any] = torch_autobatch.custom_op,
    mutates_args: Any = (),
    **op_kwargs: Any,
) -> Any:
    """An op ``fn(x, *consts)`` whose registered backward is ``scale * g * derivative(x, *consts)``.

    ``fn`` is elementwise in its one tensor input ``x`` (the others are
    non-tensor constants, which get a None gradient), and ``derivative`` its
    true elementwise derivative, written in torch ops so that the backward can
    be differentiated again. With the default ``scale`` of 2 the registered
    backward is twice the true VJP: a transform that bypasses it is off by 2x,
    and the oracle is :func:`twice_grad` of the plain function.

    ``qualname`` None: a fresh :func:`unique_op_name`. ``x`` reaches the
    backward as ``ctx.x`` or, with ``save_for_backward=True``, through
    ``ctx.save_for_backward``. ``define`` is ``torch_autobatch.custom_op`` or
    ``torch.library.custom_op`` (a third-party op, to upgrade); ``op_kwargs``
    (``schema``, ``vmap``, ...) go to it. The closures keep no reference to the
    op, so it can be garbage collected like any other.
    """
    op = define(qualname or unique_op_name(), fn, mutates_args=mutates_args, **op_kwargs)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        if save_for_backward:
            ctx.save_for_backward(inputs[0])
        else:
            ctx.x = inputs[0]
        ctx.consts = tuple(inputs[1:])

    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x = ctx.saved_tensors[0] if save_for_backward else ctx.x
        gx = scale * g * derivative(x, *ctx.consts)
        return (gx, *[None] * len(ctx.consts)) if ctx.consts else gx

    op.register_autograd(backward, setup_context=setup_context)
    return op


# --------------------------------------------------------------- inputs
def randn(*shape: int, dtype: torch.dtype = DTYPE, seed: Optional[int] = None) -> torch.Tensor:
    """``torch.randn(*shape)`` in float64 (by default), from the global generator or, given ``seed``, its own."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=generator)
