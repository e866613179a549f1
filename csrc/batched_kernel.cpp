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
// Then, without running anything again, the outputs get the op's own grad
// node at every autograd level below (NOTE [The level walk], level_walk.cpp).
// Backward (CustomOpNode::apply): the node re-enters the vmap levels, so the
// user's backward runs batched too (NOTE [Re-entering the vmap levels]).
// Where the composite must not run once (vmap="loop"), the op runs once per
// example instead; under a graph tracer, its vmapped companion runs
// (vmap_loop.cpp).
#include "forward_mode.h"
#include "functorch.h"
#include "grad_node.h"
#include "level_walk.h"
#include "op_state.h"
#include "vmap_loop.h"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace torch_autobatch {
namespace {

using functorch::DynamicLayer;
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

// The first of `inputs` batched at vmap level `level`, or nullptr.
const at::Tensor* first_batched(const std::vector<at::Tensor>& inputs, int64_t level) {
  for (const auto& t : inputs) {
    if (t.defined() && functorch::isBatchedAtLevel(t, level)) {
      return &t;
    }
  }
  return nullptr;
}

class BatchedKernel final : public c10::OperatorKernel {
 public:
  explicit BatchedKernel(std::shared_ptr<OpState> state) : state_(std::move(state)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    if (!state_->defined.load(std::memory_order_relaxed)) {
      redispatch_without_us(*state_, this, op, ks, stack);
      return;
    }
    const auto layer = functorch::maybeCurrentDynamicLayer();
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
    const at::Tensor* batched = first_batched(inputs, level);
    if (batched == nullptr) {
      op.redispatchBoxed(ks & kBelowBatched, stack);
      return;
    }
    // Sent down by an AD level above this one (NOTE [Decompositions under an
    // AD level]); user code run from here must not see that mark.
    const bool under_ad = SentDownFromAD::level() > level;
    SentDownFromAD not_sent_down(0);
    const auto mode = state_->vmap_mode.load();
    if (run_companion_or_loop(*state_, op, *layer, mode == VmapMode::Loop, stack)) {
      return;
    }

    std::vector<c10::IValue> saved_args(args.begin(), args.end());
    const size_t base = stack->size() - num_args;
    try {
      run_once_batched(
          op, stack, inputs, std::move(arg_slots), saved_args, mode, under_ad, *batched);
    } catch (const NotBatchable&) {
      // NOTE [A forward vmap cannot batch runs per example]
      stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
      stack->insert(stack->end(), saved_args.begin(), saved_args.end());
      run_companion_or_loop(*state_, op, *layer, /*loop_mode=*/true, stack);
    }
  }

 private:
  // Thrown, for an op that loops where its function cannot run batched
  // (OpState::loop_on_failure), where the function failed on batched tensors.
  struct NotBatchable {};

  void run_once_batched(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      const std::vector<at::Tensor>& inputs,
      std::vector<Slot> arg_slots,
      const std::vector<c10::IValue>& saved_args,
      VmapMode mode,
      bool under_ad,
      const at::Tensor& batched) const {
    const auto& schema = op.schema();
    const size_t num_returns = schema.returns().size();
    const bool grad_mode = c10::GradMode::is_enabled();
    if (state_->has_closure.load(std::memory_order_relaxed)) {
      check_closure(
          *state_, inputs, grad_mode,
          /*batched_kernel=*/true); // NOTE [What the function closes over]
    }
    const bool attaches = !nothing_to_attach(*state_, grad_mode, inputs);
    // NOTE [A jvp that reruns the forward draws the primal's random numbers]
    std::optional<RngStates> rng_before_primal;
    if (attaches && state_->jvp_reruns_forward.load() &&
        c10::AutogradState::get_tls_state().get_fw_grad_mode()) {
      rng_before_primal.emplace(inputs);
    }
    // NOTE [Residuals of register_vjp]: open until the level walk's setup_context.
    ResidualRequest residuals(
        state_.get(), mode == VmapMode::Composite && state_->has_vjp.load() && attaches);
    {
      c10::AutoGradMode no_grad(false);
      // NOTE [Forward mode under vmap]: with a registered jvp, tangents at the
      // Jvp levels below come from it (attach_grad_nodes), not from the
      // composite; without one, the composite's own forward-mode AD gives them
      // here, in the same single run.
      c10::AutoFwGradMode no_fw_grad(
          c10::AutogradState::get_tls_state().get_fw_grad_mode() && !state_->has_jvp.load());
      if (mode == VmapMode::Rule) {
        run_rule(op, stack);
      } else if (!run_composite_or_refuse(
                     op, functorch::innermost(batched), stack, under_ad, saved_args)) {
        return; // its companion ran instead (a recorded trace refused a constant)
      }
      if (attaches && !state_->returns_an_argument) {
        batch_every_output(inputs, num_returns, stack);
      }
    }
    if (state_->returns_an_argument) {
      return_the_arguments(*state_, saved_args, stack); // NOTE [Returned mutated arguments]
    }
    std::vector<at::Tensor> outputs;
    auto ret_slots = flatten_tensors(torch::jit::last(*stack, num_returns), outputs);
    check_no_aliasing(*state_, schema, inputs, outputs, ret_slots);
    attach_grad_nodes(
        state_, schema, grad_mode, std::move(arg_slots), std::move(ret_slots), saved_args,
        torch::jit::last(*stack, num_returns), inputs, outputs, rng_before_primal);
  }

