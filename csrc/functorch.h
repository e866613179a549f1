// The one place torch_autobatch touches functorch's unstable C++ internals
// (ATen/functorch, torch 2.13 to 2.15). Everything used here is exported from
// libtorch_cpu; what is not exported (Interpreter::process,
// sendToNextInterpreter, the loop fallback) is not used. Re-check this file on
// every torch release; where releases differ, the difference is absorbed here
// (TORCH_VERSION_* from torch/version.h), nowhere else.
#pragma once

#include <torch/version.h>

// NOTE [Supported torch window] (torch_autobatch/_version.py): the oldest
// release whose internals this file matches. Newer releases build; the
// package refuses to import on one outside the tested window.
#if TORCH_VERSION_MAJOR != 2 || TORCH_VERSION_MINOR < 13
#error "torch_autobatch needs torch >= 2.13: its functorch internals differ before."
#endif

#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h> // needs csrc/shim: NOTE [nlohmann stub]
#include <ATen/functorch/PlumbingHelper.h>
#include <ATen/functorch/TensorWrapper.h>

namespace torch_autobatch::functorch {

using at::functorch::DynamicLayer;
using at::functorch::RandomnessType;
using at::functorch::TransformType;

// functorch's entry points that are used as they are. The rest of csrc/ calls
// them through this namespace, so a release that renames or changes one gets
// a shim here and nowhere else.
using at::functorch::getDynamicLayerStack; // the thread's levels, outermost first
using at::functorch::isBatchedAtLevel;
using at::functorch::makeBatched; // (tensor, bdim, level) -> BatchedTensor
using at::functorch::maybeCurrentDynamicLayer; // the innermost level, if any
using at::functorch::maybeGetBatchedImpl;
using at::functorch::maybeGetTensorWrapper;
using at::functorch::unwrapTensorAtLevel; // BatchedTensor -> (value, bdim)

// The grad mode the op would see at a Grad level (prevGradMode is the mode in
// force outside that level).
inline bool prev_grad_mode(const DynamicLayer& layer) {
  return std::get<at::functorch::GradInterpreterMeta>(layer.interpreter().meta()).prevGradMode_;
}

// `t` seen from one level down: the wrapped value if `t` is a TensorWrapper of
// `level`, else `t` itself.
inline at::Tensor unwrap_grad_level(const at::Tensor& t, int64_t level) {
  auto* w = at::functorch::maybeGetTensorWrapper(t);
  return (w != nullptr && w->level() == level) ? w->value() : t;
}

// `t` seen from below a Functionalize level: the wrapped value of a
// FunctionalTensorWrapper of `level`, else `t` itself.
inline at::Tensor unwrap_functionalize_level(const at::Tensor& t, int64_t level) {
  if (!at::functionalization::impl::isFunctionalTensor(t)) {
    return t;
  }
  auto* w = at::functionalization::impl::unsafeGetFunctionalWrapper(t);
  return w->level() == level ? w->value() : t;
}

inline bool is_wrapped_at(const at::Tensor& t, int64_t level) {
  auto* w = at::functorch::maybeGetTensorWrapper(t);
  return w != nullptr && w->level() == level;
}

// `t` without the TensorWrappers of Grad/Jvp levels that have exited. A dead
// wrapper only forwards to its value, but functorch's front fallback unwraps
// one dead layer per visit (unwrapIfDead), so user code that wraps such a
// tensor again (a backward calling torch.func.vjp) would reach an empty stack
// with a BatchedTensor inside (INTERNAL ASSERT, Interpreter.cpp).
inline at::Tensor strip_dead_wrappers(at::Tensor t) {
  while (auto* w = at::functorch::maybeGetTensorWrapper(t)) {
    if (w->is_alive()) {
      break;
    }
    t = w->value();
  }
  return t;
}

// `t` without its TensorWrappers (BatchedTensors kept): the tensor an op's
// kernel below every Grad/Jvp level saw.
inline at::Tensor below_grad_levels(at::Tensor t) {
  while (auto* w = at::functorch::maybeGetTensorWrapper(t)) {
    t = w->value();
  }
  return t;
}

// NOTE [Second derivatives through residuals] (torch_autobatch/op/_vjp.py): can
// a differentiation that tracks `t`, an input of a grad node of functorch
// `level` (0: the base), differentiate the node's backward? `t` is a
// TensorWrapper of the node's level while that level is alive (the level
// tracks it itself when the backward keeps its graph; else its value one
// level down tells), or already an outer level's tensor once the level has
// exited; a dead wrapper counts as tracked.
inline bool tracked_beyond_node(at::Tensor t, int64_t level, bool keep_graph) {
  auto unbatch = [](at::Tensor u) {
    while (auto* b = at::functorch::maybeGetBatchedImpl(u)) {
      u = b->value();
    }
    return u;
  };
  t = unbatch(t);
  if (level > 0) {
    auto* w = at::functorch::maybeGetTensorWrapper(t);
    if (w != nullptr && w->level().value_or(-2) >= level) {
      if (keep_graph) {
        return true;
      }
      t = unbatch(w->value());
    }
  }
  return at::functorch::maybeGetTensorWrapper(t) != nullptr || t.requires_grad();
}

// The number of Grad and Jvp levels on this thread's stack.
inline size_t num_ad_levels() {
  size_t n = 0;
  for (const DynamicLayer& layer : at::functorch::getDynamicLayerStack()) {
    n += layer.key() == TransformType::Grad || layer.key() == TransformType::Jvp;
  }
  return n;
}

// The innermost plain tensor under every BatchedTensor and TensorWrapper.
inline at::Tensor innermost(at::Tensor t) {
  while (true) {
    if (auto* b = at::functorch::maybeGetBatchedImpl(t)) {
      t = b->value();
    } else if (auto* w = at::functorch::maybeGetTensorWrapper(t)) {
      t = w->value();
    } else {
      return t;
    }
  }
}

// The vmap levels at which `t` is batched, outermost last: its BatchedTensors,
// looking through the TensorWrappers of Grad/Jvp levels between them.
inline std::vector<int64_t> batched_levels(at::Tensor t) {
  std::vector<int64_t> levels;
  while (true) {
    if (auto* b = at::functorch::maybeGetBatchedImpl(t)) {
      levels.push_back(b->level());
      t = b->value();
    } else if (auto* w = at::functorch::maybeGetTensorWrapper(t)) {
      t = w->value();
    } else {
      return levels;
    }
  }
}

// Gives `g` (a gradient or tangent one vmap level down) the batch layout of its input:
// batch dimension at `want` (or none), from `have`.
inline at::Tensor match_bdim(
    at::Tensor g,
    std::optional<int64_t> have,
    std::optional<int64_t> want,
    const c10::SymInt& batch_size) {
  if (!want) {
    // The input was the same for every example: its gradient is their sum.
    return have ? g.sum(*have) : g;
  }
  if (!have) {
    g = g.unsqueeze(*want);
    auto sizes = g.sym_sizes().vec();
    sizes[*want] = batch_size;
    return g.expand_symint(sizes);
  }
  return *have == *want ? g : g.movedim(*have, *want);
}

// Inside a kernel of the top level: makes the stack hold only the levels up to
// `level`, with the dispatch TLS that was in force before the top level began
// processing this op, until the guard dies. Code run under it (that pushes
// levels of its own) dispatches as if called from just above `level`;
// without it the top interpreter would be entered again while it is still
// processing (INTERNAL ASSERT on savedLocalDispatchKeySet_).
class LowerToLevel {
 public:
  explicit LowerToLevel(int64_t level)
      : saved_stack_(at::functorch::getDynamicLayerStack()),
        saved_tls_(c10::impl::tls_local_dispatch_key_set()) {
    std::vector<DynamicLayer> kept;
    for (const auto& layer : saved_stack_) {
      if (layer.layerId() <= level) {
        kept.push_back(layer);
      }
    }
    const auto outer_tls = saved_stack_.back().interpreter().getSavedLocalDispatchKeySet();
    at::functorch::setDynamicLayerStack(kept);
    c10::impl::_force_tls_local_dispatch_key_set(outer_tls);
  }
  LowerToLevel(const LowerToLevel&) = delete;
  LowerToLevel& operator=(const LowerToLevel&) = delete;
  ~LowerToLevel() {
    at::functorch::setDynamicLayerStack(saved_stack_);
    c10::impl::_force_tls_local_dispatch_key_set(saved_tls_);
  }

