"""``vmap="expand_dims"`` / ``"broadcast_all"``: opaque kernels batched by one call per vmap level.

NOTE [vmap presets: the calling convention]
Most custom ops wrap a kernel the dispatcher cannot see into (numpy, a C++
or CUDA kernel, another ``torch.library`` op), so their function cannot run
once on BatchedTensors; yet most such kernels accept leading batch dims. A
preset (JAX's ``vmap_method`` of ``pure_callback`` / ``ffi_call``) says how to
put the batch there, and the op's function is then called **once per vmap
level** with plain tensors:

- forward (:func:`run_forward`, the op's batching rule: the batched kernel
  runs it as it runs a ``register_vmap`` rule, ``VmapMode.rule``): at the
  level being batched, a batched tensor argument has its batch dim moved to
  the front; an unbatched tensor argument gets a new leading dim of size 1
  (``"expand_dims"``), or of the batch size, an expanded view
  (``"broadcast_all"``). The op is then called one level down on those
  tensors, so where nothing else is batched it reaches its kernel at once;
  under nested vmap, each level batched by an argument does the same in
  turn, innermost first: the kernel gets one leading dim per such level,
  the outermost vmap's first (the levels are stacked, not folded), each of
  its batch size or 1. Every tensor output must come back with a leading
  dim of the batch size, or 1 meaning "the same for every example"
  (returned unbatched at that level); anything else is an error naming the
  op and the preset (:func:`check_output`), never a silently wrong shape.
  The fake kernel (``register_fake``, used by ``torch.compile`` and
  ``torch.export``) gets the same arguments, so it follows the convention
  by itself. Under a graph tracer the op reaches the trace once per vmap
  level (the preset is one call of the op itself, so the trace keeps it:
  ``KernelSide._dissolves_in_trace``).
- backward (:func:`call_backward`, called by ``KernelSide._run_backward``)
  and jvp (:func:`call_jvp`): the grad node has re-entered the forward's
  vmap levels (NOTE [Re-entering the vmap levels], csrc/vmap_frames.h), and
  under ``vmap(grad)`` the outer vmap is still on the stack; the saved
  tensors and the gradients are functorch wrappers. They are peeled: every
  vmap level that batches one of them becomes a leading dim (one per level,
  outermost first, batch size or 1 / expanded, as in the forward), and the
  TensorWrapper of the node's own grad level (the level being
  differentiated, which torch.func's first derivative never differentiates
  again; but see ``create_graph`` below) and of levels that have exited is
  dropped. The user's function is called
  once, with those plain tensors as ``ctx.saved_tensors`` and gradients
  (``register_vjp``'s residuals are rebuilt from them); each returned
  gradient must have the same leading dims (B or 1), and is wrapped back:
  batched at each level whose dim is B, unbatched where 1, and at the
  node's own grad level. Where grad mode is off (a ``.backward()``
  without ``create_graph``) the tensors are also detached, so ``.numpy()``
  works on a saved leaf. A live AD level other than the node's own (a
  second derivative: ``grad(grad(op))``, ``jacfwd(jacrev(op))``) is kept:
  the tensors below it reach the function wrapped, as they do without a
  preset, so a backward made of torch ops is differentiated again and an
  opaque one fails loudly rather than giving zeros. So is the node's own
  level when grad mode is on and the running backward keeps its graph
  (``_C._graph_task_keeps_graph``: ``torch.autograd.grad(..., create_graph=True)``
  inside a torch.func transform, whose result that same level may
  differentiate again; torch.func's own backward keeps none, and
  ``vjp``'s and ``jacrev``'s pullback runs once the level has exited).
  A kept level stays on the stack while the function runs, and so does
  every level below it: those are not peeled from any argument (a
  register_vjp residual batched at a vmap level below it included), so
  the function then sees every argument as it would without a preset.
  The same for the jvp, whose own level is the forward-mode level its
  tangents belong to; and for register_vjp's ``fwd`` (NOTE [Residuals
  under a preset]).
- The batch consistency of the op's outputs (NOTE [An output is batched
  wherever an input is], csrc/batched_kernel.cpp) is the batched kernel's,
  after the rule: an output returned unbatched (leading 1) is still given
  its batch dim before grad nodes are attached.
- Random draws: NOTE [A preset's draws follow vmap's randomness] (vmap/_preset_draws.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch._C import _functorch as _ft
from torch._C._functorch import TransformType
from torch.utils import _pytree as pytree

from .. import _C
from ..core._levels import Popped, restore
from ._preset_draws import _DIFFERENT, _ERROR, _SAME, Draws

if TYPE_CHECKING:
    from ..core._types import KernelSide

# Not in torch's type stubs.
_is_dead: Callable[[torch.Tensor], bool] = getattr(_ft, "is_dead_tensor_wrapper")  # noqa: B009

__all__ = [
    "PRESETS",
    "VMAP_MODES",
    "call_backward",
    "call_jvp",
    "is_preset",
    "normalize",
    "run_forward",
    "vjp_residuals",
]

#: The presets: the op's function is called once per vmap level (NOTE [vmap presets: the calling convention]).
PRESETS = ("expand_dims", "broadcast_all")
#: Every accepted value of ``vmap=`` (``"sequential"`` is a spelling of ``"loop"``).
VMAP_MODES = ("auto", "loop", "sequential", *PRESETS)


def normalize(where: str, vmap: Any) -> str:
    """``vmap=`` checked and in its canonical spelling: ``"auto"``, ``"loop"``, or a preset.

    ``where`` names the call for the error, e.g. ``"torch_autobatch.custom_op('ns::f')"``.
    """
    if isinstance(vmap, str):
        if vmap == "sequential":
            return "loop"
        if vmap in VMAP_MODES:
            return vmap
    raise ValueError(
        f"{where}: vmap must be 'auto' (run the function once on batched tensors), 'loop' or "
        f"'sequential' (once per example), 'expand_dims' or 'broadcast_all' (an opaque kernel called "
        f"once with the batch in a leading dim); got {vmap!r}."
    )


def is_preset(vmap: str) -> bool:
    return vmap in PRESETS


# ------------------------------------------------------------------ forward
# An op's values are flat: a Tensor (or None, a scalar), or a list of them
# (Tensor[], Tensor?[]); mapping over them needs no pytree (each call costs
# microseconds on this path, which runs per call of vmap(op)).
def _map(fn: Callable[[torch.Tensor], Any], values: Sequence[Any]) -> list[Any]:
    return [
        fn(v)
        if isinstance(v, torch.Tensor)
        else [fn(e) if isinstance(e, torch.Tensor) else e for e in v]
        if isinstance(v, (list, tuple))
        else v
        for v in values
    ]


def _leaves(values: Sequence[Any]) -> list[Any]:
    return [e for v in values for e in (v if isinstance(v, (list, tuple)) else (v,))]


def run_forward(op: KernelSide, positional: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The op at the current vmap level, by its preset: one call one level down; one value per return."""
    preset = op._ab.vmap_preset
    assert preset is not None
    interpreter = _ft.peek_interpreter_stack()
    vmap_interpreter = _ft.CVmapInterpreterPtr(interpreter)
    level, batch_size = interpreter.level(), vmap_interpreter.batchSize()
    randomness = vmap_interpreter.randomness()  # NOTE [A preset's draws follow vmap's randomness]
    draws = None
    if randomness != _DIFFERENT:
        draws = Draws(randomness, _leaves((*positional, *kwargs.values()) if kwargs else positional))

    def front(t: torch.Tensor) -> torch.Tensor:
        t, bdim = _ft._unwrap_batched(t, level)
        if bdim is not None:
            return t if bdim == 0 else t.movedim(bdim, 0)
        t = t.unsqueeze(0)
        return t.expand(batch_size, *t.shape[1:]) if preset == "broadcast_all" else t

    popped = Popped()  # NOTE [Popping levels, interruptibly]
    try:
        popped.one()  # one level down (the interpreter's lower())
        args = _map(front, positional)
        kw = dict(zip(kwargs, _map(front, tuple(kwargs.values())))) if kwargs else kwargs
        out = op._opoverload(*args, **kw)
        outs = (out,) if op._ab.num_returns == 1 else tuple(out)
        index = iter(range(1 << 30))

        def rebuild(o: torch.Tensor) -> tuple[torch.Tensor, bool]:
            batched = check_output(op, "function", preset, next(index), o, (batch_size,))
            assert batched is not None
            return (o, True) if batched[0] else (o.squeeze(0), False)

        rebuilt = _map(rebuild, outs)
    finally:
        restore(popped.back)
    if draws is not None:
        draws.check(op, preset, "forward")

    def wrap(v: Any) -> Any:
        o, batched = v
        return _ft._add_batch_dim(o, 0, level) if batched else o

    return tuple(
        wrap(v) if type(v) is tuple else [wrap(e) if type(e) is tuple else e for e in v] if type(v) is list else v
        for v in rebuilt
    )


