// The Autograd-key kernel of every torch_autobatch operator: runs the op once
// below autograd, then attaches its grad node (grad_node.cpp) and sets its
// output tangents (forward_mode.cpp).
//
// NOTE [Why our own Autograd kernel]
// torch.library.custom_op wraps the user's backward in an autograd.Function
// whose forward takes ctx; torch.func refuses that ("must override the
// setup_context staticmethod") and forward-mode AD silently sees zeros. A C++
// kernel at the Autograd alias key that (1) redispatches below
// ADInplaceOrView, so the user's Python forward runs once and is never
// recorded, and (2) attaches a plain autograd Node, is what every functorch
// Grad level expects: functorch re-enables the Autograd keys per level and our
// kernel runs once per level, on that level's TensorWrappers.
#include "forward_mode.h"
#include "functorch.h"
#include "grad_node.h"
#include "op_state.h"
#include "vmap_frames.h"

#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>

namespace torch_autobatch {
namespace {

class AutogradKernel final : public c10::OperatorKernel {
 public:
  explicit AutogradKernel(std::shared_ptr<OpState> state) : state_(std::move(state)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    if (!state_->defined.load(std::memory_order_relaxed)) {
      redispatch_without_us(*state_, this, op, ks, stack);
      return;
    }
    const auto& schema = op.schema();
    const size_t num_args = schema.arguments().size();
    const size_t num_returns = schema.returns().size();
    const auto args = torch::jit::last(*stack, num_args);

    std::vector<at::Tensor> inputs;
    auto arg_slots = flatten_tensors(args, inputs);
    bool some_requires_grad = false;
    bool any_tangent = false;
    for (const auto& t : inputs) {
      any_tangent |= torch::autograd::isFwGradDefined(t);
      some_requires_grad |= t.defined() && t.requires_grad();
    }
    const bool needs_node = some_requires_grad && c10::GradMode::is_enabled();
    if (state_->has_closure.load(std::memory_order_relaxed)) {
      check_closure(
          *state_, inputs, c10::GradMode::is_enabled(),
          /*batched_kernel=*/false); // NOTE [What the function closes over]
    }
    if (needs_node && schema.is_mutable()) {
      check_mutated_need_no_grad(schema, args);
    }
    std::vector<c10::IValue> saved_args;
    if (needs_node || any_tangent || state_->returns_an_argument) {
      saved_args.assign(args.begin(), args.end());
    }
    // NOTE [Derived tangents draw the primal's random numbers]
    std::optional<RngStates> rng_before_primal;
    std::optional<PreMutationArgs> pre_mutation; // NOTE [Derived tangents of a mutating op]
    if (any_tangent && !state_->has_jvp.load()) {
      rng_before_primal.emplace(inputs);
      if (schema.is_mutable()) {
        pre_mutation.emplace(schema, saved_args);
      }
    } else if (any_tangent && state_->jvp_reruns_forward.load()) {
      // NOTE [A jvp that reruns the forward draws the primal's random numbers]
      rng_before_primal.emplace(inputs);
    }

    // NOTE [Residuals of register_vjp]: open until setup_context has run.
    ResidualRequest residuals(state_.get(), needs_node && state_->has_vjp.load());
    const bool called_directly = run_below_autograd(op, ks, stack, needs_node);
    if (state_->returns_an_argument) {
      return_the_arguments(*state_, saved_args, stack); // NOTE [Returned mutated arguments]
    }
    const auto returns = torch::jit::last(*stack, num_returns);
    std::vector<at::Tensor> outputs;
    auto ret_slots = flatten_tensors(returns, outputs);
    check_no_aliasing(*state_, schema, inputs, outputs, ret_slots, called_directly);
    if (!needs_node && !any_tangent) {
      return;
    }
    c10::intrusive_ptr<CustomOpNode> node;
    if (needs_node) {
      node = c10::make_intrusive<CustomOpNode>(
          state_, std::move(arg_slots), ret_slots, inputs, inputs, std::vector<VmapFrame>{},
          passed_arguments(saved_args, schema.arguments()).num_positional);
      node->set_history(outputs);
      const auto layer = functorch::maybeCurrentDynamicLayer();
      node->set_level(layer.has_value() ? layer->layerId() : 0);
    }
    py::gil_scoped_acquire gil;
    if (any_tangent) {
      // NOTE [Forward mode]. Before the node saves anything: a saved output
      // keeps its tangent.
      set_tangents(
          schema, saved_args, returns, ret_slots, outputs, rng_before_primal, pre_mutation);
    }
    if (node) {
      save_for_backward(*node, schema, saved_args, returns, outputs);
    }
  }

