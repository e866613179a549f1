// The per-example path of the batched kernel (vmap_loop.cpp).
#pragma once

#include "functorch.h"
#include "op_state.h"

namespace torch_autobatch {

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
bool trace_keeps_op(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const functorch::DynamicLayer& layer);

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