  // NOTE [A forward vmap cannot batch runs per example]
  // A lifted autograd.Function is a library's code, written for one call:
  // its forward may build a fresh buffer and accumulate into it in place,
  // build a tensor from the input's Python values (.tolist()), or call a
  // TorchScript kernel that does either, none of which vmap can batch, while the same class works unlifted under a loop of
  // .backward(). So under vmap="auto", where its function fails on batched
  // tensors with torch's own error (RuntimeError, NotImplementedError; not a
  // randomness error, which a loop would hit too), the call runs again once
  // per example, as vmap="loop" runs it (the backward still runs batched where
  // it can). The failed attempt's work is dropped: the function has no
  // mutable arguments, and random ops it ran before failing drew once more.
  bool run_composite_or_refuse(
      const c10::OperatorHandle& op,
      const at::Tensor& physical,
      torch::jit::Stack* stack,
      bool under_ad,
      const std::vector<c10::IValue>& args) const {
    if (!state_->loop_on_failure.load(std::memory_order_relaxed)) {
      return run_composite(op, physical, stack, under_ad, args);
    }
    try {
      return run_composite(op, physical, stack, under_ad, args);
    } catch (const python_error& e) {
      if ((e.type != PyExc_RuntimeError && e.type != PyExc_NotImplementedError) ||
          is_randomness_error(e.what())) {
        throw;
      }
    } catch (const c10::Error& e) {
      if (is_randomness_error(e.what_without_backtrace())) {
        throw;
      }
    }
    throw NotBatchable{};
  }

  static bool is_randomness_error(const std::string& msg) {
    return msg.find("randomness") != std::string::npos;
  }

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
  // Returns false where the op's vmapped companion ran instead.
  bool run_composite(
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
    auto restore_arguments = [&] {
      stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
      stack->insert(stack->end(), args.begin(), args.end());
    };
    try {
      run_composite_once(op, physical, stack, decompose, may_retry);
    } catch (const MissingBatchingRule&) {
      state_->decompose_under_ad.store(true);
      restore_arguments();
      run_composite_once(op, physical, stack, /*decompose=*/true, /*may_retry=*/false);
    } catch (FakeConstantRefused& refused) {
      // NOTE [A fake run of the function reads its tensor constants]
      // (torch_autobatch/graphs/_compile.py): a metadata-only run lets the fake mode
      // take them, and runs again; in a run a graph tracer records (Inductor
      // decomposing vmap(op)), the op's companion is recorded instead, one
      // node that reads them when it runs. (Run twice on fake tensors, a
      // mutating function mutates no data.)
      py::gil_scoped_acquire gil;
      py::object compile = py::module_::import("torch_autobatch.graphs._compile");
      py::object mode = compile.attr("allow_constants")(py::make_tuple(physical));
      restore_arguments();
      if (mode.is_none()) {
        if (!has_companion(*state_, op.schema())) {
          throw std::move(refused.error);
        }
        {
          py::gil_scoped_release no_gil;
          run_companion(*state_, op, stack);
        }
        compile.attr("keep_companion_opaque")(state_->opdef());
        return false;
      }
      try {
        py::gil_scoped_release no_gil;
        run_composite_once(op, physical, stack, decompose, /*may_retry=*/false);
      } catch (...) {
        compile.attr("disallow_constants")(mode);
        throw;
      }
      compile.attr("disallow_constants")(mode);
    }
    return true;
  }

  // Thrown by run_composite_once when a decomposing rerun may succeed.
  struct MissingBatchingRule {};

