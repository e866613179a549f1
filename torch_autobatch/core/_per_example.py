"""A Python function run once per example of the vmap levels its arguments are batched at.

NOTE [Once per example, in Python]
Some user code cannot run on batched tensors (a register_vjp ``fwd`` that
leaves torch under vmap="loop"; a lifted Function's ``backward`` that uses
boolean-mask indexing, which vmap cannot batch). :func:`per_example` runs it
the way functorch's loop fallback runs an op: the arguments' torch.func
grad/jvp wrappers are peeled (it runs below autograd: first derivatives
only), and so are its BatchedTensors, every vmap level's batch dim moved to
the front (innermost level first); the function is called once per example
below every level (``_DisableFuncTorch``, so no level wraps what it makes),
recursively for the vmap levels outside, and each tensor of the results is
stacked, one leading dim per level, then batched at every level. Peeling
every level first keeps functorch out of the selects and stacks (a select
of a tensor still batched at an outer level, below every level, fails).
A Python value in the results must be the same for every example.

NOTE [Per-example draws follow vmap's randomness]
Run below every level, the function's random ops are plain draws, which
functorch never sees: each example would draw its own numbers whatever the
vmap asked. So each level's loop honours that level's ``randomness``, as the
plain function under the same vmap would (and as the C++ loop of
vmap="loop" ops does, csrc/vmap_loop.cpp): ``"different"`` draws anew per
example; ``"same"`` puts the random state of before the first example back
before each later one, so every example draws the first one's numbers;
``"error"`` (vmap's default) raises functorch's error, naming the function,
when any example drew. The random state is the CPU generator's and the
default generator's of each device the arguments are on (what
torch.utils.checkpoint keeps); a draw is seen as a change of that state,
read once before and once after the loop, so the usual no-draw path pays a
few microseconds per loop, not a dispatch mode per op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import RandomnessType, TransformType
from torch.utils import _pytree as pytree

__all__ = ["per_example"]


def _randomness(level: int) -> Any:
    """The ``randomness`` of vmap ``level`` (``Different`` where that level is not on the stack)."""
    functorch = torch._C._functorch
    for interpreter in functorch.get_interpreter_stack() or ():
        if interpreter.level() == level and interpreter.key() == TransformType.Vmap:
            return functorch.CVmapInterpreterPtr(interpreter).randomness()
    return RandomnessType.Different


class RandomState:
    """The CPU generator's state and the arguments' devices' (NOTE [Per-example draws follow vmap's randomness]).

    Read, compared and put back with no dispatch mode on: under a tracer's
    fake mode (torch.compile) the states are real tensors all the same.
    """

    def __init__(self, leaves: list[Any]) -> None:
        self.devices: list[Any] = []
        self.device_states: list[Any] = []
        with _no_modes():
            self.cpu = torch.get_rng_state()
            if any(isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta") for t in leaves):
                from torch.utils.checkpoint import get_device_states

                self.devices, self.device_states = get_device_states(*leaves)

    def restore(self) -> None:
        with _no_modes():
            torch.set_rng_state(self.cpu)
            if self.devices:
                from torch.utils.checkpoint import set_device_states

                set_device_states(self.devices, self.device_states)

    def changed(self, leaves: list[Any]) -> bool:
        now = RandomState(leaves)
        with _no_modes():
            return any(
                not torch.equal(a.cpu(), b.cpu())
                for a, b in zip((now.cpu, *now.device_states), (self.cpu, *self.device_states))
            )


def _no_modes() -> Any:
    if torch._C._len_torch_dispatch_stack():
        from torch.utils._python_dispatch import _disable_current_modes

        return _disable_current_modes()
    return contextlib.nullcontext()


class DrewUnderError(RuntimeError):
    """A per-example fallback drew random numbers under ``randomness="error"`` (functorch's message first)."""


def _drew_in_error_mode(what: str, level: int) -> RuntimeError:
    return DrewUnderError(
        "vmap: called random operation while in randomness error mode. Please either use the 'same' or "
        "'different' randomness flags on vmap or perform the randomness operation out of vmap. "
        f"torch_autobatch: {what} drew random numbers while it ran once per example of the vmap at level "
        f"{level} (vmap cannot batch it), and that vmap has randomness='error' (the default)."
    )


def _physical(t: Any) -> tuple[Any, dict[int, int]]:
    """``t`` without any functorch wrapper, and the physical dim of each vmap level batching it.

    Each BatchedTensor's bdim counts the dims of the tensor under it (its
    inner levels' dims taken out): turned into positions in the plain tensor.
    The grad/jvp wrappers go (it runs below autograd).
    """
    functorch = torch._C._functorch
    if not isinstance(t, torch.Tensor):
        return t, {}
    top_first = []
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            level = functorch.maybe_get_level(t)
            t, bdim = functorch._unwrap_batched(t, level)
            assert bdim is not None  # a BatchedTensor is batched at its level
            top_first.append((level, bdim))
        else:
            t = functorch.get_unwrapped(t)
    taken: list[int] = []
    positions = {}
    for level, bdim in reversed(top_first):  # the outermost level's bdim is a physical dim
        position = [d for d in range(t.dim()) if d not in taken][bdim]
        taken.append(position)
        positions[level] = position
    return t, positions


def per_example(fn: Callable[..., Any], args: tuple[Any, ...], what: str, *, leaves: bool = False) -> Any:
    """``fn(*args)`` once per example of the vmap levels its arguments are batched at, results stacked.

    ``what`` names ``fn`` in errors. With no batched argument it is ``fn(*args)`` on the peeled arguments.
    ``leaves=True``: ``fn`` is called with the list of ``args``' pytree leaves (one example's), which it
    rebuilds itself (a loop that would flatten them again saves a flatten and an unflatten per example).
    """
    flat, spec = pytree.tree_flatten(args)
    peeled = [_physical(t) for t in flat]
    levels = sorted({level for _, positions in peeled for level in positions}, reverse=True)  # innermost first
    call: Callable[[list[Any]], Any] = fn if leaves else lambda xs: fn(*pytree.tree_unflatten(xs, spec))
    if not levels:
        return call([t for t, _ in peeled])
    plain = [t for t, _ in peeled]
    with torch._C._DisableFuncTorch():  # each example runs below every level, as the loop runs it
        # Each tensor with one leading dim per level that batches it, innermost first.
        tensors: list[tuple[Any, list[int]]] = []
        sizes = {}
        for t, positions in peeled:
            mine = [level for level in levels if level in positions]
            order = [positions[level] for level in mine]
            if order and order != list(range(len(order))):
                t = t.permute(*order, *[d for d in range(t.dim()) if d not in order])
            for i, level in enumerate(mine):
                sizes[level] = t.shape[i]
            tensors.append((t, mine))
        out, out_spec = _loop(call, what, tensors, levels, [sizes[level] for level in levels], plain)
    # Tensors come back with one leading dim per level, innermost first: batched
    # at the outermost level first (its BatchedTensor is the one under the others).
    results = []
    for leaf in out:
        if isinstance(leaf, torch.Tensor):
            for i in reversed(range(len(levels))):
                leaf = torch._C._functorch._add_batch_dim(leaf, i, levels[i])
        results.append(leaf)
    return pytree.tree_unflatten(results, out_spec)


def _loop(
    fn: Callable[[list[Any]], Any],
    what: str,
    leaves: list[tuple[Any, list[int]]],
    levels: list[int],
    sizes: list[int],
    plain: list[Any],
) -> tuple[list[Any], Any]:
    """``fn`` per example of ``levels[0]``, recursively of the others; tensors stacked, one leading dim per level."""
    if not levels:
        return pytree.tree_flatten(fn([t for t, _ in leaves]))
    level, size = levels[0], sizes[0]
    randomness = _randomness(level)  # NOTE [Per-example draws follow vmap's randomness]
    state = None if randomness == RandomnessType.Different else RandomState(plain)
    examples = []
    for b in range(size):
        if b and randomness == RandomnessType.Same:
            state.restore()  # type: ignore[union-attr]  # set for Same
        example = [(t.select(0, b), mine[1:]) if mine and mine[0] == level else (t, mine) for t, mine in leaves]
        examples.append(_loop(fn, what, example, levels[1:], sizes[1:], plain))
    if randomness == RandomnessType.Error and state.changed(plain):  # type: ignore[union-attr]
        raise _drew_in_error_mode(what, level)
    first, out_spec = examples[0]
    if any(e[1] != out_spec for e in examples[1:]):
        raise RuntimeError(
            f"torch_autobatch: {what} returned results of different structures for the examples of a vmap."
        )
    out = []
    for j, leaf in enumerate(first):
        column = [e[0][j] for e in examples]
        if isinstance(leaf, torch.Tensor):
            out.append(torch.stack(column))
        elif any(v != leaf for v in column[1:]):
            raise RuntimeError(
                f"torch_autobatch: {what} returned a Python value ({type(leaf).__name__}) that differs between "
                f"the examples of a vmap; it must be a tensor or the same for every example."
            )
        else:
            out.append(leaf)
    return out, out_spec
