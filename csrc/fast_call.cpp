// The unbatched call without the dispatcher: an op's function, called from
// Python when nothing would see the difference.
//
// NOTE [The unbatched call's fast path]
// A call of an op that no transform, mode, observer or gradient touches
// does, through the dispatcher, exactly this: our Autograd kernel finds no
// input requiring grad and no tangent, runs the op's function below
// ADInplaceOrView (run_backend), checks that no output aliases an input, and
// returns the outputs. The dispatcher's part of that (OpOverload.__call__,
// argument parsing, boxing to a stack and back, the kernel lookup) is most of
// the ~1.6 us an op call costs over the plain function on a (64,) tensor. The
// op's __call__ (op/_kernel_side.py) first asks fast_call, which does the same
// work itself, and only when every way the dispatcher's path could differ is
// ruled out, from state torch keeps anyway:
// - the thread's local dispatch key set is torch's default (included and
//   excluded): no TorchDispatchMode, make_fx, FlopCounterMode, functorch
//   transform, autocast, inference mode, functionalization, jit tracer or
//   Python dispatcher is active, as each adds or removes keys there;
// - no RecordFunction callback is registered (torch.profiler, our trace(),
//   any observer of dispatcher calls) and no TorchFunctionMode is on the stack;
// - every argument is what the schema holds without conversion: a Tensor or
//   Parameter (not a subclass: a subclass sees the op at its own keys) for a
//   Tensor, an int for an int, a float for a float, a bool for a bool; no
//   keyword arguments; the op's schema is functional, takes only those kinds
//   and returns only Tensors;
// - each tensor's keys are a dense backend plus autograd, ADInplaceOrView and
//   autocast keys (no Conjugate, Negative, ZeroTensor, Python, Sparse, functorch
//   wrapper...), none requires grad while grad mode is on, none has a tangent;
//   and the kernel the dispatcher would pick below autograd for their backend
//   is the op's function (run_backend's own test);
// - the op's kernels are registered and its definition lives, and its user code
//   closes over nothing that the Autograd kernel would check.
// Torch.compile never reaches here: __call__ asks only outside a Dynamo trace.
// Outputs are converted and checked as there (push_returns,
// check_no_aliasing), so a wrong return raises the same error.
// Where only the arguments' own kinds hold (a tensor requires grad, a profiler
// or a dispatch mode is on, ...), the call goes to the dispatcher as torch.ops'
// Python binding sends it (the stack, callBoxed without the GIL, the returns as
// Python values), without that binding's argument parsing, which the checks
// above did; a TorchFunctionMode, a tensor subclass or keyword arguments leave
// the call to torch's binding (fast_call returns NotImplemented before anything
// ran). test_fast_path.py calls the op under each observer and checks that it
// sees the op.
#include "op_state.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace torch_autobatch {
namespace {

enum class ArgKind : uint8_t { Tensor, Int, Float, Bool };

// One op's fast path: what its schema allows, decided once.
struct FastCall {
  std::shared_ptr<OpState> state;
  c10::OperatorHandle op;
  std::vector<ArgKind> kinds; // one per schema argument
  size_t required = 0; // arguments before the first with a default
  bool eligible = false;
};

constexpr const char* kCapsuleName = "torch_autobatch.FastCall";

// NOTE [The unbatched call's fast path]: the calls on this thread that
// skipped the dispatcher, and those that fast_call sent to it; for tests.
thread_local int64_t t_fast_calls = 0;
thread_local int64_t t_dispatched_calls = 0;

FastCall make_fast_call(std::shared_ptr<OpState> state, const c10::OperatorHandle& op) {
  FastCall f{std::move(state), op, {}, 0, false};
  const auto& schema = op.schema();
  bool ok =
      f.state->functional_schema && !schema.returns().empty() && !f.state->returns_an_argument;
  bool any_tensor = false;
  bool seen_default = false;
  for (const auto& a : schema.arguments()) {
    const auto kind = a.type()->kind(); // SymInt reads as int
    if (a.kwarg_only()) {
      ok = false;
    } else if (kind == c10::TypeKind::TensorType) {
      f.kinds.push_back(ArgKind::Tensor);
      any_tensor = true;
    } else if (kind == c10::TypeKind::IntType) {
      f.kinds.push_back(ArgKind::Int);
    } else if (kind == c10::TypeKind::FloatType) {
      f.kinds.push_back(ArgKind::Float);
    } else if (kind == c10::TypeKind::BoolType) {
      f.kinds.push_back(ArgKind::Bool);
    } else {
      ok = false;
    }
    if (a.default_value().has_value()) {
      seen_default = true;
    } else if (seen_default) {
      ok = false; // a positional argument without a default after one with
    } else {
      f.required += 1;
    }
  }
  for (const auto& r : schema.returns()) {
    ok = ok && r.type()->kind() == c10::TypeKind::TensorType;
  }
  f.eligible = ok && any_tensor;
  return f;
}

// The keys a tensor may have beyond its dense backend for the fast path.
constexpr c10::DispatchKeySet kAboveBackend =
    c10::autograd_dispatch_keyset | c10::autocast_dispatch_keyset |
    c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);

