// The FuncTorchBatched-key kernel of every torch_autobatch operator: vmap of
// the op with no batching rule written by the user.
//
// NOTE [Free batching rule]
// Forward: when an input is batched at the current vmap level, we run the op's
// own function ONCE on the BatchedTensors, dispatching straight to its backend
// kernel, so each aten op inside hits its own batching rule (no per-example
// loop). It runs with GradMode off: below the vmap level functorch's Grad
// interpreters re-enable the Autograd keys, and excluding keys would not stop
// the decomposition from being recorded there.
// Then, without running anything again, we give the outputs the op's own grad
// node at every autograd level below (each functorch Grad level, and the base),
// walking the dynamic layer stack down from the top: at a Vmap level we unwrap
// and remember the batch dims (a VmapFrame), at a Grad level we attach a node
// to that level's TensorWrappers. A node attached once, only at the level
// right below vmap, gives silently wrong gradients for vmap(vmap(op)) and for
// an outer grad differentiating a value computed under an inner one.
// Backward (CustomOpNode::apply): the node re-enters its VmapFrames, so the
// user's backward runs batched too, then unbatches and reduces the gradients
// of inputs that were not batched.
#include "autobatch.h"
#include "forward_mode.h"
#include "functorch.h"
#include "grad_node.h"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace torch_autobatch {
namespace {

using at::functorch::DynamicLayer;
using functorch::RandomnessType;
using functorch::TransformType;

// NOTE [Key sets of the batched kernel]
// Both are computed from the dispatch-key order (docs/design.md, "Dispatch-key order"),
// never listed by hand:
// - kBelowBatched: redispatch when nothing is batched at this level. The keys
//   between FuncTorchBatched and FuncTorchDynamicLayerBackMode are excluded by
//   the vmap interpreter anyway; BackMode hands the op to the next level.
// - kBackendKeys: where the op's own function is registered. The composite
//   skips BackMode (the op must run at THIS level, on BatchedTensors) and the
//   Python key (a mode would see BatchedTensors; it sees the aten ops of the
//   composite instead, one level down, as for any batched aten op).
const c10::DispatchKeySet kBelowBatched(
    c10::DispatchKeySet::FULL_AFTER,
    c10::DispatchKey::FuncTorchBatched);
const c10::DispatchKeySet kBackendKeys(
    c10::DispatchKeySet::FULL_AFTER,
    c10::DispatchKey::BackendSelect);

// Unwraps every defined tensor of `ts` at vmap level `level`; returns the bdims.
std::vector<std::optional<int64_t>> unwrap_vmap_level(
    std::vector<at::Tensor>& ts,
    int64_t level) {
  std::vector<std::optional<int64_t>> bdims(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].defined()) {
      std::tie(ts[i], bdims[i]) = at::functorch::unwrapTensorAtLevel(ts[i], level);
    }
  }
  return bdims;
}

// Unwraps the TensorWrappers (Grad, Jvp) or FunctionalTensorWrappers
// (Functionalize) of `layer`.
void unwrap_wrapper_level(std::vector<at::Tensor>& ts, const DynamicLayer& layer) {
  const int64_t level = layer.layerId();
  const bool functionalize = layer.key() == TransformType::Functionalize;
  for (auto& t : ts) {
    if (t.defined()) {
      t = functionalize ? functorch::unwrap_functionalize_level(t, level)
                        : functorch::unwrap_grad_level(t, level);
    }
  }
}

bool looks_like_batching_failure(const std::string& msg) {
  for (const char* clear : {"randomness", "inplace arithmetic"}) {
    if (msg.find(clear) != std::string::npos) {
      // functorch's own message is clear and our ways out would not help:
      // vmap(..., randomness="error"), or a mutation of an unbatched tensor
      // with a batched value (vmap="loop" would mutate it once per example).
      return false;
    }
  }
  for (const char* needle :
       {"vmap", "Batching rule", "BatchedTensor", "data pointer", "storage",
        "does not require grad", "functorch"}) {
    if (msg.find(needle) != std::string::npos) {
      return true;
    }
  }
  return false;
}

