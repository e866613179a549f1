"""Activation checkpointing (``torch.utils.checkpoint``) of regions that call our ops.

NOTE [Selective checkpointing of register_vjp ops] (torch_autobatch/op/_sac.py):
selective activation checkpointing (SAC) that saves a register_vjp op
(``MUST_SAVE``/``PREFER_SAVE``) must not replay its ``fwd`` on recompute, and
its backward must still get ``fwd``'s residuals. Each op's backward is
deliberately 2x, so the gradient must be :func:`twice_grad` of the plain
function's; counters prove how often the op's forward ran on real data (the
function also runs on fake/meta tensors to check ``fwd``'s output, which is
not counted).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from oracles import DTYPE, make_scaled_rule_op, randn, twice_grad, unique_op_name
from torch._subclasses.fake_tensor import FakeTensor
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torch_autobatch

CALLS = {"fn": 0, "fwd": 0, "bwd": 0, "forward": 0}


def counts() -> dict[str, int]:
    out = dict(CALLS)
    for k in CALLS:
        CALLS[k] = 0
    return out


def _real(x: torch.Tensor) -> bool:
    return not (isinstance(x, FakeTensor) or x.is_meta)


def make_vjp_op() -> torch_autobatch.CustomOpDef:
    """``tanh``, whose ``fwd`` saves the input and ``1 - tanh(x)**2`` (not an input); ``bwd`` is 2x."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        CALLS["fn"] += _real(x)
        return torch.tanh(x)

    def fwd(x):
        CALLS["fwd"] += _real(x)
        t = torch.tanh(x)
        return t, (x, 1 - t * t, "a python value")

    def bwd(residuals, g):
        CALLS["bwd"] += 1
        x, d, value = residuals
        assert value == "a python value" and x.shape == d.shape
        return 2 * g * d

    op = torch_autobatch.custom_op(unique_op_name("tab_ckpt", "tanh"), fn, mutates_args=())
    op.register_vjp(fwd, bwd)
    return op


def make_autograd_op() -> torch_autobatch.CustomOpDef:
    """``tanh`` with a register_autograd backward 2x the true one (it saves the input)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        CALLS["fn"] += _real(x)
        return torch.tanh(x)

    return make_scaled_rule_op(None, fn, lambda x: 1 - torch.tanh(x) ** 2, save_for_backward=True)


class Exp2(torch.autograd.Function):
    """A legacy autograd.Function (``forward(ctx, x)``) that saves an intermediate; its backward is 2x."""

    @staticmethod
    def forward(ctx, x):
        CALLS["forward"] += _real(x)
        y = torch.exp(x)
        ctx.save_for_backward(y)  # an intermediate, not an input
        return y * 1.0

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return 2 * g * y


def region(op: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A checkpointed region: aten ops before and after the op (the op's input is recomputed)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(op(x * 1.5)).sum()

    return f


def sac(qualname: str, policy: CheckpointPolicy) -> Callable[[], Any]:
    """SAC's ``context_fn``: ``policy`` for the op (any overload), PREFER_RECOMPUTE for everything else."""

    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return policy if func.name().split(".")[0] == qualname else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy_fn)