def check_output(
    op: KernelSide, what: str, preset: str, index: int, out: Any, batch_sizes: Sequence[Any]
) -> Optional[list[bool]]:
    """Which leading dims of a tensor ``out`` hold a batch (True) or are 1 (False); None for a non-tensor.

    Raises, naming the op and the preset, where a leading dim is neither
    (NOTE [vmap presets: the calling convention]).
    """
    if not isinstance(out, torch.Tensor):
        return None
    n = len(batch_sizes)
    if out.dim() < n:
        _wrong(op, what, preset, index, out, batch_sizes, f"has {out.dim()} dim(s)")
    batched = []
    for d, b in enumerate(batch_sizes):
        size = out.shape[d]
        # Only plain ints are compared (a symbolic size would add a guard);
        # a symbolic size is taken as the batch.
        if type(size) is not int or type(b) is not int or size == b:
            batched.append(True)
        elif size == 1:
            batched.append(False)
        else:
            _wrong(op, what, preset, index, out, batch_sizes, f"has size {size} in dim {d}")
    return batched


def _wrong(
    op: KernelSide, what: str, preset: str, index: int, out: torch.Tensor, batch_sizes: Sequence[Any], found: str
) -> None:
    if len(batch_sizes) == 1:
        dims, sizes = "a leading dim", f"size {batch_sizes[0]}"
    else:
        dims = f"{len(batch_sizes)} leading dims (one per vmap level, outermost first)"
        sizes = f"sizes ({', '.join(str(b) for b in batch_sizes)})"
    value = {"function": "output", "backward": "gradient", "jvp": "tangent", "fwd": "residual"}[what]
    fix = (
        f"use vmap='loop', or register a batching rule with {op._name}.register_vmap(rule)"
        if what == "function"
        else "use vmap='loop' or 'auto'"
    )
    raise RuntimeError(
        f"torch_autobatch: vmap of {op._qualname} with vmap={preset!r} calls its {what} once, with the "
        f"batch in {dims} of {sizes}, and expects every tensor it returns to keep {dims} of "
        f"that size, or 1 for a value that is the same for every example; the {value} it returned at "
        f"position {index} (tensors counted), of shape {tuple(out.shape)}, {found}. The {what} must treat "
        f"the leading dim(s) as a batch; one that ignores them or reduces over them cannot use this "
        f"preset: {fix}."
    )