class BatchedKernel final : public c10::OperatorKernel {
 public:
  explicit BatchedKernel(std::shared_ptr<OpState> state)
      : state_(std::move(state)) {}

  void operator()(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet ks,
      torch::jit::Stack* stack) {
    if (!state_->defined.load(std::memory_order_relaxed)) {
      redispatch_without_us(*state_, this, op, ks, stack);
      return;
    }
    const auto layer = at::functorch::maybeCurrentDynamicLayer();
    // A BatchedTensor reaches FuncTorchBatched outside the vmap that made it
    // when it escaped (a closure, a tensor constant of make_fx(vmap(f),
    // pre_dispatch=True)): functorch's error for aten ops, naming the op.
    TORCH_CHECK(
        layer.has_value() && layer->key() == TransformType::Vmap,
        "torch_autobatch: ", state_->qualname,
        " received a BatchedTensor outside the vmap that created it. Either "
        "your tensor may have escaped from inside a function being vmapped and "
        "this is a user error (see "
        "https://pytorch.org/functorch/stable/ux_limitations.html), or a tracer "
        "recorded a batched tensor as a constant.");
    const int64_t level = layer->layerId();
    const auto& schema = op.schema();
    const size_t num_args = schema.arguments().size();
    const size_t num_returns = schema.returns().size();
    const auto args = torch::jit::last(*stack, num_args);

    std::vector<at::Tensor> inputs;
    auto arg_slots = flatten_tensors(args, inputs);
    const at::Tensor* batched = nullptr;
    for (const auto& t : inputs) {
      if (t.defined() && at::functorch::isBatchedAtLevel(t, level)) {
        batched = &t;
        break;
      }
    }
    if (batched == nullptr) {
      op.redispatchBoxed(ks & kBelowBatched, stack);
      return;
    }
    // Sent down by an AD level above this one (NOTE [Decompositions under an
    // AD level]); user code run from here must not see that mark.
    const bool under_ad = SentDownFromAD::level() > level;
    SentDownFromAD not_sent_down(0);
    const auto mode = state_->vmap_mode.load();
    if (mode == VmapMode::Loop || trace_keeps_op(schema, *layer)) {
      run_loop(op, *layer, stack);
      return;
    }

    const bool grad_mode = c10::GradMode::is_enabled();
    std::vector<c10::IValue> saved_args(args.begin(), args.end());
    {
      c10::AutoGradMode no_grad(false);
      // NOTE [Forward mode under vmap]: with a registered jvp, tangents at the
      // Jvp levels below come from it (attach_grad_nodes), not from the
      // composite; without one, the composite's own forward-mode AD gives them
      // here, in the same single run.
      c10::AutoFwGradMode no_fw_grad(
          c10::AutogradState::get_tls_state().get_fw_grad_mode() &&
          !state_->has_jvp.load());
      if (mode == VmapMode::Rule) {
        run_rule(op, stack);
      } else {
        run_composite(op, functorch::innermost(*batched), stack, under_ad, saved_args);
      }
    }
    if (state_->returns_an_argument) {
      return_the_arguments(*state_, saved_args, stack); // NOTE [Returned mutated arguments]
    }
    std::vector<at::Tensor> outputs;
    auto ret_slots = flatten_tensors(torch::jit::last(*stack, num_returns), outputs);
    check_no_aliasing(*state_, schema, inputs, outputs, ret_slots);
    attach_grad_nodes(
        schema, grad_mode, std::move(arg_slots), std::move(ret_slots), saved_args,
        torch::jit::last(*stack, num_returns), inputs, outputs);
  }

