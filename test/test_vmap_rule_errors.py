"""A ``register_vmap`` rule that returns the wrong thing: errors that name the op and the rule.

NOTE [A vmap rule's return is checked] (torch_autobatch/_vmap_check.py).
torch's own check speaks of "the autograd.Function's vmap staticmethod", and
an out_dim out of range or of another type fails as a bare IndexError or
TypeError; ours names the op, the rule and where it is defined, what was
expected and what came back, on every path the rule runs. Messages are
pinned with ``assertExpectedInline`` (``EXPECTTEST_ACCEPT=1 python
test/test_vmap_rule_errors.py`` refreshes them); the rule's ``file:line``
is checked exactly, then written ``<file>:<line>`` in the pinned text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad, vmap
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_vmap_rule"
DTYPE = torch.float64


class MyError(Exception):
    """A user exception raised inside a rule: it must come out unchanged."""


@torch_autobatch.custom_op(f"{NS}::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


double.register_autograd(lambda ctx, g: 2 * g)


@torch_autobatch.custom_op(f"{NS}::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return 2 * x, 3 * x


pair.register_autograd(lambda ctx, g1, g2: 2 * g1 + 3 * g2)


# ------------------------------------------------------------ the bad rules
def output_only(info, in_dims, x):
    return 2 * x


def three_values(info, in_dims, x):
    return 2 * x, in_dims[0], None


def out_dims_for_two_outputs(info, in_dims, x):
    return 2 * x, (in_dims[0], in_dims[0])


def out_dim_out_of_range(info, in_dims, x):
    return 2 * x, 5


def out_dim_a_float(info, in_dims, x):
    return 2 * x, 0.0


def out_dim_not_the_batch(info, in_dims, x):
    return 2 * x.movedim(in_dims[0], 0)[:1], 0


def pair_out_dims_a_list(info, in_dims, x):
    return (2 * x, 3 * x), [in_dims[0], in_dims[0]]


def pair_second_out_dim_a_str(info, in_dims, x):
    return (2 * x, 3 * x), (in_dims[0], "0")


def raises_its_own(info, in_dims, x):
    raise MyError("the rule's own words")


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DTYPE)


#: Every path a rule runs on; each calls it once per vmap level.
PATHS: dict[str, Callable[[Any], Any]] = {
    "vmap": lambda op: vmap(op)(_x(4, 3)),
    "vmap_vmap": lambda op: vmap(vmap(op))(_x(2, 4, 3)),
    "vmap_grad": lambda op: vmap(grad(lambda x: _first(op(x)).sum()))(_x(4, 3)),
    "grad_vmap": lambda op: grad(lambda x: _first(vmap(op)(x)).sum())(_x(4, 3)),
}


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class TestVmapRuleReturn(TestCase):
    def tearDown(self) -> None:
        double.register_vmap(lambda info, in_dims, x: (2 * x, in_dims[0]))
        pair.register_vmap(lambda info, in_dims, x: ((2 * x, 3 * x), in_dims[0]))
        super().tearDown()

    def _message(self, op, rule, error: type[Exception]) -> str:
        """The error of ``rule`` on every path, the same on each; ``file:line`` checked, then made generic."""
        op.register_vmap(rule)
        messages = set()
        for path, run in PATHS.items():
            with self.subTest(path=path):
                with self.assertRaises(error) as cm:
                    run(op)
                self.assertIs(type(cm.exception), error)
                messages.add(str(cm.exception))
                self.assertIsNone(torch._C._functorch.maybe_current_level())
        self.assertEqual(len(messages), 1, messages)
        (msg,) = messages
        where = f"{rule.__code__.co_filename}:{rule.__code__.co_firstlineno}"
        self.assertIn(f"({rule.__qualname__} at {where})", msg)
        return re.sub(re.escape(where), "<file>:<line>", msg)

    def test_output_only(self):
        self.assertExpectedInline(
            self._message(double, output_only, RuntimeError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::double (output_only at <file>:<line>) returned a Tensor of shape (4, 3); expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return a pair: `return output, out_dims`, e.g. `return result, 0` for a result batched along dim 0.""",
        )

    def test_three_values(self):
        self.assertExpectedInline(
            self._message(double, three_values, RuntimeError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::double (three_values at <file>:<line>) returned a tuple of 3 (Tensor of shape (4, 3), int (0), None); expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return a pair: `return output, out_dims`, e.g. `return result, 0` for a result batched along dim 0.""",
        )

    def test_out_dims_do_not_match_the_output(self):
        self.assertExpectedInline(
            self._message(double, out_dims_for_two_outputs, RuntimeError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::double (out_dims_for_two_outputs at <file>:<line>) returned out_dims=(0, 0), which does not match the structure of its output, a Tensor of shape (4, 3); expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return out_dims shaped like the output.""",
        )
        self.assertExpectedInline(
            self._message(pair, pair_out_dims_a_list, RuntimeError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::pair (pair_out_dims_a_list at <file>:<line>) returned out_dims=[0, 0], which does not match the structure of its output, a tuple of 2 (Tensor of shape (4, 3), Tensor of shape (4, 3)); expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return out_dims shaped like the output.""",
        )

    def test_out_dim_out_of_range(self):
        self.assertExpectedInline(
            self._message(double, out_dim_out_of_range, IndexError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::double (out_dim_out_of_range at <file>:<line>) returned out_dim 5 for the output, a Tensor of shape (4, 3), which has no dimension 5 (it has 2: out_dims must lie in [-2, 1]); expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return the dimension that holds the batch.""",
        )

    def test_out_dim_not_an_int(self):
        self.assertExpectedInline(
            self._message(double, out_dim_a_float, TypeError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::double (out_dim_a_float at <file>:<line>) returned out_dims=0.0: the out_dim 0.0 of the output, a Tensor of shape (4, 3), is a float; expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return an int or None for it.""",
        )
        self.assertExpectedInline(
            self._message(pair, pair_second_out_dim_a_str, TypeError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::pair (pair_second_out_dim_a_str at <file>:<line>) returned out_dims=(0, '0'): the out_dim '0' of output 1, a Tensor of shape (4, 3), is a str; expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return an int or None for it.""",
        )

    def test_out_dim_whose_size_is_not_the_batch(self):
        # torch's helper returns a result of the wrong batch size, silently.
        self.assertExpectedInline(
            self._message(double, out_dim_not_the_batch, RuntimeError),
            """torch_autobatch: the register_vmap rule of tab_vmap_rule::double (out_dim_not_the_batch at <file>:<line>) returned out_dim 0 for the output, a Tensor of shape (1, 3), whose dimension 0 has size 1, not the vmap's batch size 4; expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs). Return the dimension that holds the batch (info.batch_size = 4), or None for an output that has none.""",
        )

    def test_the_rule_s_own_exception_is_unchanged(self):
        double.register_vmap(raises_its_own)
        for path, run in PATHS.items():
            with self.subTest(path=path):
                with self.assertRaises(MyError) as cm:
                    run(double)
                self.assertIs(type(cm.exception), MyError)
                self.assertEqual(str(cm.exception), "the rule's own words")

    def test_good_rules_still_run(self):
        # A negative out_dim, nested vmap, vmap(grad), one out_dim for two outputs, None for an unbatched output.
        x = _x(4, 3)
        double.register_vmap(lambda info, in_dims, x: (2 * x.movedim(in_dims[0], -1), -1))
        self.assertEqual(vmap(double)(x), 2 * x)
        double.register_vmap(lambda info, in_dims, x: (2 * x, in_dims[0]))
        self.assertEqual(vmap(vmap(double))(_x(2, 4, 3)).shape, (2, 4, 3))
        self.assertEqual(vmap(grad(lambda x: double(x).sum()))(x), torch.full_like(x, 2))
        pair.register_vmap(lambda info, in_dims, x: ((2 * x, 3 * x), in_dims[0]))
        self.assertEqual(vmap(pair)(x), (2 * x, 3 * x))

        @torch_autobatch.custom_op(f"{NS}::first", mutates_args=())
        def first(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x.clone()

        first.register_vmap(lambda info, in_dims, x, y: (x.clone(), in_dims[0]))
        self.assertEqual(vmap(first, in_dims=(0, None))(x, x[0]), x)
        first.register_vmap(lambda info, in_dims, x, y: (y.sum(-1), None))
        self.assertEqual(vmap(first, in_dims=(0, None))(x, x[0]), x[0].sum().expand(4))


if __name__ == "__main__":
    run_tests()
