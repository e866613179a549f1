// register_vjp's per-call bookkeeping in C++ (its Python half:
// torch_autobatch/_vjp.py, _vjp_check.py): which tensors a call's node saves,
// whether its backward must rerun fwd, and the key of fwd's output check. Each
// runs on every differentiated call, where Python loops over tensors cost more
// than the op's own work at small batch sizes.
#include "functorch.h"
#include "grad_node.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <unordered_map>

namespace torch_autobatch {
namespace {

// A leaf that is never a pytree container.
bool is_atom(PyObject* v) {
  return v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
         PyComplex_CheckExact(v) || PyUnicode_CheckExact(v) || THPDtype_Check(v) ||
         THPDevice_Check(v) || THPLayout_Check(v);
}

bool is_flat(const py::handle& tree) {
  if (!PyTuple_CheckExact(tree.ptr())) {
    return false;
  }
  for (const auto& v : py::reinterpret_borrow<py::tuple>(tree)) {
    if (!THPVariable_Check(v.ptr()) && !is_atom(v.ptr())) {
      return false;
    }
  }
  return true;
}

// `tree` (a flat tuple) with None where its tensors were; appends the
// tensors' slots in `saved` as (index, slot) to `slots`. A tensor found in
// `shared` takes that slot; any other is appended to `saved` (and, with
// `shared` given, sets `*computed`).
py::tuple take_tensors(
    const py::tuple& tree,
    std::vector<py::object>& saved,
    py::list& slots,
    const std::unordered_map<c10::TensorImpl*, size_t>* shared = nullptr,
    bool* computed = nullptr) {
  py::tuple rest(tree.size());
  for (size_t i = 0; i < tree.size(); ++i) {
    py::object v = tree[i];
    if (!THPVariable_Check(v.ptr())) {
      rest[i] = v;
      continue;
    }
    rest[i] = py::none();
    size_t slot = saved.size();
    bool is_input = false;
    if (shared != nullptr) {
      auto found = shared->find(THPVariable_Unpack(v.ptr()).unsafeGetTensorImpl());
      if (found != shared->end()) {
        slot = found->second;
        is_input = true;
      }
    }
    if (!is_input) {
      saved.push_back(v);
      if (computed != nullptr) {
        *computed = true;
      }
    }
    slots.append(py::make_tuple(i, slot));
  }
  return rest;
}

// NOTE [Residuals of register_vjp]: the tensors a node saves for one call,
// the tensor inputs (for a backward that reruns fwd) and fwd's residuals, a
// residual that is an input (fwd saw it below the levels) sharing the
// input's slot. `leaves`: both are tuples of pytree leaves already; else None
// unless both are flat tuples (Python flattens them and calls again).
py::object split_saved(const py::handle& inputs, const py::handle& residuals, bool leaves) {
  if (!leaves && (!is_flat(inputs) || !is_flat(residuals))) {
    return py::none();
  }
  std::vector<py::object> saved;
  py::list input_slots, residual_slots;
  py::tuple input_rest =
      take_tensors(py::reinterpret_borrow<py::tuple>(inputs), saved, input_slots);
  // An input as this level sees it, and as fwd below the levels saw it.
  std::unordered_map<c10::TensorImpl*, size_t> below;
  for (size_t s = 0; s < saved.size(); ++s) {
    const at::Tensor& t = THPVariable_Unpack(saved[s].ptr());
    below.emplace(t.unsafeGetTensorImpl(), s);
    below.emplace(functorch::below_grad_levels(t).unsafeGetTensorImpl(), s);
  }
  bool computed = false;
  py::tuple residual_rest = take_tensors(
      py::reinterpret_borrow<py::tuple>(residuals), saved, residual_slots, &below, &computed);
  // Could a differentiation other than the innermost AD level differentiate
  // the backward (NOTE [Second derivatives through residuals])? Only with a
  // second AD level, or with an input that requires grad at the base.
  bool outer = functorch::num_ad_levels() > 1;
  for (size_t s = 0; s < input_slots.size() && !outer; ++s) {
    outer = functorch::innermost(THPVariable_Unpack(saved[s].ptr())).requires_grad();
  }
  py::tuple saved_tuple(saved.size());
  for (size_t s = 0; s < saved.size(); ++s) {
    saved_tuple[s] = saved[s];
  }
  return py::make_tuple(
      saved_tuple, input_rest, input_slots, residual_rest, residual_slots, computed, outer);
}

// NOTE [Second derivatives through residuals]: does a differentiation track
// one of the saved inputs (`slots` of `saved`) of the node whose backward runs?
bool inputs_tracked(const py::tuple& saved, const py::list& slots, bool keep_graph) {
  const int64_t level = backward_level();
  for (const auto& entry : slots) {
    py::object t = saved[py::reinterpret_borrow<py::tuple>(entry)[1].cast<size_t>()];
    if (functorch::tracked_beyond_node(THPVariable_Unpack(t.ptr()), level, keep_graph)) {
      return true;
    }
  }
  return false;
}

// Appends `v`'s encoding to `key`; false if it has none (a symbolic size,
// a value of another type).
bool encode(PyObject* v, std::string& key) {
  auto put = [&key](const auto& x) { key.append(reinterpret_cast<const char*>(&x), sizeof(x)); };
  if (THPVariable_Check(v)) {
    const at::Tensor& t = THPVariable_Unpack(v);
    if (t.is_nested() || t.unsafeGetTensorImpl()->is_python_dispatch()) {
      return false; // sizes of their own: Python builds the key
    }
    key.push_back('T');
    put(static_cast<int64_t>(t.dim()));
    for (const c10::SymInt& d : t.sym_sizes()) {
      if (d.is_symbolic()) {
        return false;
      }
      put(d.as_int_unchecked());
    }
    put(static_cast<int8_t>(t.scalar_type()));
    put(static_cast<int8_t>(t.device().type()));
    put(static_cast<int8_t>(t.device().index()));
    put(static_cast<int8_t>(t.layout()));
    return true;
  }
  if (v == Py_None) {
    key.push_back('N');
  } else if (PyBool_Check(v)) {
    key.push_back(v == Py_True ? 'b' : 'B');
  } else if (PyLong_CheckExact(v)) {
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow != 0) {
      return false;
    }
    key.push_back('I');
    put(x);
  } else if (PyFloat_CheckExact(v)) {
    key.push_back('F');
    put(PyFloat_AS_DOUBLE(v));
  } else if (PyUnicode_CheckExact(v)) {
    Py_ssize_t n = 0;
    const char* text = PyUnicode_AsUTF8AndSize(v, &n);
    if (text == nullptr) {
      PyErr_Clear();
      return false;
    }
    key.push_back('S');
    put(static_cast<int64_t>(n));
    key.append(text, static_cast<size_t>(n));
  } else if (THPDtype_Check(v)) {
    key.push_back('D');
    put(static_cast<int8_t>(reinterpret_cast<THPDtype*>(v)->scalar_type));
  } else if (THPDevice_Check(v)) {
    const c10::Device& d = reinterpret_cast<THPDevice*>(v)->device;
    key.push_back('V');
    put(static_cast<int8_t>(d.type()));
    put(static_cast<int8_t>(d.index()));
  } else if (THPLayout_Check(v)) {
    key.push_back('L');
    put(static_cast<int8_t>(reinterpret_cast<THPLayout*>(v)->layout));
  } else if (PyTuple_CheckExact(v) || PyList_CheckExact(v)) {
    key.push_back(PyTuple_CheckExact(v) ? '(' : '[');
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    put(static_cast<int64_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!encode(PySequence_Fast_GET_ITEM(v, i), key)) {
        return false;
      }
    }
  } else {
    return false;
  }
  return true;
}

// NOTE [fwd returns what the op returns] (torch_autobatch/_vjp_check.py):
// the key its check caches the op's output metadata under, as bytes: the
// arguments' tensor metadata and values. None where an argument has no
// encoding (Python builds a key of its own then).
py::object metadata_key(const py::tuple& args) {
  std::string key;
  key.reserve(64 * args.size());
  for (const auto& v : args) {
    if (!encode(v.ptr(), key)) {
      return py::none();
    }
  }
  return py::bytes(key);
}

} // namespace

void bind_vjp_residuals(py::module_& m) {
  m.def(
      "_vjp_metadata_key", &metadata_key,
      "register_vjp: a bytes key of the arguments' tensor metadata and values, or None.");
  m.def(
      "_vjp_split_saved", &split_saved,
      "register_vjp: (saved, input leaves, input slots, residual leaves, residual slots, computed, "
      "outer) "
      "for tuples of inputs and residuals that are flat (or pytree leaves), else None.",
      py::arg("inputs"), py::arg("residuals"), py::arg("leaves"));
  m.def(
      "_vjp_inputs_tracked", &inputs_tracked,
      "register_vjp: is a saved input of the node whose backward runs tracked by a "
      "differentiation of that backward?");
}

} // namespace torch_autobatch
