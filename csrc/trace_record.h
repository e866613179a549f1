// The tracer's private declarations, shared by its files: the record (OpInfo,
// Value, Entry, TraceImpl: trace_record.cpp), the autograd node hooks
// (NodeHook, AccHook: trace_hooks.cpp), the thread's state and the
// RecordFunction observer (trace_observer.cpp). The Python bindings are
// trace_bindings.cpp (public entry: tracer.h). Not for other files.
#pragma once

#include "torch_internals.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/hash.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch_autobatch::tracer {

using internals::Node;
using internals::variable_list;

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using Dims = c10::SmallVector<int64_t, 4>;

// NOTE [The record allocates little]
// A record outlives the tensors it describes. Every small heap block it keeps
// per op can land in the hole a freed large tensor left and split it, so the
// next large tensor needs fresh memory (a first version got a new address for
// nearly every one of 30 freed-and-remade 4 MB temporaries; untraced, they
// reuse 3: benchmarks/bench_tracer.py reports it). So per op the record keeps no heap block
// of its own but amortized growth: inline small vectors, flat hash maps,
// integer lists in one pool, interned names; and no reference that keeps a
// tensor's memory allocated.

// ------------------------------------------------------------------ operators
struct OpInfo {
  int32_t id;
  std::string name; // "aten::mm"
  std::string overload; // "" for the default overload
  // NOTE [Composite ops are seen through]
  // An op whose autograd kernel is its CompositeImplicitAutograd
  // decomposition (linear, matmul, ...) is not an op to autograd: the ops it
  // calls make the nodes, and autograd saves their outputs. It is not
  // recorded (nor counted in depth): the ops it calls are, in its place, so
  // every tensor a backward can be given is a value of the trace.
  bool transparent;
  // NOTE [Fresh constants]
  // torch.tensor(data) makes an empty tensor (an op), writes the data with
  // no op, and lifts it (aten::lift_fresh). The lifted tensor is listed as
  // an input, held with its data, not as the empty tensor's value.
  bool lifts;
  const c10::FunctionSchema* schema; // nullptr: no longer registered when interned
};

// The op's OpInfo, made on first use; its address is stable. Thread-safe.
OpInfo* intern(const c10::OperatorName& name);
// (name, overload) of the op with OpInfo::id `id`; std::out_of_range if none.
std::pair<std::string, std::string> op_name(int32_t id);

// Node and group names, interned (NOTE [The record allocates little]). Thread-safe.
const std::string* intern_name(std::string name);

// ---------------------------------------------------------------- the record
struct TraceImpl;
struct NodeHook;

// Where a tensor's elements are: NOTE [Values are keyed by TensorImpl address].
struct Layout {
  const c10::StorageImpl* storage = nullptr;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  Dims sizes;
  Dims strides;

  explicit Layout(const at::Tensor& t) : dtype(t.scalar_type()), sizes(t.sizes()) {
    if (t.has_storage() && !t.is_nested()) {
      storage = t.storage().unsafeGetStorageImpl();
      offset = t.storage_offset();
      strides = Dims(t.strides());
    }
  }

  bool matches(const at::Tensor& t) const {
    if (t.scalar_type() != dtype || t.sizes() != c10::IntArrayRef(sizes)) {
      return false;
    }
    if (!t.has_storage() || t.is_nested()) {
      return storage == nullptr;
    }
    return t.storage().unsafeGetStorageImpl() == storage && t.storage_offset() == offset &&
           t.strides() == c10::IntArrayRef(strides);
  }
};

// A value: one version of one tensor (an in-place op's output is a new value).
struct Value {
  int32_t num; // >= 0: the output %num; < 0: the input number -1 - num
  int32_t node = -1; // index of the traced node that is its grad_fn
  int64_t seq = -1; // sequence_nr of the grad_fn it was last seen with
  // NOTE [Values are keyed by TensorImpl address]
  // The record keeps no reference to a tensor it did not hold (NOTE [The
  // record allocates little]), so a dead tensor's address may come back as
  // another tensor's. A value found by address is that tensor's only if it
  // is laid out on the same storage the same way; else it is a new input. (A
  // new output always takes the address over.)
  Layout layout;
};

