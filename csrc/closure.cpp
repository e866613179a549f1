// What an op's user code closes over: check_closure (op_state.h).
//
// NOTE [What the function closes over]
// The op's derivatives come from its registered rules, which see only its
// arguments, and its function runs below autograd. A tensor the function (or
// register_vjp's fwd, or a register_vmap rule) reaches through a closure
// rather than an argument is invisible to both: if that tensor is being
// differentiated (it requires grad at a live level with grad mode on, or
// carries a forward-mode tangent), its derivative would silently be zero,
// where the plain function gives the right one (JAX raises: custom_vjp
// closing over a tracer). If it is batched by a vmap level that is not on
// the stack when the op runs (the op was called under that vmap with no
// batched argument, so it runs below the level), functorch fails with "your
// tensor may have escaped", naming neither the op nor the cause. A tensor
// wrapped by a grad or jvp level above the vmap level the function runs at
// once (a non-differentiated argument of torch.func.grad, all of which it
// wraps) cannot be used there either (functorch's INTERNAL ASSERT). All get an
// error naming the op, the function and the variable, and the fix: pass the
// tensor as an argument. What is checked: each cell of the functions'
// closures, each tensor default, each global name the code loads that held a
// tensor, None or nothing when the rule was registered (a tensor may be put
// there later), and each chain of attributes the code reads off a global or a
// cell (`model.lin.weight`: functional_call swaps its wrappers in there) that
// reached a tensor, None or an unset attribute then; all one level deep into
// tuples and lists. Chains are followed through stored data only (a module's
// or instance's dict, an nn.Module's parameters, buffers and submodules): no
// property or __getattr__ runs on the op's call path (core/_closure.py, Chain).
// Only ops whose user code has such cells pay (has_closure); a tensor that is
// also an argument of the call is the argument's business.
#include "functorch.h"
#include "op_state.h"

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>

namespace torch_autobatch {
namespace {

constexpr const char* kRequiresGrad =
    "a tensor that requires grad: the op's derivative comes from its registered rules, which see "
    "only its arguments, so the derivative through this tensor would silently be zero";
constexpr const char* kTangent =
    "a tensor with a forward-mode tangent: the op's tangents come from its registered jvp (or "
    "its function run on its arguments), which see only its arguments, so the tangent through "
    "this tensor would silently be zero";
constexpr const char* kEscaped =
    "a tensor batched by an enclosing vmap, and the op runs below that vmap level (none of its "
    "arguments is batched there), where the tensor cannot be used";

constexpr const char* kAbove =
    "a tensor that a torch.func transform inside the enclosing vmap holds (grad, vjp, jacrev and "
    "jvp wrap every tensor passed to them), and under that vmap the op's function runs once, below "
    "the transform, where the tensor cannot be used";

// Is `t` (one functorch layer of a closure tensor, or the plain tensor under
// them) differentiated at its own level?
const char* tracked(const at::Tensor& t, bool grad_mode) {
  if (grad_mode && t.requires_grad()) {
    return kRequiresGrad;
  }
  return torch::autograd::isFwGradDefined(t) ? kTangent : nullptr;
}

// Why `t` cannot be used through a closure by the kernel at `level` (0: the
// base), or nullptr. The Autograd kernel answers for its own level only (a
// kernel runs at each level in turn); the batched kernel for every level below
// its vmap level and the base, where its level walk attaches the op's nodes.
const char* closure_problem(
    at::Tensor t,
    int64_t level,
    bool batched_kernel,
    const std::vector<int64_t>& live_levels,
    bool grad_mode) {
  for (int64_t l : functorch::batched_levels(t)) {
    if (std::find(live_levels.begin(), live_levels.end(), l) == live_levels.end()) {
      return kEscaped;
    }
  }
  while (true) {
    if (auto* b = functorch::maybeGetBatchedImpl(t)) {
      t = b->value();
    } else if (auto* w = functorch::maybeGetTensorWrapper(t)) {
      const int64_t l = w->level().value_or(-1);
      if (!batched_kernel) {
        // A wrapper of another level is that level's kernel's business.
        return l == level && w->is_alive() ? tracked(t, grad_mode) : nullptr;
      }
      if (l > level && w->is_alive()) { // functorch's INTERNAL ASSERT (sanityCheckStack) otherwise
        const char* problem = tracked(t, grad_mode);
        return problem != nullptr ? problem : kAbove;
      }
      if (l < level && w->is_alive()) {
        if (const char* problem = tracked(t, grad_mode)) {
          return problem;
        }
      }
      t = w->value();
    } else {
      return level == 0 || batched_kernel ? tracked(t, grad_mode) : nullptr;
    }
  }
}

} // namespace

void check_closure(
    const OpState& state,
    const std::vector<at::Tensor>& inputs,
    bool grad_mode,
    bool batched_kernel) {
  std::vector<int64_t> live_levels;
  for (const auto& layer : functorch::getDynamicLayerStack()) {
    live_levels.push_back(layer.layerId());
  }
  const int64_t level = live_levels.empty() ? 0 : live_levels.back();
  auto is_input = [&](const at::Tensor& t) {
    return std::any_of(inputs.begin(), inputs.end(), [&](const at::Tensor& i) {
      return i.defined() && i.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
    });
  };
  py::gil_scoped_acquire gil;
  if (state.closure.get() == nullptr) {
    return;
  }
  for (const py::handle entry : py::reinterpret_borrow<py::tuple>(state.closure.get())) {
    const auto item = py::reinterpret_borrow<py::tuple>(entry);
    py::handle value = item[2];
    if (PyCell_Check(value.ptr())) {
      value = PyCell_GET(value.ptr()); // borrowed; NULL while the cell is empty
      if (value.ptr() == nullptr) {
        continue;
      }
    } else if (PyDict_Check(value.ptr())) { // a module's globals: look the name up now
      value = PyDict_GetItemWithError(value.ptr(), item[1].ptr()); // borrowed
      if (value.ptr() == nullptr) {
        PyErr_Clear();
        continue;
      }
    }
    py::object reached; // an attribute chain's end (model.lin.weight), kept alive here
    py::handle shown = item[1];
    if (item.size() > 3) {
      reached = item[3](value); // Chain (core/_closure.py): stored data only, no user code
      value = reached;
      shown = item[4];
    }
    std::vector<py::handle> candidates{value};
    if (PyTuple_Check(value.ptr()) || PyList_Check(value.ptr())) {
      for (const py::handle e : py::reinterpret_borrow<py::sequence>(value)) {
        candidates.push_back(e);
      }
    }
    for (const py::handle c : candidates) {
      if (!THPVariable_Check(c.ptr())) {
        continue;
      }
      const at::Tensor& t = THPVariable_Unpack(c.ptr());
      if (!t.defined() || is_input(t)) {
        continue;
      }
      const char* problem = closure_problem(t, level, batched_kernel, live_levels, grad_mode);
      TORCH_CHECK(
          problem == nullptr, "torch_autobatch: ", state.qualname, ": ",
          py::str(item[0]).cast<std::string>(), " closes over '",
          py::str(shown).cast<std::string>(), "', ", problem, ". Pass '",
          py::str(shown).cast<std::string>(),
          "' to the op as an argument (and give its gradient in the backward), or detach it "
          "if it is a constant.");
    }
  }
}

} // namespace torch_autobatch
