"""``vmap(op)`` in a graph trace: one node, the op's vmapped companion.

NOTE [One node for vmap(op) in a trace]
Under a graph tracer that keeps the op (NOTE [A trace keeps the op],
csrc/vmap_loop.h), the batched kernel calls, once and one vmap level down,
the op's **vmapped companion** (:func:`companion`), a torch_autobatch op
defined on first use:

- name: ``ns::_vmapped_<name>`` next to ``ns::name`` (the leading
  ``_vmapped_`` is reserved: defining it for another op is an error naming
  both); under nested vmap the companion's own companion,
  ``ns::_vmapped__vmapped_<name>``, one per nesting depth, not per batch size;
- schema: the op's arguments, all positional and without defaults, the
  tensors **physical** (the batch dim of the level moved to 0 where
  batched), then ``int[] _in_dims<d>`` (0 or -1 per tensor, schema order,
  a Tensor[] element by element, a None counting nothing) and
  ``str _randomness<d>`` (the level's); its returns are the op's, batched
  at dim 0 (``d`` is the nesting depth, so the names stay distinct). The
  batch size is not an argument: a batched tensor carries it, symbolic or
  not;
- function (and fake kernel): ``torch.vmap(op, in_dims, randomness=...)``
  on those tensors (its steps, without its argument checks: :func:`_vmapped`;
  under a mode, with functorch's keys let through: NOTE [A companion's
  function runs vmap below a mode]), so running the graph runs the op's
  batched kernel once (its composite, rule or loop, as its vmap mode says)
  and ``randomness="same"`` draws as eagerly;
- backward: ``torch.func.grad`` of that same vmapped call against the
  gradients (the pullback, run while its level is live): the op's
  **registered** backward, batched; jvp: ``torch.func.jvp`` of it (under
  ``torch.autograd.forward_ad``, dual tensors at the caller's level): the
  registered jvp, batched. Both recompute the forward (the op's residuals
  are BatchedTensors of a call that is gone; a node of a traced graph keeps
  only what the graph passes it), so a traced program's backward costs one
  more forward of the op. An op that draws random numbers draws the same
  numbers there: the random state before the forward is kept with the node
  and put back around the recompute (as torch.utils.checkpoint does), a
  forward that makes the grad node runs the code the recompute runs (NOTE
  [A differentiated companion's forward runs what its backward
  recomputes]), and a recompute that drew otherwise is an error (NOTE [A
  companion draws what its forward drew]): the derivative is the forward's
  draws', never another draw's.

While the companion's function or rules run, the op (and any op) under vmap
below a tracer dissolves into its composite (:func:`inside_rules`): the
companion's backward traced into a joint graph is aten ops (the op's
registered backward among them), never the companion again.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._C import _functorch as _ft
from torch.autograd import forward_ad as _forward_ad
from torch.utils import _pytree as pytree

from .. import _C
from ..core._levels import Popped, restore
from ._traced_draws import (
    _composite,
    _differ,
    _random_state,
    _redrawn,
    _rng_after,
    _same_draws,
    _same_rng,
    _tracing,
    _watch_draws,
)

if TYPE_CHECKING:
    from ..core._types import KernelSide

__all__ = ["companion", "companion_name", "inside_rules", "run"]

PREFIX = "_vmapped_"
_RANDOMNESS = {
    _ft.RandomnessType.Error: "error",
    _ft.RandomnessType.Same: "same",
    _ft.RandomnessType.Different: "different",
}
_lock = threading.Lock()
_state = threading.local()


def inside_rules() -> bool:
    """Is a companion's function or rule running on this thread (the op then dissolves in a trace)?"""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _running_rules() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


