"""vmap of an op under every transform equals a per-example loop, whatever vmap sees as batched.

NOTE [An output is batched wherever an input is] (csrc/batched_kernel.cpp): an
op's output can come out of its function (or rule) unbatched at a vmap level
where an input is batched, while the op's registered rules still connect that
input to that output. Each example must then get its own cotangent and
tangent: a node attached to the unbatched output would be handed the sum of
every example's cotangent (JAX's own custom_vjp tests found this:
``grad(vmap(f).sum())`` gave B times the per-example gradient).

The property, checked on every path that computes an op under vmap: for the
op made as a composite (``register_autograd`` + ``register_jvp``, and with its
tangent derived from its function), ``vmap="loop"``, a ``register_vmap``
rule, and ``register_vjp``; for outputs batched, unbatched and mixed (one of
two); under ``grad(vmap)``, ``vjp(vmap)``, ``jvp(vmap)``, ``jacrev(vmap)``,
``jacfwd(vmap)`` and ``vmap(grad)``, at vmap depth 1 and 2: the result equals
the same transform of a per-example loop of the op. The rules are not the
function's derivative (2x, 3x, and a term that links the x-independent output
to x), so a path that silently differentiated the function also fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from oracles import randn, unique_op_name, vmap_loop
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

KINDS = ("composite", "derived_jvp", "loop", "rule", "vjp")
PATTERNS = ("batched", "unbatched", "mixed")
TRANSFORMS = ("grad_vmap", "vjp_vmap", "jvp_vmap", "jacrev_vmap", "jacfwd_vmap", "vmap_grad")


# ---------------------------------------------------------------- the op
# out_a = sin(x) * w depends on x (batched when x is); out_b = cos(w) does not
# (unbatched when only x is batched), but the rules give x a gradient and a
# tangent from it (the terms in x).
def _outputs(pattern: str, x: torch.Tensor, w: torch.Tensor) -> Any:
    a, b = torch.sin(x) * w, torch.cos(w)
    return {"batched": a, "unbatched": b, "mixed": (a, b)}[pattern]


def _grads(pattern: str, x: torch.Tensor, w: torch.Tensor, grads: tuple[Any, ...]) -> tuple[Any, Any]:
    ga, gb = {"batched": (grads[0], None), "unbatched": (None, grads[0]), "mixed": grads}[pattern]
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    if ga is not None:
        gx, gw = gx + 2 * ga * torch.cos(x) * w, gw + 2 * ga * torch.sin(x)
    if gb is not None:
        gx, gw = gx + gb * x, gw - 2 * gb * torch.sin(w)
    return gx, gw


def _tangents(pattern: str, x: torch.Tensor, w: torch.Tensor, tx: Any, tw: Any) -> Any:
    tx = torch.zeros_like(x) if tx is None else tx
    tw = torch.zeros_like(w) if tw is None else tw
    ta = 3 * (tx * torch.cos(x) * w + torch.sin(x) * tw)
    tb = tx * x - 3 * torch.sin(w) * tw
    return {"batched": ta, "unbatched": tb, "mixed": (ta, tb)}[pattern]


def _rule(pattern: str) -> Callable[..., Any]:
    def rule(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, w: torch.Tensor) -> Any:
        xd, wd = in_dims
        x = x if xd is None else x.movedim(xd, 0)
        w = w if wd is None else w.movedim(wd, 0)
        a = torch.sin(x) * w
        b, b_dim = torch.cos(w), (None if wd is None else 0)
        a_dim = None if xd is None and wd is None else 0
        return {
            "batched": (a, a_dim),
            "unbatched": (b, b_dim),
            "mixed": ((a, b), (a_dim, b_dim)),
        }[pattern]

    return rule


def make_op(kind: str, pattern: str) -> Any:
    """The op of ``pattern``, made the ``kind`` way; ``x`` and ``w`` of one shape."""
    returns = "tuple[torch.Tensor, torch.Tensor]" if pattern == "mixed" else "torch.Tensor"
    ns: dict[str, Any] = {"torch": torch, "_outputs": _outputs, "pattern": pattern}
    exec(f"def fn(x: torch.Tensor, w: torch.Tensor) -> {returns}:\n    return _outputs(pattern, x, w)\n", ns)
    vmap_mode = "loop" if kind == "loop" else "auto"
    op = torch_autobatch.custom_op(unique_op_name("tab_consistency"), ns["fn"], mutates_args=(), vmap=vmap_mode)
    if kind == "vjp":

        def fwd(x: torch.Tensor, w: torch.Tensor) -> Any:
            return _outputs(pattern, x, w), (x, w)

        def bwd(res: Any, *grads: Any) -> Any:
            return _grads(pattern, *res, grads)

        op.register_vjp(fwd, bwd)
    else:

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(*inputs)

        def backward(ctx: Any, *grads: Any) -> Any:
            return _grads(pattern, *ctx.saved_tensors, grads)

        op.register_autograd(backward, setup_context=setup_context)
    if kind != "derived_jvp":

        def jvp_rule(ctx: Any, tx: Any, tw: Any) -> Any:
            return _tangents(pattern, *ctx.saved_tensors, tx, tw)

        op.register_jvp(jvp_rule, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
    if kind == "rule":
        op.register_vmap(_rule(pattern))
    return op


# ------------------------------------------------------------ the property
def _total(out: Any) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o * (1 + torch.arange(o.numel(), dtype=o.dtype).reshape(o.shape))).sum() for o in outs)


def batched(op: Any, depth: int, loop: bool) -> Callable[..., Any]:
    """``vmap`` of ``op`` over x (w unbatched), ``depth`` times; or the per-example loop of it."""
    f = op
    for _ in range(depth):
        f = (lambda g: lambda x, w: vmap_loop(g, (0, None), x, w))(f) if loop else vmap(f, in_dims=(0, None))
    return f


def run(transform: str, f: Callable[..., Any], x: torch.Tensor, w: torch.Tensor, tx: torch.Tensor) -> Any:
    if transform == "grad_vmap":
        return grad(lambda x, w: _total(f(x, w)), argnums=(0, 1))(x, w)
    if transform == "vjp_vmap":
        out, pullback = vjp(f, x, w)
        ct = tuple(
            torch.ones_like(o) + tx.reshape(-1)[: o.numel()].reshape(o.shape)
            for o in (out if isinstance(out, tuple) else (out,))
        )
        return pullback(ct if isinstance(out, tuple) else ct[0])
    if transform == "jvp_vmap":
        return jvp(f, (x, w), (tx, torch.ones_like(w)))
    if transform == "jacrev_vmap":
        return jacrev(f, argnums=(0, 1))(x, w)
    if transform == "jacfwd_vmap":
        return jacfwd(f, argnums=(0, 1))(x, w)
    raise AssertionError(transform)


class TestOutputsBatchedLikeInputs(TestCase):
    """NOTE [An output is batched wherever an input is]: every path, every transform, against a loop."""

    @parametrize("depth", [1, 2])
    @parametrize("transform", TRANSFORMS)
    @parametrize("pattern", PATTERNS)
    @parametrize("kind", KINDS)
    def test_vmap_under_transform_equals_loop(self, kind: str, pattern: str, transform: str, depth: int) -> None:
        op = make_op(kind, pattern)
        shape = (3, 2, 4)[-depth - 1 :] if depth == 2 else (3, 4)
        x, w, tx = randn(*shape, seed=0), randn(4, seed=1), randn(*shape, seed=2)
        if transform == "vmap_grad":
            # vmap over grad: the op is called per example inside grad.
            def g(x: torch.Tensor, w: torch.Tensor) -> Any:
                return grad(lambda x, w: _total(op(x, w)), argnums=(0, 1))(x, w)

            got = batched(g, depth, loop=False)(x, w)
            expected = batched(g, depth, loop=True)(x, w)
        else:
            got = run(transform, batched(op, depth, loop=False), x, w, tx)
            expected = run(transform, batched(op, depth, loop=True), x, w, tx)
        self.assertEqual(got, expected)

    @parametrize("kind", KINDS)
    def test_backward_and_another_thread_equal_loop(self, kind: str) -> None:
        # .backward() through vmap (the base level), here and on a second thread.
        op = make_op(kind, "mixed")

        def per_example_grads(loop: bool) -> tuple[torch.Tensor, torch.Tensor]:
            x, w = randn(3, 4, seed=0).requires_grad_(), randn(4, seed=1).requires_grad_()
            _total(batched(op, 1, loop)(x, w)).backward()
            return x.grad, w.grad

        expected = per_example_grads(loop=True)
        self.assertEqual(per_example_grads(loop=False), expected)
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(per_example_grads(loop=False)))
        thread.start()
        thread.join()
        self.assertEqual(result[0], expected)

    @parametrize("kind", ("composite", "vjp"))
    def test_compiled_backward_equals_loop(self, kind: str) -> None:
        op = make_op(kind, "unbatched")

        def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _total(vmap(op, in_dims=(0, None))(x, w))

        x, w = randn(3, 4, seed=0), randn(4, seed=1)
        expected = grad(lambda x, w: _total(vmap_loop(op, (0, None), x, w)), argnums=(0, 1))(x, w)
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.compile(step, backend="aot_eager", fullgraph=True)(xc, wc).backward()
        self.assertEqual((xc.grad, wc.grad), expected)

    def test_issue_example(self) -> None:
        @torch_autobatch.custom_op(unique_op_name("tab_consistency"), mutates_args=())
        def f(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(x.shape, dtype=x.dtype)

        f.register_autograd(lambda ctx, g: g)
        f.register_jvp(lambda ctx, t: t)
        x, t = torch.arange(3.0), torch.tensor([1.0, 2.0, 3.0])
        self.assertEqual(grad(lambda x: vmap(f)(x).sum())(x), torch.ones(3))
        self.assertEqual(vjp(vmap(f), x)[1](t)[0], t)
        self.assertEqual(jvp(vmap(f), (x,), (t,))[1], t)
        self.assertEqual(jacrev(vmap(f))(x), torch.eye(3))
        self.assertEqual(jacfwd(vmap(f))(x), torch.eye(3))


instantiate_parametrized_tests(TestOutputsBatchedLikeInputs)

if __name__ == "__main__":
    run_tests()
