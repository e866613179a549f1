// How torch_autobatch's C++ talks to Python: owning references that any
// thread may drop, the Python methods the kernels call (one list), schema-typed
// conversion of op values, and exceptions handed back to Python unchanged.
#pragma once

#include <Python.h>

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <c10/util/SmallVector.h>
#include <pybind11/pybind11.h>

#include <initializer_list>
#include <utility>
#include <vector>

namespace torch_autobatch {

namespace py = pybind11;

// An owning reference to a Python object that can be dropped on any thread:
// the autograd engine frees grad nodes on its worker threads, without the GIL.
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(py::object obj) : obj_(obj.release().ptr()) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  PyRef(PyRef&& other) noexcept : obj_(other.obj_) {
    other.obj_ = nullptr;
  }
  PyRef& operator=(PyRef&& other) noexcept {
    if (this != &other) {
      reset();
      obj_ = other.obj_;
      other.obj_ = nullptr;
    }
    return *this;
  }
  ~PyRef() {
    reset();
  }

  // Requires the GIL.
  py::handle get() const {
    return obj_;
  }
  explicit operator bool() const {
    return obj_ != nullptr;
  }
  void reset();

 private:
  PyObject* obj_ = nullptr;
};

// NOTE [The Python side of the kernels]
// Every attribute our C++ looks up on a torch_autobatch.CustomOpDef (or on
// the ctx it returns) is listed here, interned once (under the GIL, on first
// use) and never freed, like CPython's own identifiers: a lookup then builds
// no str object, and a rename on the Python side has one place to follow
// (test_contract.py checks that each exists, with the signature the call
// needs, on torch_autobatch/op/_kernel_side.py's KernelSide). The ctx attributes always
// exist (BackwardContext's class defaults, core/_autograd.py): a failed lookup
// would build and drop an AttributeError per call.
struct PyNames {
  // CustomOpDef methods (KernelSide, torch_autobatch/op/_kernel_side.py).
  PyObject* setup_autograd; // forward: ctx from setup_context
  PyObject* run_backward; // backward: the user's backward
  PyObject* run_jvp; // forward mode: the user's jvp
  PyObject* composite_tangents; // forward mode: derived from the function
  PyObject* run_vmap_rule; // vmap: the user's register_vmap rule
  PyObject* check_aliasing; // torch.library's aliasing error
  PyObject* dissolves_in_trace; // vmap under a graph trace: NOTE [A trace keeps the op]
  PyObject* run_vmapped_companion; // ... one node: NOTE [One node for vmap(op) in a trace]
  PyObject* backward_fn_name; // for error messages
  PyObject* jvp_fn_name;
  PyObject* verify_vjp_fwd; // register_vjp: fwd's result where C++ could not verify it
  // torch's CustomOpDef attribute: device type -> backend function.
  PyObject* backend_fns;
  // BackwardContext attributes (what FunctionCtx's methods record).
  PyObject* to_save;
  PyObject* non_differentiable;
  PyObject* materialize_grads;
};
// Requires the GIL.
const PyNames& py_names();
// The declaration PyNames is built from: each name, the number of arguments
// a call passes (-1: an attribute), and the object it is looked up on ("op",
// "ctx"); _C._python_side_names() returns it for test_contract.py.
struct PythonSideName {
  const char* name;
  int nargs;
  const char* on;
};
const std::vector<PythonSideName>& python_side();
// self.<name>(*args), one vectorcall (no argument tuple). Requires the GIL.
py::object call_method(py::handle self, PyObject* name, std::initializer_list<py::handle> args);

// NOTE [Op values reach Python by their schema type]
// An IValue cannot tell a ScalarType, Layout or MemoryFormat from an int: all
// three are stored as ints. torch's boxed-to-Python path (behind every
// Python kernel, and so behind torch.library.custom_op's function) converts
// by the argument's declared type, so the function receives torch.float64,
// not 7 (and a list of dtypes for ScalarType[]). Everything our C++ hands to
// user Python as an op argument or return (the function on the direct path,
// setup_context, the jvp, the vmap rule, the tracer's listing) converts here,
// with the schema's real type: a `dtype` that arrived as an int would
// silently turn `x.view(dtype)` into a reshape and `x.to(dtype)` into a move
// to device `dtype`. Requires the GIL.
py::object to_py(const c10::IValue& value, const c10::Type& type);
// One value per schema argument (or return), in order: `values[i]` has type
// `schema[i].real_type()`.
py::tuple to_py_tuple(c10::ArrayRef<c10::IValue> values, const std::vector<c10::Argument>& schema);

// NOTE [The function gets its arguments as torch passes them]
// torch's Python kernels, and so torch.library.custom_op's function and its
// register_vmap rule, receive an op's arguments as torch's boxed-to-Python
// conversion makes them: the positional ones up to the last one that differs
// from its schema default, the keyword-only ones by name unless equal to
// their default; the function's own Python defaults stand for the rest.
// (setup_context's `inputs` hold every argument.) Where we call the function
// or the rule ourselves, we pass the same.
struct PassedArguments {
  size_t num_positional = 0; // arguments 0 .. num_positional-1, by position
  c10::SmallVector<size_t, 4> keywords; // keyword-only arguments passed, by index
};
PassedArguments passed_arguments(
    c10::ArrayRef<c10::IValue> values,
    const std::vector<c10::Argument>& schema);
// The arguments as (positional tuple, keyword dict), by PassedArguments.
// Requires the GIL.
std::pair<py::tuple, py::dict> to_py_call(
    c10::ArrayRef<c10::IValue> values,
    const std::vector<c10::Argument>& schema);

// Converts a pending Python exception into the C++ exception that torch's
// bindings and autograd engine re-raise unchanged in Python.
[[noreturn]] void rethrow_python_error(py::error_already_set& e);

} // namespace torch_autobatch
