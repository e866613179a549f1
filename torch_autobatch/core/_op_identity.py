"""An op is a global, as a function is: ``copy`` returns it, ``pickle`` refers to it by name.

NOTE [An op is a global]
An operator is one entry in the dispatcher, named ``ns::name``: there is no
second copy of it to make. A copy holding the same registration would share
every kernel and rule with the original, and a deepcopy cannot be made at
all (torch's ``CustomOpDef`` holds its ``torch.library.Library``, whose
``_DispatchModule`` cannot be pickled: "cannot pickle '_DispatchModule'"), yet
``copy.deepcopy(model)`` of an ``nn.Module`` holding an op as an attribute is
what ensembles, EMA and model averaging do. So ``copy.copy(op)`` and
``copy.deepcopy(op)`` return the op itself, as they return a function.

``pickle`` does for an op what it does for a function: it records where the
op is defined, the module and name of the function ``custom_op`` decorated
(``torch.save(model)`` of a module holding the op, a multiprocessing worker's
argument), and loading imports that module and finds the op there, after
checking at dump time that the name leads back to this very op. An op
reachable under no such name (made inside a function, or by ``custom_op``
called on a function later bound to another name) is refused with an error
naming the op, as an op of ``torch.library.custom_op`` is refused (which
cannot be pickled at all on torch 2.13: its function's name leads to the op,
not the function, and its ``Library`` cannot be pickled).
"""

from __future__ import annotations

import importlib
import pickle
from typing import Any

__all__ = ["OpIdentity"]


def _op_by_reference(module: str, qualname: str) -> Any:
    """The object named ``qualname`` (dotted in a class) in ``module``: how an op unpickles.

    Raises ImportError or AttributeError where there is none (NOTE [An op is a global]).
    """
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class OpIdentity:
    """``copy``, ``deepcopy`` and ``pickle`` of an op (NOTE [An op is a global]).

    A mixin of :class:`torch_autobatch.CustomOpDef`: it reads the op's
    ``_qualname`` and ``_init_fn`` (torch's ``CustomOpDef`` attributes).
    """

    _qualname: str
    _init_fn: Any

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        fn = self._init_fn
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        where = f"{module}.{qualname}" if module and qualname else "no module-level name"
        found: Any = None
        if module and qualname and "<locals>" not in qualname:
            try:
                found = _op_by_reference(module, qualname)
            except Exception:  # noqa: S110  (not importable or not there: refused below)
                pass
        if found is not self:
            raise pickle.PicklingError(
                f"torch_autobatch: cannot pickle the op {self._qualname}: an op is pickled by reference, "
                f"as a function is, to the module-level name it is defined under ({where}), but that name "
                f"does not lead to this op. Define the op at the top level of a module, with "
                f"@torch_autobatch.custom_op on the function whose name it keeps (NOTE [An op is a global])."
            )
        return (_op_by_reference, (module, qualname))
