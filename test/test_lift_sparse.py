"""Lifted ``autograd.Function`` classes with sparse (COO) tensor arguments (issue 47, item 7).

A lifted class gives what the unlifted class gives: its own (2x) backward
under eager ``.backward()``, and the same under ``torch.func`` (which the
unlifted legacy class refuses), against a per-example loop of the unlifted
class's ``.backward()`` for ``vmap``.
"""

from __future__ import annotations

from typing import Any

import torch
from oracles import DTYPE
from test_lift import lifted_in_place
from torch.func import grad, jacrev, vjp, vmap
from torch.testing._internal.common_utils import TestCase, run_tests


class SpMM(torch.autograd.Function):
    """A sparse constant times a dense input; the backward is twice the true one."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return torch.sparse.mm(a, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        (a,) = ctx.saved_tensors
        return None, 2 * torch.sparse.mm(a.t(), g)


class SparseScale(torch.autograd.Function):
    """A sparse input times a dense scalar: a sparse output and a sparse (2x) gradient."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(s)
        return a * s

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        (s,) = ctx.saved_tensors
        return 2 * g * s, None


def _sparse() -> torch.Tensor:
    return torch.tensor([[1.0, 0, 2], [0, 3, 0], [4, 0, 0]], dtype=DTYPE).to_sparse()


def _unlifted_grad(x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    SpMM.apply(_sparse(), leaf).sum().backward()
    return leaf.grad


class TestSparseArguments(TestCase):
    def test_a_sparse_constant(self) -> None:
        a, x = _sparse(), torch.randn(3, 2, dtype=DTYPE)
        X = torch.randn(4, 3, 2, dtype=DTYPE)
        want = _unlifted_grad(x)
        loop = torch.stack([_unlifted_grad(xi) for xi in X])
        with lifted_in_place(SpMM):
            self.assertEqual(_unlifted_grad(x), want)  # eager, now through the op
            f = lambda x: SpMM.apply(a, x).sum()  # noqa: E731
            self.assertEqual(grad(f)(x), want)
            self.assertEqual(vjp(f, x)[1](torch.tensor(1.0, dtype=DTYPE))[0], want)
            self.assertEqual(jacrev(f)(x), want)
            self.assertEqual(vmap(lambda x: SpMM.apply(a, x))(X), torch.stack([a @ xi for xi in X]))
            self.assertEqual(vmap(grad(f))(X), loop)

    def test_a_sparse_input_and_output(self) -> None:
        s = torch.tensor(3.0, dtype=DTYPE)

        def eager() -> torch.Tensor:
            a = _sparse().requires_grad_()
            out = SparseScale.apply(a, s)
            self.assertEqual(out.layout, torch.sparse_coo)
            torch.sparse.sum(out).backward()
            return a.grad

        want = eager()
        self.assertEqual(want.to_dense(), 2 * s * (_sparse().to_dense() != 0))
        with lifted_in_place(SparseScale):
            self.assertEqual(eager(), want)
            got = grad(lambda a: torch.sparse.sum(SparseScale.apply(a, s)))(_sparse())
            self.assertEqual(got.to_dense(), want.to_dense())


if __name__ == "__main__":
    run_tests()
