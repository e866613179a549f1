// The op's tensors as both kernels see them: flattened from the dispatcher's
// stack, and checked for aliasing the schema does not declare.
#include "functorch.h"
#include "op_state.h"

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

// NOTE [Returned mutated arguments]
// An in-place op (torch.Tag.inplace) returns its first argument, mutated; an
// out= op (torch.Tag.out) its out arguments: the schema says so
// (`Tensor(a!) x -> Tensor(a!)`). torch's backend wrapper checks that the
// function returned them. Our kernels then return the argument itself (at
// their own level: a functorch level would otherwise hand back a new wrapper
// of it), skip it in the aliasing check, and give it the op's grad node the
// way autograd gives an in-place op's result its history (rebase_history).
std::vector<int64_t> return_aliases(const c10::FunctionSchema& schema) {
  std::vector<int64_t> aliases;
  for (const auto& r : schema.returns()) {
    int64_t found = -1;
    const auto* info = r.alias_info();
    for (size_t a = 0; info != nullptr && info->isWrite() && a < schema.arguments().size(); ++a) {
      const auto* arg_info = schema.arguments()[a].alias_info();
      if (arg_info != nullptr && arg_info->isWrite() &&
          arg_info->beforeSets() == info->beforeSets()) {
        found = static_cast<int64_t>(a);
        break;
      }
    }
    aliases.push_back(found);
  }
  return aliases;
}

std::vector<bool>
returned_arguments(const OpState& state, const std::vector<Slot>& ret_slots, size_t num_outputs) {
  std::vector<bool> returned(num_outputs, false);
  for (size_t r = 0; state.returns_an_argument && r < ret_slots.size(); ++r) {
    if (state.return_aliases[r] >= 0) {
      for (size_t k = ret_slots[r].first; k < ret_slots[r].first + ret_slots[r].count; ++k) {
        returned[k] = true;
      }
    }
  }
  return returned;
}

void return_the_arguments(
    const OpState& state,
    const std::vector<c10::IValue>& args,
    torch::jit::Stack* stack) {
  const size_t num_returns = state.return_aliases.size();
  for (size_t r = 0; r < num_returns; ++r) {
    const int64_t a = state.return_aliases[r];
    if (a >= 0) {
      (*stack)[stack->size() - num_returns + r] = args[static_cast<size_t>(a)];
    }
  }
}

void check_no_aliasing(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& all_outputs,
    const std::vector<Slot>& ret_slots,
    bool torch_check) {
  // Returned arguments are torch's to check (its backend wrapper does).
  std::vector<at::Tensor> others;
  if (state.returns_an_argument) {
    others = all_outputs;
    const auto returned = returned_arguments(state, ret_slots, others.size());
    for (size_t k = 0; k < others.size(); ++k) {
      if (returned[k]) {
        others[k] = at::Tensor();
      }
    }
  }
  const auto& outputs = state.returns_an_argument ? others : all_outputs;
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
      !found->other_output, "torch_autobatch: ", state.qualname, " returned outputs ",
      found->other_output.value_or(0), " and ", found->output,
      " that alias each other (share memory), which its schema `", schema,
      "` does not declare. Return distinct tensors: e.g. `y, y.clone()` "
      "instead of `y, y`.");
  TORCH_CHECK(
      false, "torch_autobatch: ", state.qualname, " returned an output (tensor ", found->output,
      ") that aliases one of its inputs, which its schema `", schema,
      "` does not declare. Operators made by torch_autobatch.custom_op "
      "must return new tensors: return `x.clone()` instead of `x` or a "
      "view of it.");
}

} // namespace torch_autobatch
