"""register_vjp's ``fwd`` returns what the op returns: its output checked against the op's fake kernel.

NOTE [fwd returns what the op returns]
fwd runs instead of the op's function only when something is differentiated,
so an fwd whose output differs from the function's (another dtype, a shape
with an extra dim) would change the op's result exactly then: silently. Every
call of fwd that stands for the op (``_vjp.run_fwd``: the backend kernel, the
batched composite, the per-example loop, setup_context under a register_vmap
rule or the fake kernel, Inductor's decomposition) compares its output's
structure, shapes, dtypes and devices with the op's fake kernel's
(register_fake's, else the function's) on the same inputs: torch's own
statement of what the op returns. The fake kernel runs outside every functorch
level, autograd and dispatch mode, on meta copies of the inputs (where it
cannot, as a fake kernel that asks torch.library.get_ctx() for a dynamic size,
on fake copies in a FakeTensorMode of its own: the first one a process makes
costs ~1 s). It runs, and fwd's output is compared, once per input metadata
and values (the key, built in C++ by the call of fwd, ``Registration.run_fwd``);
the op caches the key as checked (a fact about the key: no per-call state)
in its C++ state, where a later call finds it (~0.1 us), or, for arguments
C++ has no encoding for (nested tensors, tensor subclasses), in a dict of
Python keys; register_vjp and register_fake clear both (``forget_checks``).
fwd's output metadata is taken to be a function of its inputs' metadata and
values, as the fake kernel's is, as JAX checks a ``custom_vjp``'s fwd once
per trace. An output on the
meta device has no device to compare. Symbolic sizes (a dynamic-shape trace)
are not a key: the fake kernel then runs in the trace's fake mode on every
call, and only a size that differs for certain is an error. A fake kernel
that cannot run on these inputs (it leaves torch) leaves only the structure
checked (``_vjp.run_fwd``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

if TYPE_CHECKING:
    from ._custom_op import CustomOpDef

__all__ = ["check_fwd_output", "forget_checks", "fwd_name"]

_CACHE_SIZE = 256  # keys per op; a full cache starts again
_CHECKED = True  # the value of a key whose call was checked


class _TensorMeta(NamedTuple):
    """What the check compares of an output tensor."""

    shape: tuple[Any, ...]  # ints; SymInts in a dynamic-shape trace
    dtype: torch.dtype
    device: Optional[torch.device]  # None: computed on the meta device, not compared


def fwd_name(op: CustomOpDef) -> str:
    """How errors name the op's register_vjp ``fwd``."""
    fwd = op._ab.vjp_fwd
    return getattr(fwd, "__qualname__", None) or repr(fwd)


def check_fwd_output(
    op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any], outs: tuple[Any, ...], *, keyed: bool
) -> None:
    """Raises if ``outs`` (fwd's output, one value per return) is not what the op returns for these inputs.

    Called where C++ found the arguments' key not checked yet (``keyed``: it
    records the key when this returns) or had no key for them (then the
    Python key, in ``op._ab.vjp_checked``).
    """
    key: Any = None
    if not keyed:
        # The fake kernel's output is a function of the key alone, whatever
        # the tensors are: real, batched, fake with static sizes.
        arguments = args + tuple(kwargs.values()) if kwargs else args  # kwargs: in schema order
        try:
            key = _key(arguments)
            if op._ab.vjp_checked.get(key) is _CHECKED:
                return
        except TypeError:  # a symbolic size, or a value that cannot be hashed: not cached
            key = None
    expected = _run_fake_kernel(op, args, kwargs)
    if expected is None or _matches(outs, expected):
        if key is not None:
            cache = op._ab.vjp_checked
            if len(cache) >= _CACHE_SIZE:
                cache.clear()
            cache[key] = _CHECKED
        return
    raise TypeError(
        f"torch_autobatch: the fwd of {op._qualname} ({fwd_name(op)}) must return the op's output as its "
        f"function does (fwd runs instead of it when the op is differentiated), but on these inputs fwd "
        f"returned {_describe(_meta(outs))} and the op returns {_describe(expected)} (its fake kernel: "
        f"register_fake's function, else the op's own function on meta or fake tensors). Make fwd's output match."
    )


def forget_checks(op: CustomOpDef) -> None:
    """fwd's output is checked anew on every key: a new fwd, or a new fake kernel."""
    op._ab.vjp_checked.clear()
    op._ab.registration.forget_fwd_checks()


def _key(value: Any) -> Any:
    """The key for arguments C++ has no encoding for (raises TypeError if unhashable)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.layout)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple([_key(v) for v in value]))
    if isinstance(value, dict):
        return (dict, tuple([(k, _key(v)) for k, v in value.items()]))
    return (type(value), value)


def _run_fake_kernel(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[list[Any]]:
    fake_kernel = op._abstract_fn if op._abstract_fn is not None else op._init_fn
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    # Symbolic sizes belong to the trace's shape environment: its fake mode.
    traced = any(type(d) is not int for t in tensors for d in t.shape)

    def run(device: Optional[str]) -> Any:
        def empty_like(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device=device or t.device, layout=t.layout)

        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, empty_like, (args, kwargs))
        out = fake_kernel(*fake_args, **fake_kwargs)
        return _meta((out,) if op._ab.num_returns == 1 else tuple(out))

    with torch._C._DisableFuncTorch(), torch.no_grad(), _disable_current_modes():
        if not traced:
            try:
                return run("meta")
            except Exception:  # noqa: S110  (then in a fake mode, below)
                pass
        if traced:
            mode = torch._guards.detect_fake_mode()
        else:
            from torch._subclasses.fake_tensor import FakeTensorMode  # NOTE [Lazy heavy imports]

            mode = FakeTensorMode(allow_non_fake_inputs=True)
        if mode is None:
            return None
        try:
            with mode:
                return run(None)
        except Exception:  # it cannot run here: NOTE [fwd returns what the op returns]
            return None


def _meta(value: Any) -> Any:
    """``value`` with each tensor replaced by its _TensorMeta, each sequence by a list, anything else by its type."""
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        device = None if value.device.type == "meta" else value.device
        return _TensorMeta(shape, value.dtype, device)
    if isinstance(value, (tuple, list)):
        return [_meta(v) for v in value]
    return type(value)


def _matches(got: Any, want: Any) -> bool:
    """Is ``got`` an output of metadata ``want`` (one structure; tensors of one dtype, device and shape)?"""
    if type(want) is _TensorMeta:
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype:
            return False
        if want.device is not None and got.device != want.device:
            return False
        shape = got.shape
        if len(shape) != len(want.shape):
            return False
        if all(type(d) is int for d in shape) and all(type(d) is int for d in want.shape):
            return shape == want.shape
        # Symbolic sizes: a trace, which imported symbolic_shapes already (NOTE [Lazy heavy imports]).
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return not any(statically_known_true(a != b) for a, b in zip(shape, want.shape))
    if type(want) is list:
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(map(_matches, got, want))
    return not isinstance(got, (torch.Tensor, tuple, list))


def _describe(meta: list[Any]) -> str:
    def one(m: Any) -> str:
        if type(m) is _TensorMeta:
            device = "" if m.device is None else f", device={m.device}"
            return f"Tensor(shape={list(m.shape)}, dtype={m.dtype}{device})"
        if type(m) is list:
            return "[" + ", ".join(one(v) for v in m) + "]"
        return str(m.__name__)

    return one(meta[0]) if len(meta) == 1 else "(" + ", ".join(one(v) for v in meta) + ")"
