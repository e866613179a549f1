"""PyTorch's own custom_op_db, re-declared with torch_autobatch.custom_op.

``torch/testing/_internal/custom_op_db.py`` holds numpy-backed
``torch.library.custom_op`` operators written to torch.library's whole contract
(``register_fake``, ``register_autograd`` with 3- and 4-argument
``setup_context``, ``ctx.mark_non_differentiable``, ``register_vmap`` rules with
keyword-only arguments and pytree ``out_dims``, ``List[Tensor]`` outputs), each
with OpInfo samples. We exec that module's source with ``torch.library.custom_op``
replaced by ``torch_autobatch.custom_op`` (in the ``tab_db`` namespace), so the
same functions and rules define our ops, and check every OpInfo sample of ours
against the original torch.library op run eagerly:

- values;
- ``vmap`` (through their rules) against the original under vmap and against a
  per-example loop, shapes exact;
- ``torch.func.grad`` and ``torch.func.vjp`` against eager autograd of the original;
- ``vmap(grad)`` and ``vmap(vjp)`` (per-sample gradients) against a loop of eager autograd;
- ``jvp``: a clear error naming ``register_jvp`` (the functions leave torch through
  numpy), never zeros (the original gives silent zeros).
"""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.testing._internal.custom_op_db as original_db
from oracles import vmap_loop
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import torch_autobatch  # noqa: F401  (the exec'd source imports it)

NS = "tab_db"
B = 3


# torch's numpy_cat_vmap unpacks the in_dims of its two arguments as one
# (`x_bdim, = in_dims`) and would concatenate along the wrong dim, so vmap of
# numpy_cat fails in torch itself, and so does anything whose backward calls it
# under vmap (numpy_split_copy*). A correct rule, for the checks that would
# otherwise only show torch's bug:
CAT_RULE_BUG = "    x_bdim, = in_dims\n    result = numpy_cat(x, dim)\n    return result, x_bdim"
CAT_RULE_FIXED = """\
    x_bdims, _ = in_dims
    x = [xi.movedim(b, 0) if b is not None else xi.expand(info.batch_size, *xi.shape)
         for xi, b in zip(x, x_bdims)]
    return numpy_cat(x, dim + 1 if dim >= 0 else dim), 0"""
NEEDS_CAT_RULE = {"NumpyCatCustomOp", "NumpySplitCopyCustomOp", "NumpySplitCopyWithIntCustomOp"}


def _load_ours(ns: str, fix_cat_rule: bool = False) -> types.ModuleType:
    """custom_op_db's operators, declared with torch_autobatch.custom_op in namespace ``ns``."""
    source = inspect.getsource(original_db)
    source = source.split("# some mechanical test cases")[0]  # not custom_op_db's ops
    source = source.replace("@torch.library.custom_op(", "@torch_autobatch.custom_op(")
    source = source.replace("_torch_testing", ns)
    assert "torch.library.custom_op" not in source and CAT_RULE_BUG in source
    if fix_cat_rule:
        source = source.replace(CAT_RULE_BUG, CAT_RULE_FIXED)
    module = types.ModuleType(f"{ns}_custom_op_db")
    exec(compile("import torch_autobatch\n" + source, original_db.__file__, "exec"), module.__dict__)
    return module


ours_db = _load_ours(NS)
fixed_db = _load_ours(NS + "_fixed", fix_cat_rule=True)
PAIRS = {o.name: (o, ours) for o, ours in zip(original_db.custom_op_db, ours_db.custom_op_db)}
FIXED = {o.name: o for o in fixed_db.custom_op_db}
AUTOGRAD = [name for name, (o, _) in PAIRS.items() if o.supports_autograd]


