// Forward-mode AD of a torch_autobatch operator (forward_mode.cpp): the one
// home of output tangents, called by both kernels. Every tangent a user's
// jvp returns passes one gate (NOTE [One gate for every user tangent]).
#pragma once

#include "op_state.h"
#include "vmap_frames.h"

#include <utility>

namespace torch_autobatch {

// NOTE [Derived tangents draw the primal's random numbers]
// Without a registered jvp the tangents come from running the function again
// on the dual inputs (NOTE [Forward mode]). A random op inside (dropout) must
// draw there exactly what the primal run drew, or the tangent belongs to
// another mask: silently wrong. So the default generators of the inputs'
// devices (and the CPU's) are put back to their state before the primal run
// for the tangent run, and to their state after it once it is done: the
// caller's random stream advances once, as for the plain function.
class RngStates {
 public:
  explicit RngStates(const std::vector<at::Tensor>& inputs);
  // The same generators' states now.
  RngStates current() const;
  void restore() const;
  // Whether any of the generators moved since (byte for byte, no dispatch:
  // under a tracer's fake mode the states are real CPU tensors all the same).
  bool changed() const;

 private:
  RngStates() = default;
  void add(const at::Generator& gen);
  std::vector<std::pair<at::Generator, at::Tensor>> states_;
};

// NOTE [A jvp that reruns the forward draws the primal's random numbers]
// A lifted legacy autograd.Function's jvp needs what its forward left on ctx,
// so its setup_context runs the forward again (lift/_rules.py). A forward
// that draws (a sampler's noise, saved for backward) must draw there what the
// primal run drew, or the tangent belongs to other noise than the output:
// silently wrong. As for derived tangents (NOTE above), the generators are
// put back to their state before the primal run for setup_context and the
// jvp, and to their state after it once they are done.

// For its lifetime, the generators as `before` had them; then as they were
// when it was made (on every exit). Nothing where `before` is empty.
class PrimalDraws {
 public:
  explicit PrimalDraws(const std::optional<RngStates>& before);
  ~PrimalDraws();
  PrimalDraws(const PrimalDraws&) = delete;
  PrimalDraws& operator=(const PrimalDraws&) = delete;

 private:
  std::optional<RngStates> after_;
};

// NOTE [Derived tangents of a mutating op]
// Derived tangents run the op's function a second time (NOTE [Forward
// mode]). For an op that mutates arguments that second run must not mutate
// them again (a buffer incremented twice), and must see them as the first
// run did, before its mutation. So before the primal run the mutated
// arguments are cloned (with their tangents, at the kernel's level), the
// tangent run gets the clones, and afterwards each mutated argument takes
// its clone's tangent: the mutation's own forward derivative, as for a plain
// function.
class PreMutationArgs {
 public:
  // Nothing is cloned for an op that mutates nothing.
  PreMutationArgs(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args);
  bool empty() const {
    return mutated_.empty();
  }
  // `args` with the mutated ones replaced by their clones.
  const std::vector<c10::IValue>& args() const {
    return args_;
  }
  // Gives each mutated argument of `originals` its clone's tangent; called
  // by the kernel itself (not from user Python's state), as an in-place aten
  // op's kernel updates its tangent.
  void copy_tangents_to(const std::vector<c10::IValue>& originals) const;

 private:
  std::vector<size_t> mutated_;
  std::vector<c10::IValue> args_;
};

// Gives each differentiable output its tangent (undefined: none); a returned
// mutated argument's is set as an in-place op sets its self's, unless
// `skip_returned` (derived tangents: PreMutationArgs set them). Called as the
// kernel, not from user Python's state.
void set_output_tangents(
    const OpState& state,
    const std::vector<Slot>& ret_slots,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& tangents,
    bool skip_returned);

// The Autograd kernel's half (no vmap level above the op): each
// differentiable output's tangent, from the registered jvp or derived from
// the op's function (the caller sets them: set_output_tangents). `args` are the op's arguments with their tangents;
// `returns`/`outputs` the primal outputs (`ret_slots` maps one to the other).
// `rng_before_primal`: the generators' states before the primal run, for
// derived tangents and a jvp that reruns the forward; `pre_mutation`: for
// derived tangents, the mutated arguments before the primal run (the caller
// then calls pre_mutation->copy_tangents_to).
// Requires the GIL.
std::vector<at::Tensor> output_tangents(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const std::vector<c10::IValue>& args,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<Slot>& ret_slots,
    const std::vector<at::Tensor>& outputs,
    const std::optional<RngStates>& rng_before_primal,
    const std::optional<PreMutationArgs>& pre_mutation);

// The level of forward-mode AD's own dual tensors, below every functorch level.
constexpr int64_t kBaseLevel = 0;

// The batched kernel's half (NOTE [Forward mode under vmap]): at the Jvp
// level `level` below one or more vmap levels (or at kBaseLevel), the
// registered jvp on this level's primals and tangents (`in`, `out`: the op's
// flat tensors at this level), re-entering `frames_inner_first` so it sees
// each example's shapes.
// `args`/`returns`: the op's arguments and returns as the batched kernel got
// and made them (for their non-tensor values). Takes the GIL itself.
void set_jvp_tangents_below_vmap(
    const OpState& state,
    const c10::FunctionSchema& schema,
    int64_t level,
    const std::vector<at::Tensor>& in,
    const std::vector<at::Tensor>& out,
    const std::vector<VmapFrame>& frames_inner_first,
    const std::vector<c10::IValue>& args,
    const std::vector<Slot>& arg_slots,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<Slot>& ret_slots,
    const std::optional<RngStates>& rng_before_primal);

} // namespace torch_autobatch