# ------------------------------------------------------- backward and jvp
# How one tensor was wrapped: (level, bdim) for a BatchedTensor, (level,
# None) for a TensorWrapper, outermost (highest level) first.
Layers = list[tuple[int, Optional[int]]]

#: ``own_level`` for :func:`_peel`: every live AD level is peeled (register_vjp's fwd).
ALL_AD_LEVELS = -1


def _peel(t: torch.Tensor, own_level: Optional[int], floor: int = 0) -> tuple[torch.Tensor, Layers]:
    """``t`` without its functorch wrappers down to the first one kept (a live AD level not ``own_level``).

    A live level at or below ``floor`` is kept too (:meth:`_Call.peel`).
    """
    layers: Layers = []
    while _ft.is_functorch_wrapped_tensor(t):
        level = _ft.maybe_get_level(t)
        if _ft.is_gradtrackingtensor(t) and _is_dead(t):
            t = _ft.get_unwrapped(t)
        elif level <= floor:
            break
        elif _ft.is_batchedtensor(t):
            t, bdim = _ft._unwrap_batched(t, level)
            layers.append((level, bdim))
        elif _ft.is_gradtrackingtensor(t):
            if level == own_level or own_level == ALL_AD_LEVELS:
                t = _ft._unwrap_for_grad(t, level)
                layers.append((level, None))
            else:
                break
        else:  # a functionalize level: kept
            break
    return t, layers


