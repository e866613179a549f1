"""Random draws of a traced ``vmap(op)``'s companion: the forward's kept, a recompute's watched.

NOTE [One node for vmap(op) in a trace] (vmap/_traced.py) is the companion;
this module keeps what makes its derivatives belong to the forward's draws.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._C import _functorch as _ft
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from ..core._types import KernelSide

__all__ = ["TracedDrawError"]


# NOTE [A companion draws what its forward drew]
# The companion's backward and jvp recompute the forward; for an op that draws
# random numbers, they must draw what it drew, so the random state before the
# forward is kept with the node and put back around the recompute. That is
# right only where the recompute runs the code that drew in the forward (NOTE
# [A differentiated companion's forward runs what its backward recomputes]),
# and where nothing draws again. Not so: a jvp recompute under which a
# register_vjp op runs fwd (drawing otherwise than the function that computed
# the primal), an op's fwd run again in a backward whose inputs stay tracked
# (NOTE [Second derivatives through residuals], op/_vjp.py: create_graph=True,
# an outer AD level, a loop op's examples). So, run eagerly, a backward
# checks that the generators end where the forward left them (their states
# after the forward are kept with the node), and a jvp that its recomputed
# primal is the forward's output; else TracedDrawError, naming the op. Both
# only for an op with a register_vjp fwd, the one code that runs in a
# differentiated call and not in a plain one (a backward of such an op that
# draws random numbers itself fails the check too). A traced
# recompute is watched instead (NOTE [A traced recompute cannot replay
# draws]). Reading the state (the CPU generator's and each input device's)
# is most of a small companion's own cost per call, so it is skipped where
# the forward cannot have drawn: under randomness="error" functorch refuses
# every random op of a composite run on BatchedTensors. A loop, a vmap preset
# or a register_vmap rule runs below the level, where functorch does not see
# a draw: those keep it.
def _composite(op: KernelSide) -> bool:
    """Does the op's batched kernel run its function on BatchedTensors (where functorch checks randomness)?

    A companion's function is vmap of its op: composite where that op is (nested vmap).
    """
    inner = getattr(op, "_companion_of", None)
    if inner is not None:
        return _composite(inner)
    return not op._ab.vmap_loop and op._ab.vmap_preset is None and op._vmap_fn is None


def _random_state(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The random state a call starts from: the CPU generator's and the inputs' devices' (checkpoint's helpers)."""
    from torch.utils.checkpoint import get_device_states

    return (torch.get_rng_state(), *get_device_states(*args))


def _rng_after(state: Any) -> Any:
    """The generators' states now, for those ``state`` (a :func:`_random_state`) holds."""
    from torch.utils.checkpoint import DefaultDeviceType, _get_device_module

    _, devices, _ = state
    device_states = []
    if devices:
        module: Any = _get_device_module(DefaultDeviceType.get_device_type())
        for d in devices:
            with module.device(d):
                device_states.append(module.get_rng_state())
    return torch.get_rng_state(), device_states


def _same_rng(a: Any, b: Any) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@contextlib.contextmanager
def _same_draws(state: Any) -> Iterator[None]:
    """The forward's random state for a recompute, the caller's restored after it."""
    if state is None:
        yield
        return
    from torch.utils.checkpoint import set_device_states

    cpu, devices, device_states = state
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        set_device_states(devices, device_states)
        yield


# NOTE [A traced recompute cannot replay draws]
# The companion's backward and jvp recompute the op's forward with the
# forward's random state put back (NOTE [A companion draws what its forward
# drew]): right where they run eagerly, as when a traced vmap(op) is
# differentiated by autograd. Traced themselves (make_fx of vjp(vmap(op)),
# AOTAutograd's joint graph for a vmap="loop" op), the recompute's draws are
# graph ops that draw anew each time the graph runs, while the state put back
# is the one at trace time: the backward would silently differentiate other
# draws than the forward's. So while a graph tracer records, a recompute is
# watched, and one that draws is an error naming the op and what works
# instead. A draw is an aten op tagged nondeterministic_seeded, seen where
# the op's function runs on BatchedTensors, or, where the op itself reaches
# the tracer (a loop records it once per example), in one probe run of its
# function on those (fake) arguments, off the graph; a function that cannot
# run on them (it leaves torch) draws nothing torch replays.
class TracedDrawError(RuntimeError):
    """A backward traced into a graph would recompute a random op's draws (NOTE [A traced recompute cannot replay draws]).

    Raised while tracing, naming the op; its own class, so the batched kernel
    passes it on unchanged. Trace ``vmap(op)`` alone and differentiate the
    traced program instead, compile with Inductor, or pass the random
    numbers to the op as an argument.

    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> @torch_autobatch.custom_op("doc_draws::dropout", mutates_args=())
    ... def dropout(x: torch.Tensor) -> torch.Tensor:
    ...     return x * (torch.rand_like(x) > 0.5)
    >>> def backward(ctx, g):
    ...     return g * ctx.kept
    >>> _ = dropout.register_autograd(backward, setup_context=lambda ctx, inputs, out: setattr(ctx, "kept", out != 0))
    >>> program = torch.vmap(dropout, randomness="different")
    >>> try:
    ...     make_fx(lambda x: torch.func.vjp(program, x)[1](torch.ones_like(x)))(torch.ones(4, 3))
    ... except torch_autobatch.TracedDrawError as e:
    ...     print(str(e)[:72])
    torch_autobatch: doc_draws::dropout draws random numbers (aten.rand_like
    """


