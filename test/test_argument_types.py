"""Every argument type reaches user code as torch.library.custom_op delivers it, on every path.

NOTE [Op values reach Python by their schema type] (csrc/python_interop.h):
the dispatcher's stack holds a ``ScalarType``, ``Layout`` or ``MemoryFormat``
as an int, and only the schema tells it apart. A path that converts without
the schema hands the user's code ``7`` for ``torch.float64``: ``x.view(dtype)``
silently becomes a reshape. So this is a property over every argument type
``torch.library.infer_schema`` accepts (and the ones only an explicit schema
reaches), checked on every path our C++ hands arguments to Python: the
function (eager, with grad, batched composite, loop, derived tangents,
torch.compile's fake and real runs), ``setup_context``, the jvp's
``setup_context``, the vmap rule, the tracer's listing. The oracle is what the
same op made with ``torch.library.custom_op`` gives its function, eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from oracles import unique_op_name
from torch.func import grad, jvp, vmap
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

_T = torch.ones(2)

# (id, schema type, value, schema default). Without a default the value is
# passed; with one it is left out of the call, and is what the default means.
CASES: list[tuple[str, str, Any, Any]] = [
    ("tensor", "Tensor", _T, None),
    ("opt_tensor_none", "Tensor?", None, None),
    ("opt_tensor", "Tensor?", _T, None),
    ("tensor_list", "Tensor[]", [_T, _T], None),
    ("opt_tensor_list", "Tensor?[]", [_T, None], None),
    ("symint", "SymInt", 3, None),
    ("int", "int", 3, None),
    ("opt_symint_none", "SymInt?", None, None),
    ("opt_symint", "SymInt?", 4, None),
    ("symint_list", "SymInt[]", [1, 2], None),
    ("opt_symint_list", "SymInt[]?", [1, 2], None),
    ("float", "float", 2.5, None),
    ("opt_float", "float?", 2.5, None),
    ("float_list", "float[]", [1.5, 2.5], None),
    ("bool", "bool", True, None),
    ("opt_bool", "bool?", False, None),
    ("bool_list", "bool[]", [True, False], None),
    ("str", "str", "hi", None),
    ("opt_str_none", "str?", None, None),
    ("scalar_int", "Scalar", 2, None),
    ("scalar_float", "Scalar", 2.5, None),
    ("opt_scalar", "Scalar?", 1.5, None),
    ("scalar_list", "Scalar[]", [1, 2.5], None),
    ("dtype_float64", "ScalarType", torch.float64, None),
    ("dtype_uint8", "ScalarType", torch.uint8, None),
    ("dtype_float16", "ScalarType", torch.float16, None),
    ("opt_dtype", "ScalarType?", torch.int8, None),
    ("opt_dtype_none", "ScalarType?", None, None),
    ("dtype_list", "ScalarType[]", [torch.float32, torch.int8], None),
    ("device", "Device", torch.device("cpu"), None),
    ("opt_device", "Device?", torch.device("cpu"), None),
    ("layout", "Layout", torch.sparse_coo, None),
    ("opt_layout", "Layout?", torch.strided, None),
    ("memory_format", "MemoryFormat", torch.channels_last, None),
    ("opt_memory_format", "MemoryFormat?", torch.contiguous_format, None),
    ("generator_none", "Generator?", None, None),
    ("generator", "Generator?", torch.Generator().manual_seed(5), None),
    # Defaults, left out of the call: the value is the default as Python sees it.
    ("default_dtype", "ScalarType", torch.float64, "float64"),
    ("default_opt_dtype", "ScalarType?", None, "None"),
    ("default_layout", "Layout", torch.strided, "strided"),
    ("default_memory_format", "MemoryFormat", torch.contiguous_format, "contiguous_format"),
    ("default_int", "SymInt", 3, "3"),
    ("default_float", "float", 1.5, "1.5"),
    ("default_str", "str", "abc", "'abc'"),
    ("default_bool", "bool", True, "True"),
    ("default_scalar", "Scalar", 2, "2"),
    ("default_int_list", "SymInt[]", [1, 2], "[1, 2]"),
]
CASE_IDS = [c[0] for c in CASES]
_BY_ID = {c[0]: c for c in CASES}
# Where a keyword-only argument is tested too (the value passed by name).
KWARG_ONLY = {"dtype_float64", "layout", "memory_format", "default_dtype", "device", "str"}


ABSENT = ("absent",)  # not passed: torch leaves a defaulted argument to the function's own default


def norm(v: Any) -> Any:
    """What a value is, as a test compares it: its type, and its value for non-tensors."""
    if isinstance(v, torch.Tensor):
        return ("Tensor",)
    if isinstance(v, torch.Generator):
        return ("Generator", v.initial_seed())
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [norm(e) for e in v])
    return (type(v).__name__, v)


def _schema(case_id: str, kwarg_only: bool) -> str:
    _, typ, _, default = _BY_ID[case_id]
    arg = f"{typ} a" + ("" if default is None else f"={default}")
    return f"(Tensor x, *, {arg}) -> Tensor" if kwarg_only else f"(Tensor x, {arg}) -> Tensor"


def _call_args(case_id: str, kwarg_only: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    _, _, value, default = _BY_ID[case_id]
    if default is not None:
        return (), {}
    return ((), {"a": value}) if kwarg_only else ((value,), {})


_REFERENCE: dict[tuple[str, bool], Any] = {}


def _received(args: tuple[Any, ...], kwargs: dict[str, Any], kwarg_only: bool) -> Any:
    if kwarg_only:
        return norm(kwargs["a"]) if "a" in kwargs else ABSENT
    return norm(args[0]) if args else ABSENT


def expected(case_id: str, kwarg_only: bool, where: str) -> Any:
    """What user code at ``where`` must receive: the function and the vmap rule
    what torch.library's function receives; setup_context every argument."""
    if where in ("function", "vmap rule"):
        return reference(case_id, kwarg_only)
    return norm(_BY_ID[case_id][2])


