"""Forward mode of an op with a register_vmap rule and no jvp: both transform orders differentiate the rule.

NOTE [Derived tangents differentiate the vmap rule] (torch_autobatch/op/_rule_tangents.py).
The rule here is deliberately 3x the batched function, as JAX's tests make a
rule that is not the function so that which one ran is visible: the primal
and the tangent must both come from it, under ``jvp(vmap(op))``,
``vmap(jvp(op))`` and forward_ad's dual tensors around ``vmap``, for batched and unbatched
arguments, ``in_dims`` other than 0 and an unbatched output. Where the rule
made the primal below another kind of level (a ``grad`` between it and the
forward-mode level), the tangent cannot come from the rule: a clear error
naming the op and ``register_jvp``, never the function's tangent.
``vmap(jacfwd(op))``, whose basis vmap sits between, differentiates the rule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from oracles import randn, unique_op_name
from torch.func import grad, jacfwd, jvp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch


def make_op(two_outputs: bool = False) -> Any:
    """sin(x) * w (and cos(w)); its vmap rule is 3x that, with no register_jvp."""
    returns = "tuple[torch.Tensor, torch.Tensor]" if two_outputs else "torch.Tensor"
    ns: dict[str, Any] = {"torch": torch}
    body = "(torch.sin(x) * w, torch.cos(w))" if two_outputs else "torch.sin(x) * w"
    exec(f"def fn(x: torch.Tensor, w: torch.Tensor) -> {returns}:\n    return {body}\n", ns)
    op = torch_autobatch.custom_op(unique_op_name("tab_rule_tangents"), ns["fn"], mutates_args=())
    op.register_autograd(lambda ctx, *g: (None, None), setup_context=lambda ctx, inputs, output: None)

    @op.register_vmap
    def rule(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, w: torch.Tensor) -> Any:
        xd, wd = in_dims
        x = x if xd is None else x.movedim(xd, 0)
        w = w if wd is None else w.movedim(wd, 0)
        a = 3 * torch.sin(x) * w
        if not two_outputs:
            return a, 0
        return (a, 3 * torch.cos(w)), (0, None if wd is None else 0)

    return op


def expected(x: torch.Tensor, w: torch.Tensor, tx: torch.Tensor, tw: torch.Tensor, two_outputs: bool) -> Any:
    """The rule's primal and tangent, per example (x, w already broadcast to the batch)."""
    a, ta = 3 * torch.sin(x) * w, 3 * (torch.cos(x) * tx * w + torch.sin(x) * tw)
    if not two_outputs:
        return a, ta
    return (a, 3 * torch.cos(w)), (ta, -3 * torch.sin(w) * tw)


IN_DIMS = {"x0": (0, None), "x1": (1, None), "both0": (0, 0), "w0": (None, 0), "both1": (1, 1)}