# NOTE [A companion's function runs vmap below a mode]
# A graph tracer's mode (and fake mode) runs an op's kernel from its
# __torch_dispatch__, where every key above Python is excluded: torch.vmap
# in the companion's function would push a level that no op can reach (its
# tensors' batched key excluded). The keys are functorch's only, whose
# levels the function's own vmap pushes and pops; they are let through for
# its call, the rest of the caller's key set kept.
_FUNCTORCH_KEYS = tuple(
    getattr(torch._C.DispatchKey, k)
    for k in (
        "FuncTorchDynamicLayerFrontMode",
        "FuncTorchDynamicLayerBackMode",
        "FuncTorchBatched",
        "FuncTorchVmapMode",
        "FuncTorchGradWrapper",
    )
)

_FUNCTORCH_MASK = functools.reduce(
    lambda ks, k: ks.add(k), _FUNCTORCH_KEYS[1:], torch._C.DispatchKeySet(_FUNCTORCH_KEYS[0])
).raw_repr()


def _functorch_guard() -> Any:
    """A guard letting functorch's keys through, or None where none is excluded."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not excluded.raw_repr() & _FUNCTORCH_MASK:
        return None
    for k in _FUNCTORCH_KEYS:
        excluded = excluded.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def companion_name(op: KernelSide) -> str:
    namespace, name = op._qualname.split("::")
    return f"{namespace}::{PREFIX}{name}"


# ------------------------------------------------------------ the schema
def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _schema(op: KernelSide) -> str:
    """The companion's schema (NOTE [One node for vmap(op) in a trace])."""
    schema = op._opoverload._schema
    text = str(schema)
    opening = text.index("(")
    depth = 0
    for i in range(opening, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            break
    arguments = [a.split("=", 1)[0].strip() for a in _split_top(text[opening + 1 : i]) if a != "*"]
    d = sum(a.name.startswith("_in_dims") for a in schema.arguments)
    returns = text[i + 1 :].split("->", 1)[1].strip()
    return f"({', '.join([*arguments, f'int[] _in_dims{d}', f'str _randomness{d}'])}) -> {returns}"


# ------------------------------------------------------- the companion
def companion(op: KernelSide) -> Any:
    """The op's vmapped companion (a CustomOpDef), defined on first use."""
    found = op._ab.vmapped_companion
    if found is not None:
        return found
    with _lock:
        if op._ab.vmapped_companion is None:
            op._ab.vmapped_companion = _define(op)
    return op._ab.vmapped_companion


def _define(op: KernelSide) -> Any:
    qualname = companion_name(op)
    namespace, name = qualname.split("::")
    if torch._C._dispatch_has_kernel(qualname) or hasattr(getattr(torch.ops, namespace), name):
        raise RuntimeError(
            f"torch_autobatch: vmap of {op._qualname} under a graph tracer records one call of its vmapped "
            f"companion {qualname}, but an operator of that name exists already. Op names starting with "
            f"{PREFIX!r} are reserved for companions: rename that operator."
        )
    n = len(op._opoverload._schema.arguments)

    def function(*args: Any) -> Any:
        # Plain code, no context managers: this runs on every call of a graph.
        # NOTE [A companion's function runs vmap below a mode]
        _state.depth = getattr(_state, "depth", 0) + 1
        # NOTE [A companion draws what its forward drew]: the state before the forward
        rng = _random_state(args) if args[n + 1] != "error" or not _composite(op) else None
        if _forward_ad._current_level >= 0:  # NOTE [A companion's function sees no dual tensors]
            args = _without_tangents(n, args)
        try:
            guard = _functorch_guard()
            if guard is None:
                return _forward(made, op, n, args, rng)
            with guard:
                return _forward(made, op, n, args, rng)
        finally:
            _state.depth -= 1
            # read by this call's setup_contexts (_save), which run next; set
            # after the call, so a companion the call ran inside cannot replace it
            _state.rng = rng

    function.__name__ = function.__qualname__ = f"{PREFIX}{op._name}"
    # Our CustomOpDef (type(op)): a companion is an op like any other.
    made: Any = type(op)(namespace, name, _schema(op), function, None)  # type: ignore[call-arg]
    made._companion_of = op
    made.register_autograd(
        lambda ctx, *grads: _backward(op, n, ctx, grads),
        setup_context=lambda ctx, inputs, output: _save_for_backward(op, ctx, inputs),
    )
    made.register_jvp(
        lambda ctx, *tangents: _jvp(op, n, ctx, tangents),
        setup_context=lambda ctx, inputs, output: _save(ctx, inputs, output),
    )
    # NOTE [A differentiated companion's forward runs what its backward
    # recomputes]: our Autograd kernel asks the function for residuals where
    # it makes a node; _forward answers with vmap(op)'s output and none:
    # nothing for register_vjp's output check to compare.
    made._ab.vjp_fwd_is_function = True
    made._ab.registration.set_has_vjp(True)
    return made


_SAVED = object()  # a saved tensor's place among ctx.leaves


def _save(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """The jvp's setup_context: the inputs, the forward's random state and its output (for :func:`_differ`)."""
    ctx.random_state = getattr(_state, "rng", None)  # the backward's setup_context, next, takes it too
    leaves, spec = pytree.tree_flatten(list(inputs))
    ctx.save_for_backward(*[t for t in leaves if isinstance(t, torch.Tensor)])
    ctx.leaves = [_SAVED if isinstance(t, torch.Tensor) else t for t in leaves]
    ctx.spec = spec
    ctx.output = output


def _inputs(ctx: Any) -> list[Any]:
    it = iter(ctx.saved_tensors)
    return pytree.tree_unflatten([next(it) if v is _SAVED else v for v in ctx.leaves], ctx.spec)


# NOTE [A differentiated companion's forward runs what its backward recomputes]
# The companion's backward recomputes the forward (a pullback cannot be
# kept: the op's backward may read tensors it kept on ctx, which die with
# the grad level it ran at) from the forward's random state: right only if
# the recompute runs the code that drew in the forward. The recompute runs
# vmap(op) as a differentiated call, where a register_vjp op runs its fwd
# (and a loop op its function per example, at the grad level); a forward
# below autograd runs the op's function, which may draw otherwise (another
# number of draws, another order). So where the forward can have drawn
# (ctx.random_state) and our Autograd kernel makes the companion's grad node,
# the forward is that differentiated call too: the companion takes
# register_vjp's residual request (NOTE [Residuals of register_vjp],
# csrc/op_state.h: the one signal, below autograd, that a node is being
# made), and its function runs ``torch.func.vjp`` of the vmapped call on the
# inputs detached (the node carries their history; the pullback is dropped).
# The recompute repeats it on the inputs detached and unwrapped from the AD
# levels (:func:`_untracked`), so no node in it finds an input tracked
# beyond it and runs fwd again. Only a backward that is itself
# differentiated (``_VjpCall.residuals`` is None: the question an op's node
# asks, NOTE [Second derivatives through residuals] in op/_vjp.py, answered the
# same way) recomputes on the inputs as saved, so its result is tracked;
# an op's fwd then runs again there, and draws anew: NOTE [A companion draws
# what its forward drew] makes that an error. A forward that cannot draw,
# or whose op has no fwd (its differentiated call runs its function below
# autograd, as the plain call does), stays plain: that differentiated
# forward cost a small random op's forward + backward ~25%.
class _Mark:
    """A residual that is not an input: ``_VjpCall`` then answers whether the backward is differentiated."""

    tensor = torch.empty(0)  # made once, at import: never traced, never in a compile fingerprint


# NOTE [A companion's function sees no dual tensors]
# Our Autograd kernel runs the function below autograd on the arguments as
# given: under torch.autograd.forward_ad, dual tensors, whose tangents the
# op's own kernel would then find inside the vmap, below autograd, and fail
# on (an INTERNAL ASSERT of _fw_primal). The companion's tangents are its
# jvp's (_jvp), so the function runs on the primals: a detach below
# autograd aliases the data without the tangent.
def _without_tangents(n: int, args: tuple[Any, ...]) -> tuple[Any, ...]:
    def primal(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.detach()
        return [primal(e) for e in a] if isinstance(a, (list, tuple)) and _is_tensors(a) else a

    return (*[primal(a) for a in args[:n]], *args[n:])


def _forward(made: Any, op: KernelSide, n: int, args: tuple[Any, ...], rng: Any) -> Any:
    """The companion's function: ``vmap(op)``, differentiated where its grad node is being made and it can draw."""
    if rng is not None and _runs_fwd(op):
        answered = made._ab.registration.answer_residual_request(_differentiated, (op, n, args), {})
        if answered is not None:
            return answered[0]
    return _vmapped(op, n, args)


def _runs_fwd(op: KernelSide) -> bool:
    """Does a differentiated call of the op run other code than its function (register_vjp's fwd)?"""
    inner = getattr(op, "_companion_of", None)
    return _runs_fwd(inner) if inner is not None else op._ab.vjp_fwd is not None


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _differentiated(op: KernelSide, n: int, args: tuple[Any, ...]) -> tuple[Any, None]:
    """(vmap(op) as a differentiated call, no residuals): the residual request's answer."""
    from torch._subclasses.fake_tensor import FakeTensor

    fn, leaves, where = _as_fn(op, n, list(args))
    if not where or any(isinstance(t, FakeTensor) for t in leaves):  # fake: nothing draws
        return _vmapped(op, n, args), None

    def split(*diff: Any) -> tuple[list[Any], Any]:
        out = fn(*diff)
        return [o for o in pytree.tree_leaves(out) if _differentiable(o)] or pytree.tree_leaves(out), out

    _, _, out = torch.func.vjp(split, *[leaves[i].detach() for i in where], has_aux=True)  # type: ignore[misc]
    return out, None


def _save_for_backward(op: KernelSide, ctx: Any, inputs: tuple[Any, ...]) -> None:
    """The backward's setup_context: the inputs, the random state before and after the forward."""
    state, _state.rng = getattr(_state, "rng", None), None
    ctx.random_state = state
    # NOTE [A companion draws what its forward drew]: where a recompute can draw otherwise, where it must end
    ctx.rng_after = None if state is None or not _runs_fwd(op) or _tracing() else _rng_after(state)
    saved, ctx.call = _C._vjp_save(tuple(inputs), (_Mark.tensor,))
    ctx.save_for_backward(*saved)


def _vmapped(op: KernelSide, n: int, args: tuple[Any, ...]) -> Any:
    """``torch.vmap(op)`` on the companion's arguments: the physical tensors, in_dims, randomness.

    torch.vmap's own steps (a level, the arguments batched at it, the op, the
    outputs unbatched at dim 0) without its argument checks and pytrees: the
    companion checked its arguments, and this runs on every call of a graph.
    """
    # A graph recorded before op was defined again: NOTE [A redefined op's old object is stale]
    if op._ab.gone is not None:
        raise RuntimeError(op._ab.gone)
    op_args, randomness = args[:n], args[n + 1]
    flat = iter(args[n])
    batch_size: Any = None  # an int or SymInt, from the first batched tensor
    pairs: list[Any] = []
    for a in op_args:
        if not _is_tensors(a):
            pairs.append((a, None))
            continue
        elements = a if isinstance(a, (list, tuple)) else (a,)
        dims = [next(flat) if isinstance(t, torch.Tensor) else -1 for t in elements]
        for t, d in zip(elements, dims):
            if d >= 0 and batch_size is None:
                batch_size = t.size(d)
        pairs.append((a, dims))
    depth = _ft.get_dynamic_layer_stack_depth()
    try:  # NOTE [Popping levels, interruptibly]: the push inside, the pop only of what was pushed
        level = _ft._vmap_increment_nesting(batch_size, randomness)

        def batched(a: Any, dims: Any) -> Any:
            if dims is None:
                return a
            if isinstance(a, torch.Tensor):
                return a if dims[0] < 0 else _ft._add_batch_dim(a, dims[0], level)
            return [t if d < 0 else _ft._add_batch_dim(t, d, level) for t, d in zip(a, dims)]

        positional, kwargs = op._split_args(tuple(batched(a, d) for a, d in pairs))
        out = op._opoverload(*positional, **kwargs)

        def unbatched(o: Any) -> Any:
            if isinstance(o, torch.Tensor):
                return _ft._remove_batch_dim(o, level, batch_size, 0)
            return type(o)(unbatched(e) for e in o) if isinstance(o, (list, tuple)) else o

        return unbatched(out)
    finally:  # one C call: pops (and undoes) the level if it was pushed, nothing else
        _ft.pop_dynamic_layer_stack_and_undo_to_depth(depth)


def _tensor_leaves(args: Sequence[Any]) -> list[Any]:
    """Each argument's tensor slots, in order: a Tensor, each element of a list of tensors (or Nones)."""
    return [e for a in args if _is_tensors(a) for e in (a if isinstance(a, (list, tuple)) else (a,))]


def _is_tensors(a: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return any(isinstance(e, torch.Tensor) for e in a)
    return isinstance(a, torch.Tensor)


def _per_arg(args: Sequence[Any], leaves: Sequence[Any]) -> list[Any]:
    """``leaves`` (as :func:`_tensor_leaves` lists them) put back per argument; None for the others."""
    it = iter(leaves)
    return [
        (list(itertools.islice(it, len(a))) if isinstance(a, (list, tuple)) else next(it)) if _is_tensors(a) else None
        for a in args
    ]


def _as_fn(op: KernelSide, n: int, args: list[Any]) -> tuple[Callable[..., Any], list[Any], list[int]]:
    """The vmapped call as a function of its differentiable tensors (their positions in the leaves)."""
    leaves = _tensor_leaves(args[:n])
    where = [
        i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]

    def fn(*diff: Any) -> Any:
        new = list(leaves)
        for i, t in zip(where, diff):
            new[i] = t
        rebuilt = [b if _is_tensors(a) else a for a, b in zip(args[:n], _per_arg(args[:n], new))]
        return _vmapped(op, n, (*rebuilt, *args[n:]))

    return fn, leaves, where


def _backward(op: KernelSide, n: int, ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """The op's registered backward, batched (NOTE [One node for vmap(op) in a trace])."""
    saved = ctx.saved_tensors
    args = list(ctx.call.inputs(saved))
    fn, leaves, where = _as_fn(op, n, args)
    flat_grads = [e for g in grads for e in (g if isinstance(g, (list, tuple)) else (g,))]
    result: list[Any] = [None] * len(leaves)
    if where and any(g is not None for g in flat_grads):
        # NOTE [A differentiated companion's forward runs what its backward recomputes]
        differentiated = ctx.call.residuals(saved) is None
        state, after = ctx.random_state, ctx.rng_after

        def loss(*diff: Any) -> torch.Tensor:
            # The pullback of cotangent g is the gradient of Re(<g, out>),
            # taken while the grad level is live: the op's backward may read
            # tensors it kept on ctx, which die with the level.
            terms = [
                ((o * g.conj()).real if o.is_complex() else o * g).sum()
                for o, g in zip(pytree.tree_leaves(fn(*diff)), flat_grads)
                if g is not None
            ]
            return functools.reduce(torch.add, terms)

        primals = [leaves[i] if differentiated else _untracked(leaves[i]) for i in where]
        with _running_rules(), _same_draws(state), _watch_draws(op, ctx, "backward"):
            got = torch.func.grad(loss, argnums=tuple(range(len(where))))(*primals)
            # NOTE [A companion draws what its forward drew]
            if after is not None and not _same_rng(_rng_after(state), after):
                raise _redrawn(op, "backward")
        for i, g in zip(where, got):
            result[i] = g
    return (*_per_arg(args[:n], result), None, None)


def _untracked(t: Any) -> Any:
    """An input as the recompute of a backward nothing differentiates takes it: detached, the AD levels' wrappers off.

    No node of the recompute then finds it tracked beyond its level, so
    none runs register_vjp's fwd again (NOTE [Second derivatives through
    residuals]: an input wrapped at an outer level counts as tracked). A
    BatchedTensor stays: its vmap level is the backward's own.
    """
    t = t.detach()
    while _ft.is_gradtrackingtensor(t):
        t = _ft.get_unwrapped(t)
    return t


def _jvp(op: KernelSide, n: int, ctx: Any, tangents: tuple[Any, ...]) -> Any:
    """The op's registered jvp, batched (NOTE [One node for vmap(op) in a trace])."""
    from torch._functorch import eager_transforms

    args = _inputs(ctx)
    fn, leaves, where = _as_fn(op, n, args)
    flat: list[Any] = []
    for a, t in zip(args[:n], tangents[:n]):
        if _is_tensors(a):
            flat += (
                list(t) if isinstance(t, (list, tuple)) else [None] * len(a) if isinstance(a, (list, tuple)) else [t]
            )
    state = ctx.random_state
    with _running_rules(), _same_draws(state), _watch_draws(op, ctx, "jvp"):
        tangent_in = tuple(torch.zeros_like(leaves[i]) if flat[i] is None else flat[i] for i in where)
        primals = tuple(leaves[i] for i in where)
        if _forward_ad._current_level >= 0 and eager_transforms.JVP_NESTING == 0:
            # Dual tensors (torch.autograd.forward_ad): torch.func.jvp cannot
            # open a second dual level; the caller's is there to use.
            out = fn(*[_forward_ad.make_dual(p, t) for p, t in zip(primals, tangent_in)])
            unpacked = [_forward_ad.unpack_dual(o) for o in pytree.tree_leaves(out)]
            primal_out = [u.primal for u in unpacked]
            tangent_out = pytree.tree_unflatten(
                [u.tangent if u.tangent is not None else torch.zeros_like(u.primal) for u in unpacked],
                pytree.tree_structure(out),
            )
        else:
            out, tangent_out = torch.func.jvp(fn, primals, tangent_in)  # type: ignore[misc]
            primal_out = pytree.tree_leaves(out)
        # NOTE [A companion draws what its forward drew]
        if (
            state is not None
            and _runs_fwd(op)
            and not _tracing()
            and _differ(primal_out, pytree.tree_leaves(ctx.output))
        ):
            raise _redrawn(op, "jvp")
    return tangent_out


# ---------------------------------------------------- the batched kernel
def run(op: KernelSide, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """vmap of ``op`` at the current level as one call of its companion; one value per return."""
    made = companion(op)
    interpreter = _ft.peek_interpreter_stack()
    level = interpreter.level()
    randomness = _RANDOMNESS[_ft.CVmapInterpreterPtr(interpreter).randomness()]
    in_dims: list[int] = []

    def physical(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t, bdim = _ft._unwrap_batched(v, level)
            in_dims.append(-1 if bdim is None else 0)
            return t if not bdim else t.movedim(bdim, 0)
        if isinstance(v, (list, tuple)):
            return [physical(e) for e in v]
        return v

    phys = [physical(a) for a in args]
    popped = Popped()  # NOTE [Popping levels, interruptibly]
    try:
        popped.one()  # one level down (the interpreter's lower())
        out = made._opoverload(*phys, in_dims, randomness)
    finally:
        restore(popped.back)
    outs = (out,) if op._ab.num_returns == 1 else tuple(out)

    def wrap(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return _ft._add_batch_dim(v, 0, level)
        return [wrap(e) for e in v] if isinstance(v, (list, tuple)) else v

    return tuple(wrap(v) for v in outs)
