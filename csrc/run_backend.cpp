// How both kernels run the op's own function below them: run_backend.
//
// NOTE [Calling the composite directly]
// Our Autograd and FuncTorchBatched kernels run the op's own function by
// redispatching below themselves. For an op that torch.library's CustomOpDef
// registered (ours, or one upgraded in place), the kernel the dispatcher then
// finds at a dense backend key with no kernel of its own is the one
// register_kernel put at CompositeExplicitAutograd: torch's PythonKernelHolder
// calling `backend_impl`, which calls `_backend_fns[None]` (torch._disable_dynamo
// around the set_kernel_enabled check around the function) and then checks the
// outputs alias no input. That chain was ~3.4 of the 6.7 us an unbatched
// call added over the plain function (benchmarks/bench_call_path.py), and
// ~4 of the ~28 us a call under vmap added.
// When the dispatcher would pick exactly that kernel, run_backend calls
// `_backend_fns[None]` itself:
// - the keys left are those the dispatcher sees (`ks`): the highest must be a
//   dense backend (nothing in between: Python, Functionalize, Conjugate, ...
//   go the dispatcher's way) with no kernel registered at that key itself
//   (register_kernel("cpu"), torch.library.impl(..., "CPU"), a fake at Meta);
// - the schema declares no aliasing or mutation (backend_impl's return
//   checks for in-place and out= ops stay torch's);
// - backend_impl's aliasing check is the calling kernel's check_no_aliasing,
//   which both kernels run anyway; only when an output does alias is torch's
//   check called, for torch's error (run_backend returns true for that);
// - torch._disable_dynamo is skipped only when it would do nothing: no Dynamo
//   frame callback is set on this thread and torch.export is not running.
//   Otherwise the wrapper is called as torch calls it;
// - the set_kernel_enabled check is read inline (NOTE [The set_kernel_enabled
//   check, inline]).
// The one registration the dispatcher does not let us see is a Python
// kernel that overrides CompositeExplicitAutograd by hand
// (Library.impl(..., allow_override=True), which torch warns about); such an
// op is not a CustomOpDef any more in torch's own sense either (its
// _backend_fns no longer run).
#include "op_state.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace torch_autobatch {
namespace {

// Looked up once, when torch_autobatch._C is imported (init_composite_call):
// a function-local static initialised with Python calls could deadlock with
// the GIL.
PyObject* g_get_eval_frame_callback = nullptr; // torch._C._dynamo.eval_frame
PyObject* g_torch_compiler = nullptr; // torch.compiler (_is_exporting_flag)
PyObject* g_wrapped = nullptr; // "__wrapped__"
PyObject* g_name = nullptr; // "__name__"
PyObject* g_wrapped_fn = nullptr; // "wrapped_fn"
PyObject* g_is_exporting_flag = nullptr; // "_is_exporting_flag"
PyObject* g_disabled_kernel = nullptr; // "_disabled_kernel"

// Would torch._disable_dynamo change anything around a call made now?
bool dynamo_wrapper_needed() {
  if (g_get_eval_frame_callback == nullptr || g_torch_compiler == nullptr) {
    return true; // a torch without these: keep torch's wrapper
  }
  PyObject* callback = PyObject_CallNoArgs(g_get_eval_frame_callback);
  if (callback == nullptr) {
    throw py::error_already_set();
  }
  const bool no_callback = callback == Py_None;
  Py_DECREF(callback);
  if (!no_callback) {
    return true;
  }
  PyObject* exporting = PyObject_GetAttr(g_torch_compiler, g_is_exporting_flag);
  if (exporting == nullptr) {
    PyErr_Clear();
    return true;
  }
  const bool is_exporting = exporting != Py_False;
  Py_DECREF(exporting);
  return is_exporting;
}

// Is `fn` register_kernel's `wrapped_fn` (the set_kernel_enabled check),
// as in every torch we support? A torch that wraps differently keeps its
// whole wrapper.
bool is_kernel_enabled_check(PyObject* fn) {
  PyObject* name = PyObject_GetAttr(fn, g_name);
  if (name == nullptr) {
    PyErr_Clear();
    return false;
  }
  const int same = PyUnicode_Check(name) ? PyUnicode_Compare(name, g_wrapped_fn) : 1;
  Py_DECREF(name);
  return same == 0;
}

// NOTE [The set_kernel_enabled check, inline]
// register_kernel's `wrapped_fn` is, in every torch we support,
//     if device_type in self._disabled_kernel: return self._init_fn(*args, **kwargs)
//     else: return fn(*args, **kwargs)
// with `device_type`, `fn` and `self` its closure cells. Where the kernel is
// not disabled, we call `fn` ourselves: one Python frame less on every call
// (~0.2 us). Recognised by its code object's free variables, looked up once:
// any other code keeps `wrapped_fn` itself.
struct KernelEnabledCheck {
  PyObject* code = nullptr; // wrapped_fn's code object (a constant of torch's module), once seen
  Py_ssize_t device_type = -1, fn = -1, self = -1; // their indices in the closure
};
KernelEnabledCheck g_check;

bool learn_kernel_enabled_check(PyObject* code) {
  PyObject* freevars = PyObject_GetAttrString(code, "co_freevars");
  if (freevars == nullptr) {
    PyErr_Clear();
    return false;
  }
  const py::object owned = py::reinterpret_steal<py::object>(freevars);
  if (!PyTuple_Check(freevars) || PyTuple_GET_SIZE(freevars) != 3) {
    return false;
  }
  KernelEnabledCheck check;
  for (Py_ssize_t i = 0; i < 3; ++i) {
    PyObject* name = PyTuple_GET_ITEM(freevars, i);
    if (PyUnicode_CompareWithASCIIString(name, "device_type") == 0) {
      check.device_type = i;
    } else if (PyUnicode_CompareWithASCIIString(name, "fn") == 0) {
      check.fn = i;
    } else if (PyUnicode_CompareWithASCIIString(name, "self") == 0) {
      check.self = i;
    }
  }
  if (check.device_type < 0 || check.fn < 0 || check.self < 0) {
    return false;
  }
  Py_INCREF(code);
  check.code = code;
  g_check = check;
  return true;
}

// `wrapped_fn`'s own `fn` where its check would call it, else `wrapped_fn`.
py::object enabled_kernel(py::object wrapped_fn) {
  if (!PyFunction_Check(wrapped_fn.ptr())) {
    return wrapped_fn;
  }
  PyObject* code = PyFunction_GET_CODE(wrapped_fn.ptr());
  if (code != g_check.code && (g_check.code != nullptr || !learn_kernel_enabled_check(code))) {
    return wrapped_fn;
  }
  PyObject* closure = PyFunction_GET_CLOSURE(wrapped_fn.ptr());
  if (closure == nullptr || !PyTuple_Check(closure) || PyTuple_GET_SIZE(closure) != 3) {
    return wrapped_fn;
  }
  PyObject* device_type = PyCell_GET(PyTuple_GET_ITEM(closure, g_check.device_type));
  PyObject* self = PyCell_GET(PyTuple_GET_ITEM(closure, g_check.self));
  PyObject* fn = PyCell_GET(PyTuple_GET_ITEM(closure, g_check.fn));
  if (device_type == nullptr || self == nullptr || fn == nullptr) {
    return wrapped_fn;
  }
  PyObject* disabled = PyObject_GetAttr(self, g_disabled_kernel);
  if (disabled == nullptr) {
    PyErr_Clear();
    return wrapped_fn;
  }
  const int contains = PySet_Check(disabled) ? PySet_Contains(disabled, device_type) : -1;
  Py_DECREF(disabled);
  if (contains != 0) {
    PyErr_Clear();
    return wrapped_fn; // disabled (wrapped_fn calls _init_fn), or not a set
  }
  return py::reinterpret_borrow<py::object>(fn);
}

// Would the dispatcher, at `ks`, find CustomOpDef's CompositeExplicitAutograd
// kernel (if the op has one)?
bool composite_serves(const c10::OperatorHandle& op, c10::DispatchKeySet ks) {
  if (ks.empty()) {
    return false;
  }
  const auto key = ks.highestPriorityTypeId();
  return c10::toFunctionalityKey(key) == c10::DispatchKey::Dense &&
         !op.hasKernelForDispatchKey(key);
}

// The Python function that CustomOpDef's CompositeExplicitAutograd kernel
// would call, or None when the op has no such kernel. Requires the GIL.
py::object direct_function(const OpState& state) {
  PyObject* fns = PyObject_GetAttr(state.opdef().ptr(), py_names().backend_fns);
  if (fns == nullptr) {
    PyErr_Clear();
    return py::none();
  }
  py::object backend_fns = py::reinterpret_steal<py::object>(fns);
  if (!PyDict_Check(fns)) {
    return py::none();
  }
  PyObject* wrapper = PyDict_GetItemWithError(fns, Py_None); // borrowed
  if (wrapper == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return py::none();
  }
  if (!dynamo_wrapper_needed()) {
    // torch._disable_dynamo's functools.wraps: the set_kernel_enabled check
    // (register_kernel's `wrapped_fn`) around the function.
    PyObject* inner = PyObject_GetAttr(wrapper, g_wrapped);
    if (inner == nullptr) {
      PyErr_Clear();
    } else if (is_kernel_enabled_check(inner)) {
      return enabled_kernel(py::reinterpret_steal<py::object>(inner));
    } else {
      Py_DECREF(inner);
    }
  }
  return py::reinterpret_borrow<py::object>(wrapper);
}

} // namespace

