// Shared declarations of torch_autobatch's C++ kernels.
//
// Each operator made by torch_autobatch.custom_op owns one OpState. The
// kernels we register for it (Autograd here; FuncTorchBatched later) and every
// grad node they create hold a shared_ptr to it, so a node outlives the kernel
// registration that made it.
#pragma once

#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <memory>
#include <string>
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

// What our kernels know about one operator.
struct OpState {
  std::string qualname; // "mylib::softclip"
  std::string node_name; // "GeneratedBackwardFor_mylib_softclip"
  std::vector<std::string> arg_names; // from the schema, for error messages
  // The torch_autobatch.CustomOpDef. Its private methods are the Python half
  // of each kernel: _setup_autograd (forward) and _run_backward (backward).
  PyRef opdef;
};

// Registers our Autograd-key kernel for `state->qualname` into `lib`
// (a torch::Library IMPL fragment for the op's namespace). autograd.cpp.
void register_autograd_kernel(
    torch::Library& lib,
    const std::shared_ptr<OpState>& state);

// Converts a pending Python exception into the C++ exception that torch's
// bindings and autograd engine re-raise unchanged in Python.
[[noreturn]] void rethrow_python_error(py::error_already_set& e);

} // namespace torch_autobatch
