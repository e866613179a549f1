"""Two threads running the same grad node's backward each see their own saved tensors.

NOTE [Saved tensors belong to the call] (csrc/grad_node.cpp): the ctx is shared by
every run of a node, so ``ctx.saved_tensors`` must belong to the call. The
interleavings that broke it are forced with events (deterministic); a stress
loop runs the same without them. The op's backward is 2x the true VJP, so
the oracle is the plain function with a 2x backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from oracles import twice_grad
from torch.func import vjp, vmap
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

TIMEOUT = 30.0


class Interleaving:
    """Makes the backward of the thread named "first" wait, after it entered,
    for the thread named "second" to get to a point, then read its saved tensors."""

    def __init__(self) -> None:
        self.first_in = threading.Event()
        self.second_in = threading.Event()
        self.first_read = threading.Event()
        self.second_done = threading.Event()
        self.hold_second = False  # second waits inside its backward until first has read

    def entered(self) -> None:
        name = threading.current_thread().name
        if name == "first":
            self.first_in.set()
            assert (self.second_in if self.hold_second else self.second_done).wait(TIMEOUT)
        elif name == "second":
            self.second_in.set()
            if self.hold_second:
                assert self.first_read.wait(TIMEOUT)

    def read(self) -> None:
        if threading.current_thread().name == "first":
            self.first_read.set()


def _make_op(name: str, interleaving: list[Interleaving]) -> Any:
    @torch_autobatch.custom_op(f"tab_threads::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, g):
        if interleaving:
            interleaving[0].entered()
        (x,) = ctx.saved_tensors
        if interleaving:
            interleaving[0].read()
        return 2 * g * torch.cos(x)

    op.register_autograd(backward, setup_context=setup_context)
    return op


def _run(targets: dict[str, Callable[[], Any]], started: Callable[[str], None] = lambda n: None) -> dict[str, Any]:
    """Runs each target on a thread of its name, in order; returns results (or raises the first error)."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []
    threads = []

    def wrap(name, fn):
        def run():
            try:
                results[name] = fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        return run

    for name, fn in targets.items():
        t = threading.Thread(target=wrap(name, fn), name=name)
        threads.append(t)
        t.start()
        started(name)
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]
    return results


def _ref(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x)


class TestSavedTensorsPerCall(TestCase):
    def test_two_backwards_of_one_graph(self):
        # The second backward finishes while the first is inside its backward:
        # the first must still read its saved tensors (it raised "only
        # available inside the backward" when they were stored on the ctx).
        inter: list[Interleaving] = [Interleaving()]
        op = _make_op("two_backwards", inter)
        x = torch.randn(5, dtype=torch.float64, requires_grad=True)
        y = op(x).sum()

        def started(name):
            if name == "first":
                assert inter[0].first_in.wait(TIMEOUT)

        def second():
            try:
                return torch.autograd.grad(y, x, retain_graph=True)[0]
            finally:
                inter[0].second_done.set()

        results = _run(
            {"first": lambda: torch.autograd.grad(y, x, retain_graph=True)[0], "second": second},
            started,
        )
        expected = 2 * torch.cos(x.detach())
        self.assertEqual(results["first"], expected)
        self.assertEqual(results["second"], expected)

    def test_different_vmap_nesting_on_each_thread(self):
        # One thread runs vmap(pullback), the other pullback, of one
        # vmap(vjp) pullback; both are inside the node's backward at once.
        # With the saved tensors on the ctx, the first read the second's,
        # batched at the second thread's level: a silently wrong gradient.
        inter: list[Interleaving] = [Interleaving()]
        inter[0].hold_second = True
        op = _make_op("different_nesting", inter)
        B, n = 4, 3
        x = torch.randn(B, n, dtype=torch.float64)
        _, pullback = vjp(vmap(op), x)
        gs = torch.randn(B, B, n, dtype=torch.float64)  # K == B: a wrong batch dim fits
        g = torch.randn(B, n, dtype=torch.float64)

        def started(name):
            if name == "first":
                assert inter[0].first_in.wait(TIMEOUT)

        results = _run({"first": lambda: vmap(pullback)(gs)[0], "second": lambda: pullback(g)[0]}, started)
        inter.clear()
        _, ref_pullback = vjp(vmap(twice_grad(_ref)), x)
        self.assertEqual(results["first"], vmap(ref_pullback)(gs)[0])
        self.assertEqual(results["second"], ref_pullback(g)[0])

    def test_stress(self):
        op = _make_op("stress", [])
        x = torch.randn(64, dtype=torch.float64, requires_grad=True)
        y = op(x).sum()
        expected = 2 * torch.cos(x.detach())

        def work():
            return [torch.autograd.grad(y, x, retain_graph=True)[0] for _ in range(200)]

        results = _run({f"t{k}": work for k in range(4)})
        for grads in results.values():
            for gx in grads:
                self.assertEqual(gx, expected)

    def test_outside_the_backward_is_an_error(self):
        op = _make_op("outside", [])
        seen = []

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            seen.append(ctx)

        op.register_autograd(lambda ctx, g: 2 * g * torch.cos(ctx.saved_tensors[0]), setup_context=setup_context)
        x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        op(x).sum().backward()
        with self.assertRaisesRegex(RuntimeError, "only available inside the backward"):
            seen[0].saved_tensors  # noqa: B018


if __name__ == "__main__":
    run_tests()
