"""Run code once a heavy module of torch has been imported, without importing it (NOTE [Lazy heavy imports])."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Optional

__all__ = ["after_import", "is_loaded"]

_lock = threading.Lock()
# Module name -> the callbacks waiting for it to execute.
_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}


def is_loaded(fullname: str) -> Optional[ModuleType]:
    """The module, if it is imported and has finished executing; else None."""
    module = sys.modules.get(fullname)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def after_import(fullname: str, callback: Callable[[ModuleType], None]) -> None:
    """Runs ``callback(module)`` once module ``fullname`` has executed: now if it
    has, else right after it is first imported (a one-shot import hook)."""
    module = is_loaded(fullname)
    if module is not None:
        callback(module)
        return
    with _lock:
        if fullname in _waiting:
            _waiting[fullname].append(callback)
            return
        _waiting[fullname] = [callback]
        sys.meta_path.insert(0, _AfterImport(fullname))


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs the callbacks waiting for one module once it has executed."""

    def __init__(self, fullname: str) -> None:
        self._fullname = fullname

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self._fullname:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            callbacks = _waiting.pop(self._fullname, [])
        for callback in callbacks:
            callback(module)
