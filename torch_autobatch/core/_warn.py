"""The user's line: torch's warnings from inside our overrides reported there, and where an op was defined.

NOTE [torch's warnings point at the user's line]
A method we override that calls torch's (``super().register_fake(fn)``)
would make torch's ``warnings.warn(..., stacklevel=2)`` point at our line in
``op/_custom_op.py``, not at the user's call: where torch.library's own op
reports it (the "fake registration ... is unnecessary" warning for an op
tagged ``torch.Tag.inplace`` or ``torch.Tag.out``, say), and where the
user's warning filters (``module=``, ``lineno``) and the once-per-line
registry look. :func:`call_warning_at_caller` runs the call recording its
warnings, then issues each again one frame further out, at the line that
called our method, under the user's filters.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # torch_autobatch/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def user_source() -> str:
    """``file:line`` of the innermost caller outside torch_autobatch and torch (the user's definition)."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_PACKAGE_DIR + os.sep) or path.startswith(_TORCH_DIR + os.sep)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def call_warning_at_caller(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its warnings issued at the line that called the caller of this function."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    for w in caught:
        # 1: this function, 2: our method (its caller), 3: the user's line.
        warnings.warn(w.message, stacklevel=3)
    return result