def reference(case_id: str, kwarg_only: bool) -> Any:
    """What torch.library.custom_op's function receives for the argument, eagerly."""
    key = (case_id, kwarg_only)
    if key not in _REFERENCE:
        seen = []

        def fn(x, *args, **kwargs):
            seen.append(_received(args, kwargs, kwarg_only))
            return x.clone()

        name = unique_op_name("tab_argtypes_ref")
        op = torch.library.custom_op(name, fn, mutates_args=(), schema=_schema(case_id, kwarg_only))
        args, kwargs = _call_args(case_id, kwarg_only)
        op(torch.ones(2), *args, **kwargs)
        _REFERENCE[key] = seen[0]
    return _REFERENCE[key]


class Recorder:
    """A torch_autobatch op whose every piece of user code records what it got for ``a``."""

    def __init__(self, case_id: str, kwarg_only: bool, variant: str) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.kwarg_only = kwarg_only
        schema = _schema(case_id, kwarg_only)
        record = self.record

        def fn(x, *args, **kwargs):
            record("function", args, kwargs)
            return x * 2

        name = unique_op_name("tab_argtypes")
        self.op = torch_autobatch.custom_op(
            name, fn, mutates_args=(), schema=schema, vmap="loop" if variant == "loop" else "auto"
        )

        def setup_context(ctx, inputs, *rest):
            # (ctx, inputs, output) or (ctx, inputs, keyword_only_inputs, output)
            record("setup_context", inputs[1:], rest[0] if len(rest) == 2 else {})

        self.op.register_autograd(lambda ctx, g: (2 * g, None), setup_context=setup_context)
        if variant == "jvp":

            def jvp_setup(ctx, inputs, *rest):
                record("jvp setup_context", inputs[1:], rest[0] if len(rest) == 2 else {})

            self.op.register_jvp(lambda ctx, tx, *rest: 2 * tx, setup_context=jvp_setup)
        if variant == "rule":

            def rule(info, in_dims, x, *args, **kwargs):
                record("vmap rule", args, kwargs)
                return x * 2, in_dims[0]

            self.op.register_vmap(rule)

    def record(self, where: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.seen.append((where, _received(args, kwargs, self.kwarg_only)))

    def take(self) -> list[tuple[str, Any]]:
        seen, self.seen = self.seen, []
        return seen


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape or (2,), dtype=torch.float64)


# path -> (variant, run(op, args, kwargs), the user code that must have run)
PATHS: dict[str, tuple[str, Callable[..., Any], set[str]]] = {
    "eager": ("plain", lambda op, a, k: op(_x(), *a, **k), {"function"}),
    "requires_grad": (
        "plain",
        lambda op, a, k: op(_x().requires_grad_(), *a, **k).sum().backward(),
        {"function", "setup_context"},
    ),
    "vmap": ("plain", lambda op, a, k: vmap(lambda x: op(x, *a, **k))(_x(3, 2)), {"function"}),
    "vmap_requires_grad": (
        "plain",
        lambda op, a, k: vmap(lambda x: op(x, *a, **k))(_x(3, 2).requires_grad_()).sum().backward(),
        {"function", "setup_context"},
    ),
    "grad": (
        "plain",
        lambda op, a, k: grad(lambda x: op(x, *a, **k).sum())(_x()),
        {"function", "setup_context"},
    ),
    "vmap_grad": (
        "plain",
        lambda op, a, k: vmap(grad(lambda x: op(x, *a, **k).sum()))(_x(3, 2)),
        {"function", "setup_context"},
    ),
    "jvp_derived": (
        "plain",
        lambda op, a, k: jvp(lambda x: op(x, *a, **k), (_x(),), (_x(),)),
        {"function"},
    ),
    "jvp_registered": (
        "jvp",
        lambda op, a, k: jvp(lambda x: op(x, *a, **k), (_x(),), (_x(),)),
        {"function", "jvp setup_context"},
    ),
    "jvp_of_vmap_registered": (
        "jvp",
        lambda op, a, k: jvp(vmap(lambda x: op(x, *a, **k)), (_x(3, 2),), (_x(3, 2),)),
        {"function", "jvp setup_context"},
    ),
    "vmap_loop": ("loop", lambda op, a, k: vmap(lambda x: op(x, *a, **k))(_x(3, 2)), {"function"}),
    "vmap_rule": ("rule", lambda op, a, k: vmap(lambda x: op(x, *a, **k))(_x(3, 2)), {"vmap rule"}),
}


