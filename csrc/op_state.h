// Shared declarations of torch_autobatch's C++ kernels.
//
// Each operator made by torch_autobatch.custom_op owns one OpState. The
// kernels we register for it (Autograd, FuncTorchBatched) and every
// grad node they create hold a shared_ptr to it, so a node outlives the kernel
// registration that made it; the registration itself lives no longer than
// the op's definition (NOTE [Kernels die with their op], registration.cpp).
#pragma once

#include "python_interop.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/FunctionRef.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace torch_autobatch {

// How the batched kernel computes an op's outputs under vmap (Python sees
// it as _C.VmapMode, bound in bindings.cpp).
enum class VmapMode : int {
  Composite = 0, // the op's own function, once, on batched tensors (default)
  Rule = 1, // the user's register_vmap rule
  Loop = 2, // one call per example (custom_op(..., vmap="loop"))
};

// What our kernels know about one operator.
struct OpState {
  std::string qualname; // "mylib::softclip"
  std::string node_name; // "GeneratedBackwardFor_mylib_softclip"
  std::vector<std::string> arg_names; // from the schema, for error messages
  // A weak reference to the torch_autobatch.CustomOpDef, whose private
  // methods are the Python half of each kernel (NOTE [The Python side of the
  // kernels]); weak, so that the op object holding our registration can be
  // collected (NOTE [Kernels die with their op]).
  PyRef opdef_weakref;
  std::atomic<VmapMode> vmap_mode{VmapMode::Composite};
  std::atomic<bool> has_jvp{false}; // register_jvp was called
  std::atomic<bool> has_vjp{false}; // register_vjp was called: NOTE [Residuals of register_vjp]
  // The registered jvp's setup_context runs the forward again (a lifted
  // legacy autograd.Function): NOTE [A jvp that reruns the forward draws the
  // primal's random numbers] (forward_mode.h).
  std::atomic<bool> jvp_reruns_forward{false};
  // The keys (metadata_key, vjp_residuals.cpp) of the arguments for which
  // fwd's output was checked: NOTE [fwd returns what the op returns] (op/_vjp_check.py).
  // Requires the GIL.
  std::unordered_set<std::string> vjp_checked;
  // Its function needs an AD level to decompose some CompositeImplicit op:
  // NOTE [Decompositions under an AD level] (batched_kernel.cpp).
  std::atomic<bool> decompose_under_ad{false};
  // The schema declares no aliasing and no mutation: run_backend may call the
  // op's function itself (NOTE [Calling the composite directly]).
  bool functional_schema = false;
  // Per schema return: the argument it is (`Tensor(a!) x -> Tensor(a!)`, the
  // returns of torch.Tag.inplace and torch.Tag.out ops), or -1: NOTE
  // [Returned mutated arguments] (op_tensors.cpp).
  std::vector<int64_t> return_aliases;
  bool returns_an_argument = false;
  // What the op's user code (function, register_vjp's fwd, register_vmap's
  // rule) closes over: a tuple of (function name, variable name, cell or
  // value), checked on each call while non-empty (NOTE [What the function
  // closes over], closure.cpp). Set and read with the GIL.
  PyRef closure;
  std::atomic<bool> has_closure{false};
  // A lifted autograd.Function: a gradient of another dtype than its input's
  // is cast to the input's, as autograd casts a Function's (an AMP forward
  // that cast its inputs); any other op's is an error (grad_node.cpp).
  std::atomic<bool> cast_grad_dtypes{false};
  // A lifted autograd.Function under vmap="auto": where its forward fails on
  // batched tensors, the call runs once per example (NOTE [A forward vmap
  // cannot batch runs per example], batched_kernel.cpp).
  std::atomic<bool> loop_on_failure{false};
  // The definition our kernels were registered for still exists; cleared by
  // the dispatcher listener (registration.cpp).
  std::atomic<bool> defined{true};
  // Our kernels are registered (cleared by deregister()): the unbatched
  // call's fast path stands for them only then (fast_call.cpp).
  std::atomic<bool> registered{true};

  // The CustomOpDef; raises a clear error if it is gone. Requires the GIL.
  py::object opdef() const;

  // Our kernels' registration, dropped by deregister() (idempotent).
  std::mutex lib_mutex;
  std::unique_ptr<torch::Library> lib;
  void deregister();
};

// The operator `qualname` names ("ns::name" or "ns::name.overload"); raises
// if there is none (registration.cpp).
c10::OperatorHandle find_op(const std::string& qualname);

// A kernel of ours that finds its op's definition gone (`!state.defined`):
// deregisters our kernels and redispatches `ks` to what the dispatcher has
// without them (NOTE [Kernels die with their op]).
void redispatch_without_us(
    OpState& state,
    c10::OperatorKernel* kernel,
    const c10::OperatorHandle& op,
    c10::DispatchKeySet ks,
    torch::jit::Stack* stack);

