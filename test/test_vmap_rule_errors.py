"""A ``register_vmap`` rule that returns the wrong thing: errors that name the op and the rule.

NOTE [A vmap rule's return is checked] (torch_autobatch/vmap/_check.py).
torch's own check speaks of "the autograd.Function's vmap staticmethod", and
an out_dim out of range or of another type fails as a bare IndexError or
TypeError; ours names the op, the rule and where it is defined, what was
expected and what came back, on every path the rule runs. Messages are
pinned with ``assertExpectedInline`` (``EXPECTTEST_ACCEPT=1 python
test/test_vmap_rule_errors.py`` refreshes them); the rule's ``file:line``
is checked exactly, then written ``<file>:<line>`` in the pinned text. An
output whose structure is not the op's schema returns (two outputs for an op
with one, one for two, a tensor for ``Tensor[]``) is pinned with
``assertRaisesRegex``, on those paths and ``vmap(jvp)``.
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


def two_outputs_for_one(info, in_dims, x):
    return (2 * x, 3 * x), (in_dims[0], in_dims[0])


def two_outputs_one_out_dim(info, in_dims, x):
    return (2 * x, 3 * x), in_dims[0]


def one_output_for_two(info, in_dims, x):
    return 2 * x, in_dims[0]


def three_outputs_for_two(info, in_dims, x):
    return (2 * x, 3 * x, 4 * x), in_dims[0]


def a_list_for_one(info, in_dims, x):
    return [2 * x], in_dims[0]


def a_tensor_for_a_list(info, in_dims, x):
    return 2 * x, in_dims[0]


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


@torch_autobatch.custom_op(f"{NS}::parts", mutates_args=())
def parts(x: torch.Tensor) -> list[torch.Tensor]:
    return [2 * x, 3 * x]


parts.register_autograd(lambda ctx, grads: 2 * grads[0] + 3 * grads[1])


def _tangent(op: Any, p: torch.Tensor, d: torch.Tensor) -> Any:
    return torch.func.jvp(op, (p,), (d,))[1]


#: The paths of the structure checks: the above, and vmap of jvp (tangents derived from the rule).
STRUCTURE_PATHS: dict[str, Callable[[Any], Any]] = {
    **PATHS,
    "vmap_jvp": lambda op: vmap(lambda p, d: _first(_tangent(op, p, d)))(_x(4, 3), _x(4, 3)),
}


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class TestVmapRuleReturn(TestCase):
    def tearDown(self) -> None:
        double.register_vmap(lambda info, in_dims, x: (2 * x, in_dims[0]))
        pair.register_vmap(lambda info, in_dims, x: ((2 * x, 3 * x), in_dims[0]))
        parts.register_vmap(lambda info, in_dims, x: ([2 * x, 3 * x], in_dims[0]))
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

    def _structure(self, op, rule, output: str, declared: str, expected: str) -> None:
        """The output's structure is not the op's: one RuntimeError on every path, naming the op and the rule."""
        op.register_vmap(rule)
        where = f"{rule.__code__.co_filename}:{rule.__code__.co_firstlineno}"
        pattern = (
            f"^torch_autobatch: the register_vmap rule of {re.escape(op._qualname)} "
            f"\\({re.escape(rule.__qualname__)} at {re.escape(where)}\\) returned as its output "
            f"{re.escape(output)}, but {re.escape(op._qualname)} returns {re.escape(declared)}, so the output "
            f"must be {re.escape(expected)}\\. Give the output the op's structure: return "
        )
        messages = set()
        for path, run in STRUCTURE_PATHS.items():
            with self.subTest(path=path):
                with self.assertRaisesRegex(RuntimeError, pattern) as cm:
                    run(op)
                self.assertIs(type(cm.exception), RuntimeError)
                self.assertNotIn("Unable to cast", str(cm.exception))
                messages.add(str(cm.exception))
                self.assertIsNone(torch._C._functorch.maybe_current_level())
        self.assertEqual(len(messages), 1, messages)

    def test_two_outputs_for_an_op_with_one(self):
        # Was: "Unable to cast (BatchedTensor(...), BatchedTensor(...)) to Tensor", naming neither.
        two = "a tuple of 2 (Tensor of shape (4, 3), Tensor of shape (4, 3))"
        self._structure(double, two_outputs_for_one, two, "Tensor", "a Tensor")
        self._structure(double, two_outputs_one_out_dim, two, "Tensor", "a Tensor")
        self._structure(double, a_list_for_one, "a list of 1 (Tensor of shape (4, 3))", "Tensor", "a Tensor")

    def test_one_output_for_an_op_with_two(self):
        # Was: the one tensor split along its first dim into the op's outputs.
        self._structure(
            pair,
            one_output_for_two,
            "a Tensor of shape (4, 3)",
            "(Tensor, Tensor)",
            "a tuple of 2 (a Tensor, a Tensor)",
        )
        self._structure(
            pair,
            three_outputs_for_two,
            "a tuple of 3 (Tensor of shape (4, 3), Tensor of shape (4, 3), Tensor of shape (4, 3))",
            "(Tensor, Tensor)",
            "a tuple of 2 (a Tensor, a Tensor)",
        )

    def test_a_tensor_for_a_list_return(self):
        self._structure(parts, a_tensor_for_a_list, "a Tensor of shape (4, 3)", "Tensor[]", "a list of Tensors")

    def test_the_op_s_structure_still_runs(self):
        x = _x(4, 3)
        for path, run in STRUCTURE_PATHS.items():
            with self.subTest(path=path):
                parts.register_vmap(lambda info, in_dims, x: ([2 * x, 3 * x], in_dims[0]))
                run(parts)
                parts.register_vmap(lambda info, in_dims, x: ((2 * x, 3 * x), in_dims[0]))  # a tuple for a list
                run(parts)
                pair.register_vmap(lambda info, in_dims, x: ([2 * x, 3 * x], in_dims[0]))  # a list for a tuple
                run(pair)
        self.assertEqual(vmap(parts)(x), [2 * x, 3 * x])

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