// Nothing would see a call that skips the dispatcher: see the NOTE.
bool nothing_observes() {
  const auto tls = c10::impl::tls_local_dispatch_key_set();
  return tls.included_ == c10::default_included_set && tls.excluded_ == c10::default_excluded_set &&
         !at::hasCallbacks();
}

// The arguments of one call, as far as the fast path reads them.
struct Parsed {
  std::vector<at::Tensor> inputs;
  c10::DispatchKeySet keys; // the union of the tensors' keys
  bool plain = true; // no tensor needs grad or has a tangent; only backend-level keys
};

// Does every argument have its schema's kind without conversion (see the
// NOTE)? Fills `p`.
bool parse(const FastCall& f, PyObject* args, Parsed& p) {
  const auto n = static_cast<size_t>(PyTuple_GET_SIZE(args));
  if (n < f.required || n > f.kinds.size()) {
    return false;
  }
  const bool grad_mode = c10::GradMode::is_enabled();
  p.inputs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    switch (f.kinds[i]) {
      case ArgKind::Tensor: {
        if (!THPVariable_CheckExact(a)) {
          return false;
        }
        const at::Tensor& t = THPVariable_Unpack(a);
        // Dense is the lowest functionality: being the highest, it is the only one.
        const auto ks = t.key_set();
        const auto below = ks - kAboveBackend;
        // An inference tensor outside inference mode reaches torch's backend
        // wrapper, not our Autograd kernel: the dispatcher's path.
        p.plain = p.plain && !(grad_mode && t.requires_grad()) && !t.is_inference() &&
                  !torch::autograd::isFwGradDefined(t) && !below.empty() &&
                  below.highestFunctionalityKey() == c10::DispatchKey::Dense;
        p.keys = p.keys | ks;
        p.inputs.push_back(t);
        break;
      }
      case ArgKind::Int: {
        if (!PyLong_CheckExact(a)) {
          return false;
        }
        int overflow = 0;
        PyLong_AsLongLongAndOverflow(a, &overflow);
        if (overflow != 0) {
          return false;
        }
        break;
      }
      case ArgKind::Float:
        if (!PyFloat_CheckExact(a)) {
          return false;
        }
        break;
      case ArgKind::Bool:
        if (!PyBool_Check(a)) {
          return false;
        }
        break;
    }
  }
  return true;
}

// The call through the dispatcher, as torch.ops' Python binding makes it
// (torch's invokeOperatorFromPython: the stack, callBoxed without the GIL,
// the returns), without its argument parsing, which parse() did.
PyObject* call_dispatcher(const FastCall& f, PyObject* args) {
  const auto& schema = f.op.schema();
  const auto n = static_cast<size_t>(PyTuple_GET_SIZE(args));
  torch::jit::Stack stack;
  stack.reserve(f.kinds.size());
  for (size_t i = 0; i < f.kinds.size(); ++i) {
    if (i >= n) {
      stack.push_back(*schema.arguments()[i].default_value());
      continue;
    }
    PyObject* a = PyTuple_GET_ITEM(args, i);
    switch (f.kinds[i]) {
      case ArgKind::Tensor:
        stack.emplace_back(THPVariable_Unpack(a));
        break;
      case ArgKind::Int:
        stack.emplace_back(static_cast<int64_t>(PyLong_AsLongLong(a)));
        break;
      case ArgKind::Float:
        stack.emplace_back(PyFloat_AS_DOUBLE(a));
        break;
      case ArgKind::Bool:
        stack.emplace_back(a == Py_True);
        break;
    }
  }
  {
    py::gil_scoped_release no_gil;
    f.op.callBoxed(&stack);
  }
  return torch::jit::createPyObjectForStack(std::move(stack)).release().ptr();
}