// Pushes what the op's function returned, as the schema's returns.
void push_returns(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const py::object& out,
    torch::jit::Stack* stack) {
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    torch::jit::push(*stack, torch::jit::toIValue(out, returns[0].type()));
    return;
  }
  if (returns.empty()) {
    TORCH_CHECK(
        out.is_none(), "torch_autobatch: ", state.qualname,
        " declares no return value, but its function returned ",
        py::str(py::type::handle_of(out).attr("__name__")).cast<std::string>(),
        ". Return None, or declare the return in the schema.");
    return;
  }
  TORCH_CHECK(
      py::isinstance<py::tuple>(out) || py::isinstance<py::list>(out),
      "torch_autobatch: ", state.qualname, " declares ", returns.size(),
      " return values, so its function must return a tuple of ", returns.size(), "; it returned ",
      py::str(py::type::handle_of(out).attr("__name__")).cast<std::string>(), ".");
  py::sequence seq = out;
  TORCH_CHECK(
      seq.size() == returns.size(), "torch_autobatch: ", state.qualname, " declares ",
      returns.size(), " return values, but its function returned ", seq.size(), ".");
  for (size_t r = 0; r < returns.size(); ++r) {
    torch::jit::push(*stack, torch::jit::toIValue(seq[r], returns[r].type()));
  }
}

