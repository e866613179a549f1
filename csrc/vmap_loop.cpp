// The per-example path of the batched kernel (vmap="loop"), and vmap(op)
// under a graph tracer that must keep the op: its one-node companion, or
// the loop (vmap_loop.h).
#include "vmap_loop.h"

#include "forward_mode.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <algorithm>
#include <cstring>
#include <mutex>

namespace torch_autobatch {
namespace {

using functorch::DynamicLayer;
using functorch::RandomnessType;

void check_loop_output(const OpState& state, const c10::IValue& out, size_t r) {
  TORCH_CHECK(
      out.isTensor(), "torch_autobatch: vmap=\"loop\" of ", state.qualname,
      " supports tensor outputs only; output ", r, " is a ", out.tagKind());
}

// A batch of no examples: the outputs have the shapes one example would
// give, with a batch dimension of 0, as for a plain function. Those shapes
// come from the op's fake kernel (register_fake, or the function itself) on
// meta tensors of one example's shape, where it can run there; else from the
// function run once on zeros of that shape (a vmap="loop" function often
// reads values: .item()). Its outputs are dropped: only their shapes and
// dtypes are used.
void run_loop_empty(
    const OpState& state,
    const c10::OperatorHandle& op,
    const std::vector<c10::IValue>& args,
    const std::vector<std::vector<bool>>& batched,
    int64_t level,
    torch::jit::Stack* stack) {
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
        return on_meta      ? at::empty_symint(sizes, t.options().device(c10::kMeta))
               : is_batched ? at::zeros_symint(sizes, t.options())
                            : t;
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
          false, "torch_autobatch: vmap=\"loop\" of ", state.qualname,
          " over a batch of size 0 needs the shapes of one example's outputs. The "
          "op's fake kernel failed on meta tensors:\n",
          why, "\nand its function failed on zeros of one example's shape:\n", on_zeros.what(),
          "\nRegister a fake kernel with ", state.qualname.substr(state.qualname.find("::") + 2),
          ".register_fake(fn) that returns empty tensors of the output shapes.");
    }
  }
  for (size_t r = 0; r < num_returns; ++r) {
    check_loop_output(state, outs[r], r);
    const at::Tensor& example = outs[r].toTensor();
    std::vector<c10::SymInt> sizes{c10::SymInt(0)};
    for (const auto& d : example.sym_sizes()) {
      sizes.push_back(d);
    }
    const auto options = example.options().device(device.value_or(c10::Device(c10::kCPU)));
    torch::jit::push(*stack, functorch::makeBatched(at::empty_symint(sizes, options), 0, level));
  }
}

} // namespace

using functorch::DynamicLayer;

bool has_companion(const OpState& state, const c10::FunctionSchema& schema) {
  if (schema.is_mutable() || state.returns_an_argument) {
    return false;
  }
  return std::all_of(schema.returns().begin(), schema.returns().end(), [](const auto& r) {
    const auto& type = r.real_type();
    return type->kind() == c10::TypeKind::TensorType ||
           (type->kind() == c10::TypeKind::ListType &&
            type->template expectRef<c10::ListType>().getElementType()->kind() ==
                c10::TypeKind::TensorType);
  });
}

namespace {

// NOTE [Residuals of register_vjp]: an open request belongs to the batched
// call; a call made for it (one example's, the companion's) must not answer
// it with its own residuals.
struct NoResidualRequest {
  ResidualRequest* outer = t_residual_request;
  NoResidualRequest() {
    t_residual_request = nullptr;
  }
  NoResidualRequest(const NoResidualRequest&) = delete;
  NoResidualRequest& operator=(const NoResidualRequest&) = delete;
  ~NoResidualRequest() {
    t_residual_request = outer;
  }
};

} // namespace

TracePath
trace_path(const OpState& state, const c10::FunctionSchema& schema, const DynamicLayer& layer) {
  if (!c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::PROXY)
           .has_value()) {
    return TracePath::kComposite;
  }
  py::gil_scoped_acquire gil;
  bool dissolves = false;
  try {
    dissolves = call_method(state.opdef(), py_names().dissolves_in_trace, {}).cast<bool>();
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
  if (dissolves) {
    return TracePath::kComposite;
  }
  if (has_companion(state, schema)) {
    return TracePath::kCompanion;
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
    why =
        "that draws random numbers per example, and this vmap has "
        "randomness=\"same\"";
  }
  if (why.empty() && !layer.batchSize().maybe_as_int().has_value()) {
    why =
        "that needs a static batch size, and this one is symbolic (a dynamic "
        "batch dim of torch.export, make_fx's tracing_mode=\"symbolic\")";
  }
  if (why.empty()) {
    return TracePath::kLoop;
  }
  // A Python warning (a C++ TORCH_WARN here reaches no Python handler).
  const std::string msg = c10::str(
      "torch_autobatch: vmap of ", state.qualname,
      " is being traced into a graph (make_fx, torch.export's "
      "run_decompositions, aot_function). It mutates an argument or returns "
      "other than Tensor / Tensor[], so it has no one-node companion and "
      "would run once per example so that the graph keeps the op and its "
      "registered rules; ",
      why,
      ". The graph holds the op's decomposition instead: differentiating "
      "the traced program uses the function's own derivatives, not the "
      "registered backward or jvp. Trace the transform itself "
      "(make_fx(vmap(grad(f)))) rather than differentiating the traced "
      "program, or trace with a static batch size and Tensor returns.");
  if (PyErr_WarnEx(PyExc_UserWarning, msg.c_str(), 1) != 0) {
    throw python_error(); // warnings are errors
  }
  return TracePath::kComposite;
}