 private:
  // The user's forward runs once, below autograd: never recorded. A mutating
  // op goes through ADInplaceOrView, whose kernel (torch's, registered by
  // CustomOpDef) bumps the mutated inputs' versions, so a tensor saved for
  // backward and mutated here is caught as autograd does (NOTE [Mutating
  // ops]). Returns whether run_backend called the function directly.
  bool run_below_autograd(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet ks,
      torch::jit::Stack* stack,
      bool needs_node) const {
    const bool mutates = op.schema().is_mutable();
    std::optional<at::AutoDispatchBelowAutograd> below_autograd;
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_ad_inplace;
    if (mutates) {
      below_autograd.emplace();
    } else {
      below_ad_inplace.emplace();
    }
    // NOTE [The kernel sees grad mode off when a node is made]
    // As in torch.library (the kernel runs in autograd.Function.forward), the
    // backend kernel runs with grad mode off when this call makes a node for
    // tensors that really require grad, so `.numpy()` and
    // `torch.is_grad_enabled()` in it behave alike. Only at the base: at a
    // functorch Grad level, grad mode must stay on for the levels below (they
    // read it to decide whether to attach their own node), and the kernel
    // sees unwrapped tensors that need no grad anyway.
    const auto layer = functorch::maybeCurrentDynamicLayer();
    std::optional<c10::AutoGradMode> no_grad;
    if (needs_node && !layer.has_value()) {
      no_grad.emplace(false);
    }
    const bool ad_level = layer.has_value() && (layer->key() == functorch::TransformType::Grad ||
                                                layer->key() == functorch::TransformType::Jvp);
    SentDownFromAD sent_down(ad_level ? layer->layerId() : 0);
    if (mutates) {
      op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
      return false;
    }
    return run_backend(*state_, op, ks & c10::after_ADInplaceOrView_keyset, stack);
  }

  // The output tangents, from the registered jvp or the function's own
  // forward-mode AD (NOTE [Forward mode]). Requires the GIL.
  void set_tangents(
      const c10::FunctionSchema& schema,
      const std::vector<c10::IValue>& saved_args,
      c10::ArrayRef<c10::IValue> returns,
      const std::vector<Slot>& ret_slots,
      const std::vector<at::Tensor>& outputs,
      const std::optional<RngStates>& rng_before_primal,
      const std::optional<PreMutationArgs>& pre_mutation) const {
    std::vector<at::Tensor> tangents;
    {
      // The jvp or the function is user Python: NOTE [User Python sees a
      // plain caller's state].
      functorch::AsPlainCaller plain;
      tangents = output_tangents(
          *state_, schema, saved_args, returns, ret_slots, outputs, rng_before_primal,
          pre_mutation);
    }
    // Set as this level's kernel: NOTE [Derived tangents of a mutating op].
    if (pre_mutation) {
      pre_mutation->copy_tangents_to(saved_args);
    }
    set_output_tangents(*state_, ret_slots, outputs, tangents, pre_mutation.has_value());
  }

  // The user's setup_context (user Python too), and what it saves. Requires
  // the GIL.
  void save_for_backward(
      CustomOpNode& node,
      const c10::FunctionSchema& schema,
      const std::vector<c10::IValue>& saved_args,
      c10::ArrayRef<c10::IValue> returns,
      const std::vector<at::Tensor>& outputs) const {
    functorch::AsPlainCaller plain;
    std::vector<bool> needs_input_grad(saved_args.size(), false);
    for (size_t a = 0; a < saved_args.size(); ++a) {
      needs_input_grad[a] = any_requires_grad(saved_args[a]);
    }
    std::vector<at::Tensor> saved;
    std::vector<bool> non_differentiable;
    py::object ctx = call_setup_context(
        *state_, schema, saved_args, returns, outputs, needs_input_grad, saved, non_differentiable);
    node.save(ctx, saved, outputs, non_differentiable);
  }

  // NOTE [Mutating ops]
  // An op may mutate inputs (mutates_args): its backward differentiates the
  // others. A mutated input that requires grad would need its history
  // rebased onto this op, as autograd does for in-place aten ops; the user's
  // backward has no gradient for "the input before the mutation", so that is
  // refused with a clear error rather than silently losing the mutation's
  // derivative. Except for an argument the op returns (torch.Tag.inplace,
  // torch.Tag.out: NOTE [Returned mutated arguments]): its history is
  // rebased onto the node, whose backward must then give the gradient with
  // respect to it before the mutation (None is refused: CustomOpNode).
  void check_mutated_need_no_grad(
      const c10::FunctionSchema& schema,
      c10::ArrayRef<c10::IValue> args) const {
    for (size_t a = 0; a < args.size(); ++a) {
      const auto& info = schema.arguments()[a].alias_info();
      const bool returned = std::find(
                                state_->return_aliases.begin(), state_->return_aliases.end(),
                                static_cast<int64_t>(a)) != state_->return_aliases.end();
      TORCH_CHECK(
          !(info && info->isWrite() && !returned && any_requires_grad(args[a])),
          "torch_autobatch: ", state_->qualname, " mutates its argument '",
          schema.arguments()[a].name(),
          "' in place, and that tensor requires grad. A custom op's backward "
          "cannot differentiate through its own mutation: pass a tensor that "
          "does not require grad (e.g. a buffer, or x.detach().clone()), or make "
          "the op functional and return the new value.");
    }
  }

  std::shared_ptr<OpState> state_;
};

} // namespace

torch::CppFunction autograd_kernel(const std::shared_ptr<OpState>& state) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(state));
}

} // namespace torch_autobatch