namespace {

// Replaces the op's arguments on `stack` by what `fn` returns for them, as
// torch's PythonKernelHolder does (keyword-only arguments by name). One
// vectorcall: no argument tuple or dict is built. Requires the GIL.
void call_on_stack(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const py::object& fn,
    torch::jit::Stack* stack) {
  const auto& arguments = schema.arguments();
  const size_t num_args = arguments.size();
  const auto args = torch::jit::last(*stack, num_args);
  // NOTE [The function gets its arguments as torch passes them]
  const PassedArguments passed = passed_arguments(args, arguments);
  const size_t num_passed = passed.num_positional + passed.keywords.size();
  // Slot 0 is free for the callee (PY_VECTORCALL_ARGUMENTS_OFFSET).
  c10::SmallVector<py::object, 8> owned(num_passed);
  c10::SmallVector<PyObject*, 9> argv(num_passed + 1, nullptr);
  auto pass = [&](size_t slot, size_t a) {
    // NOTE [Op values reach Python by their schema type]
    owned[slot] = to_py(args[a], *arguments[a].real_type());
    argv[slot + 1] = owned[slot].ptr();
  };
  for (size_t a = 0; a < passed.num_positional; ++a) {
    pass(a, a);
  }
  py::object kwnames;
  if (!passed.keywords.empty()) {
    py::tuple names(passed.keywords.size());
    for (size_t k = 0; k < passed.keywords.size(); ++k) {
      const size_t a = passed.keywords[k];
      pass(passed.num_positional + k, a);
      names[k] = py::str(arguments[a].name());
    }
    kwnames = std::move(names);
  }
  PyObject* out = PyObject_Vectorcall(
      fn.ptr(), argv.data() + 1, passed.num_positional | PY_VECTORCALL_ARGUMENTS_OFFSET,
      kwnames ? kwnames.ptr() : nullptr);
  if (out == nullptr) {
    throw py::error_already_set();
  }
  const py::object result = py::reinterpret_steal<py::object>(out);
  torch::jit::drop(*stack, num_args);
  push_returns(state, schema, result, stack);
}

} // namespace

bool has_functional_schema(const c10::FunctionSchema& schema) {
  if (schema.is_mutable()) {
    return false;
  }
  for (const auto& a : schema.arguments()) {
    if (a.alias_info() != nullptr) {
      return false;
    }
  }
  for (const auto& r : schema.returns()) {
    if (r.alias_info() != nullptr) {
      return false;
    }
  }
  return true;
}

void init_composite_call() {
  g_wrapped = PyUnicode_InternFromString("__wrapped__");
  g_name = PyUnicode_InternFromString("__name__");
  g_wrapped_fn = PyUnicode_InternFromString("wrapped_fn");
  g_is_exporting_flag = PyUnicode_InternFromString("_is_exporting_flag");
  g_disabled_kernel = PyUnicode_InternFromString("_disabled_kernel");
  try {
    py::object get_callback =
        py::module_::import("torch._C._dynamo.eval_frame").attr("get_eval_frame_callback");
    g_get_eval_frame_callback = get_callback.release().ptr();
    g_torch_compiler = py::module_::import("torch.compiler").release().ptr();
  } catch (py::error_already_set&) {
    // An older or newer torch without them: torch's wrapper is always kept.
    g_get_eval_frame_callback = nullptr;
    g_torch_compiler = nullptr;
  }
}

py::object
served_function(const OpState& state, const c10::OperatorHandle& op, c10::DispatchKeySet ks) {
  if (!state.functional_schema || !composite_serves(op, ks)) {
    return py::none();
  }
  return direct_function(state);
}

bool run_backend(
    const OpState& state,
    const c10::OperatorHandle& op,
    c10::DispatchKeySet ks,
    torch::jit::Stack* stack) {
  if (state.functional_schema && composite_serves(op, ks)) {
    py::gil_scoped_acquire gil;
    py::object fn = direct_function(state);
    if (!fn.is_none()) {
      call_on_stack(state, op.schema(), fn, stack);
      return true;
    }
  }
  op.redispatchBoxed(ks, stack);
  return false;
}

} // namespace torch_autobatch
