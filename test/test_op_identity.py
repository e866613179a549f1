"""An op is a global: copy and deepcopy return it, pickle refers to it by name (issue 33, item 6).

NOTE [An op is a global] (core/_op_identity.py). ``copy.deepcopy(model)`` of an
``nn.Module`` holding an op (ensembles, EMA, model averaging) used to fail
with "cannot pickle '_DispatchModule'"; the copy's forward must still use the
op's registered backward, which here is deliberately 2x the true derivative.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from oracles import make_scaled_rule_op
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_op_identity"


def _setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.x = inputs[0]  # type: ignore[attr-defined]


def _twice_backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
    return 2 * g * torch.cos(ctx.x)  # type: ignore[attr-defined]  # 2x the true derivative of sin


@torch_autobatch.custom_op(f"{NS}::sin2", mutates_args=())
def sin2(x: torch.Tensor) -> torch.Tensor:
    """sin, with a backward registered at 2x the true derivative."""
    return torch.sin(x)


sin2.register_autograd(_twice_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NS}::upgraded_sin2", mutates_args=())
def upgraded_sin2(x: torch.Tensor) -> torch.Tensor:
    """A torch.library op, upgraded below; its backward is 2x the true derivative."""
    return torch.sin(x)


upgraded_sin2.register_autograd(_twice_backward, setup_context=_setup_context)
torch_autobatch.autobatch(upgraded_sin2)


def _lambda_op(qualname: str | None = None) -> torch_autobatch.CustomOpDef:
    """An op whose function is a lambda (no module-level name), backward 2x the true derivative."""
    return make_scaled_rule_op(qualname, lambda x: torch.sin(x), torch.cos, schema="(Tensor x) -> Tensor")


class _Model(torch.nn.Module):
    """A module holding an op as an attribute, as ensembles and EMA copy."""

    def __init__(self, op: object) -> None:
        super().__init__()
        self.op = op
        self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x * self.w).sum()  # type: ignore[operator]


class TestCopy(TestCase):
    def _ops(self) -> list[object]:
        return [sin2, upgraded_sin2, _lambda_op()]

    def test_copy_and_deepcopy_return_the_op(self):
        self.assertIsInstance(upgraded_sin2, torch_autobatch.CustomOpDef)
        for op in self._ops():
            self.assertIs(copy.copy(op), op)
            self.assertIs(copy.deepcopy(op), op)
            self.assertIs(copy.deepcopy({"op": op})["op"], op)

    def test_deepcopy_of_a_module_holding_the_op_uses_its_backward(self):
        x = torch.randn(5, dtype=torch.float64)
        for op in self._ops():
            model = _Model(op)
            clone = copy.deepcopy(model)
            self.assertIs(clone.op, op)
            self.assertIsNot(clone.w, model.w)
            clone.w.data.mul_(0.5)  # the copy's parameters are its own
            clone(x).backward()
            # The registered backward: 2x the true derivative of sin(x * w) in w.
            self.assertEqual(clone.w.grad, 2 * torch.cos(x * clone.w.detach()) * x)
            self.assertIsNone(model.w.grad)
            self.assertEqual(clone(x), torch.sin(x * clone.w.detach()).sum())


class TestPickle(TestCase):
    def test_a_module_level_op_pickles_by_reference(self):
        for op in (sin2, upgraded_sin2):
            for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
                self.assertIs(pickle.loads(pickle.dumps(op, protocol=protocol)), op)
        model = pickle.loads(pickle.dumps(_Model(sin2)))
        self.assertIs(model.op, sin2)

    def test_a_pickled_op_loads_in_a_fresh_process(self):
        # The loading process imports the op's module, as it would a function's.
        payload = pickle.dumps(sin2)
        script = textwrap.dedent(
            f"""
            import pickle, sys, torch
            sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
            op = pickle.loads({payload!r})
            x = torch.ones(3, dtype=torch.float64, requires_grad=True)
            op(x).sum().backward()
            print(op._qualname, torch.allclose(x.grad, 2 * torch.cos(x.detach())))
            """
        )
        if sin2._init_fn.__module__ == "__main__":
            self.skipTest("run as a script: its module is __main__ in the loading process too")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), [f"{NS}::sin2", "True"])

    def test_an_op_without_a_module_level_name_is_refused_naming_it(self):
        @torch_autobatch.custom_op(f"{NS}::local", mutates_args=())
        def local(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        renamed = _lambda_op(f"{NS}::from_lambda")
        for op, qualname in ((local, f"{NS}::local"), (renamed, f"{NS}::from_lambda")):
            with self.assertRaisesRegex(pickle.PicklingError, f"cannot pickle the op {qualname}: .*module-level"):
                pickle.dumps(op)


if __name__ == "__main__":
    run_tests()
