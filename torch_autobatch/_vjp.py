"""``register_vjp(fwd, bwd)``: a backward that receives the forward's intermediates.

NOTE [Residuals of register_vjp] (csrc/op_state.h) is the C++ half: a kernel
of ours that is about to make the op's grad node opens a thread-local request
for the call; whatever runs the op below it (the backend function wrapped
here, Inductor's decomposition) takes the request, runs ``fwd`` instead of
the function, and answers it with the residuals. The op's internal
``setup_context`` reads them back (where nothing answered, as under a
register_vmap rule or the fake kernel, it runs ``fwd`` for them), saves their tensors with
``save_for_backward`` (so they are version-checked, seen by
``saved_tensors_hooks``, batched per level under vmap, and freed with the
graph), and the internal backward rebuilds the residuals for ``bwd``.

NOTE [Second derivatives through residuals]
A residual computed by ``fwd`` (``t = tanh(x)``) is a function of the inputs,
but it was computed below autograd, so it has no history: differentiating
``bwd``'s result again through it would miss d(residual)/d(input) and be
silently wrong (autograd.Function's trap for intermediates saved in
``forward``). So when the backward runs with grad mode on (``create_graph=True``,
or a torch.func level) and an input is tracked by a differentiation outside
the node's own level (at the base: the input requires grad; under torch.func:
the input, one grad level down, is still tracked by a transform), it runs
``fwd`` again on the inputs it saved, recorded, and hands ``bwd`` those
residuals: the second derivative is ``bwd``'s derivative through ``fwd``, as
JAX's ``custom_vjp`` gives. First derivatives never pay for it; residuals that
are inputs themselves (``w`` passed through) carry their own history anyway.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from . import _C, _compile

if TYPE_CHECKING:
    from ._custom_op import CustomOpDef

__all__ = ["register", "take_request_and_run_fwd", "wrap_kernel"]


def _fwd_name(op: CustomOpDef) -> str:
    fwd = op._ab.vjp_fwd
    return getattr(fwd, "__qualname__", None) or repr(fwd)


def run_fwd(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any], *, check: bool = True) -> tuple[Any, Any]:
    """``fwd(*args, **kwargs)``, checked (NOTE [fwd returns what the op returns]): the op's output and the residuals."""
    assert op._ab.vjp_fwd is not None
    result = op._ab.vjp_fwd(*args, **kwargs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"torch_autobatch: the fwd of {op._qualname} ({_fwd_name(op)}) must return "
            f"(output, residuals), a tuple of two; it returned {type(result).__name__}"
            f"{'' if not isinstance(result, tuple) else f' of {len(result)}'}."
        )
    out, residuals = result
    n = op._ab.num_returns
    outs = (out,) if n == 1 else out
    if not isinstance(outs, tuple) or len(outs) != n:
        raise TypeError(
            f"torch_autobatch: the fwd of {op._qualname} ({_fwd_name(op)}) returned an output "
            f"of structure {pytree.tree_structure(out)}, but the op returns {n} value(s) "
            f"({op._opoverload._schema.returns}). Return them as the op's function does."
        )
    if check:
        _check_output(op, args, kwargs, outs)
    return out, residuals


# NOTE [fwd returns what the op returns]
# fwd runs instead of the op's function only when something is differentiated,
# so an fwd whose output differs from the function's (another dtype, a shape
# with an extra dim) would change the op's result exactly then: silently. Every
# call of fwd that stands for the op (run_fwd: the backend kernel, the batched
# composite, the per-example loop, setup_context under a register_vmap rule,
# Inductor's decomposition) compares its output's structure, shapes, dtypes
# and devices with the op's fake kernel's (register_fake's, else the function's)
# on the same inputs: torch's own statement of what the op returns. On real
# tensors the fake kernel runs on fake copies in a FakeTensorMode of its own,
# outside every functorch level, autograd and dispatch mode, once per input
# metadata (cached on the op: a pure function of the key, no per-call state);
# on traced tensors (torch.compile, export) it runs in the trace's fake mode,
# and only a size that differs for certain is an error. A fake kernel that
# cannot run on these inputs (it leaves torch) leaves only the structure
# checked.
_CACHE_SIZE = 256


def _check_output(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any], outs: tuple[Any, ...]) -> None:
    expected = _expected_output(op, args, kwargs)
    if expected is None or _matches(outs, expected):
        return
    raise TypeError(
        f"torch_autobatch: the fwd of {op._qualname} ({_fwd_name(op)}) must return the op's output as its "
        f"function does (fwd runs instead of it when the op is differentiated), but on these inputs fwd "
        f"returned {_describe(outs)} and the op returns {_describe(expected)} (its fake kernel: "
        f"register_fake's function, else the op's own function on fake tensors). Make fwd's output match."
    )