 private:
  // NOTE [Decompositions under an AD level]
  // A CompositeImplicitAutograd op with no batching rule (column_stack of a
  // TensorList, narrow with a tensor start) fails under vmap alone, for a
  // plain function too: it decomposes only at the Autograd keys, and
  // FuncTorchBatched outranks them. Under vmap(grad(f)) or vmap(jvp(f)) a
  // plain function gets past it because the AD level's Autograd key
  // decomposes the op before the vmap level sees it; our Autograd kernel sends
  // the whole op below that level (marking it: SentDownFromAD), so that chance
  // is gone. When the mark is above this vmap level and the composite fails
  // for a missing batching rule, the composite runs again under a temporary
  // Grad level of our own (grad mode off: it records nothing, and its
  // prevGradMode keeps the levels below from recording), where such ops
  // decompose as they would at the AD level; the vmap level batches the
  // pieces. The op remembers it needs this (decompose_under_ad), so later
  // calls under an AD level go straight there, and calls under vmap alone fail
  // as the plain function does. Only failing ops pay for the extra level.
  // The first call runs the composite up to the failing op twice, so random
  // ops before it draw twice.
  void run_composite(
      const c10::OperatorHandle& op,
      const at::Tensor& physical,
      torch::jit::Stack* stack,
      bool under_ad,
      const std::vector<c10::IValue>& args) const {
    const bool decompose = under_ad && state_->decompose_under_ad.load();
    const size_t base = stack->size() - args.size();
    // A mutating function is never run twice: its mutations before the
    // failing op would happen twice (it then fails as a plain function does).
    const bool may_retry = under_ad && !decompose && !op.schema().is_mutable();
    try {
      run_composite_once(op, physical, stack, decompose, may_retry);
    } catch (const MissingBatchingRule&) {
      state_->decompose_under_ad.store(true);
      stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
      stack->insert(stack->end(), args.begin(), args.end());
      run_composite_once(op, physical, stack, /*decompose=*/true, /*may_retry=*/false);
    }
  }

  // Thrown by run_composite_once when a decomposing rerun may succeed.
  struct MissingBatchingRule {};

  void run_composite_once(
      const c10::OperatorHandle& op,
      const at::Tensor& physical,
      torch::jit::Stack* stack,
      bool decompose,
      bool may_retry) const {
    try {
      // Each op inside enters through the front key, as in a plain function:
      // NOTE [User Python sees a plain caller's state].
      functorch::AsPlainCaller plain;
      if (!decompose) {
        run_backend(*state_, op, physical.key_set() & kBackendKeys, stack);
        return;
      }
      functorch::GradLevelGuard grad_level(/*prev_grad_mode=*/false);
      op.redispatchBoxed(physical.key_set() & kBackendKeys, stack);
      for (auto it = stack->end() - static_cast<std::ptrdiff_t>(op.schema().returns().size());
           it != stack->end(); ++it) {
        *it = unwrap_returned(*it, grad_level.level());
      }
    } catch (py::error_already_set& e) {
      // A Python kernel's exception arrives as pybind11's; make it torch's.
      try {
        rethrow_python_error(e);
      } catch (python_error& err) {
        handle_composite_error(err, may_retry);
      }
    } catch (python_error& e) {
      handle_composite_error(e, may_retry);
    } catch (const c10::Error& e) {
      if (!looks_like_batching_failure(e.what_without_backtrace())) {
        throw;
      }
      fail_unbatchable(e.what_without_backtrace(), may_retry);
    }
  }

  static c10::IValue unwrap_returned(const c10::IValue& v, int64_t level) {
    return map_tensors(v, [&](const at::Tensor& t, size_t) {
      return t.defined() ? functorch::unwrap_grad_level(t, level) : t;
    });
  }

  // Turns functorch's "cannot batch this" into our error naming the op and
  // the ways out; any other exception goes on unchanged. torch's and
  // functorch's errors reach Python as exactly RuntimeError (or
  // NotImplementedError); a user's own exception class, even one derived
  // from them, is the user's: its type and message stay as raised.
  [[noreturn]] void handle_composite_error(python_error& e, bool may_retry) const {
    e.persist();
    const bool is_torch_error =
        e.type == PyExc_RuntimeError || e.type == PyExc_NotImplementedError;
    if (!is_torch_error || !looks_like_batching_failure(e.what())) {
      throw std::move(e);
    }
    fail_unbatchable(e.what(), may_retry);
  }