class _Call:
    """One call of a user function under a preset: the peeled levels, and how to rebuild results.

    ``peel`` (on the stack), then ``physical`` and the call and ``rebuild``
    below the peeled levels (``pop`` ... ``restore(call.popped.back)``), then ``wrap`` (on the stack).
    """

    def __init__(self, op: KernelSide, preset: str, own_level: Optional[int]) -> None:
        self.op, self.preset, self.own_level = op, preset, own_level
        self.vmap_levels: list[int] = []  # batched in some argument, ascending (outermost first)
        self.batch_sizes: list[Any] = []
        self.grad_levels: list[int] = []  # TensorWrappers peeled (the own level)
        self.floor = 0  # the highest level kept on some argument: levels above it are popped
        self._peeled: list[tuple[Any, Optional[Layers]]] = []
        self.popped = Popped()  # ``pop`` inside a try, then ``finally: restore(call.popped.back)``

    def peel(self, leaves: Sequence[Any]) -> None:
        peeled: list[tuple[Any, Optional[Layers]]] = [
            _peel(t, self.own_level) if isinstance(t, torch.Tensor) else (t, None) for t in leaves
        ]
        for t, _ in peeled:
            if isinstance(t, torch.Tensor) and _ft.is_functorch_wrapped_tensor(t):
                self.floor = max(self.floor, _ft.maybe_get_level(t))
        if self.floor and any(lv < self.floor for _, layers in peeled if layers for lv, _ in layers):
            # A level kept on one argument stays on the stack while the
            # function runs, and so do the vmap levels below it: an argument
            # peeled below it is peeled again, only down to it (NOTE [vmap
            # presets: the calling convention]).
            peeled = [
                _peel(t, self.own_level, self.floor) if isinstance(t, torch.Tensor) else (t, None) for t in leaves
            ]
        self._peeled = peeled
        vmap_levels: set[int] = set()
        grad_levels: set[int] = set()
        for _, layers in peeled:
            if layers is None:
                continue
            for level, bdim in layers:
                (grad_levels if bdim is None else vmap_levels).add(level)
        self.vmap_levels = sorted(vmap_levels)
        self.grad_levels = sorted(grad_levels)
        if self.vmap_levels:
            sizes = {
                c.level(): _ft.CVmapInterpreterPtr(c).batchSize()
                for c in _ft.get_interpreter_stack()
                if c.key() == TransformType.Vmap
            }
            self.batch_sizes = [sizes[level] for level in self.vmap_levels]

    def draws(self, leaves: list[Any]) -> Optional[Draws]:
        """What the call must check of its draws, or None (NOTE [A preset's draws follow vmap's randomness]).

        ``"error"`` at any vmap level it runs below (above ``floor``); ``"same"``
        at a level whose batch is a leading dim of the call (``vmap_levels``).
        """
        strictest = _DIFFERENT
        for c in _ft.get_interpreter_stack() or ():
            if c.key() == TransformType.Vmap and c.level() > self.floor:
                randomness = _ft.CVmapInterpreterPtr(c).randomness()
                if randomness == _ERROR:
                    strictest = _ERROR
                    break
                if randomness == _SAME and c.level() in self.vmap_levels:
                    strictest = _SAME
        return None if strictest == _DIFFERENT else Draws(strictest, leaves)

    def pop(self) -> None:
        """Takes the levels above ``floor`` off the stack (``restore(self.popped.back)`` puts them back).

        Called inside the ``try`` whose ``finally`` restores (NOTE [Popping levels, interruptibly]).
        """
        self.popped.above(self.floor)

    def physical(self) -> list[Any]:
        """Each peeled tensor with one leading dim per vmap level (B, or 1 / expanded)."""
        return [t if layers is None or not self.vmap_levels else self._front(t, layers) for t, layers in self._peeled]

    def _front(self, t: torch.Tensor, layers: Layers) -> torch.Tensor:
        # Each bdim counts the dims of the tensor under its level: the
        # physical position of a level's dim, innermost (lowest) level first.
        taken: list[int] = []
        position: dict[int, int] = {}
        for level, bdim in reversed(layers):
            if bdim is None:
                continue
            free = [d for d in range(t.dim()) if d not in taken]
            position[level] = free[bdim]
            taken.append(free[bdim])
        order = [position[level] for level in self.vmap_levels if level in position]
        if order != list(range(len(order))):
            t = t.permute(*order, *[d for d in range(t.dim()) if d not in order])
        for i, level in enumerate(self.vmap_levels):
            if level in position:
                continue
            t = t.unsqueeze(i)
            if self.preset == "broadcast_all":
                shape = list(t.shape)
                shape[i] = self.batch_sizes[i]
                t = t.expand(shape)
        return t

    def rebuild(self, what: str, index: int, out: Any) -> tuple[Any, Optional[list[bool]]]:
        """A result of the user's function: checked, its size-1 dims dropped."""
        if not isinstance(out, torch.Tensor) or not self.vmap_levels:
            return out, None
        batched = check_output(self.op, what, self.preset, index, out, self.batch_sizes)
        assert batched is not None
        for d in reversed(range(len(batched))):
            if not batched[d]:
                out = out.squeeze(d)
        return out, batched

    def wrap(self, out: Any, batched: Optional[list[bool]], grad_levels: bool = True) -> Any:
        """``rebuild``'s result wrapped again at the peeled levels."""
        if not isinstance(out, torch.Tensor):
            return out
        levels = [(lv, True) for lv, b in zip(self.vmap_levels, batched or ()) if b]
        if grad_levels:
            levels += [(lv, False) for lv in self.grad_levels]
        for level, is_vmap in sorted(levels):
            out = _ft._add_batch_dim(out, 0, level) if is_vmap else _ft._wrap_for_grad(out, level)
        return out


