// register_vjp's per-call bookkeeping in C++ (its Python half:
// torch_autobatch/op/_vjp.py, op/_vjp_check.py): which tensors a call's node saves,
// the residuals its backward hands bwd or whether it must rerun fwd, and the
// key of fwd's output check. Each runs on every differentiated call, where
// Python loops over tensors cost more than the op's own work at small batch
// sizes.
// functorch.h first: its ATen/functorch headers are ambiguous (isBatchedTensor)
// after ATen/LegacyBatchedTensorImpl.h, which torch_internals.h brings in.
#include "functorch.h"

#include "grad_node.h"
#include "torch_internals.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/util/SmallVector.h>

#include <cstdint>
#include <string>
#include <utility>

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

// A new tuple of `n` items, each to be set.
py::tuple new_tuple(Py_ssize_t n) {
  PyObject* t = PyTuple_New(n);
  if (t == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::tuple>(t);
}

// A pytree of a call's, its tensors saved with the node: the leaves with
// None where a tensor was, and each tensor's (leaf index, saved slot).
struct SavedTree {
  py::object spec = py::none(); // None: a flat tuple, the leaves themselves
  py::tuple leaves;
  c10::SmallVector<std::pair<uint32_t, uint32_t>, 4> slots;

  // The tree again, its tensors taken from `saved` (what the node saved).
  py::object rebuild(const py::tuple& saved) const {
    const Py_ssize_t n = PyTuple_GET_SIZE(leaves.ptr());
    py::tuple values = new_tuple(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* v = PyTuple_GET_ITEM(leaves.ptr(), i);
      Py_INCREF(v);
      PyTuple_SET_ITEM(values.ptr(), i, v);
    }
    for (const auto& [leaf, slot] : slots) {
      PyObject* t = PyTuple_GET_ITEM(saved.ptr(), slot);
      Py_INCREF(t);
      PyObject* old = PyTuple_GET_ITEM(values.ptr(), leaf);
      PyTuple_SET_ITEM(values.ptr(), leaf, t);
      Py_DECREF(old);
    }
    if (spec.is_none()) {
      return std::move(values);
    }
    return py::module_::import("torch.utils._pytree")
        .attr("tree_unflatten")(py::list(values), spec);
  }
  // (leaves, ((leaf index, saved slot), ...), spec): what rebuild reads.
  py::tuple parts() const {
    py::tuple pairs = new_tuple(static_cast<Py_ssize_t>(slots.size()));
    for (size_t i = 0; i < slots.size(); ++i) {
      PyTuple_SET_ITEM(
          pairs.ptr(), static_cast<Py_ssize_t>(i),
          py::make_tuple(slots[i].first, slots[i].second).release().ptr());
    }
    return py::make_tuple(leaves, pairs, spec);
  }
};

// A tensor's TensorImpl and the slot it was saved in.
using SlotOf = c10::SmallVector<std::pair<const c10::TensorImpl*, uint32_t>, 8>;

// Fills `tree` from `leaves`, a tuple of pytree leaves: a tensor found in
// `shared` takes that slot; any other is appended to `saved` (borrowed from
// `leaves`; and, with `shared` given, sets `*computed`).
void take_tensors(
    const py::tuple& leaves,
    SavedTree& tree,
    c10::SmallVector<PyObject*, 8>& saved,
    const SlotOf* shared = nullptr,
    bool* computed = nullptr) {
  const Py_ssize_t n = PyTuple_GET_SIZE(leaves.ptr());
  tree.leaves = new_tuple(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyTuple_GET_ITEM(leaves.ptr(), i);
    const bool tensor = THPVariable_Check(v);
    PyObject* leaf = tensor ? Py_None : v;
    Py_INCREF(leaf);
    PyTuple_SET_ITEM(tree.leaves.ptr(), i, leaf);
    if (!tensor) {
      continue;
    }
    auto slot = static_cast<uint32_t>(saved.size());
    bool is_input = false;
    if (shared != nullptr) {
      const c10::TensorImpl* impl = THPVariable_Unpack(v).unsafeGetTensorImpl();
      for (const auto& [input, input_slot] : *shared) {
        if (input == impl) {
          slot = input_slot;
          is_input = true;
          break;
        }
      }
    }
    if (!is_input) {
      saved.push_back(v);
      if (computed != nullptr) {
        *computed = true;
      }
    }
    tree.slots.emplace_back(static_cast<uint32_t>(i), slot);
  }
}

// NOTE [Residuals of register_vjp]: one differentiated call, as its node
// saved it: the tensor inputs (for a backward that reruns fwd) and fwd's
// residuals, a residual that is an input (fwd saw it below the levels)
// sharing the input's slot. Made by setup_context, held by the call's ctx:
// nothing on it outlives or is shared beyond the call.
class VjpCall {
 public:
  // (the tensors to save, the call): setup_context saves the first with the
  // node and keeps the second on ctx.
  static py::tuple save(const py::tuple& inputs, const py::object& residuals) {
    VjpCall call;
    py::tuple input_leaves = inputs, residual_leaves;
    if (is_flat(inputs) && is_flat(residuals)) {
      residual_leaves = py::reinterpret_borrow<py::tuple>(residuals);
    } else { // their pytree leaves
      py::object flatten = py::module_::import("torch.utils._pytree").attr("tree_flatten");
      py::tuple in = flatten(inputs), res = flatten(residuals);
      input_leaves = py::tuple(in[0]);
      call.inputs_.spec = in[1];
      residual_leaves = py::tuple(res[0]);
      call.residuals_.spec = res[1];
    }
    c10::SmallVector<PyObject*, 8> saved; // borrowed from the leaves
    take_tensors(input_leaves, call.inputs_, saved);
    // An input as this level sees it, and as fwd below the levels saw it.
    SlotOf below;
    for (size_t s = 0; s < saved.size(); ++s) {
      const at::Tensor& t = THPVariable_Unpack(saved[s]);
      below.emplace_back(t.unsafeGetTensorImpl(), static_cast<uint32_t>(s));
      below.emplace_back(
          functorch::below_grad_levels(t).unsafeGetTensorImpl(), static_cast<uint32_t>(s));
    }
    const size_t num_inputs = saved.size();
    take_tensors(residual_leaves, call.residuals_, saved, &below, &call.computed_);
    // Could a differentiation other than the innermost AD level differentiate
    // the backward (NOTE [Second derivatives through residuals])? Only with a
    // second AD level, or with an input that requires grad at the base.
    call.outer_ = functorch::num_ad_levels() > 1;
    for (size_t s = 0; s < num_inputs && !call.outer_; ++s) {
      call.outer_ = functorch::innermost(THPVariable_Unpack(saved[s])).requires_grad();
    }
    py::tuple saved_tuple = new_tuple(static_cast<Py_ssize_t>(saved.size()));
    for (size_t s = 0; s < saved.size(); ++s) {
      Py_INCREF(saved[s]);
      PyTuple_SET_ITEM(saved_tuple.ptr(), static_cast<Py_ssize_t>(s), saved[s]);
    }
    return py::make_tuple(std::move(saved_tuple), py::cast(std::move(call)));
  }

  // In the call's backward, given what the node saved: (the residuals for
  // bwd,), or None where fwd must run again, recorded, on `inputs(saved)`:
  // grad mode is on and a differentiation that can differentiate this
  // backward tracks an input (NOTE [Second derivatives through residuals]).
  py::object residuals(const py::tuple& saved) const {
    if (computed_ && at::GradMode::is_enabled()) {
      // Without a second AD level, only the node's own level can, keeping the graph.
      const bool keep_graph = internals::current_graph_task_keeps_graph();
      if ((outer_ || keep_graph) && inputs_tracked(saved, keep_graph)) {
        return py::none();
      }
    }
    return py::make_tuple(residuals_.rebuild(saved)); // the residuals may be None
  }
  // The op's inputs (setup_context's `inputs`), given what the node saved.
  py::object inputs(const py::tuple& saved) const {
    return inputs_.rebuild(saved);
  }
  // How residuals() rebuilds the residuals, for a backward that Dynamo
  // traces (NOTE [Compiled autograd sees an autograd.Function]), where
  // nothing differentiates the backward again.
  py::tuple residual_parts() const {
    return residuals_.parts();
  }

 private:
  bool inputs_tracked(const py::tuple& saved, bool keep_graph) const {
    const int64_t level = backward_level();
    for (const auto& entry : inputs_.slots) {
      const at::Tensor& t = THPVariable_Unpack(PyTuple_GET_ITEM(saved.ptr(), entry.second));
      if (functorch::tracked_beyond_node(t, level, keep_graph)) {
        return true;
      }
    }
    return false;
  }

  SavedTree inputs_, residuals_;
  bool computed_ = false; // a residual tensor is not an input
  bool outer_ = false; // a differentiation besides the innermost AD level tracks an input
};

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

// NOTE [fwd returns what the op returns] (torch_autobatch/op/_vjp_check.py):
// the key under which the op's checked outputs are cached: the arguments'
// tensor metadata and values, positional then keyword (in schema order).
// False where an argument has no encoding (Python keys the call then).
bool metadata_key(const py::tuple& args, const py::dict& kwargs, std::string& key) {
  key.reserve(64 * (args.size() + kwargs.size()));
  for (const auto& v : args) {
    if (!encode(v.ptr(), key)) {
      return false;
    }
  }
  for (const auto& item : kwargs) {
    if (!encode(item.second.ptr(), key)) {
      return false;
    }
  }
  return true;
}

// Keys per op; a full set starts again.
constexpr size_t kMaxCheckedKeys = 256;

} // namespace