  // functorch's message comes first, unchanged, as for a plain function.
  [[noreturn]] void fail_unbatchable(const std::string& cause, bool may_retry) const {
    if (may_retry && cause.find("Batching rule not implemented for") != std::string::npos) {
      throw MissingBatchingRule{};
    }
    const auto& name = state_->qualname.substr(state_->qualname.find("::") + 2);
    TORCH_CHECK(
        false,
        cause,
        "\ntorch_autobatch: vmap of ",
        state_->qualname,
        " runs its function once on batched tensors, and that failed (above). "
        "A function vmap can batch uses torch ops only: no .item(), "
        ".tolist(), .numpy(), no Python control flow on tensor values, and no "
        "autograd calls of its own (it runs with grad mode off). "
        "Two ways out: register a batching rule with ",
        name,
        ".register_vmap(rule), or define the op with "
        "torch_autobatch.custom_op(..., vmap=\"loop\") to run it once per "
        "example (slower, correct for values and gradients).");
  }

  // NOTE [A trace keeps the op]
  // A graph tracer below vmap (make_fx, in any tracing mode; the retrace of
  // torch.export's run_decompositions(); aot_function) records the aten ops
  // that reach its mode at the Python key, and no autograd. Run once on
  // BatchedTensors, the composite reaches it as the function's aten ops: the
  // op, and with it the registered backward and jvp, would vanish from the
  // graph, and differentiating the traced program later would silently use
  // the decomposition's derivatives. So under such a tracer the op runs once
  // per example (the vmap="loop" path), and each call reaches the tracer as
  // the op itself, rules and all, as torch.library's ops do. The composite
  // runs only where the tracer's decomposition table asks for the op's
  // decomposition: the user's own table lists the op, or the table is
  // Inductor's (torch.compile), where AOTAutograd has already traced the
  // op's rules through autograd and a graph is never differentiated again
  // (_compile.py). The tracer is found by its mode key, so eager calls pay
  // one TLS read. Three cases cannot run per example, and keep the composite
  // with a Python warning naming the op and the way out: returns other than
  // Tensor (they cannot be stacked); randomness="same" (generators put back
  // between examples at trace time are not in the graph); and a symbolic
  // batch size (a dynamic batch dim of torch.export, make_fx's "symbolic"
  // mode), which the loop would specialise to the traced size with no guard
  // make_fx enforces.
  bool trace_keeps_op(const c10::FunctionSchema& schema, const DynamicLayer& layer) const;

  // The user's register_vmap rule, through torch's helper for such rules.
  void run_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack) const;

  // vmap="loop": one call per example, one level down; each call gets its own
  // grad nodes there, so no node is attached here.
  void run_loop(
      const c10::OperatorHandle& op,
      const DynamicLayer& layer,
      torch::jit::Stack* stack) const;
  void run_loop_empty(
      const c10::OperatorHandle& op,
      const std::vector<c10::IValue>& args,
      const std::vector<std::vector<bool>>& batched,
      int64_t level,
      torch::jit::Stack* stack) const;
  void check_loop_output(const c10::IValue& out, size_t r) const;

  bool nothing_to_attach(bool grad_mode, const std::vector<at::Tensor>& inputs) const;

  void attach_grad_nodes(
      const c10::FunctionSchema& schema,
      bool grad_mode,
      std::vector<Slot> arg_slots,
      std::vector<Slot> ret_slots,
      const std::vector<c10::IValue>& args,
      c10::ArrayRef<c10::IValue> returns,
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs) const;

  std::shared_ptr<OpState> state_;
};