struct Input {
  int32_t value;
  std::string name;
  bool requires_grad;
  at::Tensor held; // NOTE [What a Trace holds]: inputs without a grad_fn
  std::optional<WeakImpl> weak; // the others
};

struct Group {
  int32_t pass; // 0: forward; k: the k-th backward call that ran this trace
  const std::string* name;
  int32_t node = -1; // the traced node's index
  int32_t value = -1; // AccumulateGrad: the leaf's value
};

struct RunKey {
  int64_t task;
  int64_t node; // a traced node's index; -1: no node; -2 - seq: an untraced node
  uint64_t thread;
  bool operator==(const RunKey& o) const {
    return task == o.task && node == o.node && thread == o.thread;
  }
};

struct RunKeyHash {
  size_t operator()(const RunKey& k) const {
    return c10::hash_combine(
        c10::hash_combine(std::hash<int64_t>()(k.task), std::hash<int64_t>()(k.node)),
        std::hash<uint64_t>()(k.thread));
  }
};

// Where a value sits in an entry: args[pos] (or args[pos][elem]), or outs;
// value < 0: args[pos] is the int list ints[elem, elem - 1 - value) of the pool.
struct Ref {
  bool out;
  uint32_t pos;
  int32_t elem; // -1: the argument itself
  int32_t value;
};

using Args = c10::SmallVector<c10::IValue, 6>;
using Refs = c10::SmallVector<Ref, 6>;

struct Entry {
  int32_t group;
  const OpInfo* op; // nullptr: an AccumulateGrad run, args = (leaf, grad)
  Args args; // schema order; a value is its index (see refs)
  c10::SmallVector<c10::IValue, 1> outs;
  Refs refs;
};

// One trace's record (Python: _C._TraceImpl, shown by torch_autobatch.Trace).
// Methods in trace_record.cpp, except those that hook nodes (trace_hooks.cpp).
struct TraceImpl : std::enable_shared_from_this<TraceImpl> {
  const int64_t id;
  std::mutex mu;
  int64_t version = 0; // bumped by every change the Python layer shows
  std::vector<Value> values;
  std::vector<Input> inputs;
  std::vector<Group> groups{Group{0, intern_name("forward")}};
  std::vector<Entry> entries;
  std::vector<int64_t> ints; // the int lists of entries' arguments
  ska::flat_hash_map<const c10::TensorImpl*, int32_t> ids; // tensor -> its latest value
  // storage -> the last output with a grad_fn on it; `saved_before` chains the older ones
  ska::flat_hash_map<const c10::StorageImpl*, int32_t> saved;
  ska::flat_hash_map<int32_t, int32_t> saved_before;
  ska::flat_hash_map<int64_t, int32_t> passes; // graph task id -> backward call number
  ska::flat_hash_map<RunKey, int32_t, RunKeyHash> run_groups;
  int32_t next_num = 0;
  int32_t next_node = 0;
  int32_t unnamed = 0;
  // An op ran on a torch.func transform's wrapper tensors (BatchedTensor,
  // GradTrackingTensor): listed at its logical shapes, not replayable.
  bool saw_transform = false;

  TraceImpl();

  // All below: `mu` held.
  int32_t new_value(const at::Tensor& t, int32_t num);
  int32_t add_input(const at::Tensor& t, std::string name, bool in_backward = false);
  // NOTE [A saved output is the value it saved] (trace_record.cpp).
  void note_saved(int32_t v);
  int32_t saved_value(const at::Tensor& t);
  // The value of `t` used as an op's input (`in_backward`: by a backward).
  int32_t use(const at::Tensor& t, bool in_backward = false);
  // Replaces the tensors in `iv` by their values' indices, noting where in `refs`.
  c10::IValue
  record(const c10::IValue& iv, bool out, uint32_t pos, Refs& refs, bool in_backward = false);
  int32_t pass_of(int64_t task);