def _expected_output(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple[Any, ...]]:
    """The op's fake kernel's output for inputs like ``args``/``kwargs``, one value per return; None if unknown."""
    try:
        # The fake kernel's output is a function of this key alone (its
        # inputs' metadata and values), whatever the tensors are: real,
        # batched, fake with static sizes.
        key = (op._abstract_fn, _key(args), _key(kwargs) if kwargs else None)
        cache = op._ab.vjp_expected
        hit = cache.get(key, _MISSING)
    except TypeError:  # a symbolic size, or a value that cannot be hashed
        return _run_fake_kernel(op, args, kwargs)
    if hit is not _MISSING:
        return hit  # type: ignore[no-any-return]
    if len(cache) >= _CACHE_SIZE:
        cache.clear()
    cache[key] = expected = _run_fake_kernel(op, args, kwargs)
    return expected


_MISSING = object()


def _key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.layout)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _key(v)) for k, v in value.items()))
    return (type(value), value)


def _run_fake_kernel(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple[Any, ...]]:
    fake_kernel = op._abstract_fn if op._abstract_fn is not None else op._init_fn
    # Symbolic sizes belong to the trace's shape environment: its fake mode.
    traced = any(
        not isinstance(d, int) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for d in t.shape
    )
    fake_mode = torch._guards.detect_fake_mode() if traced else None
    with torch._C._DisableFuncTorch(), torch.no_grad(), _disable_current_modes():
        with fake_mode if fake_mode is not None else FakeTensorMode(allow_non_fake_inputs=True):

            def empty_like(t: torch.Tensor) -> torch.Tensor:
                return torch.empty(t.shape, dtype=t.dtype, device=t.device, layout=t.layout)

            try:
                fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, empty_like, (args, kwargs))
                out = fake_kernel(*fake_args, **fake_kwargs)
            except Exception:  # it cannot run here: NOTE [fwd returns what the op returns]
                return None
    return (out,) if op._ab.num_returns == 1 else tuple(out)


def _matches(got: Any, want: Any) -> bool:
    """Do ``got`` and ``want`` have one structure, and tensors of one dtype, device and shape (where sizes are known)?"""
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
            return False
        if got.dtype != want.dtype or got.device != want.device or got.dim() != want.dim():
            return False
        return got.shape == want.shape or not any(statically_known_true(a != b) for a, b in zip(got.shape, want.shape))
    if isinstance(got, (tuple, list)) or isinstance(want, (tuple, list)):
        if not (isinstance(got, (tuple, list)) and isinstance(want, (tuple, list))) or len(got) != len(want):
            return False
        return all(_matches(g, w) for g, w in zip(got, want))
    return True