// The op's returns as the dispatcher's path returns them to Python.
py::object returned(const FastCall& f, py::object out, std::vector<at::Tensor>& outputs) {
  const auto& schema = f.op.schema();
  const size_t num_returns = schema.returns().size();
  if (num_returns == 1 && THPVariable_Check(out.ptr())) {
    outputs.push_back(THPVariable_Unpack(out.ptr()));
    return out;
  }
  // Anything else converts as the dispatcher's path does, errors included.
  torch::jit::Stack stack;
  push_returns(*f.state, schema, out, &stack);
  for (const auto& v : stack) {
    outputs.push_back(v.toTensor());
  }
  return torch::jit::createPyObjectForStack(std::move(stack));
}

// The op's outputs for the arguments' tuple `args` (a new reference), or
// NotImplemented (a new reference) where torch's Python binding must run.
PyObject* call_fast(const FastCall& f, PyObject* args) {
  const OpState& state = *f.state;
  // A definition gone (or our kernels with it) leaves `f.op` dangling: torch's
  // binding and the op's __call__ say what happened.
  if (!f.eligible || !state.registered.load(std::memory_order_relaxed) ||
      !state.defined.load(std::memory_order_relaxed) || at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NOTIMPLEMENTED; // (a TorchFunctionMode sees the call in torch's binding)
  }
  Parsed p;
  if (!parse(f, args, p)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  py::object fn;
  if (p.plain && !state.has_closure.load(std::memory_order_relaxed) && nothing_observes()) {
    fn = served_function(state, f.op, p.keys & c10::after_ADInplaceOrView_keyset);
  }
  if (!fn || fn.is_none()) {
    ++t_dispatched_calls;
    return call_dispatcher(f, args);
  }
  const auto& inputs = p.inputs;
  ++t_fast_calls;
  py::object out;
  {
    // As run_backend runs it below our Autograd kernel.
    at::AutoDispatchBelowADInplaceOrView below;
    PyObject* result =
        PyObject_Vectorcall(fn.ptr(), &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), nullptr);
    if (result == nullptr) {
      throw py::error_already_set();
    }
    out = py::reinterpret_steal<py::object>(result);
  }
  std::vector<at::Tensor> outputs;
  py::object result = returned(f, std::move(out), outputs);
  std::vector<Slot> ret_slots;
  ret_slots.reserve(outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) {
    ret_slots.push_back(Slot{k, 1, false});
  }
  check_no_aliasing(state, f.op.schema(), inputs, outputs, ret_slots, /*torch_check=*/true);
  return result.release().ptr();
}

PyObject* fast_call(PyObject* self, PyObject* const* argv, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const auto* f = static_cast<const FastCall*>(PyCapsule_GetPointer(self, kCapsuleName));
  if (f == nullptr) {
    return nullptr;
  }
  TORCH_CHECK(
      nargs == 1 && PyTuple_Check(argv[0]),
      "torch_autobatch: fast_call takes the arguments' tuple");
  return call_fast(*f, argv[0]);
  END_HANDLE_TH_ERRORS
}

PyMethodDef g_fast_call_def = {
    "fast_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_call)),
    METH_FASTCALL,
    "fast_call(args): the op's outputs for `args` (a tuple, no keywords) by NOTE [The unbatched "
    "call's fast path], or NotImplemented where the dispatcher's path must run."};

} // namespace

