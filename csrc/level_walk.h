// The level walk of the batched kernel: after the op's outputs are computed
// under vmap, give them the op's grad node (and registered-jvp tangents) at
// every autograd level below (level_walk.cpp).
#pragma once

#include "forward_mode.h"

namespace torch_autobatch {

// Whether the walk would attach nothing: only vmap levels, and at the base no
// input requires grad (with grad mode on) or has a registered-jvp tangent.
bool nothing_to_attach(const OpState& state, bool grad_mode, const std::vector<at::Tensor>& inputs);

// `inputs`/`outputs`: the op's flat tensors as the batched kernel sees them
// (BatchedTensors of the top level); `args`/`returns` the schema values they
// came from, with `arg_slots`/`ret_slots`. `grad_mode`: the grad mode in
// force when the kernel was entered. NOTE [The level walk].
void attach_grad_nodes(
    const std::shared_ptr<OpState>& state,
    const c10::FunctionSchema& schema,
    bool grad_mode,
    std::vector<Slot> arg_slots,
    std::vector<Slot> ret_slots,
    const std::vector<c10::IValue>& args,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const std::optional<RngStates>& rng_before_primal);

} // namespace torch_autobatch
