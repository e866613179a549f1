// The vmap levels a grad node's backward, or a jvp below vmap, runs inside
// again: VmapFrame (what the forward's level walk saw at one vmap level) and
// ReenteredFrames (re-enter them, batch, leave).
#pragma once

#include "functorch.h"

#include <optional>
#include <vector>

namespace torch_autobatch {

using Bdims = std::vector<std::optional<int64_t>>;

// One vmap level above a node in the forward: where the batch dimension sat in
// each input, output and saved tensor of the node's level.
struct VmapFrame {
  c10::SymInt batch_size;
  int64_t randomness = 0; // functorch::RandomnessType
  Bdims in_bdims, out_bdims, saved_bdims;
};

// NOTE [Re-entering the vmap levels]
// User code that the forward's vmap levels were above (a node's backward, a
// registered jvp below vmap) runs batched: the frames' levels are pushed
// again, outermost first, each tensor is wrapped as the BatchedTensor it was
// at each level (`enter`), and each result is unwrapped again, innermost level
// first, and given the batch layout its caller's level expects (`leave`: the
// gradient of an input unbatched at a level is the sum over that level's
// examples). Levels still pushed are popped when the guard dies (every exit
// path).
class ReenteredFrames {
 public:
  // `frames`: outermost first.
  explicit ReenteredFrames(const std::vector<VmapFrame>& frames) : frames_(frames) {
    ids_.reserve(frames_.size());
    for (const auto& f : frames_) {
      ids_.push_back(levels_.push(f.batch_size, f.randomness));
    }
  }
  ReenteredFrames(const ReenteredFrames&) = delete;
  ReenteredFrames& operator=(const ReenteredFrames&) = delete;

  // Wraps each defined tensor of `ts` at every level, by the frame's `bdims`.
  void enter(std::vector<at::Tensor>& ts, Bdims VmapFrame::* bdims) const {
    for (size_t j = 0; j < frames_.size(); ++j) {
      const Bdims& dims = frames_[j].*bdims;
      for (size_t k = 0; k < ts.size(); ++k) {
        if (ts[k].defined()) {
          ts[k] = functorch::makeBatched(ts[k], dims[k], ids_[j]);
        }
      }
    }
  }

  // Pops every level, unwrapping each defined tensor of `ts` and moving its
  // batch dim to the frame's `bdims` (summing where that is none).
  void leave(std::vector<at::Tensor>& ts, Bdims VmapFrame::* bdims) {
    for (size_t j = frames_.size(); j-- > 0;) {
      const VmapFrame& f = frames_[j];
      Bdims have(ts.size());
      for (size_t k = 0; k < ts.size(); ++k) {
        if (ts[k].defined()) {
          std::tie(ts[k], have[k]) = functorch::unwrapTensorAtLevel(ts[k], ids_[j]);
        }
      }
      levels_.pop();
      for (size_t k = 0; k < ts.size(); ++k) {
        if (ts[k].defined()) {
          ts[k] = functorch::match_bdim(ts[k], have[k], (f.*bdims)[k], f.batch_size);
        }
      }
    }
  }

 private:
  const std::vector<VmapFrame>& frames_;
  std::vector<int64_t> ids_;
  functorch::ReenteredVmapLevels levels_;
};

} // namespace torch_autobatch
