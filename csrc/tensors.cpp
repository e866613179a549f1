// The op's tensors as both kernels see them: flattened from the dispatcher's
// stack, and checked for aliasing the schema does not declare.
#include "autobatch.h"
#include "functorch.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace torch_autobatch {

std::vector<Slot> flatten_tensors(
    c10::ArrayRef<c10::IValue> values,
    std::vector<at::Tensor>& tensors) {
  std::vector<Slot> slots;
  slots.reserve(values.size());
  for (const auto& v : values) {
    Slot slot{tensors.size(), 0, false};
    if (v.isTensor()) {
      tensors.push_back(v.toTensor());
      slot.count = 1;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        tensors.push_back(t);
      }
      slot.count = tensors.size() - slot.first;
      slot.is_list = true;
    } else if (is_optional_tensor_list(v)) {
      for (const c10::IValue& e : v.toListRef()) {
        tensors.push_back(e.isTensor() ? e.toTensor() : at::Tensor());
      }
      slot.count = tensors.size() - slot.first;
      slot.is_list = true;
    }
    slots.push_back(slot);
  }
  return slots;
}

py::tuple slots_to_py(
    const std::vector<at::Tensor>& flat,
    const std::vector<Slot>& slots,
    c10::function_ref<py::object(size_t)> other) {
  auto wrap = [](const at::Tensor& t) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t)); // None if undefined
  };
  py::tuple out(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const Slot& s = slots[i];
    if (s.is_list) {
      py::list l(s.count);
      for (size_t k = 0; k < s.count; ++k) {
        l[k] = wrap(flat[s.first + k]);
      }
      out[i] = l;
    } else {
      out[i] = s.count == 1 ? wrap(flat[s.first]) : other(i);
    }
  }
  return out;
}

bool any_requires_grad(const c10::IValue& v) {
  bool any = false;
  map_tensors(v, [&](const at::Tensor& t, size_t) {
    any = any || (t.defined() && t.requires_grad());
    return t;
  });
  return any;
}

namespace {

bool aliases(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) {
    return false;
  }
  if (a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl()) {
    return true;
  }
  // BatchedTensors and TensorWrappers may have no storage of their own.
  const auto pa = functorch::innermost(a);
  const auto pb = functorch::innermost(b);
  return pa.has_storage() && pb.has_storage() && pa.is_alias_of(pb);
}

} // namespace

std::optional<Aliasing> find_aliasing(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs) {
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (size_t p = 0; p < o; ++p) {
      if (aliases(outputs[o], outputs[p])) {
        return Aliasing{o, p};
      }
    }
    for (const auto& in : inputs) {
      if (aliases(outputs[o], in)) {
        return Aliasing{o, std::nullopt};
      }
    }
  }
  return std::nullopt;
}

void check_no_aliasing(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    bool torch_check) {
  const auto found = find_aliasing(inputs, outputs);
  if (!found) {
    return;
  }
  if (torch_check) {
    // torch.library's error, as backend_impl would have raised it.
    py::gil_scoped_acquire gil;
    const auto as_tuple = [](const std::vector<at::Tensor>& ts) {
      py::tuple t(ts.size());
      for (size_t k = 0; k < ts.size(); ++k) {
        t[k] = py::cast(ts[k]);
      }
      return t;
    };
    call_method(
        state.opdef(), py_names().check_aliasing,
        {as_tuple(inputs), py::dict(), as_tuple(outputs)});
  }
  TORCH_CHECK(
      !found->other_output,
      "torch_autobatch: ",
      state.qualname,
      " returned outputs ",
      found->other_output.value_or(0),
      " and ",
      found->output,
      " that alias each other (share memory), which its schema `",
      schema,
      "` does not declare. Return distinct tensors: e.g. `y, y.clone()` "
      "instead of `y, y`.");
  TORCH_CHECK(
      false,
      "torch_autobatch: ",
      state.qualname,
      " returned an output (tensor ",
      found->output,
      ") that aliases one of its inputs, which its schema `",
      schema,
      "` does not declare. Operators made by torch_autobatch.custom_op "
      "must return new tensors: return `x.clone()` instead of `x` or a "
      "view of it.");
}

} // namespace torch_autobatch
