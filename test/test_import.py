"""``import torch_autobatch`` costs little on top of ``import torch`` (issue 33, item 10).

The time itself is noisy on a shared machine, so the test checks its
deterministic proxy: the heavy modules (sympy through
``torch.fx.experimental.symbolic_shapes``, ~0.3-2 s; the fake-tensor and
dynamo machinery) that ``import torch_autobatch`` pulls in beyond what
``import torch`` itself has already imported, in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

# Modules that are slow to import and that only some features need: each is
# imported inside the function that uses it (NOTE [Lazy heavy imports]).
HEAVY = (
    "sympy",
    "mpmath",
    "torch.utils._sympy",
    "torch.fx.experimental.symbolic_shapes",
    "torch._subclasses.fake_tensor",
    "torch._dynamo",
    "torch._inductor",
    "torch._functorch.aot_autograd",
    "torch.onnx",
)


def _modules_new_with_import() -> list[str]:
    """The modules ``import torch_autobatch`` adds to those ``import torch`` imported, in a fresh process."""
    script = textwrap.dedent(
        """
        import json, sys
        import torch
        before = set(sys.modules)
        import torch_autobatch
        print(json.dumps(sorted(set(sys.modules) - before)))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


class TestImportCost(TestCase):
    def test_import_pulls_in_no_heavy_module_torch_did_not(self):
        added = _modules_new_with_import()
        self.assertIn("torch_autobatch._C", added)  # the import did run
        heavy = sorted(m for m in added if any(m == h or m.startswith(h + ".") for h in HEAVY))
        self.assertFalse(heavy, f"import torch_autobatch imports {heavy} (torch alone imported the rest)")


def _doubling_op(name: str, bad_fwd: object) -> torch_autobatch.CustomOpDef:
    """``2 * x`` whose register_vjp fwd is ``bad_fwd`` (an output of another shape)."""

    @torch_autobatch.custom_op(f"tab_import::{name}", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    double.register_vjp(bad_fwd, lambda residuals, g: 2 * g)
    return double


class TestLazilyImportedPaths(TestCase):
    """The two checks of register_vjp's fwd that import their modules when they run."""

    def test_fwd_check_in_a_fake_mode_of_its_own(self):
        op = _doubling_op("fake_mode", lambda x: ((2 * x)[None], ()))

        @op.register_fake
        def _(x: torch.Tensor) -> torch.Tensor:
            if x.is_meta:  # so that the check runs it in a FakeTensorMode
                raise RuntimeError("no meta")
            return torch.empty_like(x)

        x = torch.randn(3, requires_grad=True)
        # device=cpu: the fake kernel ran on fake tensors, not meta ones.
        with self.assertRaisesRegex(TypeError, r"returned Tensor\(shape=\[1, 3\].*shape=\[3\].*device=cpu"):
            op(x).sum().backward()

    def test_fwd_check_with_symbolic_sizes(self):
        op = _doubling_op("symbolic", lambda x: ((2 * x)[1:], ()))  # size s0 - 1 for s0: differs for certain

        @torch.compile(dynamic=True, backend="aot_eager", fullgraph=True)
        def grad_of_op(x: torch.Tensor) -> torch.Tensor:
            return torch.func.grad(lambda x: op(x).sum())(x)

        with self.assertRaisesRegex(Exception, r"must return the op\\?'s output"):
            grad_of_op(torch.randn(5))


if __name__ == "__main__":
    run_tests()