py::object run_vjp_fwd(
    OpState& state,
    py::handle fwd,
    const py::tuple& args,
    const py::dict& kwargs,
    bool check) {
  py::object result = py::reinterpret_steal<py::object>(
      PyObject_Call(fwd.ptr(), args.ptr(), kwargs.empty() ? nullptr : kwargs.ptr()));
  if (!result) {
    throw py::error_already_set();
  }
  // (output, residuals), one output per return.
  const size_t num_returns = state.return_aliases.size();
  bool verified = PyTuple_Check(result.ptr()) && PyTuple_GET_SIZE(result.ptr()) == 2;
  if (verified && num_returns != 1) {
    PyObject* out = PyTuple_GET_ITEM(result.ptr(), 0);
    verified = PyTuple_Check(out) && static_cast<size_t>(PyTuple_GET_SIZE(out)) == num_returns;
  }
  std::string key;
  const bool keyed = check && metadata_key(args, kwargs, key);
  if (verified && check) {
    verified = keyed && state.vjp_checked.count(key) > 0;
  }
  if (!verified) {
    // Raises unless the result is right; with `check`, its output was
    // compared with the op's fake kernel's: the key is checked now.
    call_method(
        state.opdef(), py_names().verify_vjp_fwd,
        {args, kwargs, result, py::bool_(check), py::bool_(keyed)});
    if (keyed) {
      if (state.vjp_checked.size() >= kMaxCheckedKeys) {
        state.vjp_checked.clear();
      }
      state.vjp_checked.insert(std::move(key));
    }
  }
  return result;
}

