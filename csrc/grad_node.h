// The grad node of a torch_autobatch operator (grad_node.cpp).
#pragma once

#include "op_state.h"
#include "vmap_frames.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

namespace torch_autobatch {

// The op's grad node at one autograd level: a functorch Grad level, or the
// base. Its backward calls the user's backward, re-entering the vmap levels
// (`frames`) that were above the node's level in the forward, so a backward
// written for one example runs batched (NOTE [Free batching rule]).
//
// Made in three steps, so that outputs have their history before the user's
// setup_context runs (it may compute saved tensors from them):
//   auto node = make_intrusive<CustomOpNode>(...); node->set_history(outputs);
//   ctx = call_setup_context(...); node->save(ctx, saved);
class CustomOpNode final : public torch::autograd::Node {
 public:
  // `inputs`: flat tensor inputs at the node's level (undefined where an input
  // has no edge there); `logical_inputs`: the same inputs as the user's
  // backward sees them (batched), to check its gradients against.
  CustomOpNode(
      std::shared_ptr<OpState> state,
      std::vector<Slot> arg_slots,
      std::vector<Slot> ret_slots,
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& logical_inputs,
      std::vector<VmapFrame> frames,
      size_t num_passed_positional);

  std::string name() const override {
    return state_->node_name;
  }
  // Undefined or non-differentiable outputs get no edge; their gradient is None.
  void set_history(const std::vector<at::Tensor>& outputs);
  // Takes the saved tensors (at the node's level) and what ctx recorded:
  // outputs marked non-differentiable lose their edge (`outputs` at the
  // node's level), ctx.set_materialize_grads. Requires the GIL.
  // The functorch level the node was attached at (0: the base), which the
  // backward reports to Python: NOTE [Second derivatives through residuals]
  // (op/_vjp.py).
  void set_level(int64_t level) {
    level_ = level;
  }
  void save(
      py::handle ctx,
      const std::vector<at::Tensor>& saved,
      const std::vector<at::Tensor>& outputs,
      const std::vector<bool>& non_differentiable);
  std::vector<VmapFrame>& frames() {
    return frames_;
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  void release_variables() override;

  // Compiled autograd (compiled_autograd.cpp): NOTE [Compiled autograd sees
  // an autograd.Function].
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override;
  torch::autograd::variable_list apply_with_saved(
      const torch::autograd::variable_list& inputs,
      torch::dynamo::autograd::SwapSavedVariables& saved) override;
  // (return slots, argument slots, edge_metadata(), returns_an_argument)
  // for _compiled_autograd.CompiledNode. Requires the GIL.
  py::tuple compiled_info() const;
  // apply's body, given the saved tensors (unpacked) and the incoming
  // gradients: the user's backward, re-entering the vmap frames.
  torch::autograd::variable_list run_backward(
      std::vector<at::Tensor> saved,
      torch::autograd::variable_list grads);
  bool has_frames() const {
    return !frames_.empty();
  }
  // What apply returns for the user's backward's `result`, checked as apply
  // checks it. Requires the GIL.
  torch::autograd::variable_list checked_input_grads(py::handle result) const {
    return unwrap_input_grads(result);
  }

 private:
  // (layout, device, dtype, size) of each next edge's gradient, None where
  // none is wanted. Requires the GIL.
  py::tuple edge_metadata() const;
  torch::autograd::variable_list record_backward_call(
      const torch::autograd::variable_list& inputs,
      torch::dynamo::autograd::SwapSavedVariables& saved);
  // The user's backward (CustomOpDef._run_backward) on `saved` and `grads`.
  torch::autograd::variable_list call_backward(
      const std::vector<at::Tensor>& saved,
      const torch::autograd::variable_list& grads) const;
  py::tuple wrap_grads(const torch::autograd::variable_list& grads) const;
  torch::autograd::variable_list unwrap_input_grads(py::handle result) const;
  at::Tensor check_input_grad(py::handle grad, size_t edge, size_t arg) const;
  void require_gradient_of_returned_argument(size_t arg) const;
  [[noreturn]] void fail_backward(const std::string& what) const;

  std::shared_ptr<OpState> state_;
  std::vector<Slot> arg_slots_; // schema arguments -> next edges
  std::vector<Slot> ret_slots_; // schema returns -> node inputs
  std::vector<torch::autograd::TypeAndSize> logical_meta_; // per next edge
  std::vector<bool> input_defined_; // per next edge: false for a Tensor?[]'s None
  std::vector<VmapFrame> frames_; // outermost first
  // Positional arguments the call passed (trailing defaults left out, NOTE
  // [The function gets its arguments as torch passes them]): a backward may
  // return that many gradients, as torch.library's may.
  size_t num_passed_positional_;
  std::vector<bool> differentiable_; // per node input
  bool materialize_grads_ = true; // ctx.set_materialize_grads
  std::vector<at::Tensor> outputs_for_saving_; // cleared by save()
  std::vector<torch::autograd::SavedVariable> saved_;
  PyRef ctx_;
  PyRef opdef_; // the CustomOpDef, strongly: set by save()
  bool released_ = false;
  int64_t level_ = 0;
};

// ctx.saved_tensors == saved for the scope's lifetime, on this thread only:
// NOTE [Saved tensors belong to the call] (grad_node.cpp). Requires the GIL
// (at construction and destruction); scopes nest.
class SavedTensorsScope {
 public:
  SavedTensorsScope(py::handle ctx, py::handle saved);
  SavedTensorsScope(const SavedTensorsScope&) = delete;
  SavedTensorsScope& operator=(const SavedTensorsScope&) = delete;
  ~SavedTensorsScope();
};

// Adds _C._SavedTensors (the type of BackwardContext.saved_tensors) and
// _C._call_with_saved_tensors.
void bind_saved_tensors(py::module_& m);
// Adds _C._CustomOpNode, compiled autograd's view of a grad node
// (compiled_autograd.cpp).
void bind_compiled_autograd(py::module_& m);
// register_vjp's per-call bookkeeping (vjp_residuals.cpp).
void bind_vjp_residuals(py::module_& m);

// The level of the grad node whose backward is running on this thread (0: the
// base, or none).
int64_t backward_level();

} // namespace torch_autobatch