py::object make_fast_call_function(const std::shared_ptr<OpState>& state) {
  auto* f = new FastCall(make_fast_call(state, find_op(state->qualname)));
  PyObject* capsule = PyCapsule_New(f, kCapsuleName, [](PyObject* c) {
    delete static_cast<FastCall*>(PyCapsule_GetPointer(c, kCapsuleName));
  });
  if (capsule == nullptr) {
    delete f;
    throw py::error_already_set();
  }
  PyObject* fn = PyCFunction_New(&g_fast_call_def, capsule);
  Py_DECREF(capsule);
  if (fn == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(fn);
}

namespace {

// NOTE [The op's call slot]
// Python reaches an instance's __call__ through its type's tp_call slot; for
// a class defined in Python that is CPython's slot_tp_call, which looks the
// method up, prepends self and enters a Python frame that packs *args and
// **kwargs: ~0.5 us, a third of what the fast path saves. The op class's
// tp_call is set to op_call below, which does what KernelSide.__call__ does
// (op/_kernel_side.py) for a call that takes the fast path, and otherwise
// calls that __call__ itself, so every other call runs the same Python.
// __call__ stays the Python method in the class: Dynamo inlines it (and reads
// is_compiling there), inspect and help see it. Assigning __call__ on the
// class or defining it in a subclass makes CPython put its own slot back,
// which is only slower. _C._install_call_slot checks that the class's
// tp_call is CPython's before replacing it. The slot does not ask
// is_compiling as __call__ does: Dynamo never calls it (it inlines __call__),
// and the graph tracers that set torch.compiler's flag eagerly (AOTAutograd,
// non-strict export) pass fake or functional tensors, which fast_call declines.
PyTypeObject* g_op_class = nullptr;
ternaryfunc g_python_slot = nullptr; // CPython's slot_tp_call, kept for subclasses
PyObject* g_ab = nullptr; // "_ab"
PyObject* g_guarded = nullptr; // "guarded"
PyObject* g_fast_call_attr = nullptr; // "fast_call"

// NotImplemented (a new reference) unless the op's fast path served the call.
PyObject* try_fast(PyObject* self, PyObject* args) {
  PyObject* ab = PyObject_GetAttr(self, g_ab);
  if (ab == nullptr) {
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;
  }
  const py::object ab_ref = py::reinterpret_steal<py::object>(ab);
  PyObject* guarded = PyObject_GetAttr(ab, g_guarded);
  if (guarded == nullptr) {
    throw py::error_already_set();
  }
  Py_DECREF(guarded);
  if (guarded != Py_False) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  PyObject* fc = PyObject_GetAttr(ab, g_fast_call_attr);
  if (fc == nullptr) {
    throw py::error_already_set();
  }
  const py::object fc_ref = py::reinterpret_steal<py::object>(fc);
  if (PyCFunction_Check(fc) && PyCFunction_GET_FUNCTION(fc) == g_fast_call_def.ml_meth) {
    const auto* f =
        static_cast<const FastCall*>(PyCapsule_GetPointer(PyCFunction_GET_SELF(fc), kCapsuleName));
    if (f == nullptr) {
      throw py::error_already_set();
    }
    return call_fast(*f, args);
  }
  Py_RETURN_NOTIMPLEMENTED;
}

PyObject* op_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  if (Py_TYPE(self) != g_op_class) {
    return g_python_slot(self, args, kwargs); // a subclass that inherited the slot
  }
  HANDLE_TH_ERRORS
  if (kwargs == nullptr || PyDict_GET_SIZE(kwargs) == 0) {
    PyObject* out = try_fast(self, args);
    if (out != Py_NotImplemented) {
      return out;
    }
    Py_DECREF(out);
  }
  return g_python_slot(self, args, kwargs);
  END_HANDLE_TH_ERRORS
}

} // namespace

void install_call_slot(py::handle cls) {
  TORCH_CHECK(PyType_Check(cls.ptr()), "torch_autobatch: _install_call_slot takes a class");
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  if (type->tp_call == op_call) {
    return;
  }
  const py::object call = py::getattr(cls, "__call__", py::none());
  TORCH_CHECK(
      g_op_class == nullptr && PyFunction_Check(call.ptr()) && type->tp_call != nullptr,
      "torch_autobatch: _install_call_slot: the op class must define __call__ in Python, once");
  g_ab = PyUnicode_InternFromString("_ab");
  g_guarded = PyUnicode_InternFromString("guarded");
  g_fast_call_attr = PyUnicode_InternFromString("fast_call");
  Py_INCREF(type);
  g_op_class = type;
  g_python_slot = type->tp_call;
  type->tp_call = op_call;
}

std::pair<int64_t, int64_t> fast_calls_on_this_thread() {
  return {t_fast_calls, t_dispatched_calls};
}

} // namespace torch_autobatch