class TestArgumentTypes(TestCase):
    def _check(self, case_id: str, kwarg_only: bool, path: str) -> None:
        variant, run, must_run = PATHS[path]
        rec = Recorder(case_id, kwarg_only, variant)
        args, kwargs = _call_args(case_id, kwarg_only)
        run(rec.op, args, kwargs)
        seen = rec.take()
        self.assertTrue(must_run <= {where for where, _ in seen}, msg=f"{path}: ran {seen}")
        for where, got in seen:
            self.assertEqual(got, expected(case_id, kwarg_only, where), msg=f"{case_id} on {path}, in the {where}")

    @parametrize("path", list(PATHS))
    @parametrize("case_id", CASE_IDS)
    def test_positional(self, case_id, path):
        self._check(case_id, False, path)

    @parametrize("path", ["eager", "requires_grad", "vmap", "grad", "jvp_registered", "vmap_rule"])
    @parametrize("case_id", sorted(KWARG_ONLY))
    def test_keyword_only(self, case_id, path):
        self._check(case_id, True, path)

    @parametrize("case_id", CASE_IDS)
    def test_compile(self, case_id):
        # The fake kernel (the function on fake tensors) while Dynamo traces,
        # then the real kernel at run time.
        if case_id == "generator":
            self.skipTest("Dynamo does not take a torch.Generator argument to a custom op (torch.library's either)")
        rec = Recorder(case_id, False, "plain")
        args, kwargs = _call_args(case_id, False)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: rec.op(x, *args, **kwargs), backend="aot_eager", fullgraph=True)
        compiled(_x().requires_grad_()).sum().backward()
        seen = rec.take()
        self.assertTrue({"function", "setup_context"} <= {w for w, _ in seen}, msg=seen)
        for where, got in seen:
            self.assertEqual(got, expected(case_id, False, where), msg=f"{case_id} in the {where}")

    @parametrize("case_id", CASE_IDS)
    def test_tracer_listing(self, case_id):
        rec = Recorder(case_id, False, "plain")
        args, kwargs = _call_args(case_id, False)
        with torch_autobatch.trace() as t:
            rec.op(_x(), *args, **kwargs)
        t._snapshot()
        (entry,) = [e for e in t._entries if e.func is rec.op.opoverload]
        pos_args, kw = entry.args, entry.kwargs
        if "a" not in kw and len(pos_args) < 2:
            self.assertIsNotNone(_BY_ID[case_id][3], msg="only a default may be left out")
            return
        listed = kw["a"] if "a" in kw else pos_args[1]
        want = expected(case_id, False, "listing")
        if want[0] == "Tensor" or (want[0] == "list" and want[1] and want[1][0] == ("Tensor",)):
            return  # tensors are listed as trace values
        self.assertEqual(norm(listed), want, msg=f"{case_id} in the tracer's listing")


class TestDtypeArgumentSemantics(TestCase):
    """The issue's examples: a dtype argument used as a dtype."""

    def test_view_and_to(self):
        @torch_autobatch.custom_op("tab_argtypes::view_as_dtype", mutates_args=())
        def view_as(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
            return x.to(dtype) * 2 if dtype == torch.float64 else x.view(dtype).clone()

        x = torch.ones(4)
        self.assertEqual(view_as(x), torch.full((4,), 2.0, dtype=torch.float64))
        self.assertEqual(view_as(x, torch.uint8), x.view(torch.uint8))
        self.assertEqual(vmap(view_as)(torch.ones(3, 4)), torch.full((3, 4), 2.0, dtype=torch.float64))

    def test_upgraded_third_party_op(self):
        @torch.library.custom_op("tab_argtypes::third_party_scale_if", mutates_args=())
        def scale_if(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
            return x * 2 if dtype == torch.float64 else x.clone()

        before = scale_if(torch.ones(2))
        op = torch_autobatch.autobatch(scale_if)
        self.assertEqual(op(torch.ones(2)), before)
        self.assertEqual(op(torch.ones(2)), torch.full((2,), 2.0))


instantiate_parametrized_tests(TestArgumentTypes)

if __name__ == "__main__":
    run_tests()