 private:
  std::vector<DynamicLayer> saved_stack_;
  c10::impl::LocalDispatchKeySet saved_tls_;
};

// NOTE [User Python sees a plain caller's state]
// Our kernels run inside the top interpreter's process(): the top level holds
// the dispatch TLS of its caller (savedLocalDispatchKeySet_) and the thread's
// TLS is the one process() set up (FuncTorchDynamicLayerFrontMode excluded).
// User Python run from there (the op's function under vmap, setup_context, a
// jvp) that calls a torch.func transform pushes a level whose ops skip the
// excluded front key, so the new level never saves a key set and
// dynamicLayerBack asserts (Interpreter.h, savedLocalDispatchKeySet_); random
// ops with FrontMode kernels (dropout family) skip vmap's randomness checks.
// A plain function called at that point sees the same stack with the top
// *not* processing and the caller's TLS. So, for the guard's lifetime, the
// top level's saved key set is cleared and the TLS is that saved set; both are
// restored on every exit path. No-op outside transforms, or when the top is
// not processing. The top is changed in place (a copy of the stack cost ~1 us
// a call): the destructor finds it again by depth and level, since user code
// in between may replace the thread's functorch state with a copy (an
// autograd engine run restores the one it captured, with the set cleared).
class AsPlainCaller {
 public:
  AsPlainCaller() : saved_tls_(c10::impl::tls_local_dispatch_key_set()), caller_tls_(saved_tls_) {
    // process() excludes the front key from the TLS while it runs: that is
    // how we know the top is processing (its saved key set is then set).
    const auto& stack = at::functorch::getDynamicLayerStack();
    if (stack.empty() || !c10::impl::tls_is_dispatch_key_excluded(
                             c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
      return;
    }
    auto& top = top_interpreter();
    caller_tls_ = top.getSavedLocalDispatchKeySet();
    depth_ = stack.size();
    level_ = top.level();
    top.clearSavedLocalDispatchKeySet();
    c10::impl::_force_tls_local_dispatch_key_set(caller_tls_);
    active_ = true;
  }
  AsPlainCaller(const AsPlainCaller&) = delete;
  AsPlainCaller& operator=(const AsPlainCaller&) = delete;
  ~AsPlainCaller() {
    if (!active_) {
      return;
    }
    try {
      if (at::functorch::getDynamicLayerStack().size() == depth_ &&
          top_interpreter().level() == level_) {
        top_interpreter().saveLocalDispatchKeySet(caller_tls_);
      }
    } catch (const c10::Error&) {
      // The level already holds a saved set: functorch's guards in between
      // were unbalanced. Leave it; a destructor must not throw.
    }
    c10::impl::_force_tls_local_dispatch_key_set(saved_tls_);
  }

 private:
  // getDynamicLayerStack() is the thread's own vector (not a copy).
  static at::functorch::Interpreter& top_interpreter() {
    return const_cast<DynamicLayer&>(at::functorch::getDynamicLayerStack().back()).interpreter();
  }

  c10::impl::LocalDispatchKeySet saved_tls_;
  c10::impl::LocalDispatchKeySet caller_tls_;
  size_t depth_ = 0;
  int64_t level_ = 0;
  bool active_ = false;
};

// Pushes a Grad level for the lifetime of the guard (exception-safe).
// `prev_grad_mode` is the grad mode the levels below it see.
class GradLevelGuard {
 public:
  explicit GradLevelGuard(bool prev_grad_mode)
      : level_(
            at::functorch::initAndPushDynamicLayer(
                TransformType::Grad,
                std::nullopt,
                std::nullopt,
                prev_grad_mode)) {}
  GradLevelGuard(const GradLevelGuard&) = delete;
  GradLevelGuard& operator=(const GradLevelGuard&) = delete;
  ~GradLevelGuard() {
    at::functorch::popDynamicLayerAndDeleteMetadata();
  }
  int64_t level() const {
    return level_;
  }

 private:
  int64_t level_;
};

// The vmap levels a grad node's backward (or a jvp below vmap) re-enters,
// pushed outermost first and popped innermost first; what is still pushed
// when the guard dies is popped then (every exit path).
class ReenteredVmapLevels {
 public:
  ReenteredVmapLevels() = default;
  ReenteredVmapLevels(const ReenteredVmapLevels&) = delete;
  ReenteredVmapLevels& operator=(const ReenteredVmapLevels&) = delete;
  ~ReenteredVmapLevels() {
    while (!levels_.empty()) {
      pop();
    }
  }
  // Pushes a level inside the others; returns its id.
  int64_t push(const c10::SymInt& batch_size, int64_t randomness) {
    levels_.push_back(
        at::functorch::initAndPushDynamicLayer(
            TransformType::Vmap, batch_size, static_cast<RandomnessType>(randomness)));
    return levels_.back();
  }
  int64_t innermost() const {
    return levels_.back();
  }
  void pop() {
    levels_.pop_back();
    at::functorch::popDynamicLayerAndDeleteMetadata();
  }

 private:
  std::vector<int64_t> levels_;
};

} // namespace torch_autobatch::functorch
