// The per-example path of the batched kernel (vmap_loop.cpp).
#pragma once

#include "functorch.h"
#include "op_state.h"

namespace torch_autobatch {

// NOTE [A trace keeps the op]
// A graph tracer below vmap (make_fx, in any tracing mode; the retrace of
// torch.export's run_decompositions(); aot_function; torch.compile with a
// backend other than Inductor) records the aten ops that reach its mode at
// the Python key, and no autograd. Run once on BatchedTensors, the
// composite reaches it as the function's aten ops: the op, and with it the
// registered backward and jvp, would vanish from the graph, and
// differentiating the traced program later would silently use the
// decomposition's derivatives. So under such a tracer the op's vmap is one
// call of its vmapped companion on the physical tensors (NOTE [One node for
// vmap(op) in a trace], torch_autobatch/vmap/_traced.py): one node at any
// batch size, static or symbolic, whose rules are the op's rules batched.
// The composite runs only where the tracer's decomposition table asks for
// the op's decomposition: the user's own table lists the op, or the table
// is Inductor's (torch.compile), where AOTAutograd has already traced the
// op's rules through autograd and a graph is never differentiated again
// (graphs/_compile.py); and inside the companion's own rules (the op's
// _dissolves_in_trace says so). The tracer is found by its mode key, so
// eager calls pay one TLS read. An op that mutates an argument, or returns
// other than Tensor / Tensor[], has no companion: it runs once per example
// (the vmap="loop" path), each call reaching the tracer as the op; where
// that cannot work (randomness="same", a symbolic batch size, a non-Tensor
// return) it keeps the composite with a Python warning naming the op.
enum class TracePath {
  kComposite, // no tracer, or it decomposes the op: the usual batched path
  kCompanion, // one call of the vmapped companion (run_companion)
  kLoop, // once per example (run_loop)
};
TracePath trace_path(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const functorch::DynamicLayer& layer);

// The op at this vmap level by another path than its composite: the
// companion under a tracer that keeps the op, else the loop where
// vmap="loop" (`loop_mode`) or the trace asks for it. False: nothing ran.
bool run_companion_or_loop(
    const OpState& state,
    const c10::OperatorHandle& op,
    const functorch::DynamicLayer& layer,
    bool loop_mode,
    torch::jit::Stack* stack);

// The op's vmapped companion, called once one level down on the physical
// tensors (NOTE [One node for vmap(op) in a trace]). `stack` holds the op's
// arguments (some batched at the current level); they are replaced by its
// returns, batched at dim 0 of that level.
void run_companion(const OpState& state, const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Does the op have a vmapped companion (NOTE [A trace keeps the op])?
bool has_companion(const OpState& state, const c10::FunctionSchema& schema);

// vmap="loop": one call per example, one level down; each call gets its own
// grad nodes there, so no node is attached at this level. `stack` holds the
// op's arguments (BatchedTensors of `layer`); they are replaced by its
// returns, batched at `layer`.
void run_loop(
    const OpState& state,
    const c10::OperatorHandle& op,
    const functorch::DynamicLayer& layer,
    torch::jit::Stack* stack);

} // namespace torch_autobatch
