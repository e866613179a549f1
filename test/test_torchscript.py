"""``torch.jit.script`` of code that calls an op scripts the op's node (NOTE [TorchScript sees the op]).

torch.library's ``CustomOpDef`` scripts, called as a global, to a Python
call (a ``python_value`` node ``torch.jit.save`` refuses); as a module
attribute it does not script at all. Ours scripts either way to the op's
node ``ns::name``, as ``torch.ops.ns.name(x)`` does, and saves and loads.
"""

import io
import warnings

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

NS = "tab_script"


@torch_autobatch.custom_op(f"{NS}::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


@torch_autobatch.custom_op(f"{NS}::scale.by_float", mutates_args=(), schema="(Tensor x, float s) -> Tensor")
def scale_by_float(x, s):
    return x * s


class _Global(torch.nn.Module):
    """Calls the op as a module-level name, with a keyword argument."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softclip(x, scale=2.0) + 1


class _Attribute(torch.nn.Module):
    """Holds the op as an attribute (``self.op = op``)."""

    def __init__(self) -> None:
        super().__init__()
        self.op = softclip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, 3.0)


class _Overload(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_by_float(x, 3.0)


def _round_trip(scripted: torch.jit.ScriptModule) -> torch.jit.ScriptModule:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.save/load
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        return torch.jit.load(buffer)


class TestTorchScript(TestCase):
    def _check(self, module: torch.nn.Module, node: str) -> None:
        scripted = torch.jit.script(module)
        self.assertIn(f"{node}(", str(scripted.graph))
        self.assertNotIn("python_value", str(scripted.graph))
        x = torch.randn(4, 3)
        self.assertEqual(scripted(x), module(x))
        loaded = _round_trip(scripted)
        self.assertIn(f"{node}(", str(loaded.graph))
        self.assertEqual(loaded(x), module(x))

    def test_module_calling_the_op_as_a_global_scripts_saves_and_loads(self):
        self._check(_Global(), f"{NS}::softclip")

    def test_module_holding_the_op_as_an_attribute_scripts_saves_and_loads(self):
        self._check(_Attribute(), f"{NS}::softclip")

    def test_an_overload_name_scripts_to_its_operator(self):
        self._check(_Overload(), f"{NS}::scale")

    def test_scripted_function_is_the_same_as_calling_torch_ops(self):
        def by_op(x: torch.Tensor) -> torch.Tensor:
            return softclip(x, 2.0)

        def by_name(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.tab_script.softclip(x, 2.0)

        ours, theirs = torch.jit.script(by_op), torch.jit.script(by_name)
        self.assertEqual(
            [n.kind() for n in ours.graph.nodes()],
            [n.kind() for n in theirs.graph.nodes()],
        )
        x = torch.randn(5)
        self.assertEqual(ours(x), theirs(x))

    def test_the_entry_goes_with_the_definition(self):
        # Keyed by id(): gone before the op can die and its id be reused.
        op = torch_autobatch.custom_op(
            f"{NS}::short_lived", lambda x: 2 * x, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        table = torch.jit._builtins._get_builtin_table()
        self.assertEqual(table.get(id(op)), f"{NS}::short_lived")
        op._lib._destroy()
        self.assertNotIn(id(op), table)


if __name__ == "__main__":
    run_tests()