// The common case of the walk below, without its copies: only vmap levels
// (no Grad or Jvp level to attach at), and at the base no input, with its
// batch dims peeled, requires grad (with grad mode on) or has a tangent for
// the registered jvp (forward-mode AD's dual tensors).
bool BatchedKernel::nothing_to_attach(
    bool grad_mode,
    const std::vector<at::Tensor>& inputs) const {
  for (const auto& layer : at::functorch::getDynamicLayerStack()) {
    if (layer.key() != TransformType::Vmap) {
      return false;
    }
  }
  const bool has_jvp = state_->has_jvp.load();
  if (!grad_mode && !has_jvp) {
    return true;
  }
  for (at::Tensor t : inputs) {
    while (auto* b = t.defined() ? at::functorch::maybeGetBatchedImpl(t) : nullptr) {
      t = b->value();
    }
    if (t.defined() &&
        ((grad_mode && t.requires_grad()) ||
         (has_jvp && torch::autograd::isFwGradDefined(t)))) {
      return false;
    }
  }
  return true;
}

void BatchedKernel::attach_grad_nodes(
    const c10::FunctionSchema& schema,
    bool grad_mode,
    std::vector<Slot> arg_slots,
    std::vector<Slot> ret_slots,
    const std::vector<c10::IValue>& args,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs) const {
  if (nothing_to_attach(grad_mode, inputs)) {
    return;
  }
  // A copy: setup_context below runs user Python, which may replace the
  // thread's functorch state (an autograd engine run inside it).
  const auto layers = at::functorch::getDynamicLayerStack();

  // 1. Walk down the levels; attach a node, with history on the outputs, at
  //    each autograd level where an input requires grad.
  struct Site {
    c10::intrusive_ptr<CustomOpNode> node;
    int64_t level; // -1: the base
    size_t num_frames;
    std::vector<at::Tensor> outputs; // at the node's level
  };
  std::vector<Site> sites;
  std::vector<VmapFrame> frames; // innermost first
  std::vector<at::Tensor> in = inputs;
  std::vector<at::Tensor> out = outputs;
  std::vector<bool> needs(inputs.size(), false);
  const size_t num_passed = passed_arguments(args, schema.arguments()).num_positional;
  bool mode = grad_mode; // the grad mode in force at the level being visited
  auto attach = [&](int64_t level,
                    const std::vector<at::Tensor>& in_here,
                    const std::vector<at::Tensor>& out_here) {
    auto node = c10::make_intrusive<CustomOpNode>(
        state_, arg_slots, ret_slots, in_here, inputs,
        std::vector<VmapFrame>(frames.rbegin(), frames.rend()), num_passed);
    node->set_history(out_here);
    sites.push_back({std::move(node), level, frames.size(), out_here});
  };
  for (size_t i = layers.size(); i-- > 0;) {
    const DynamicLayer& layer = layers[i];
    const int64_t id = layer.layerId();
    switch (layer.key()) {
      case TransformType::Vmap: {
        VmapFrame f;
        f.batch_size = layer.batchSize();
        f.randomness = static_cast<int64_t>(layer.randomness());
        f.in_bdims = unwrap_vmap_level(in, id);
        f.out_bdims = unwrap_vmap_level(out, id);
        frames.push_back(std::move(f));
        break;
      }
      case TransformType::Grad: {
        std::vector<at::Tensor> in_here(in.size());
        bool any = false;
        for (size_t k = 0; k < in.size(); ++k) {
          if (in[k].defined() && functorch::is_wrapped_at(in[k], id)) {
            in_here[k] = in[k];
            if (in[k].requires_grad()) {
              any = needs[k] = true;
            }
          }
        }
        if (mode && any) {
          std::vector<at::Tensor> out_here(out.size());
          for (size_t k = 0; k < out.size(); ++k) {
            if (out[k].defined() && functorch::is_wrapped_at(out[k], id)) {
              out_here[k] = out[k];
            }
          }
          attach(id, in_here, out_here);
        }
        unwrap_wrapper_level(in, layer);
        unwrap_wrapper_level(out, layer);
        mode = functorch::prev_grad_mode(layer);
        break;
      }
      case TransformType::Jvp:
        if (state_->has_jvp.load()) {
          set_jvp_tangents_below_vmap(
              *state_, schema, id, in, out, frames, args, arg_slots, returns, ret_slots);
        }
        unwrap_wrapper_level(in, layer);
        unwrap_wrapper_level(out, layer);
        break;
      default: // Functionalize: nothing to attach, look through it
        unwrap_wrapper_level(in, layer);
        unwrap_wrapper_level(out, layer);
    }
  }
  if (state_->has_jvp.load()) {
    // The base: tangents of forward-mode AD's dual tensors (fwAD.make_dual
    // around vmap(op)), NOTE [Forward mode under vmap].
    set_jvp_tangents_below_vmap(
        *state_, schema, kBaseLevel, in, out, frames, args, arg_slots, returns, ret_slots);
  }
  if (mode) {
    bool any = false;
    for (size_t k = 0; k < in.size(); ++k) {
      if (in[k].defined() && in[k].requires_grad()) {
        any = needs[k] = true;
      }
    }
    if (any) {
      attach(-1, in, out);
    }
  }
  if (sites.empty()) {
    return;
  }

  // 2. The user's setup_context, once, on what it would see: the batched
  //    inputs and outputs of this level.
  std::vector<bool> needs_arg(args.size(), false);
  for (size_t a = 0; a < args.size(); ++a) {
    const Slot& s = arg_slots[a];
    for (size_t k = s.first; k < s.first + s.count; ++k) {
      needs_arg[a] = needs_arg[a] || needs[k];
    }
  }
  py::gil_scoped_acquire gil;
  std::vector<at::Tensor> saved;
  std::vector<bool> non_differentiable;
  py::object ctx;
  {
    functorch::AsPlainCaller plain;
    ctx = call_setup_context(
        *state_, schema, args, returns, outputs, needs_arg, saved, non_differentiable);
  }

  // 3. The same walk for the saved tensors: each node saves them as seen at
  //    its level, with their batch dims in its frames.
  std::vector<std::vector<std::optional<int64_t>>> saved_bdims; // innermost first
  auto site = sites.begin();
  auto hand_over = [&](int64_t level) {
    if (site == sites.end() || site->level != level) {
      return;
    }
    auto& node_frames = site->node->frames();
    for (size_t j = 0; j < site->num_frames; ++j) {
      node_frames[site->num_frames - 1 - j].saved_bdims = saved_bdims[j];
    }
    site->node->save(ctx, saved, site->outputs, non_differentiable);
    ++site;
  };
  for (size_t i = layers.size(); i-- > 0;) {
    const DynamicLayer& layer = layers[i];
    const int64_t id = layer.layerId();
    if (layer.key() == TransformType::Vmap) {
      saved_bdims.push_back(unwrap_vmap_level(saved, id));
      continue;
    }
    if (layer.key() == TransformType::Grad) {
      hand_over(id);
    }
    unwrap_wrapper_level(saved, layer);
  }
  hand_over(-1);
}