def _describe(outs: tuple[Any, ...]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"Tensor(shape={list(v.shape)}, dtype={v.dtype}, device={v.device})"
        return type(v).__name__

    values = pytree.tree_map(one, outs)
    return str(values[0]) if len(values) == 1 else str(values)


def take_request_and_run_fwd(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fwd``'s output if a kernel asked for the op's residuals on this thread, else ``NotImplemented``."""
    reg = op._ab.registration
    if op._ab.vjp_fwd is None or reg is None or not reg.take_residual_request():
        return NotImplemented
    out, residuals = run_fwd(op, args, kwargs)
    reg.deliver_residuals(residuals)
    return out


def wrap_kernel(op: CustomOpDef, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as the op's backend kernel: ``fwd`` instead where residuals are asked for."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        out = take_request_and_run_fwd(op, args, kwargs)
        return fn(*args, **kwargs) if out is NotImplemented else out

    kernel.__qualname__ = getattr(fn, "__qualname__", "kernel")
    kernel.__name__ = getattr(fn, "__name__", "kernel")
    return kernel


def _below_levels(x: torch.Tensor) -> torch.Tensor:
    """``x`` without its functorch grad wrappers: the tensor the op's kernel below autograd saw."""
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(x):
        x = functorch.get_unwrapped(x)
    return x


def _setup_context(op: CustomOpDef) -> Callable[..., None]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        reg = op._ab.registration
        residuals = reg.current_residuals()
        if residuals is None:
            # The op's output came from elsewhere (a register_vmap rule, a
            # kernel registered by name): fwd runs now for its residuals.
            positional, kwargs = op._split_args(inputs)
            with torch.no_grad():
                _, residuals = run_fwd(op, positional, kwargs)
        leaves, spec = pytree.tree_flatten(residuals)
        inputs_record = _Flat.of(inputs)
        tensor_inputs = inputs_record.tensors
        # A residual that is an input (fwd saw it below the levels: unwrapped)
        # is saved as the input this level sees, so it keeps its history.
        as_input = {id(_below_levels(x)): x for x in tensor_inputs}
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        computed = False
        for i in at:
            if id(leaves[i]) in as_input:
                leaves[i] = as_input[id(leaves[i])]
            else:
                computed = True
        ctx.save_for_backward(*[leaves[i] for i in at], *tensor_inputs)
        ctx.vjp_record = (_Flat(spec, [None if i in at else leaf for i, leaf in enumerate(leaves)], at), computed)
        ctx.vjp_inputs = inputs_record.without_tensors()

    return setup_context


class _Flat(NamedTuple):
    """A pytree with its tensor leaves taken out (saved with ``save_for_backward``) and put back."""

    spec: pytree.TreeSpec
    leaves: list[Any]  # the leaves, None where a tensor was
    at: list[int]  # where the tensors were
    tensors: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def of(tree: Any) -> _Flat:
        leaves, spec = pytree.tree_flatten(tree)
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        return _Flat(spec, leaves, at, tuple(leaves[i] for i in at))

    def without_tensors(self) -> _Flat:
        return _Flat(self.spec, [None if i in self.at else v for i, v in enumerate(self.leaves)], self.at)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        values = list(self.leaves)
        for k, i in enumerate(self.at):
            values[i] = tensors[k]
        return pytree.tree_unflatten(values, self.spec)


def _tracked_outside(x: torch.Tensor, level: int) -> bool:
    """Is input ``x`` of a node of functorch ``level`` (0: the base) tracked by a differentiation outside it?

    NOTE [Second derivatives through residuals]. In the backward, ``x`` is a
    TensorWrapper of the node's level while that level is alive (its value,
    one level down, then tells), or already the outer level's tensor (the
    node's level has exited, as after ``vjp``); at the base, a tensor that
    requires grad under ``create_graph=True``.
    """
    functorch = torch._C._functorch
    while functorch.is_batchedtensor(x):
        x = functorch.get_unwrapped(x)
    if level > 0 and functorch.is_gradtrackingtensor(x) and functorch.maybe_get_level(x) >= level:
        x = functorch.get_unwrapped(x)
        while functorch.is_batchedtensor(x):
            x = functorch.get_unwrapped(x)
    return functorch.is_gradtrackingtensor(x) or x.requires_grad


def _backward(op: CustomOpDef) -> Callable[..., Any]:
    def backward(ctx: Any, *grads: Any) -> Any:
        record, computed = ctx.vjp_record
        saved = ctx.saved_tensors
        residual_tensors, inputs = saved[: len(record.at)], saved[len(record.at) :]
        level = _C._backward_level()
        if computed and torch.is_grad_enabled() and any(_tracked_outside(x, level) for x in inputs):
            residuals = _residuals_with_history(op, ctx.vjp_inputs.rebuild(inputs))
        else:
            residuals = record.rebuild(residual_tensors)
        assert op._ab.vjp_bwd is not None
        if op._ab.vjp_bwd_takes_needs_input_grad:
            return op._ab.vjp_bwd(residuals, *grads, needs_input_grad=ctx.needs_input_grad)
        return op._ab.vjp_bwd(residuals, *grads)

    return backward


def _residuals_with_history(op: CustomOpDef, inputs: tuple[Any, ...]) -> Any:
    """``fwd`` run again on the inputs this backward sees, recorded: residuals that are functions of them.

    NOTE [Second derivatives through residuals]: only when the backward is
    itself differentiated w.r.t. the inputs, so first derivatives never pay.
    """
    positional, kwargs = op._split_args(inputs)
    with torch.enable_grad():
        _, residuals = run_fwd(op, positional, kwargs, check=False)  # checked when it first ran
    return residuals


def register(op: CustomOpDef, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
    """``CustomOpDef.register_vjp``: checks, the rule, and the kernels wrapped to run ``fwd`` on request."""
    for what, f in (("fwd", fwd), ("bwd", bwd)):
        if not callable(f):
            raise TypeError(f"{op._qualname}.register_vjp: expected {what} to be callable, got {type(f).__name__}.")
    if op._backward_fn is not None and op._ab.vjp_fwd is None:
        raise RuntimeError(
            f"{op._qualname}.register_vjp: the op already has a backward from "
            f"register_autograd; an op takes one of register_autograd and register_vjp."
        )
    op._ab.vjp_bwd_takes_needs_input_grad = _takes_keyword(bwd, "needs_input_grad")
    if op._ab.vjp_fwd is not None:
        op._ab.vjp_fwd, op._ab.vjp_bwd = fwd, bwd  # kernels are wrapped already
        _compile.refresh_cache_key(op)
        return
    _install(op, fwd, bwd)
    for device_type, kernel in list(op._backend_fns.items()):
        torch._library.custom_ops.CustomOpDef.register_kernel(op, device_type, wrap_kernel(op, kernel))
    op._ab.registration.set_has_vjp(True)
    _compile.refresh_cache_key(op)


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Does ``fn`` declare a parameter ``name`` that can be passed by keyword?"""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


def _install(op: CustomOpDef, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
    """Makes ``fwd``/``bwd`` the op's reverse-mode rule (``CustomOpDef.register_vjp`` then wraps its kernels)."""
    op._ab.vjp_fwd, op._ab.vjp_bwd = fwd, bwd
    backward, setup_context = _backward(op), _setup_context(op)
    backward.__qualname__ = getattr(bwd, "__qualname__", "bwd")
    op._set_autograd_rule(backward, setup_context)
