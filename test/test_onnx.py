"""ONNX export of models that use our ops (issue 37): NOTE [ONNX export sees the function].

``torch.onnx.export(..., dynamo=True)`` of a fused op exports its function's
ONNX ops, with no translation table: the same graph as the plain model's,
which onnxruntime runs to the same values. A ``compile="opaque"`` op stays one
node, which the user's ``custom_translation_table`` translates.
"""

from __future__ import annotations

import importlib.util
import unittest
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

HAS_EXPORTER = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxscript"))
try:
    import onnxruntime

    HAS_ORT = True
except ImportError:
    HAS_ORT = False
NO_EXPORTER = "torch.onnx.export(dynamo=True) needs onnx and onnxscript: pip install --no-deps onnx onnxscript onnx-ir ml_dtypes protobuf"
NO_ORT = "onnxruntime cannot be imported (pip install --no-deps onnxruntime flatbuffers): the graphs are still compared"


# --- the README's example op, verbatim but for its namespace ---
@torch_autobatch.custom_op("tab_onnx::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
    (y,) = ctx.saved_tensors
    return grad_out * (1 - (y / ctx.scale) ** 2), None


softclip.register_autograd(_backward, setup_context=_setup_context)


@torch_autobatch.custom_op("tab_onnx::sin_mul", mutates_args=())
def sin_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


# A 2x backward: what inference never runs, so the export must not see it.
sin_mul.register_autograd(
    lambda ctx, g: (2 * g * (torch.cos(ctx.x) * ctx.y + 1), 2 * g * torch.sin(ctx.x)),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]) or setattr(ctx, "y", inputs[1]),
)


@torch_autobatch.custom_op("tab_onnx::softclip_opaque", mutates_args=(), compile="opaque")
def softclip_opaque(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


class Readme(torch.nn.Module):
    def __init__(self, clip: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.clip(x, 2.0)


class TwoOps(torch.nn.Module):
    def __init__(self, plain: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self.plain = plain

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.plain:
            return 3.0 * torch.tanh((torch.sin(h) * w + h.sum(-1, keepdim=True)) / 3.0)
        return softclip(sin_mul(h, w), 3.0)


def _plain_softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


def _export(model: torch.nn.Module, args: tuple[Any, ...], **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and version notes
        return torch.onnx.export(model, args, dynamo=True, verbose=False, **kwargs)


def _op_types(program: Any) -> list[str]:
    return [node.op_type for node in program.model_proto.graph.node]


def _run_ort(program: Any, *args: torch.Tensor) -> list[torch.Tensor]:
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    outs = session.run(None, {n: a.numpy() for n, a in zip(names, args)})
    return [torch.from_numpy(o) for o in outs]


def _translate_softclip(x: Any, scale: float) -> Any:
    """The user's ONNX translation: Mul by a folded Reciprocal, where the function's export has a Div."""
    from onnxscript import opset18 as op

    inv = op.Reciprocal(op.Constant(value_float=scale))
    return op.Mul(op.Tanh(op.Mul(x, inv)), op.Constant(value_float=scale))


@unittest.skipIf(not HAS_EXPORTER, NO_EXPORTER)
class TestOnnxFusedOp(TestCase):
    def test_readme_model_exports_the_plain_graph(self):
        x = torch.randn(5, 64)
        ours, plain = _export(Readme(softclip), (x,)), _export(Readme(_plain_softclip), (x,))
        self.assertEqual(_op_types(ours), _op_types(plain))
        self.assertEqual(_op_types(ours), ["Div", "Tanh", "Mul"])
        if HAS_ORT:
            (out,) = _run_ort(ours, x)
            torch.testing.assert_close(out, _plain_softclip(x, 2.0))

    def test_two_ops_with_a_dynamic_batch(self):
        x, w = torch.randn(4, 8), torch.randn(8)
        batch = torch.export.Dim("batch")
        shapes = ({0: batch}, None)
        ours = _export(TwoOps(plain=False), (x, w), dynamic_shapes=shapes)
        plain = _export(TwoOps(plain=True), (x, w), dynamic_shapes=shapes)
        self.assertEqual(_op_types(ours), _op_types(plain))
        if not HAS_ORT:
            self.skipTest(NO_ORT)
        for b in (1, 4, 33):
            xb = torch.randn(b, 8)
            (out,) = _run_ort(ours, xb, w)
            with torch.no_grad():
                torch.testing.assert_close(out, TwoOps(plain=True)(xb, w))

    def test_a_translation_table_wins_over_the_function(self):
        x = torch.randn(3, 4)
        program = _export(Readme(softclip), (x,), custom_translation_table={softclip._opoverload: _translate_softclip})
        self.assertEqual(_op_types(program), ["Mul", "Tanh", "Mul"])  # the function's export: Div, Tanh, Mul

    def test_export_and_run_decompositions_still_keep_one_node(self):
        # Only the ONNX exporter's own table lists the op: torch.export's default does not.
        ep = torch.export.export(Readme(softclip), (torch.randn(3, 4),)).run_decompositions()
        targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        self.assertEqual(targets, [softclip._opoverload])


@unittest.skipIf(not HAS_EXPORTER, NO_EXPORTER)
class TestOnnxOpaqueOp(TestCase):
    def test_opaque_op_is_kept_whole_without_a_table(self):
        with self.assertRaisesRegex(Exception, r"tab_onnx\.softclip_opaque"):
            _export(Readme(softclip_opaque), (torch.randn(3, 4),))

    def test_opaque_op_uses_the_users_table(self):
        x = torch.randn(3, 4)
        program = _export(
            Readme(softclip_opaque),
            (x,),
            custom_translation_table={softclip_opaque._opoverload: _translate_softclip},
        )
        self.assertEqual(_op_types(program), ["Mul", "Tanh", "Mul"])  # the constant Reciprocal is folded
        if HAS_ORT:
            (out,) = _run_ort(program, x)
            torch.testing.assert_close(out, _plain_softclip(x, 2.0))


if __name__ == "__main__":
    run_tests()
