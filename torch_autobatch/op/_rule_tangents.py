"""Tangents of an op under ``vmap(jvp(op))``, derived from its ``register_vmap`` rule.

NOTE [Derived tangents differentiate the vmap rule]
An op with a ``register_vmap`` rule and no registered jvp, under a Jvp level
whose level right below is a vmap level batching one of its arguments
(``vmap(jvp(op))``, dual tensors of ``jvp`` inside ``vmap``): its primal comes
from the rule (the Autograd kernel sends the op down to the batched kernel),
so its tangent must too. Derived from the function instead, the two disagree
wherever the rule is not the batched function, and ``jvp(vmap(op))``, which
differentiates the rule (the batched kernel runs it with forward AD on),
would give another pair (JAX: both orders differentiate the rule).

The rule runs at the vmap level, below the Jvp level, so forward AD at the
Jvp level cannot see through it. So the order is swapped: each argument's
primal and tangent are unwrapped from the Jvp level and then from the vmap
level (batch dims moved to the front, or expanded where only one of the two is
batched), wrapped again at the Jvp level only, and made dual there; the rule
then runs on these physical duals with the vmap level's ``info`` (batch size,
randomness), so forward AD of the Jvp level differentiates its torch ops; the
output tangents are batched at the vmap level by the rule's ``out_dims``.
Vmap levels between the two that batch no primal (``vmap(jacfwd(op))``:
jacfwd's basis vmap) keep their batch dims on the tangents, so the rule's
forward AD is batched over them as well. Where another kind of level sits
between (a ``grad``), the rule cannot be differentiated there: that is an
error naming the op and ``register_jvp``, never a tangent from the function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch._C import _functorch as _ft
from torch._C._functorch import TransformType
from torch._functorch.autograd_function import VmapInfo
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.utils import _pytree as pytree

from ..core._levels import Popped, restore
from ..vmap._check import checked_rule

if TYPE_CHECKING:
    from ._kernel_side import KernelSide


def rule_tangents(
    op: KernelSide, positional: tuple[Any, ...], kwargs: dict[str, Any]
) -> Optional[tuple[Optional[torch.Tensor], ...]]:
    """The output tangents from forward AD of the op's vmap rule, or None where the rule made no primal."""
    interpreters = retrieve_all_functorch_interpreters()
    if op._vmap_fn is None or len(interpreters) < 2 or interpreters[-1].key() != TransformType.Jvp:
        return None
    jvp_level = interpreters[-1].level()
    flat, spec = pytree.tree_flatten((positional, kwargs))
    pairs = [_below_jvp(a, jvp_level) for a in flat]
    # The rule ran at the first vmap level down that batches a primal; the
    # vmap levels above it (jacfwd's basis) may batch tangents only.
    between: list[int] = []
    for interpreter in reversed(interpreters[:-1]):
        if interpreter.key() != TransformType.Vmap:
            break
        if any(_batched_at(p, interpreter.level()) for p, _ in pairs):
            return _from_rule(op, pairs, spec, interpreter, between, jvp_level)
        between.append(interpreter.level())
    vmap_levels = [i.level() for i in interpreters[:-1] if i.key() == TransformType.Vmap]
    if any(_batched_below(p, vmap_levels) for p, _ in pairs):
        raise RuntimeError(
            f"torch_autobatch: forward-mode AD through {op._qualname}: its output comes from its "
            f"register_vmap rule at a vmap level below a {_kinds_between(interpreters)} level under the "
            f"forward-mode level, where the rule cannot be differentiated; a tangent from the op's "
            f"function instead could disagree with the rule. Register a jvp with "
            f"{op._name}.register_jvp(jvp) (it runs batched under vmap), or put vmap inside the other "
            f"transforms (jvp(vmap(op)) differentiates the rule)."
        )
    return None


def _kinds_between(interpreters: list[Any]) -> str:
    kinds = [i.key().name.lower() for i in interpreters[:-1] if i.key() != TransformType.Vmap]
    return kinds[-1] if kinds else "non-vmap"


def _from_rule(
    op: KernelSide, pairs: list[tuple[Any, Any]], spec: Any, vmap: Any, between: list[int], jvp_level: int
) -> tuple[Optional[torch.Tensor], ...]:
    level, batch_size = vmap.level(), vmap.batch_size()
    duals, in_dims = [], []
    for p, t in pairs:
        dual, in_dim = _physical_dual(op, p, t, level, batch_size, between, jvp_level)
        duals.append(dual)
        in_dims.append(in_dim)
    d_positional, d_kwargs = pytree.tree_unflatten(duals, spec)
    dims_positional, _ = pytree.tree_unflatten(in_dims, spec)
    info = VmapInfo(batch_size=batch_size, randomness=vmap.randomness())
    rule = op._vmap_fn
    assert rule is not None  # rule_tangents runs only for an op with a rule
    out, out_dims = checked_rule(op._qualname, rule, info, tuple(dims_positional), *d_positional, **d_kwargs)
    outs, out_spec = pytree.tree_flatten(out)
    dims = pytree._broadcast_to_and_flatten(out_dims, out_spec)
    assert dims is not None  # checked_rule checked the structure
    return tuple(_batched_tangent(o, d, level, between, jvp_level) for o, d in zip(outs, dims))