class Sample:
    """One OpInfo sample, with its floating tensors as the differentiable leaves."""

    def __init__(self, sample) -> None:
        leaves, self._spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        self._leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
        self.diff = [i for i, t in enumerate(self._leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]

    @property
    def primals(self) -> list[torch.Tensor]:
        return [self._leaves[i] for i in self.diff]

    def fn(self, op: Callable[..., Any]) -> Callable[..., Any]:
        """``op`` as a function of the differentiable leaves."""

        def f(*primals: torch.Tensor) -> Any:
            leaves = list(self._leaves)
            for i, t in zip(self.diff, primals):
                leaves[i] = t
            inp, args, kwargs = tree_unflatten(leaves, self._spec)
            return op(inp, *args, **kwargs)

        return f

    def batched(self) -> list[torch.Tensor]:
        """B different examples of each differentiable leaf, stacked at dim 0."""
        return [torch.stack([t * (1 + 0.25 * k) + 0.125 * k for k in range(B)]) for t in self.primals]


def _floats(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(f: Callable[..., Any], weights: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A scalar whose gradient is the VJP of ``f`` with cotangents ``weights``."""

    def loss(*primals: torch.Tensor) -> torch.Tensor:
        return sum((o * w).sum() for o, w in zip(_floats(f(*primals)), weights))

    return loss


def _eager_grads(loss: Callable[..., torch.Tensor], primals: list[torch.Tensor]) -> tuple:
    ps = [p.detach().requires_grad_() for p in primals]
    grads = torch.autograd.grad(loss(*ps), ps, allow_unused=True)
    return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(ps, grads))


class TestCustomOpDb(TestCase):
    def _samples(self, name: str, requires_grad: bool = False) -> list[Sample]:
        torch.manual_seed(0)
        original, _ = PAIRS[name]
        return [Sample(s) for s in original.sample_inputs("cpu", torch.float32, requires_grad=requires_grad)]

    def test_every_op_is_ours(self):
        self.assertEqual(len(PAIRS), len(original_db.custom_op_db))
        for name, (_original, ours) in PAIRS.items():
            self.assertTrue(str(ours.op).startswith(f"{NS}."), name)
            qualname = "::".join(str(ours.op).split(".")[:2])
            opdef = torch._library.custom_ops._maybe_get_opdef(qualname)
            self.assertIsInstance(opdef, torch_autobatch.CustomOpDef, name)

    @parametrize("name", list(PAIRS))
    def test_values(self, name):
        original, ours = PAIRS[name]
        for s in self._samples(name):
            self.assertEqual(s.fn(ours.op)(*s.primals), s.fn(original.op)(*s.primals), exact_dtype=True)

    @parametrize("name", list(PAIRS))
    def test_vmap_through_the_rule(self, name):
        original, ours = PAIRS[name]
        for s in self._samples(name):
            xs = s.batched()
            # vmap's out_dims: None for a non-tensor output (an int).
            out_dims = tree_map(lambda o: 0 if isinstance(o, torch.Tensor) else None, s.fn(original.op)(*s.primals))
            try:
                expected = torch.vmap(s.fn(original.op), out_dims=out_dims)(*xs)
            except Exception as e:  # the rule itself fails (torch's): so must ours, alike
                with self.assertRaisesRegex(type(e), re.escape(str(e))):
                    torch.vmap(s.fn(ours.op), out_dims=out_dims)(*xs)
                continue
            got = torch.vmap(s.fn(ours.op), out_dims=out_dims)(*xs)
            # assertEqual compares shapes exactly: a list output batched twice fails here.
            self.assertEqual(got, expected)
            self.assertEqual(got, vmap_loop(s.fn(ours.op), 0, *xs, out_dims=out_dims))

    @parametrize("name", AUTOGRAD)
    def test_grad_and_vjp_match_eager_autograd(self, name):
        original, ours = PAIRS[name]
        for s in self._samples(name, requires_grad=True):
            weights = [torch.randn_like(o) for o in _floats(s.fn(original.op)(*s.primals))]
            expected = _eager_grads(_loss(s.fn(original.op), weights), s.primals)
            argnums = tuple(range(len(s.primals)))
            got = torch.func.grad(_loss(s.fn(ours.op), weights), argnums=argnums)(*s.primals)
            self.assertEqual(got, expected)
            _, pullback = torch.func.vjp(lambda *p: tuple(_floats(s.fn(ours.op)(*p))), *s.primals)
            self.assertEqual(pullback(tuple(weights)), expected)
            # And .backward() through our Autograd kernel.
            self.assertEqual(_eager_grads(_loss(s.fn(ours.op), weights), s.primals), expected)

    def test_torchs_numpy_cat_rule_fails_alike(self):
        original, ours = PAIRS["NumpyCatCustomOp"]
        s = self._samples("NumpyCatCustomOp")[0]
        for op in (original.op, ours.op):
            with self.assertRaisesRegex(ValueError, "too many values to unpack"):
                torch.vmap(s.fn(op))(*s.batched())
        # Our op honours the rule: the backward of numpy_split_copy reaches it too.
        original, ours = PAIRS["NumpySplitCopyCustomOp"]
        s = self._samples("NumpySplitCopyCustomOp", requires_grad=True)[0]
        with self.assertRaisesRegex(ValueError, "too many values to unpack"):
            torch.vmap(torch.func.grad(lambda x: sum(o.sum() for o in s.fn(ours.op)(x))))(*s.batched())

    @parametrize("name", AUTOGRAD)
    def test_vmap_of_grad_and_vjp_match_a_loop_of_eager_autograd(self, name):
        original, ours = PAIRS[name]
        if name in NEEDS_CAT_RULE:
            ours = FIXED[name]
        for s in self._samples(name, requires_grad=True):
            xs = s.batched()
            weights = [torch.randn_like(o) for o in _floats(s.fn(original.op)(*s.primals))]
            argnums = tuple(range(len(xs)))
            got = torch.vmap(torch.func.grad(_loss(s.fn(ours.op), weights), argnums=argnums))(*xs)
            loop = vmap_loop(lambda *p: _eager_grads(_loss(s.fn(original.op), weights), list(p)), 0, *xs)
            self.assertEqual(got, loop)

            def per_sample_vjp(*p):
                _, pullback = torch.func.vjp(lambda *q: tuple(_floats(s.fn(ours.op)(*q))), *p)
                return pullback(tuple(weights))

            self.assertEqual(torch.vmap(per_sample_vjp)(*xs), loop)

    @parametrize("name", list(PAIRS))
    def test_opcheck(self, name):
        # All of opcheck's default tests (schema, autograd registration, fake
        # tensor, AOT dispatch static and dynamic), every sample, with and
        # without inputs that require grad.
        _, ours = PAIRS[name]
        torch.manual_seed(0)
        for requires_grad in (False, True):
            for s in ours.sample_inputs("cpu", torch.float32, requires_grad=requires_grad):
                torch.library.opcheck(ours.op, (s.input, *s.args), s.kwargs)

    @parametrize("name", AUTOGRAD)
    def test_jvp_is_a_clear_error_never_zeros(self, name):
        _, ours = PAIRS[name]
        for s in self._samples(name):
            tangents = [torch.ones_like(p) for p in s.primals]
            with self.assertRaisesRegex(RuntimeError, rf"(?s){NS}::.*register_jvp"):
                torch.func.jvp(s.fn(ours.op), tuple(s.primals), tuple(tangents))


instantiate_parametrized_tests(TestCustomOpDb)

if __name__ == "__main__":
    run_tests()