def _run(
    op: KernelSide,
    what: str,
    own_level: Optional[int],
    fn: Callable[..., Any],
    ctx: Any,
    saved: Sequence[Any],
    args: Sequence[Any],
) -> Any:
    """``fn(ctx, *args)`` with ``ctx.saved_tensors == saved``, peeled and rebuilt by the op's preset."""
    preset = op._ab.vmap_preset
    assert preset is not None
    call = _Call(op, preset, own_level)
    n = len(saved)
    arg_leaves = [*saved, *_leaves(args)]
    call.peel(arg_leaves)
    draws = call.draws(arg_leaves)
    try:
        call.pop()
        physical = call.physical()
        if not torch.is_grad_enabled():
            # Nothing this call computes is recorded (a backward without
            # create_graph): a tensor that requires grad (a leaf saved for
            # .backward()) goes to the user's kernel detached, so .numpy() works.
            physical = [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in physical]
        it = iter(physical[n:])
        p_args = _map(lambda _: next(it), args)
        result = _C._call_with_saved_tensors(fn, ctx, tuple(physical[:n]), *p_args)
        single = not isinstance(result, tuple)
        results = (result,) if single else result
        index = iter(range(1 << 30))
        rebuilt = _map(lambda o: call.rebuild(what, next(index), o), results)
    finally:
        restore(call.popped.back)
    if draws is not None:
        draws.check(op, preset, what)

    def wrap(v: Any) -> Any:
        return call.wrap(*v) if type(v) is tuple else v

    out = [wrap(v) if type(v) is tuple else [wrap(e) for e in v] if type(v) is list else v for v in rebuilt]
    return out[0] if single else tuple(out)