def _below_jvp(a: Any, jvp_level: int) -> tuple[Any, Optional[torch.Tensor]]:
    """An argument one level down: (primal, tangent or None)."""
    if not isinstance(a, torch.Tensor) or _ft.maybe_get_level(a) != jvp_level:
        return a, None
    primal, tangent = fwAD.unpack_dual(a)
    return _ft._unwrap_for_grad(primal, jvp_level), (
        None if tangent is None else _ft._unwrap_for_grad(tangent, jvp_level)
    )


def _batched_at(t: Any, level: int) -> bool:
    """Is ``t`` batched at vmap ``level`` (looking through the batch dims of levels above it)?"""
    while isinstance(t, torch.Tensor) and _ft.is_batchedtensor(t):
        if _ft.maybe_get_level(t) == level:
            return True
        if _ft.maybe_get_level(t) < level:
            return False
        t = _ft.get_unwrapped(t)
    return False


def _batched_below(t: Any, levels: list[int]) -> bool:
    """Is ``t`` batched at one of the vmap ``levels`` (looking through wrappers)?"""
    while isinstance(t, torch.Tensor) and _ft.is_functorch_wrapped_tensor(t):
        if _ft.is_batchedtensor(t) and _ft.maybe_get_level(t) in levels:
            return True
        t = _ft.get_unwrapped(t)
    return False


# A tensor's batch dims at some vmap levels, as (level, physical dim) from the
# innermost level out, and the physical tensor under them.
Layers = list[tuple[int, int]]


def _peel(t: torch.Tensor, levels: list[int]) -> tuple[torch.Tensor, Layers]:
    """``t`` without its BatchedTensors of ``levels`` (the outermost ones), with where their dims were."""
    outer_first = []
    while _ft.is_batchedtensor(t) and _ft.maybe_get_level(t) in levels:
        level = _ft.maybe_get_level(t)
        t, bdim = _ft._unwrap_batched(t, level)
        assert bdim is not None  # t was batched at this level
        outer_first.append((level, bdim))
    taken: list[int] = []
    layers = []
    for level, bdim in reversed(outer_first):  # each bdim counts the dims the inner levels left
        position = [d for d in range(t.dim()) if d not in taken][bdim]
        taken.append(position)
        layers.append((level, position))
    return t, layers


def _rebuild(t: torch.Tensor, layers: Layers) -> torch.Tensor:
    """``_peel`` undone: ``t`` batched again at each level of ``layers``, innermost first."""
    taken: list[int] = []
    for level, position in layers:
        t = _ft._add_batch_dim(t, position - sum(d < position for d in taken), level)
        taken.append(position)
    return t


def _front(t: torch.Tensor, level: int, batch_size: int, between: list[int]) -> torch.Tensor:
    """``t`` without its batch dim of vmap ``level``, which goes first in it (expanded if it has none).

    Its batch dims of the levels ``between`` (above ``level``) stay.
    """
    value, layers = _peel(t, [*between, level])
    here = [p for lv, p in layers if lv == level]
    rest = [(lv, p) for lv, p in layers if lv != level]
    # The levels from ``level`` up are off the stack for the view ops, and
    # restored on every exit, by one C call (NOTE [Popping levels,
    # interruptibly] in core/_levels.py: not a contextmanager, whose exit
    # runs Python before the restore).
    popped = Popped()
    try:
        popped.above(level - 1)
        if here:
            value = value.movedim(here[0], 0)
            rest = [(lv, p + 1 if p < here[0] else p) for lv, p in rest]
        else:
            value = value.unsqueeze(0).expand(batch_size, *value.shape)
            rest = [(lv, p + 1) for lv, p in rest]
    finally:
        restore(popped.back)
    return _rebuild(value, rest)


def _physical_dual(
    op: KernelSide, p: Any, t: Optional[torch.Tensor], level: int, batch_size: int, between: list[int], jvp_level: int
) -> tuple[Any, Any]:
    """The argument as the rule sees it, dual at the Jvp level; and its in_dim."""
    if not isinstance(p, torch.Tensor):
        return p, None
    batched = _batched_at(p, level) or (t is not None and _batched_at(t, level))
    value, tangent = p, t
    if batched:
        value, tangent = _front(p, level, batch_size, []), None if t is None else _front(t, level, batch_size, between)
    wrapped = _ft._wrap_for_grad(value, jvp_level)
    if tangent is not None:
        wrapped = fwAD.make_dual(wrapped, _ft._wrap_for_grad(tangent, jvp_level))
    return wrapped, (0 if batched else None)


def _batched_tangent(
    o: Any, out_dim: Optional[int], level: int, between: list[int], jvp_level: int
) -> Optional[torch.Tensor]:
    """An output's tangent from the rule, batched at the vmap level by its out_dim, at the Jvp level."""
    if not isinstance(o, torch.Tensor):
        return None
    tangent = fwAD.unpack_dual(o).tangent
    if tangent is None:
        return None
    value = _ft._unwrap_for_grad(tangent, jvp_level)
    if out_dim is not None:
        value, layers = _peel(value, between)
        taken = [p for _, p in layers]
        position = [d for d in range(value.dim()) if d not in taken][out_dim % (value.dim() - len(taken))]
        value = _rebuild(value, [(level, position), *layers])
    return _ft._wrap_for_grad(value, jvp_level)