void BatchedKernel::run_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack) const {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t num_returns = schema.returns().size();
  py::gil_scoped_acquire gil;
  try {
    // torch's helper for register_vmap rules unwraps the arguments at this
    // level, calls the rule one level down, checks what it returns and wraps
    // the outputs by their out_dims (a pytree matching the output). The rule
    // is user Python: a torch.func call in it needs the caller's state (NOTE
    // [User Python sees a plain caller's state]).
    functorch::AsPlainCaller plain;
    // NOTE [The function gets its arguments as torch passes them]
    const auto [py_args, py_kwargs] =
        to_py_call(torch::jit::last(*stack, num_args), schema.arguments());
    py::tuple outs =
        call_method(state_->opdef(), py_names().run_vmap_rule, {py_args, py_kwargs});
    torch::jit::drop(*stack, num_args);
    for (size_t r = 0; r < num_returns; ++r) {
      torch::jit::push(*stack, torch::jit::toIValue(outs[r], schema.returns()[r].type()));
    }
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

bool BatchedKernel::trace_keeps_op(
    const c10::FunctionSchema& schema,
    const DynamicLayer& layer) const {
  if (!c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::PROXY)
           .has_value()) {
    return false;
  }
  py::gil_scoped_acquire gil;
  bool dissolves = false;
  try {
    dissolves = call_method(state_->opdef(), py_names().dissolves_in_trace, {}).cast<bool>();
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
  if (dissolves) {
    return false;
  }
  std::string why;
  for (const auto& r : schema.returns()) {
    if (why.empty() && r.real_type()->kind() != c10::TypeKind::TensorType) {
      why = c10::str("that needs Tensor returns, and it returns ", r.type()->str());
    }
  }
  if (why.empty() && layer.randomness() == RandomnessType::Same) {
    // Restoring the generators between examples (as run_loop does eagerly)
    // is not in the graph: its replay would draw each example's own numbers.
    why = "that draws random numbers per example, and this vmap has "
          "randomness=\"same\"";
  }
  if (why.empty() && !layer.batchSize().maybe_as_int().has_value()) {
    why = "that needs a static batch size, and this one is symbolic (a dynamic "
          "batch dim of torch.export, make_fx's tracing_mode=\"symbolic\")";
  }
  if (why.empty()) {
    return true;
  }
  // A Python warning (a C++ TORCH_WARN here reaches no Python handler).
  const std::string msg = c10::str(
      "torch_autobatch: vmap of ", state_->qualname,
      " is being traced into a graph (make_fx, torch.export's "
      "run_decompositions, aot_function), where it would run once per "
      "example so that the graph keeps the op and its registered rules; ",
      why,
      ". The graph holds the op's decomposition instead: differentiating "
      "the traced program uses the function's own derivatives, not the "
      "registered backward or jvp. Trace the transform itself "
      "(make_fx(vmap(grad(f)))) rather than differentiating the traced "
      "program, or trace with a static batch size and Tensor returns.");
  if (PyErr_WarnEx(PyExc_UserWarning, msg.c_str(), 1) != 0) {
    throw python_error(); // warnings are errors
  }
  return false;
}

void BatchedKernel::run_loop(
    const c10::OperatorHandle& op,
    const DynamicLayer& layer,
    torch::jit::Stack* stack) const {
  const int64_t level = layer.layerId();
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t num_returns = schema.returns().size();
  const int64_t batch_size = layer.batchSize().guard_int(__FILE__, __LINE__);
  std::vector<c10::IValue> args(
      stack->end() - static_cast<std::ptrdiff_t>(num_args), stack->end());
  torch::jit::drop(*stack, num_args);
  const std::vector<c10::IValue> batched_args =
      state_->returns_an_argument ? args : std::vector<c10::IValue>{};

  // Unwrap once; move every batch dim to the front. One flag per tensor of
  // each argument: is it batched at this level?
  std::vector<std::vector<bool>> batched(num_args);
  for (size_t a = 0; a < num_args; ++a) {
    auto& flags = batched[a];
    args[a] = map_tensors(args[a], [&](const at::Tensor& t, size_t) {
      if (!t.defined()) {
        flags.push_back(false);
        return t;
      }
      auto [value, bdim] = at::functorch::unwrapTensorAtLevel(t, level);
      flags.push_back(bdim.has_value());
      return bdim ? value.movedim(*bdim, 0) : value;
    });
  }
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (batch_size == 0) {
    run_loop_empty(op, args, batched, level, stack);
    return;
  }
  // randomness="same": every example draws the numbers the first one drew.
  std::optional<RngStates> rng_before;
  if (layer.randomness() == RandomnessType::Same) {
    std::vector<at::Tensor> tensors;
    for (const auto& a : args) {
      map_tensors(a, [&](const at::Tensor& t, size_t) {
        tensors.push_back(t);
        return t;
      });
    }
    rng_before.emplace(tensors);
  }
  std::vector<std::vector<at::Tensor>> results(num_returns);
  for (int64_t b = 0; b < batch_size; ++b) {
    if (rng_before && b > 0) {
      rng_before->restore();
    }
    torch::jit::Stack call;
    for (size_t a = 0; a < num_args; ++a) {
      call.push_back(map_tensors(args[a], [&](const at::Tensor& t, size_t k) {
        return batched[a][k] ? t.select(0, b) : t;
      }));
    }
    op.callBoxed(call);
    for (size_t r = 0; r < num_returns; ++r) {
      check_loop_output(call[r], r);
      results[r].push_back(call[r].toTensor());
    }
  }
  for (size_t r = 0; r < num_returns; ++r) {
    torch::jit::push(*stack, at::functorch::makeBatched(at::stack(results[r]), 0, level));
  }
  // Each example mutated its slice of the argument in place; the op returns
  // the argument itself (NOTE [Returned mutated arguments]), not a stack.
  if (state_->returns_an_argument) {
    return_the_arguments(*state_, batched_args, stack);
  }
}

void BatchedKernel::check_loop_output(const c10::IValue& out, size_t r) const {
  TORCH_CHECK(
      out.isTensor(),
      "torch_autobatch: vmap=\"loop\" of ",
      state_->qualname,
      " supports tensor outputs only; output ",
      r,
      " is a ",
      out.tagKind());
}

// A batch of no examples: the outputs have the shapes one example would
// give, with a batch dimension of 0, as for a plain function. Those shapes
// come from the op's fake kernel (register_fake, or the function itself) on
// meta tensors of one example's shape, where it can run there; else from the
// function run once on zeros of that shape (a vmap="loop" function often
// reads values: .item()). Its outputs are dropped: only their shapes and
// dtypes are used.
void BatchedKernel::run_loop_empty(
    const c10::OperatorHandle& op,
    const std::vector<c10::IValue>& args,
    const std::vector<std::vector<bool>>& batched,
    int64_t level,
    torch::jit::Stack* stack) const {
  const size_t num_returns = op.schema().returns().size();
  std::optional<c10::Device> device;
  auto one_example = [&](bool on_meta) {
    torch::jit::Stack call;
    for (size_t a = 0; a < args.size(); ++a) {
      call.push_back(map_tensors(args[a], [&](const at::Tensor& t, size_t k) {
        if (!t.defined()) {
          return t;
        }
        const bool is_batched = batched[a][k];
        device = device.value_or(t.device());
        const auto sizes = is_batched ? t.sym_sizes().slice(1) : t.sym_sizes();
        return on_meta ? at::empty_symint(sizes, t.options().device(c10::kMeta))
                       : is_batched ? at::zeros_symint(sizes, t.options()) : t;
      }));
    }
    op.callBoxed(call);
    return call;
  };
  torch::jit::Stack outs;
  try {
    outs = one_example(/*on_meta=*/true);
  } catch (const std::exception& on_meta) {
    const std::string why = on_meta.what();
    try {
      outs = one_example(/*on_meta=*/false);
    } catch (const std::exception& on_zeros) {
      TORCH_CHECK(
          false,
          "torch_autobatch: vmap=\"loop\" of ",
          state_->qualname,
          " over a batch of size 0 needs the shapes of one example's outputs. The "
          "op's fake kernel failed on meta tensors:\n",
          why,
          "\nand its function failed on zeros of one example's shape:\n",
          on_zeros.what(),
          "\nRegister a fake kernel with ",
          state_->qualname.substr(state_->qualname.find("::") + 2),
          ".register_fake(fn) that returns empty tensors of the output shapes.");
    }
  }
  for (size_t r = 0; r < num_returns; ++r) {
    check_loop_output(outs[r], r);
    const at::Tensor& example = outs[r].toTensor();
    std::vector<c10::SymInt> sizes{c10::SymInt(0)};
    for (const auto& d : example.sym_sizes()) {
      sizes.push_back(d);
    }
    const auto options = example.options().device(device.value_or(c10::Device(c10::kCPU)));
    torch::jit::push(
        *stack, at::functorch::makeBatched(at::empty_symint(sizes, options), 0, level));
  }
}

} // namespace

torch::CppFunction batched_kernel(const std::shared_ptr<OpState>& state) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<BatchedKernel>(state));
}

} // namespace torch_autobatch