// The functorch Grad or Jvp level whose Autograd kernel is sending the op
// being dispatched down to the levels below it, or 0; thread-local, set for
// the guard's lifetime: NOTE [Decompositions under an AD level].
inline thread_local int64_t t_sent_down_from_ad = 0;

// NOTE [Residuals of register_vjp]
// An op with register_vjp(fwd, bwd) runs fwd instead of its function when a
// kernel of ours is about to make its grad node, and the node saves fwd's
// residuals. The kernel asks for them with a ResidualRequest for the lifetime
// of the call (running the op below it, then setup_context): whichever runs
// the op below (the backend function, Inductor's
// decomposition: op/_kernel_side.py) takes the request (once) and answers every
// open request of the op on this thread with the same residuals, so each
// level's node of one call saves them. Thread-local and scoped to the call:
// no state on the op that other calls or threads could read.
struct ResidualRequest;
inline thread_local ResidualRequest* t_residual_request = nullptr;

struct ResidualRequest {
  // Opens a request for `state`'s residuals when `want`; else nothing.
  ResidualRequest(const OpState* state, bool want) : prev(t_residual_request) {
    if (want) {
      op = state;
      t_residual_request = this;
    }
  }
  ResidualRequest(const ResidualRequest&) = delete;
  ResidualRequest& operator=(const ResidualRequest&) = delete;
  ~ResidualRequest() {
    if (op != nullptr) {
      t_residual_request = prev;
    }
  }
  ResidualRequest* prev;
  const OpState* op = nullptr;
  bool taken = false; // the op below ran fwd for it
  PyRef residuals; // what fwd returned as residuals, once taken
};

// register_vjp's fwd(*args, **kwargs) for the op: its (output, residuals),
// verified (NOTE [fwd returns what the op returns], op/_vjp_check.py): C++
// checks the structure and, with `check`, finds the arguments' key in
// state.vjp_checked; anything else is the op's _verify_vjp_fwd's to check
// (or reject), and its key is then added. Requires the GIL
// (vjp_residuals.cpp).
py::object run_vjp_fwd(
    OpState& state,
    py::handle fwd,
    const py::tuple& args,
    const py::dict& kwargs,
    bool check);
// The backend kernel's side of NOTE [Residuals of register_vjp]: where this
// thread has open requests for the op's residuals, takes them, runs fwd
// (run_vjp_fwd), answers them with its residuals and returns (output,);
// else None (the op's function runs). Requires the GIL.
py::object answer_residual_request(
    OpState& state,
    py::handle fwd,
    const py::tuple& args,
    const py::dict& kwargs);

class SentDownFromAD {
 public:
  explicit SentDownFromAD(int64_t level) : saved_(t_sent_down_from_ad) {
    t_sent_down_from_ad = level;
  }
  SentDownFromAD(const SentDownFromAD&) = delete;
  SentDownFromAD& operator=(const SentDownFromAD&) = delete;
  ~SentDownFromAD() {
    t_sent_down_from_ad = saved_;
  }
  static int64_t level() {
    return t_sent_down_from_ad;
  }

 private:
  int64_t saved_;
};

// Where the tensors of one schema argument (or return) sit in a flat list of
// tensors. `count` is 0 for a non-tensor or a None `Tensor?`.
struct Slot {
  size_t first = 0;
  size_t count = 0;
  bool is_list = false;
};

// Is `v` a Tensor?[] value (a list of tensors and Nones)?
inline bool is_optional_tensor_list(const c10::IValue& v) {
  if (!v.isList()) {
    return false;
  }
  const auto opt = v.toList().elementType()->cast<c10::OptionalType>();
  return opt != nullptr && opt->getElementType()->kind() == c10::TypeKind::TensorType;
}

// `v` with each of its tensors (a Tensor, or an entry of a Tensor[] or
// Tensor?[]) replaced by f(tensor, k); k counts them as flatten_tensors does
// (a Tensor?[]'s None entries included, passed to `f` as undefined tensors).
// Anything else is returned as is.
template <class F>
c10::IValue map_tensors(const c10::IValue& v, F f) {
  if (v.isTensor()) {
    return f(v.toTensor(), size_t{0});
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    size_t k = 0;
    for (const at::Tensor& t : v.toTensorList()) {
      out.push_back(f(t, k++));
    }
    return out;
  }
  if (is_optional_tensor_list(v)) {
    c10::List<std::optional<at::Tensor>> out;
    size_t k = 0;
    for (const c10::IValue& e : v.toListRef()) {
      at::Tensor t = f(e.isTensor() ? e.toTensor() : at::Tensor(), k++);
      out.push_back(t.defined() ? std::optional<at::Tensor>(std::move(t)) : std::nullopt);
    }
    return out;
  }
  return v;
}