# NOTE [Residuals under a preset]
# register_vjp's fwd is opaque too. When a kernel of ours asked for the
# residuals (the Autograd kernel under vmap(grad)), the op's kernel below
# the levels answered them from the preset's one call, so they have the
# call's leading dims: they are batched again here at the inputs' vmap
# levels. When nothing answered (grad(vmap(op)): the batched kernel ran the
# preset, with grad mode off), fwd runs now, once, on the inputs peeled by
# the preset. Either way each residual tensor must have the leading dims
# (B or 1) an output has; residuals are computed below autograd, so they are
# wrapped at the vmap levels only.
def vjp_residuals(op: KernelSide, inputs: tuple[Any, ...], answered: Optional[tuple[Any]]) -> Any:
    """register_vjp's residuals for its setup_context, by the op's preset (NOTE [Residuals under a preset]).

    ``answered``: what the op's kernel answered for the call (``fwd`` run
    there, on the arguments the preset made), or None.
    """
    preset = op._ab.vmap_preset
    assert preset is not None
    call = _Call(op, preset, ALL_AD_LEVELS)
    call.peel(_leaves(inputs))
    if answered is not None and not call.vmap_levels:
        return answered[0]
    # fwd's draws where it ran here; where the op's kernel answered, run_forward checked them.
    draws = call.draws(_leaves(inputs)) if answered is None else None
    try:
        call.pop()
        if answered is not None:
            (residuals,) = answered
        else:
            it = iter(call.physical())
            positional, kwargs = op._split_args(tuple(_map(lambda _: next(it), inputs)))
            with torch.no_grad():
                _, residuals = op._ab.registration.run_fwd(op._ab.vjp_fwd, positional, kwargs, True)  # _vjp.run_fwd
        leaves, spec = pytree.tree_flatten(residuals)
        rebuilt = [call.rebuild("fwd", i, r) for i, r in enumerate(leaves)]
    finally:
        restore(call.popped.back)
    if draws is not None:
        draws.check(op, preset, "fwd")
    return pytree.tree_unflatten([call.wrap(r, b, grad_levels=False) for r, b in rebuilt], spec)


def call_backward(op: KernelSide, backward: Callable[..., Any], ctx: Any, grads: tuple[Any, ...]) -> Any:
    """The user's backward (or register_vjp's), called once by the op's preset (NOTE [vmap presets: the calling convention])."""
    # The node's own grad level is peeled unless it may differentiate the
    # backward's result again: grad mode on and a backward that keeps its
    # graph (torch.autograd.grad(..., create_graph=True) inside torch.func).
    keeps = torch.is_grad_enabled() and _C._graph_task_keeps_graph()
    return _run(op, "backward", None if keeps else _C._backward_level(), backward, ctx, ctx.saved_tensors, grads)


def call_jvp(op: KernelSide, jvp: Callable[..., Any], ctx: Any, saved: Sequence[Any], tangents: tuple[Any, ...]) -> Any:
    """The user's jvp, called once by the op's preset (NOTE [vmap presets: the calling convention])."""
    return _run(op, "jvp", _tangent_level(tangents), jvp, ctx, saved, tangents)


def _tangent_level(tangents: tuple[Any, ...]) -> Optional[int]:
    """The forward-mode level a jvp runs for: that of the tangents' outermost live TensorWrapper."""
    own = None
    for t in pytree.tree_leaves(tangents):
        while isinstance(t, torch.Tensor) and _ft.is_functorch_wrapped_tensor(t):
            if _ft.is_gradtrackingtensor(t) and not _is_dead(t):
                level = _ft.maybe_get_level(t)
                own = level if own is None else max(own, level)
                break
            t = _ft.get_unwrapped(t)
    return own