class TestCheckpointing(TestCase):
    def setUp(self) -> None:
        super().setUp()
        counts()

    def grads(self, f: Callable[..., torch.Tensor], oracle: Callable[..., torch.Tensor], **ckpt: Any) -> None:
        """The gradient of ``f`` checkpointed (with ``ckpt``) is that of ``oracle`` unchecked."""
        x = randn(5, seed=0).requires_grad_()
        (actual,) = torch.autograd.grad(checkpoint(f, x, use_reentrant=False, **ckpt), x)
        xe = x.detach().requires_grad_()
        (expected,) = torch.autograd.grad(oracle(xe), xe)
        self.assertEqual(actual, expected)

    # ------------------------------------------------------------- register_vjp
    def check_vjp(self, policy: CheckpointPolicy | None, fwd_calls: int) -> None:
        op = make_vjp_op()
        ckpt = {} if policy is None else {"context_fn": sac(op._qualname, policy)}
        self.grads(region(op), region(twice_grad(torch.tanh)), **ckpt)
        self.assertEqual(counts(), {"fn": 0, "fwd": fwd_calls, "bwd": 1, "forward": 0})

    def test_vjp_plain_checkpoint(self) -> None:
        self.check_vjp(None, fwd_calls=2)  # the forward, then the recompute

    def test_vjp_sac_must_save(self) -> None:
        self.check_vjp(CheckpointPolicy.MUST_SAVE, fwd_calls=1)  # never replayed

    def test_vjp_sac_prefer_save(self) -> None:
        self.check_vjp(CheckpointPolicy.PREFER_SAVE, fwd_calls=1)

    def test_vjp_sac_prefer_recompute(self) -> None:
        self.check_vjp(CheckpointPolicy.PREFER_RECOMPUTE, fwd_calls=2)

    def test_vjp_sac_must_save_called_twice(self) -> None:
        # Two calls of the op in one region: each gets its own residuals back.
        op = make_vjp_op()

        def f(x: torch.Tensor, op: Callable[..., Any] = op) -> torch.Tensor:
            return (op(x * 1.5) * op(x - 0.5)).sum()

        self.grads(
            f, functools.partial(f, op=twice_grad(torch.tanh)), context_fn=sac(op._qualname, CheckpointPolicy.MUST_SAVE)
        )
        self.assertEqual(counts()["fwd"], 2)

    def test_vjp_sac_must_save_residual_mutated(self) -> None:
        # fwd's residual is a tensor it closes over; mutating it between the
        # forward and the backward is refused, as autograd refuses a mutated
        # saved tensor without checkpointing.
        scale = torch.ones(5, dtype=DTYPE)

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)

        op = torch_autobatch.custom_op(unique_op_name("tab_ckpt", "closure_res"), fn, mutates_args=())
        op.register_vjp(lambda x: (torch.tanh(x), (x, scale)), lambda r, g: g * (1 - torch.tanh(r[0]) ** 2) * r[1])
        for ckpt in (None, sac(op._qualname, CheckpointPolicy.MUST_SAVE)):
            x = randn(5, seed=0).requires_grad_()
            out = region(op)(x) if ckpt is None else checkpoint(region(op), x, use_reentrant=False, context_fn=ckpt)
            scale.add_(1)
            with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation|mutated in place"):
                out.backward()

    def test_vjp_sac_must_save_compiled(self) -> None:
        # Under torch.compile SAC is applied by the partitioner to the traced
        # graph, in which setup_context's fwd is recorded: the op runs once
        # per step, in the forward, and is not replayed in the backward.
        op = make_vjp_op()
        ctx = sac(op._qualname, CheckpointPolicy.MUST_SAVE)
        compiled = torch.compile(
            lambda x: checkpoint(region(op), x, use_reentrant=False, context_fn=ctx), backend="aot_eager"
        )
        x = randn(5, seed=0).requires_grad_()
        torch.autograd.grad(compiled(x), x)  # compiles
        counts()
        out = compiled(x)
        self.assertEqual(counts()["fn"], 1)
        (actual,) = torch.autograd.grad(out, x)
        self.assertEqual(counts(), {"fn": 0, "fwd": 0, "bwd": 0, "forward": 0})
        xe = x.detach().requires_grad_()
        self.assertEqual(actual, torch.autograd.grad(region(twice_grad(torch.tanh))(xe), xe)[0])

    # --------------------------------------------------------- register_autograd
    def check_autograd(self, policy: CheckpointPolicy | None, fn_calls: int) -> None:
        op = make_autograd_op()
        ckpt = {} if policy is None else {"context_fn": sac(op._qualname, policy)}
        self.grads(region(op), region(twice_grad(torch.tanh)), **ckpt)
        self.assertEqual(counts()["fn"], fn_calls)

    def test_autograd_plain_checkpoint(self) -> None:
        self.check_autograd(None, fn_calls=2)

    def test_autograd_sac_must_save(self) -> None:
        self.check_autograd(CheckpointPolicy.MUST_SAVE, fn_calls=1)

    def test_autograd_sac_prefer_recompute(self) -> None:
        self.check_autograd(CheckpointPolicy.PREFER_RECOMPUTE, fn_calls=2)

    # ------------------------------------------------- a lifted legacy Function
    def test_lifted_legacy_sac_must_save(self) -> None:
        exp2 = torch_autobatch.from_function(Exp2, name=unique_op_name("tab_ckpt", "exp2"))
        plain = twice_grad(torch.exp)
        self.grads(region(exp2), region(plain), context_fn=sac(exp2._qualname, CheckpointPolicy.MUST_SAVE))
        self.assertEqual(counts()["forward"], 1)

    def test_lifted_legacy_plain_checkpoint(self) -> None:
        exp2 = torch_autobatch.from_function(Exp2, name=unique_op_name("tab_ckpt", "exp2"))
        self.grads(region(exp2), region(twice_grad(torch.exp)))
        self.assertEqual(counts()["forward"], 2)


if __name__ == "__main__":
    run_tests()