// Appends the tensors of `values` to `tensors` in order; returns each value's
// slot. A Tensor?[] value's None entries are undefined tensors.
std::vector<Slot> flatten_tensors(
    c10::ArrayRef<c10::IValue> values,
    std::vector<at::Tensor>& tensors);

// One Python value per slot (an argument or a return), from the flat
// tensors: a Tensor (None if undefined), a list of them for a list slot, and
// `other(i)` for slot i holding no tensor. Requires the GIL.
py::tuple slots_to_py(
    const std::vector<at::Tensor>& flat,
    const std::vector<Slot>& slots,
    c10::function_ref<py::object(size_t)> other);

// Does a Tensor (or any tensor of a Tensor[]) argument require grad?
bool any_requires_grad(const c10::IValue& v);

// Calls the op's Python `_setup_autograd(inputs, output, needs_input_grad)`
// and returns the ctx; `saved` receives what it passed to save_for_backward,
// `non_differentiable` one flag per tensor of `outputs` (the flat tensors of
// `returns`): passed to ctx.mark_non_differentiable. Requires the GIL.
py::object call_setup_context(
    const OpState& state,
    const c10::FunctionSchema& schema,
    c10::ArrayRef<c10::IValue> args,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<at::Tensor>& outputs,
    const std::vector<bool>& needs_input_grad,
    std::vector<at::Tensor>& saved,
    std::vector<bool>& non_differentiable);

// The first output that shares memory with an earlier output (other_output)
// or with an input (other_output empty).
struct Aliasing {
  size_t output;
  std::optional<size_t> other_output;
};
std::optional<Aliasing> find_aliasing(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs);

// NOTE [Returned mutated arguments]: the schema's return aliases, and per
// flat output whether it is a returned argument.
std::vector<int64_t> return_aliases(const c10::FunctionSchema& schema);
std::vector<bool>
returned_arguments(const OpState& state, const std::vector<Slot>& ret_slots, size_t num_outputs);
// Puts each returned argument on `stack` (the op's returns at its end) as
// the argument itself, as an in-place aten op's kernel returns `self`.
void return_the_arguments(
    const OpState& state,
    const std::vector<c10::IValue>& args,
    torch::jit::Stack* stack);

// Raises if an output shares memory with an input or another output (the
// schema declares no aliasing; a returned argument is checked by torch). `torch_check`: the op's function was called
// directly (run_backend returned true) on tensors torch's check can see, so
// torch.library's own error comes first, as its backend kernel raises it.
void check_no_aliasing(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const std::vector<Slot>& ret_slots,
    bool torch_check = false);

// Runs the op's own function on `stack` with the dispatch keys `ks` (those
// below the calling kernel): calls it directly when that is the kernel the
// dispatcher would pick, else redispatches (NOTE [Calling the composite
// directly], run_backend.cpp). Returns whether it called it directly: then the
// caller's check_no_aliasing stands for torch's.
bool run_backend(
    const OpState& state,
    const c10::OperatorHandle& op,
    c10::DispatchKeySet ks,
    torch::jit::Stack* stack);
bool has_functional_schema(const c10::FunctionSchema& schema);
// The Python function run_backend would call directly for `ks` (the keys
// below the calling kernel), or None where it would redispatch. Requires the
// GIL.
py::object
served_function(const OpState& state, const c10::OperatorHandle& op, c10::DispatchKeySet ks);
// Pushes what the op's function returned (`out`) onto `stack` as the schema's
// returns, converted as torch's Python kernels convert them (raising as they
// do). Requires the GIL.
void push_returns(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const py::object& out,
    torch::jit::Stack* stack);
// Looks up what run_backend needs from torch; called once, at import.
void init_composite_call();

// NOTE [What the function closes over] (closure.cpp): raises, naming the op
// and the variable, if a tensor the op's user code closes over would lose
// its derivative (it is differentiated at a live level, or has a tangent)
// or has escaped a vmap (batched at a level not on the stack now). Only
// called while state.has_closure. `inputs`: the op's own tensors;
// `batched_kernel`: called by the batched kernel (which answers for the
// levels below its own), else by the Autograd kernel (its own level).
void check_closure(
    const OpState& state,
    const std::vector<at::Tensor>& inputs,
    bool grad_mode,
    bool batched_kernel);

// Our boxed kernels for one op: autograd_kernel.cpp (the Autograd key) and
// batched_kernel.cpp (the FuncTorchBatched key).
torch::CppFunction autograd_kernel(const std::shared_ptr<OpState>& state);
torch::CppFunction batched_kernel(const std::shared_ptr<OpState>& state);

} // namespace torch_autobatch
