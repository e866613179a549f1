"""AOTInductor packages of models that use our ops (issue 37): NOTE [AOTInductor names a Python op].

A fused op's function is compiled into the ``.pt2``: the package runs in a
fresh process that imports torch only, not this package nor the op's module,
and from C++ (``test/cpp/aoti_run.cpp``, linked with libtorch, not libpython).
An op that stays a Python call (``compile="opaque"``, a function that leaves
torch) makes ``aoti_compile_and_package`` warn, naming the op and why.
Each package takes ~10-20 s to compile on a 2-core machine (a C++ build).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
import warnings

import numpy as np
import torch
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils import cpp_extension

import torch_autobatch


@torch_autobatch.custom_op("tab_aoti::sin_mul", mutates_args=())
def sin_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * y + x.sum(-1, keepdim=True)


sin_mul.register_autograd(  # a 2x backward, which inference never runs
    lambda ctx, g: (2 * g * (torch.cos(ctx.x) * ctx.y + 1), 2 * g * torch.sin(ctx.x)),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]) or setattr(ctx, "y", inputs[1]),
)


@torch_autobatch.custom_op("tab_aoti::softclip_opaque", mutates_args=(), compile="opaque")
def softclip_opaque(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


@torch_autobatch.custom_op("tab_aoti::numpy_tanh", mutates_args=())
def numpy_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.tanh(x.numpy(force=True)))  # leaves torch: Inductor cannot trace it


@numpy_tanh.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Fused(torch.nn.Module):
    def __init__(self, plain: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self.plain = plain

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return torch.sin(h) * w + h.sum(-1, keepdim=True) if self.plain else sin_mul(h, w)


class StaysPython(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return numpy_tanh(softclip_opaque(x, 2.0))


def _package(model: torch.nn.Module, args: tuple[torch.Tensor, ...], path: str) -> list[str]:
    """Packages ``model`` at ``path``; returns torch_autobatch's warnings."""
    ep = torch.export.export(model, args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
    return [str(w.message) for w in caught if str(w.message).startswith("torch_autobatch")]


# Loads the package and runs it, in a process that imports torch only.
_LOAD = textwrap.dedent(
    """
    import sys, torch
    x, w = torch.load(sys.argv[2])
    out = torch._inductor.aoti_load_package(sys.argv[1])(x, w)
    torch.save(out, sys.argv[3])
    leaked = sorted(m for m in sys.modules if m.startswith(("torch_autobatch", "test_aoti")))
    assert not leaked, leaked
    """
)


def _cpp_build_command(target: str) -> list[str]:
    """g++ building test/cpp/aoti_run.cpp against the installed torch's headers and libtorch (a few seconds)."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpp", "aoti_run.cpp")
    libs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "g++",
        "-std=c++20",  # torch >= 2.14 needs it; 2.13's headers take it
        "-O1",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{d}" for d in cpp_extension.include_paths()),
        source,
        "-o",
        target,
        *(f"-L{d}" for d in libs),
        *(f"-Wl,-rpath,{d}" for d in libs),
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
    ]


class TestAOTInductor(TestCase):
    def test_fused_op_runs_in_a_process_without_its_module(self):
        x, w = torch.randn(4, 8), torch.randn(8)
        with tempfile.TemporaryDirectory() as tmp:
            pt2, inputs, output = (os.path.join(tmp, n) for n in ("m.pt2", "in.pt", "out.pt"))
            self.assertEqual(_package(Fused(plain=False), (x, w), pt2), [])  # compiled in: no warning
            torch.save((x, w), inputs)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            subprocess.run(
                [sys.executable, "-c", _LOAD, pt2, inputs, output], check=True, timeout=300, env=env, cwd=tmp
            )
            out = torch.load(output)
        with torch.no_grad():
            torch.testing.assert_close(out, Fused(plain=True)(x, w))

    @unittest.skipIf(shutil.which("g++") is None, "needs a C++ compiler")
    def test_fused_op_runs_from_cpp_without_python(self):
        # test/cpp/aoti_run.cpp links libtorch only; it runs the package with no Python in the process
        x, w = torch.randn(4, 8), torch.randn(8)
        with tempfile.TemporaryDirectory() as tmp:
            pt2, runner, output = (os.path.join(tmp, n) for n in ("m.pt2", "aoti_run", "out.bin"))
            self.assertEqual(_package(Fused(plain=False), (x, w), pt2), [])
            subprocess.run(_cpp_build_command(runner), check=True, timeout=300, capture_output=True)
            self.assertNotIn("libpython", subprocess.run(["ldd", runner], capture_output=True, text=True).stdout)
            inputs = []
            for name, t in (("x", x), ("w", w)):
                t.numpy().tofile(os.path.join(tmp, f"{name}.bin"))
                inputs.append(os.path.join(tmp, f"{name}.bin") + ":" + ",".join(map(str, t.shape)))
            # the package's model library links libtorch too: the loader finds it as a deployment would
            env = {"LD_LIBRARY_PATH": os.pathsep.join(cpp_extension.library_paths())}
            subprocess.run([runner, pt2, output, *inputs], check=True, timeout=300, env=env, cwd=tmp)
            out = torch.from_numpy(np.fromfile(output, dtype=np.float32)).reshape(4, 8)
        with torch.no_grad():
            torch.testing.assert_close(out, Fused(plain=True)(x, w))

    def test_ops_that_stay_python_calls_warn(self):
        with tempfile.TemporaryDirectory() as tmp:
            messages = _package(StaysPython(), (torch.randn(3, 4),), os.path.join(tmp, "m.pt2"))
        self.assertEqual(len(messages), 2, messages)
        untraced, opaque = sorted(messages)
        self.assertIn("op tab_aoti::numpy_tanh", untraced)
        self.assertIn("its function could not be traced into the graph (it leaves torch", untraced)
        self.assertIn("op tab_aoti::softclip_opaque", opaque)
        self.assertIn('defined with compile="opaque"', opaque)
        for message in messages:
            self.assertIn("imported the op's module (test_aoti)", message)
            self.assertIn("never from libtorch (C++) alone", message)

    def test_no_warning_outside_aot_mode(self):
        compiled = torch.compile(StaysPython(), backend="inductor", fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(torch.randn(3, 4))
        self.assertFalse([w for w in caught if str(w.message).startswith("torch_autobatch")])


if __name__ == "__main__":
    run_tests()