  // Thrown by run_composite_once when FakeTensorMode refused a real tensor
  // the function reads (not an argument): a run that only computes metadata
  // may take it.
  struct FakeConstantRefused {
    python_error error;
  };

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
    if (e.type == PyExc_AssertionError &&
        std::string(e.what()).find("Please convert all Tensors to FakeTensors first") !=
            std::string::npos) {
      throw FakeConstantRefused{std::move(e)};
    }
    const bool is_torch_error = e.type == PyExc_RuntimeError || e.type == PyExc_NotImplementedError;
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
        false, cause, "\ntorch_autobatch: vmap of ", state_->qualname,
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

  // NOTE [An output is batched wherever an input is]
  // The composite (or a rule) may return an output that a vmap level sees as
  // unbatched while an input is batched there (a value independent of that
  // input, a rule's out_dims None). The op's rules may still connect the two
  // (a backward giving the input a gradient from that output), so each example
  // needs its own cotangent and tangent for it. A node attached below that
  // level to the unbatched output would receive the sum of all examples'
  // cotangents (autograd's backward of vmap's final expand), and a tangent
  // set there one value for all examples: silently wrong. torch's loop
  // fallback stacks its outputs, so it is right. So when a node or tangent
  // will be attached, each floating or complex output that lacks a batch
  // level of the inputs is copied into a buffer batched at every such level
  // (new_empty on a tensor batched like the inputs, then copy_: bit-exact,
  // and copy_ carries a derived tangent). Run as user code is (each op
  // through the front key), so every level batches its own part, nested vmap
  // and the Grad/Jvp levels between included. The cost, B copies of that
  // output, is what the loop fallback pays, and only on this path.
  void batch_every_output(
      const std::vector<at::Tensor>& inputs,
      size_t num_returns,
      torch::jit::Stack* stack) const {
    std::vector<int64_t> in_levels;
    std::vector<const at::Tensor*> batched_inputs;
    for (const auto& t : inputs) {
      if (!t.defined()) {
        continue;
      }
      const auto levels = functorch::batched_levels(t);
      if (!levels.empty()) {
        batched_inputs.push_back(&t);
        in_levels.insert(in_levels.end(), levels.begin(), levels.end());
      }
    }
    auto lacks_a_level = [&](const at::Tensor& t) {
      if (!t.defined() || t.layout() != c10::kStrided ||
          !(t.is_floating_point() || t.is_complex())) {
        return false;
      }
      const auto levels = functorch::batched_levels(t);
      return std::any_of(in_levels.begin(), in_levels.end(), [&](int64_t l) {
        return std::find(levels.begin(), levels.end(), l) == levels.end();
      });
    };
    const auto returns = torch::jit::last(*stack, num_returns);
    if (std::none_of(returns.begin(), returns.end(), [&](const c10::IValue& v) {
          bool any = false;
          map_tensors(v, [&](const at::Tensor& t, size_t) {
            any = any || lacks_a_level(t);
            return t;
          });
          return any;
        })) {
      return;
    }
    functorch::AsPlainCaller plain;
    at::Tensor like; // () shaped, batched at every level an input is
    for (const at::Tensor* t : batched_inputs) {
      auto z = t->new_zeros({});
      like = like.defined() ? like.add(z) : z;
    }
    for (auto it = stack->end() - static_cast<std::ptrdiff_t>(num_returns); it != stack->end();
         ++it) {
      *it = map_tensors(*it, [&](const at::Tensor& t, size_t) {
        if (!lacks_a_level(t)) {
          return t;
        }
        auto buffer = like.new_empty_symint(t.sym_sizes(), t.options());
        buffer.copy_(t);
        return buffer;
      });
    }
  }

  // The user's register_vmap rule, through torch's helper for such rules.
  void run_rule(const c10::OperatorHandle& op, torch::jit::Stack* stack) const;

  std::shared_ptr<OpState> state_;
};

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
    py::tuple outs = call_method(state_->opdef(), py_names().run_vmap_rule, {py_args, py_kwargs});
    torch::jit::drop(*stack, num_args);
    for (size_t r = 0; r < num_returns; ++r) {
      torch::jit::push(*stack, torch::jit::toIValue(outs[r], schema.returns()[r].type()));
    }
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

} // namespace

torch::CppFunction batched_kernel(const std::shared_ptr<OpState>& state) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<BatchedKernel>(state));
}

} // namespace torch_autobatch
