// The level walk of the batched kernel (level_walk.h).
//
// NOTE [The level walk]
// The outputs of vmap(op) were computed once, at the top vmap level, with no
// autograd. The op's grad node must now be attached at every autograd level
// below, on that level's view of the inputs and outputs: walking the dynamic
// layer stack down from the top, a Vmap level is unwrapped and its batch dims
// remembered (a VmapFrame, which the node re-enters in backward: NOTE
// [Re-entering the vmap levels]); a Grad level where an input requires grad
// gets a node on its TensorWrappers; a Jvp level (and the base, for dual
// tensors) gets the registered jvp's tangents; Functionalize is looked
// through. Then the user's setup_context runs once, on the batched values of
// the top level, and the same walk hands each node what it saved, as seen at
// its level. A node attached once, only at the level right below vmap, gives
// silently wrong gradients for vmap(vmap(op)) and for an outer grad
// differentiating a value computed under an inner one.
//
// TORCH_AUTOBATCH_LOG_LEVEL_WALK=1 (read once, at the first walk) prints each
// walk to stderr: the levels seen, their batch dims, and where nodes went.
#include "level_walk.h"

#include "forward_mode.h"
#include "functorch.h"
#include "grad_node.h"
#include "vmap_frames.h"

#include <torch/csrc/autograd/functions/utils.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <sstream>

