"""The flat package's module names, importable still: pickles and user code that name them keep working.

NOTE [Modules moved into folders]
The package was once 37 modules side by side (``torch_autobatch._custom_op``,
``torch_autobatch._op_identity``, ...). A pickle records the module of each
function it refers to (an op pickles as a call of
``torch_autobatch._op_identity._op_by_reference``: NOTE [An op is a global]),
so a pickle written then names a module that is now
``torch_autobatch.core._op_identity``. Each old name is an alias of the module
that holds its code now: importing it returns that very module (one module
object, one set of globals), so those pickles load and an old private import
gets the same objects. Nothing imports the aliases itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any, Optional

# old name -> the module that holds its code now (both under torch_autobatch.)
MOVED = {
    "_autograd": "core._autograd",
    "_closure": "core._closure",
    "_levels": "core._levels",
    "_per_example": "core._per_example",
    "_schema": "core._schema",
    "_op_identity": "core._op_identity",
    "_import_hook": "core._import_hook",
    "_warn": "core._warn",
    "_tracer": "tracing._tracer",
    "_trace_fx": "tracing._fx",
    "_trace_record": "tracing._record",
    "_vmap_presets": "vmap._presets",
    "_preset_draws": "vmap._preset_draws",
    "_vmap_check": "vmap._check",
    "_traced_vmap": "vmap._traced",
    "_traced_draws": "vmap._traced_draws",
    "_compile": "graphs._compile",
    "_compiled_autograd": "graphs._compiled_autograd",
    "_deploy": "graphs._deploy",
    "_subclass": "graphs._subclass",
    "_custom_op": "op._custom_op",
    "_kernel_side": "op._kernel_side",
    "_vjp": "op._vjp",
    "_vjp_check": "op._vjp_check",
    "_forward_mode": "op._forward_mode",
    "_rule_tangents": "op._rule_tangents",
    "_sac": "op._sac",
    "_lift": "lift._lifted",
    "_lift_compile": "lift._dynamo",
    "_lift_ctx": "lift._ctx",
    "_lift_eager": "lift._eager",
    "_lift_kinds": "lift._kinds",
    "_lift_objects": "lift._objects",
    "_lift_outputs": "lift._outputs",
    "_lift_probe": "lift._probe",
    "_lift_rules": "lift._rules",
    "_lift_transpose": "lift._transpose",
    "_check_batching": "testing._batching",
    "_check_case": "testing._case",
    "_check_derivatives": "testing._derivatives",
    "_check_op": "testing._op",
}
_PREFIX = "torch_autobatch."


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_autobatch.<old name>`` and loads it as the module that holds its code now."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(_PREFIX) or fullname[len(_PREFIX) :] not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(_PREFIX + MOVED[spec.name[len(_PREFIX) :]])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module ran when it was imported under its own name


def install() -> None:
    if not any(isinstance(f, _Aliases) for f in sys.meta_path):
        sys.meta_path.append(_Aliases())