class TestRuleTangents(TestCase):
    @parametrize("two_outputs", [False, True])
    @parametrize("in_dims", list(IN_DIMS))
    def test_both_orders_differentiate_the_rule(self, in_dims: str, two_outputs: bool) -> None:
        op = make_op(two_outputs)
        dims = IN_DIMS[in_dims]
        B, n = 3, 4

        def arg(d: Any, seed: int) -> torch.Tensor:
            t = randn(B, n, seed=seed) if d is not None else randn(n, seed=seed)
            return t.movedim(0, d).contiguous() if d else t

        x, w, tx, tw = arg(dims[0], 0), arg(dims[1], 1), arg(dims[0], 2), arg(dims[1], 3)
        jvp_of_vmap = jvp(vmap(op, in_dims=dims), (x, w), (tx, tw))
        vmap_of_jvp = vmap(lambda x, w, tx, tw: jvp(op, (x, w), (tx, tw)), in_dims=dims * 2)(x, w, tx, tw)
        self.assertEqual(vmap_of_jvp, jvp_of_vmap)

        def front(t: torch.Tensor, d: Any) -> torch.Tensor:
            return t.movedim(d, 0) if d is not None else t.expand(B, n)

        xs, ws, txs, tws = front(x, dims[0]), front(w, dims[1]), front(tx, dims[0]), front(tw, dims[1])
        primal, tangent = expected(xs, ws, txs, tws, two_outputs)
        if two_outputs and dims[1] is None:  # cos(w) is unbatched: vmap returns it expanded
            primal, tangent = (primal[0], primal[1]), (tangent[0], tangent[1])
        self.assertEqual(jvp_of_vmap, (primal, tangent))

    def test_dual_tensors_around_vmap_differentiate_the_rule(self) -> None:
        # forward_ad's dual tensors (the base level) below vmap, as jvp(vmap(op)).
        op = make_op()
        x, w, tx = randn(3, 4, seed=0), randn(4, seed=1), randn(3, 4, seed=2)
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(vmap(op, in_dims=(0, None))(fwAD.make_dual(x, tx), w)).tangent
        self.assertEqual(tangent, 3 * torch.cos(x) * tx * w)
        self.assertEqual(vmap(lambda x, tx: jvp(op, (x, w), (tx, torch.zeros_like(w)))[1])(x, tx), tangent)

    def test_jacfwd_and_vmap_in_either_order_differentiate_the_rule(self) -> None:
        # vmap(jacfwd(op)): jacfwd's basis vmap sits between the Jvp level and the
        # vmap level whose rule made the primal; it batches the tangents only.
        op = make_op()
        x, w = randn(3, 4, seed=0), randn(4, seed=1)
        rule_jacobian = torch.diag_embed(3 * torch.cos(x) * w)
        self.assertEqual(torch.einsum("bibj->bij", jacfwd(vmap(op, in_dims=(0, None)))(x, w)), rule_jacobian)
        self.assertEqual(vmap(jacfwd(op), in_dims=(0, None))(x, w), rule_jacobian)
        jx, jw = vmap(jacfwd(op, argnums=(0, 1)), in_dims=(1, None))(x.T.contiguous(), w)
        self.assertEqual((jx, jw), (rule_jacobian, torch.diag_embed(3 * torch.sin(x))))
        # Two vmap levels batch the primal: the rule runs at the inner one.
        xx = x.unsqueeze(1).expand(3, 2, 4).contiguous()
        nested = vmap(vmap(jacfwd(op), in_dims=(0, None)), in_dims=(0, None))(xx, w)
        self.assertEqual(nested, rule_jacobian.unsqueeze(1).expand(3, 2, 4, 4))

    def test_a_grad_level_between_asks_for_a_jvp(self) -> None:
        op = make_op()
        x, w = randn(3, 4, seed=0), randn(4, seed=1)

        def f(x: torch.Tensor) -> torch.Tensor:
            return jvp(lambda x: op(x, w), (x,), (torch.ones_like(x),))[1].sum()

        with self.assertRaisesRegex(
            RuntimeError, r"tab_rule_tangents::op\d+: its output comes from its register_vmap rule .*register_jvp"
        ):
            vmap(grad(f))(x)

    def test_a_registered_jvp_governs_both_orders(self) -> None:
        op = make_op()
        op.register_jvp(lambda ctx, tx, tw: 5 * tx, setup_context=lambda ctx, inputs, output: None)
        x, w, tx, tw = randn(3, 4, seed=0), randn(4, seed=1), randn(3, 4, seed=2), randn(4, seed=3)
        self.assertEqual(vmap(lambda x, tx: jvp(op, (x, w), (tx, tw))[1])(x, tx), 5 * tx)
        self.assertEqual(jvp(vmap(op, in_dims=(0, None)), (x, w), (tx, tw))[1], 5 * tx)


instantiate_parametrized_tests(TestRuleTangents)

if __name__ == "__main__":
    run_tests()