  // The hook's node index if it hooks a node into this trace, else -1.
  int32_t index_in_this(const NodeHook* hook) const;
  // Makes `n` record its backward here; returns its index.
  int32_t tag(Node& n);
  // Tags the nodes an op made: NOTE [Finding the nodes an op created] (trace_hooks.cpp).
  int32_t tag_new(const c10::intrusive_ptr<Node>& root, uint64_t start_seq);

  // The group of a run, keyed (task, node index or -2 - seq, thread); makes it
  // with `name()` (called without `mu`: a Python node's name() takes the GIL).
  // `mu` not held.
  template <typename NameFn>
  int32_t run_group(RunKey key, int32_t node, NameFn name) {
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto it = run_groups.find(key);
      if (it != run_groups.end()) {
        return it->second;
      }
    }
    auto label = name();
    std::lock_guard<std::mutex> lock(mu);
    const auto it = run_groups.find(key);
    if (it != run_groups.end()) {
      return it->second;
    }
    groups.push_back(Group{pass_of(key.task), intern_name(std::move(label)), node});
    const auto g = static_cast<int32_t>(groups.size() - 1);
    run_groups.emplace(key, g);
    ++version;
    return g;
  }
};

// ------------------------------------------------------------------ hooks
// The pre-hook of a node an op recorded into `trace` created: NOTE [How a node
// records its backward] (trace_hooks.cpp).
struct NodeHook final : internals::FunctionPreHook {
  NodeHook(std::shared_ptr<TraceImpl> trace_, int32_t index_)
      : trace(std::move(trace_)), index(index_) {}

  variable_list operator()(const variable_list& grads) override;

  std::shared_ptr<TraceImpl> trace;
  const int32_t index;
};

// The pre-hook of an AccumulateGrad: NOTE [AccumulateGrad runs] (trace_hooks.cpp).
struct AccHook final : internals::FunctionPreHook {
  variable_list operator()(const variable_list& grads) override;
};

// The node's NodeHook, if a trace hooked it; else nullptr.
const NodeHook* traced_hook(const Node& n);

// ------------------------------------------------------------ thread state
// What the thread is doing; see NOTE [Which trace records an op] (trace_observer.cpp).
struct ThreadState {
  std::vector<std::shared_ptr<TraceImpl>> blocks; // active trace() blocks, innermost last
  int depth = 0; // dispatcher ops running on this thread that our callback saw start
  // RecordFunction is off on this thread while the outermost op runs: NOTE
  // [Nested calls are not observed].
  bool muted = false;
  // The outermost op, while it runs and is recorded:
  std::shared_ptr<TraceImpl> trace;
  int32_t group = 0;
  const OpInfo* op = nullptr;
  uint64_t start_seq = 0; // nodes it makes have sequence_nr >= this
  int uncaught = 0;
  Args args;
  Refs refs;
  // graph task -> the trace of the last traced node run here in it, for the
  // recent tasks (a backward can run inside another): NOTE [AccumulateGrad runs].
  std::vector<std::pair<int64_t, std::weak_ptr<TraceImpl>>> task_traces;
  // The outputs of the last op recorded with grad mode off, to look at again
  // at the next op or block exit: NOTE [Nodes attached after the op].
  std::weak_ptr<TraceImpl> recheck_trace;
  std::vector<std::pair<int32_t, WeakImpl>> recheck;
  internals::CallbackHandle handle = 0;
  // RecordFunction::name() pointer (into the op's schema) -> op
  ska::flat_hash_map<const char*, const OpInfo*> op_cache;
};

extern thread_local ThreadState tls; // trace_observer.cpp

// Installs our RecordFunction callback on this thread if it is not.
void ensure_callback(ThreadState& s);
bool callback_installed(const ThreadState& s);

// trace() blocks (the Python layer's _C._trace_push / _trace_pop).
void push_block(const std::shared_ptr<TraceImpl>& trace);
void pop_block(const std::shared_ptr<TraceImpl>& trace);
// The trace that would record an op run on this thread now, or null.
std::shared_ptr<TraceImpl> current_trace();

} // namespace torch_autobatch::tracer
