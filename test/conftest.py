"""pytest configuration for torch_autobatch's tests, and the shared oracles.

The oracles live in ``test/oracles.py`` (see its docstring): plain, typed
functions that the ``TestCase`` methods here call, imported as
``from oracles import twice_grad, vmap_loop, ...``, as ``ops.py`` (the test
operator database) and ``conformance.py`` (the op_db sweep) already are. They
are a module of their own rather than this file's contents because
``conformance.py`` also runs as a script (``python test/conformance.py``),
without pytest, and because pytest owns conftest modules: under
``--import-mode=importlib`` ``import conftest`` does not find this file.

This file puts ``test/`` first on ``sys.path``, so that ``import oracles`` (and
``ops``, ``conformance``) works under every import mode, and re-exports the
oracles, so that ``from conftest import vmap_loop`` works too where pytest's
default import mode makes this file importable. No fixtures: every test here
is a ``TestCase`` method, which pytest fixtures cannot be passed to.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

# Compiled code comes from this session's own compile, never from an on-disk
# cache an earlier run filled: a cache key holds the graph and the op's rules,
# not this package's code, so a stale entry could hide a regression.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="torch_autobatch_test_inductor_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from oracles import *  # noqa: E402,F401,F403  (re-exported: see the docstring)
from oracles import __all__  # noqa: E402,F401