bool run_companion_or_loop(
    const OpState& state,
    const c10::OperatorHandle& op,
    const DynamicLayer& layer,
    bool loop_mode,
    torch::jit::Stack* stack) {
  const TracePath path = trace_path(state, op.schema(), layer); // NOTE [A trace keeps the op]
  if (path == TracePath::kCompanion) {
    run_companion(state, op, stack);
    return true;
  }
  if (loop_mode || path == TracePath::kLoop) {
    run_loop(state, op, layer, stack);
    return true;
  }
  return false;
}

void run_companion(const OpState& state, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t num_returns = schema.returns().size();
  NoResidualRequest no_request;
  py::gil_scoped_acquire gil;
  try {
    // User Python runs below (the companion's function, its rules): NOTE
    // [User Python sees a plain caller's state].
    functorch::AsPlainCaller plain;
    py::tuple args = to_py_tuple(torch::jit::last(*stack, num_args), schema.arguments());
    py::tuple outs = call_method(state.opdef(), py_names().run_vmapped_companion, {args});
    torch::jit::drop(*stack, num_args);
    for (size_t r = 0; r < num_returns; ++r) {
      torch::jit::push(*stack, torch::jit::toIValue(outs[r], schema.returns()[r].type()));
    }
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

namespace {
// NOTE [A loop's draws under randomness="error"]
// One example's call runs below the vmap level, where functorch does not see
// a random op: under vmap(..., randomness="error") (vmap's default), the
// plain function would raise at its first draw, and the loop drew silently.
// So the states of the generators the examples draw from (the CPU one and
// each input device's default one: RngStates, as for "same") are read
// before the loop and compared after it (RngStates::changed): any change is
// functorch's error, naming the op. Reading them costs microseconds per
// loop, not per op.
//
// randomness="same": every example draws the numbers the first one drew;
// "error": none may draw.
class LoopDraws {
 public:
  LoopDraws(RandomnessType randomness, const std::vector<c10::IValue>& args)
      : same_(randomness == RandomnessType::Same) {
    if (randomness == RandomnessType::Different) {
      return;
    }
    std::vector<at::Tensor> tensors;
    for (const auto& a : args) {
      map_tensors(a, [&](const at::Tensor& t, size_t) {
        tensors.push_back(t);
        return t;
      });
    }
    before_.emplace(tensors);
  }

  void before_example(int64_t b) const {
    if (same_ && b > 0) {
      before_->restore();
    }
  }

  void check(const OpState& state) const {
    TORCH_CHECK(
        same_ || !before_ || !before_->changed(),
        "vmap: called random operation while in randomness error mode. Please either use the "
        "'same' or 'different' randomness flags on vmap or perform the randomness operation out "
        "of vmap. torch_autobatch: the function of ",
        state.qualname,
        " (vmap=\"loop\": run once per example, below the vmap) drew random numbers, and this "
        "vmap has randomness='error' (the default).");
  }

 private:
  bool same_;
  std::optional<RngStates> before_;
};
} // namespace

void run_loop(
    const OpState& state,
    const c10::OperatorHandle& op,
    const DynamicLayer& layer,
    torch::jit::Stack* stack) {
  const int64_t level = layer.layerId();
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t num_returns = schema.returns().size();
  const int64_t batch_size = layer.batchSize().guard_int(__FILE__, __LINE__);
  std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(num_args), stack->end());
  torch::jit::drop(*stack, num_args);
  const std::vector<c10::IValue> batched_args =
      state.returns_an_argument ? args : std::vector<c10::IValue>{};

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
      auto [value, bdim] = functorch::unwrapTensorAtLevel(t, level);
      flags.push_back(bdim.has_value());
      return bdim ? value.movedim(*bdim, 0) : value;
    });
  }
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  NoResidualRequest no_request; // one example's call must not answer it
  if (batch_size == 0) {
    run_loop_empty(state, op, args, batched, level, stack);
    return;
  }
  LoopDraws draws(layer.randomness(), args);
  std::vector<std::vector<at::Tensor>> results(num_returns);
  for (int64_t b = 0; b < batch_size; ++b) {
    draws.before_example(b);
    torch::jit::Stack call;
    for (size_t a = 0; a < num_args; ++a) {
      call.push_back(map_tensors(args[a], [&](const at::Tensor& t, size_t k) {
        return batched[a][k] ? t.select(0, b) : t;
      }));
    }
    op.callBoxed(call);
    for (size_t r = 0; r < num_returns; ++r) {
      check_loop_output(state, call[r], r);
      results[r].push_back(call[r].toTensor());
    }
  }
  draws.check(state);
  for (size_t r = 0; r < num_returns; ++r) {
    torch::jit::push(*stack, functorch::makeBatched(at::stack(results[r]), 0, level));
  }
  // Each example mutated its slice of the argument in place; the op returns
  // the argument itself (NOTE [Returned mutated arguments]), not a stack.
  if (state.returns_an_argument) {
    return_the_arguments(state, batched_args, stack);
  }
}

} // namespace torch_autobatch