class _Draws(TorchDispatchMode):
    """Notes the first random draw (an op tagged nondeterministic_seeded) below it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.seen is None and torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = func
        return func(*args, **(kwargs or {}))


class _DrawWatch(TorchDispatchMode):
    """Raises at the first random draw of a traced recompute (NOTE [A traced recompute cannot replay draws])."""

    def __init__(self, op: KernelSide, rule: str) -> None:
        super().__init__()
        self.op, self.rule = op, rule

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        drawn = func if torch.Tag.nondeterministic_seeded in func.tags else None
        if drawn is None and func is self.op._opoverload:
            drawn = _probe(self.op, args, kwargs)
        if drawn is not None:
            raise TracedDrawError(
                f"torch_autobatch: {self.op._qualname} draws random numbers ({drawn}) under vmap, and its {self.rule} "
                "is being traced into a graph (make_fx or torch.export of a transform that differentiates vmap(op), "
                f'or AOTAutograd (torch.compile, aot_function) for a vmap="loop" op). That traced {self.rule} '
                "recomputes the forward, whose draws would be new ones each time the graph runs: the derivative "
                "would belong to other draws than the forward's. Trace vmap(op) alone and differentiate the traced "
                'program (its backward replays the forward\'s draws), compile with backend="inductor", or draw the '
                "random numbers outside the op and pass them to it as an argument."
            )
        return func(*args, **kwargs)


def _probe(op: KernelSide, args: Any, kwargs: Any) -> Any:
    """The first draw of the op's function on these arguments, run off the graph; None if none (or it cannot run)."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    draws = _Draws()
    try:
        with disable_proxy_modes_tracing(), torch.no_grad(), draws:
            op._init_fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 (it leaves torch: no draw torch could replay)
        pass
    return draws.seen


def _watch_draws(op: KernelSide, ctx: Any, rule: str) -> Any:
    """A :class:`_DrawWatch` where a traced recompute could draw, else a no-op context."""
    tracing = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    return _DrawWatch(op, rule) if tracing and ctx.random_state is not None else contextlib.nullcontext()


def _tracing() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _differ(got: Sequence[Any], expected: Sequence[Any]) -> bool:
    """Do a recompute's outputs differ from the forward's (beyond rounding)?"""
    for a, b in zip(got, expected):
        if not isinstance(a, torch.Tensor):
            continue
        with torch.no_grad():  # isclose, from ops with batching rules (a BatchedTensor at re-entered levels)
            same = a == b
            if a.is_floating_point() or a.is_complex():
                same = same | ((a - b).abs() <= 1e-6 + 1e-5 * b.abs()) | (a.isnan() & b.isnan())
        while _ft.is_functorch_wrapped_tensor(same):  # the values, whatever levels wrap them
            same = _ft.get_unwrapped(same)
        if not bool(same.all()):
            return True
    return False


def _redrawn(op: KernelSide, rule: str) -> TracedDrawError:
    """An eager recompute drew otherwise than the forward (NOTE [A companion draws what its forward drew])."""
    return TracedDrawError(
        f"torch_autobatch: {op._qualname} draws random numbers under vmap, and the {rule} of its vmapped "
        f"companion (vmap(op) in a traced program) recomputed the forward and drew other numbers than the "
        f"forward drew: the op's register_vjp fwd draws otherwise than its function, or a fwd ran again in a "
        f"backward whose inputs stay tracked (create_graph=True, a transform outside it, a vmap='loop' op's "
        f"examples), or the {rule} draws itself. The derivative would belong to other draws than the "
        "forward's. Differentiate the traced program once, by reverse mode (torch.autograd.grad or .backward() "
        "without create_graph), or draw the random numbers outside the op and pass them to it as an argument."
    )
