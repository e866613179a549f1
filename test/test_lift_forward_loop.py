"""Lifted classes whose forward vmap cannot batch run once per example under ``vmap="auto"`` (issue 47, item 4).

NOTE [A forward vmap cannot batch runs per example] (csrc/batched_kernel.cpp).
Each class's backward is twice the true one, so the per-example gradients are
those of the class's own backward: a per-example loop of the unlifted class's
``.backward()`` is the oracle.
"""

from __future__ import annotations

from typing import Any

import torch
from oracles import DTYPE
from test_lift import lifted_in_place
from torch.func import grad, jacrev, vmap
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests


class Accumulate(torch.autograd.Function):
    """Sums the squares of the rows into a fresh buffer, in place (vmap cannot write a batch into it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[-1], dtype=x.dtype)
        for i in range(x.shape[0]):
            out += x[i] ** 2
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * (2 * x * g)


@torch.jit.script
def _scripted_square_sum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[1:], dtype=x.dtype)
    for i in range(x.shape[0]):
        out.add_(x[i] * x[i])
    return out


class Scripted(torch.autograd.Function):
    """A TorchScript kernel that accumulates in place (the TorchScript interpreter cannot batch it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _scripted_square_sum(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * (2 * x * g)


class FromValues(torch.autograd.Function):
    """Scales by ``torch.tensor(x.tolist()[0][0])``: a tensor built from the input's Python values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(x.tolist()[0][0], dtype=x.dtype)
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (scale,) = ctx.saved_tensors
        return 2 * g * scale  # (the scale's own dependence on x ignored, as the class declares)


CLASSES = {"accumulate": Accumulate, "scripted": Scripted, "from_values": FromValues}


def _unlifted_loop(cls: type, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, grads = [], []
    for x in X:
        leaf = x.detach().requires_grad_()
        out = cls.apply(leaf)
        out.sum().backward()
        values.append(out.detach())
        grads.append(leaf.grad)
    return torch.stack(values), torch.stack(grads)


@instantiate_parametrized_tests
class TestForwardPerExample(TestCase):
    @parametrize("name", list(CLASSES))
    def test_vmap_and_vmap_grad(self, name: str) -> None:
        cls = CLASSES[name]
        X = torch.randn(5, 3, 4, dtype=DTYPE)
        values, grads = _unlifted_loop(cls, X)
        with lifted_in_place(cls):
            self.assertEqual(vmap(cls.apply)(X), values)
            self.assertEqual(vmap(grad(lambda x: cls.apply(x).sum()))(X), grads)
            J = vmap(jacrev(cls.apply))(X)  # (batch, *out, *in): summed over out, the gradient of the sum
            self.assertEqual(J.flatten(1, J.dim() - X.dim()).sum(1), grads)
            self.assertEqual(_unlifted_loop(cls, X), (values, grads))  # eager, through the op

    def test_an_error_of_the_users_own_is_not_retried(self) -> None:
        calls = []

        class Refuses(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                calls.append(x.shape)
                if torch._C._functorch.is_batchedtensor(x):
                    raise ValueError("Refuses: not batched, please")
                return x * 2

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return 2 * g

        with lifted_in_place(Refuses):
            Refuses.apply(torch.randn(3, dtype=DTYPE))
            calls.clear()
            with self.assertRaisesRegex(ValueError, "not batched, please"):
                vmap(Refuses.apply)(torch.randn(4, 3, dtype=DTYPE))
        self.assertEqual(len(calls), 1)


if __name__ == "__main__":
    run_tests()