namespace torch_autobatch {
namespace {

using functorch::DynamicLayer;
using functorch::TransformType;

bool log_level_walk() {
  static const bool on = [] {
    const char* v = std::getenv("TORCH_AUTOBATCH_LOG_LEVEL_WALK");
    return v != nullptr && std::string(v) != "" && std::string(v) != "0";
  }();
  return on;
}

std::string bdims_str(const Bdims& bdims) {
  std::ostringstream s;
  s << "[";
  for (size_t k = 0; k < bdims.size(); ++k) {
    s << (k ? ", " : "") << (bdims[k] ? std::to_string(*bdims[k]) : "None");
  }
  s << "]";
  return s.str();
}

// Unwraps every defined tensor of `ts` at vmap level `level`; returns the bdims.
Bdims unwrap_vmap_level(std::vector<at::Tensor>& ts, int64_t level) {
  Bdims bdims(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].defined()) {
      std::tie(ts[i], bdims[i]) = functorch::unwrapTensorAtLevel(ts[i], level);
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

// The tensors of `ts` that are wrapped at Grad level `id` (others undefined).
std::vector<at::Tensor> wrapped_at(const std::vector<at::Tensor>& ts, int64_t id) {
  std::vector<at::Tensor> here(ts.size());
  for (size_t k = 0; k < ts.size(); ++k) {
    if (ts[k].defined() && functorch::is_wrapped_at(ts[k], id)) {
      here[k] = ts[k];
    }
  }
  return here;
}

class LevelWalk {
 public:
  LevelWalk(
      const std::shared_ptr<OpState>& state,
      const c10::FunctionSchema& schema,
      bool grad_mode,
      std::vector<Slot> arg_slots,
      std::vector<Slot> ret_slots,
      const std::vector<c10::IValue>& args,
      c10::ArrayRef<c10::IValue> returns,
      const std::vector<at::Tensor>& inputs,
      const std::vector<at::Tensor>& outputs,
      const std::optional<RngStates>& rng_before_primal)
      : state_(state),
        schema_(schema),
        arg_slots_(std::move(arg_slots)),
        ret_slots_(std::move(ret_slots)),
        args_(args),
        returns_(returns),
        inputs_(inputs),
        outputs_(outputs),
        // A copy: setup_context runs user Python, which may replace the
        // thread's functorch state (an autograd engine run inside it).
        layers_(functorch::getDynamicLayerStack()),
        in_(inputs),
        out_(outputs),
        needs_(inputs.size(), false),
        mode_(grad_mode),
        rng_before_primal_(rng_before_primal),
        log_{log_level_walk() ? std::make_unique<std::ostringstream>() : nullptr} {}

  void run() {
    for (size_t i = layers_.size(); i-- > 0;) {
      visit(layers_[i]);
    }
    visit_base();
    if (log_) {
      std::cerr << "torch_autobatch: level walk of " << state_->qualname << ":" << log_.str()
                << "\n";
    }
    if (!sites_.empty()) {
      save();
    }
  }

 private:
  // A node attached at one level (-1: the base), with the outputs it was
  // attached to and how many vmap frames were above it.
  struct Site {
    c10::intrusive_ptr<CustomOpNode> node;
    int64_t level;
    size_t num_frames;
    std::vector<at::Tensor> outputs;
  };

  void visit(const DynamicLayer& layer) {
    const int64_t id = layer.layerId();
    switch (layer.key()) {
      case TransformType::Vmap: {
        VmapFrame f;
        f.batch_size = layer.batchSize();
        f.randomness = static_cast<int64_t>(layer.randomness());
        f.in_bdims = unwrap_vmap_level(in_, id);
        f.out_bdims = unwrap_vmap_level(out_, id);
        if (log_) {
          log_ << "\n  level " << id << " vmap: batch size " << f.batch_size << ", input bdims "
               << bdims_str(f.in_bdims) << ", output bdims " << bdims_str(f.out_bdims);
        }
        frames_.push_back(std::move(f));
        return;
      }
      case TransformType::Grad:
        visit_grad(layer);
        break;
      case TransformType::Jvp:
        if (log_) {
          log_ << "\n  level " << id << " jvp"
               << (state_->has_jvp.load() ? ": registered jvp's tangents" : "");
        }
        if (state_->has_jvp.load()) {
          set_jvp_tangents_below_vmap(
              *state_, schema_, id, in_, out_, frames_, args_, arg_slots_, returns_, ret_slots_,
              rng_before_primal_);
        }
        break;
      default: // Functionalize: nothing to attach, look through it
        if (log_) {
          log_ << "\n  level " << id << " functionalize: looked through";
        }
    }
    unwrap_wrapper_level(in_, layer);
    unwrap_wrapper_level(out_, layer);
  }

  void visit_grad(const DynamicLayer& layer) {
    const int64_t id = layer.layerId();
    std::vector<at::Tensor> in_here = wrapped_at(in_, id);
    bool any = false;
    for (size_t k = 0; k < in_here.size(); ++k) {
      if (in_here[k].defined() && in_here[k].requires_grad()) {
        any = needs_[k] = true;
      }
    }
    const bool attach_here = mode_ && any;
    if (attach_here) {
      attach(id, in_here, wrapped_at(out_, id));
    }
    if (log_) {
      log_ << "\n  level " << id << " grad: "
           << (attach_here ? "node attached"
               : any       ? "no node (grad mode off)"
                           : "no node (no input requires grad)");
    }
    mode_ = functorch::prev_grad_mode(layer);
  }

  void visit_base() {
    if (state_->has_jvp.load()) {
      // The base: tangents of forward-mode AD's dual tensors (fwAD.make_dual
      // around vmap(op)), NOTE [Forward mode under vmap].
      set_jvp_tangents_below_vmap(
          *state_, schema_, kBaseLevel, in_, out_, frames_, args_, arg_slots_, returns_, ret_slots_,
          rng_before_primal_);
    }
    bool any = false;
    if (mode_) {
      for (size_t k = 0; k < in_.size(); ++k) {
        if (in_[k].defined() && in_[k].requires_grad()) {
          any = needs_[k] = true;
        }
      }
      if (any) {
        attach(-1, in_, out_);
      }
    }
    if (log_) {
      log_ << "\n  base: " << (any ? "node attached" : "no node");
    }
  }

  void attach(
      int64_t level,
      const std::vector<at::Tensor>& in_here,
      const std::vector<at::Tensor>& out_here) {
    auto node = c10::make_intrusive<CustomOpNode>(
        state_, arg_slots_, ret_slots_, in_here, inputs_,
        std::vector<VmapFrame>(frames_.rbegin(), frames_.rend()),
        passed_arguments(args_, schema_.arguments()).num_positional);
    node->set_history(out_here);
    node->set_level(level < 0 ? 0 : level);
    sites_.push_back({std::move(node), level, frames_.size(), out_here});
  }

  // The user's setup_context, once, on what it would see: the batched inputs
  // and outputs of the top level; then the same walk for the saved tensors:
  // each node saves them as seen at its level, with their batch dims in its
  // frames.
  void save() {
    std::vector<bool> needs_arg(args_.size(), false);
    for (size_t a = 0; a < args_.size(); ++a) {
      const Slot& s = arg_slots_[a];
      for (size_t k = s.first; k < s.first + s.count; ++k) {
        needs_arg[a] = needs_arg[a] || needs_[k];
      }
    }
    py::gil_scoped_acquire gil;
    std::vector<at::Tensor> saved;
    std::vector<bool> non_differentiable;
    py::object ctx;
    {
      functorch::AsPlainCaller plain;
      ctx = call_setup_context(
          *state_, schema_, args_, returns_, outputs_, needs_arg, saved, non_differentiable);
    }
    std::vector<Bdims> saved_bdims; // innermost first
    auto site = sites_.begin();
    auto hand_over = [&](int64_t level) {
      if (site == sites_.end() || site->level != level) {
        return;
      }
      auto& node_frames = site->node->frames();
      for (size_t j = 0; j < site->num_frames; ++j) {
        node_frames[site->num_frames - 1 - j].saved_bdims = saved_bdims[j];
      }
      site->node->save(ctx, saved, site->outputs, non_differentiable);
      ++site;
    };
    for (size_t i = layers_.size(); i-- > 0;) {
      const DynamicLayer& layer = layers_[i];
      if (layer.key() == TransformType::Vmap) {
        saved_bdims.push_back(unwrap_vmap_level(saved, layer.layerId()));
        continue;
      }
      if (layer.key() == TransformType::Grad) {
        hand_over(layer.layerId());
      }
      unwrap_wrapper_level(saved, layer);
    }
    hand_over(-1);
  }

  const std::shared_ptr<OpState>& state_;
  const c10::FunctionSchema& schema_;
  const std::vector<Slot> arg_slots_;
  const std::vector<Slot> ret_slots_;
  const std::vector<c10::IValue>& args_;
  const c10::ArrayRef<c10::IValue> returns_;
  const std::vector<at::Tensor>& inputs_;
  const std::vector<at::Tensor>& outputs_;
  const std::vector<DynamicLayer> layers_;
  std::vector<at::Tensor> in_, out_; // at the level being visited
  std::vector<bool> needs_; // per input: requires grad at some attached level
  bool mode_; // the grad mode in force at the level being visited
  // NOTE [A jvp that reruns the forward draws the primal's random numbers]
  const std::optional<RngStates>& rng_before_primal_;
  std::vector<VmapFrame> frames_; // innermost first
  std::vector<Site> sites_;
  // The walk's log (NOTE [The level walk]); no stream is made when it is off.
  struct Log {
    std::unique_ptr<std::ostringstream> text;
    explicit operator bool() const {
      return text != nullptr;
    }
    std::string str() const {
      return text->str();
    }
    template <class T>
    Log& operator<<(const T& v) {
      *text << v;
      return *this;
    }
  } log_;
};

} // namespace

// The common case of the walk, without its copies: only vmap levels (no Grad
// or Jvp level to attach at), and at the base no input, with its batch dims
// peeled, requires grad (with grad mode on) or has a tangent for the
// registered jvp (forward-mode AD's dual tensors).
bool nothing_to_attach(
    const OpState& state,
    bool grad_mode,
    const std::vector<at::Tensor>& inputs) {
  for (const auto& layer : functorch::getDynamicLayerStack()) {
    if (layer.key() != TransformType::Vmap) {
      return false;
    }
  }
  const bool has_jvp = state.has_jvp.load();
  if (!grad_mode && !has_jvp) {
    return true;
  }
  for (at::Tensor t : inputs) {
    while (auto* b = t.defined() ? functorch::maybeGetBatchedImpl(t) : nullptr) {
      t = b->value();
    }
    if (t.defined() &&
        ((grad_mode && t.requires_grad()) || (has_jvp && torch::autograd::isFwGradDefined(t)))) {
      return false;
    }
  }
  return true;
}

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
    const std::optional<RngStates>& rng_before_primal) {
  if (nothing_to_attach(*state, grad_mode, inputs)) {
    if (log_level_walk()) {
      std::cerr
          << "torch_autobatch: level walk of " << state->qualname
          << ": only vmap levels, no input requires grad or has a tangent: nothing attached\n";
    }
    return;
  }
  LevelWalk(
      state, schema, grad_mode, std::move(arg_slots), std::move(ret_slots), args, returns, inputs,
      outputs, rng_before_primal)
      .run();
}

} // namespace torch_autobatch