py::object answer_residual_request(
    OpState& state,
    py::handle fwd,
    const py::tuple& args,
    const py::dict& kwargs) {
  bool took = false;
  for (auto* q = t_residual_request; q != nullptr; q = q->prev) {
    if (q->op == &state && !q->taken) {
      q->taken = took = true;
    }
  }
  if (!took) {
    return py::none();
  }
  py::object result = run_vjp_fwd(state, fwd, args, kwargs, /*check=*/true);
  py::handle residuals = PyTuple_GET_ITEM(result.ptr(), 1);
  for (auto* q = t_residual_request; q != nullptr; q = q->prev) {
    if (q->op == &state && q->taken && !q->residuals) {
      q->residuals = PyRef(py::reinterpret_borrow<py::object>(residuals));
    }
  }
  return py::make_tuple(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(result.ptr(), 0)));
}

void bind_vjp_residuals(py::module_& m) {
  py::class_<VjpCall>(m, "_VjpCall")
      .def(
          "residuals", &VjpCall::residuals, py::arg("saved"),
          "In the backward: (the residuals for bwd,), or None where fwd must run again on "
          "inputs(saved).")
      .def(
          "inputs", &VjpCall::inputs, py::arg("saved"),
          "The op's inputs, given what the node saved.")
      .def(
          "residual_parts", &VjpCall::residual_parts,
          "(leaves, ((leaf index, saved slot), ...), pytree spec or None): how residuals() "
          "rebuilds the residuals from what the node saved.");
  m.def(
      "_vjp_save", &VjpCall::save, py::arg("inputs"), py::arg("residuals"),
      "register_vjp's setup_context: (the tensors to save, the call's _VjpCall).");
}

} // namespace torch_autobatch
