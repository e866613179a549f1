"""torch_autobatch: Python custom operators that work under every torch.func transform.

Public API:

- :func:`custom_op` — a drop-in for :func:`torch.library.custom_op`;
- :func:`autobatch` — the same for an operator that exists already (a third
  party's ``torch.library.custom_op``), in place;
- :class:`CustomOpDef` — the operator it returns (``register_autograd``,
  ``register_fake``, ``register_kernel``);
- :class:`BackwardContext` — the ``ctx`` of ``setup_context``, ``backward`` and ``jvp``;
- :func:`trace` — records the aten ops run in forward *and* backward (``print(t)``, ``t.to_fx()``);
- :func:`current_trace` — the trace recording this thread's ops, or None;
- :class:`UntestedTorchWarning` — warned at import on an untested torch
  (with ``TORCH_AUTOBATCH_ALLOW_UNTESTED_TORCH=1``; otherwise an ImportError);
- :class:`Trace` — what :func:`trace` returns; :class:`TraceGraphs` — what ``Trace.to_fx()`` returns;
- :class:`TracedDrawError` — a ``RuntimeError``: a backward traced into a graph would redraw
  a random op's numbers (NOTE [A traced recompute cannot replay draws]).
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from ._compat import REBUILD, UntestedTorchWarning, check_running_torch

check_running_torch()  # before the extension loads: NOTE [Supported torch window]

try:
    from . import _C  # noqa: F401  (its import registers nothing by itself)
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "torch_autobatch's C++ extension (torch_autobatch._C) failed to load: "
        f"{e}. Rebuild it against the installed torch {torch.__version__} with "
        f"`{REBUILD}` from the project root."
    ) from e

# NOTE [Lazy heavy imports]
# `import torch_autobatch` must cost little on top of `import torch` (a script
# that only calls an op pays it on every start). Modules that torch itself does
# not import and that take long to load -- torch.fx.experimental.symbolic_shapes
# (and so sympy, ~0.3-2 s), torch._subclasses.fake_tensor, torch._dynamo,
# torch._inductor -- are imported inside the function that needs them, never at
# module level here; the feature that needs one (a dynamic-shape trace, a fake
# mode, torch.compile) has loaded it already or pays for it once, when used.
# test/test_import.py checks, in a fresh process, that none of them is imported.
from ._moved import install as _install_moved
from ._upgrade import autobatch
from ._version import __version__ as __version__
from .core._autograd import BackwardContext
from .lift._lifted import LiftedFunction, from_function
from .op._custom_op import CustomOpDef, custom_op
from .tracing._fx import TraceGraphs
from .tracing._tracer import Trace, current_trace, trace
from .vmap._traced_draws import TracedDrawError

_install_moved()  # NOTE [Modules moved into folders]
del _install_moved

__all__ = [
    "BackwardContext",
    "UntestedTorchWarning",
    "autobatch",
    "CustomOpDef",
    "Trace",
    "TraceGraphs",
    "TracedDrawError",
    "current_trace",
    "custom_op",
    "from_function",
    "LiftedFunction",
    "trace",
]
