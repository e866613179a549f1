// The recorder behind torch_autobatch.trace (Python layer: _tracer.py).
//
// NOTE [How the recorder sees ops]
// A thread-local RecordFunction callback (the observer API the profiler
// uses) sees every dispatcher call on the thread, with its inputs and
// outputs, above autograd. We record only the outermost ones (`depth`): an
// op is recorded as called, never its decomposition or its kernel's own
// dispatcher calls, so a custom operator is one op. Everything here is C++:
// no op pays a trip into Python. The callback is installed only while a
// trace() block is active on the thread or a traced node runs there
// (NOTE [How a node records its backward]); with neither, nothing is
// installed and ops cost what they always do.
//
// NOTE [Which trace records an op]
// Decided when an op starts, from the autograd node the thread is
// evaluating (torch::autograd::get_current_node(), set by the engine for a
// node's pre-hooks, its backward and the gradient sums it feeds):
//   - a node with our NodeHook: that node's trace, whatever else is active;
//   - an AccumulateGrad with our AccHook: nobody (AccHook lists the run as
//     `%w.grad += %g`);
//   - any other node, or none: the innermost trace() block on this thread,
//     if any.
#include "tracer.h"

#include "functorch.h"
#include "python_interop.h"
#include "torch_internals.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <typeinfo>

namespace torch_autobatch {
namespace {

namespace py = pybind11;
using internals::kAccumulateGradSeq;
using internals::Node;
using internals::variable_list;

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using Dims = c10::SmallVector<int64_t, 4>;
const c10::DispatchKeySet kTransformKeys({c10::DispatchKey::FuncTorchBatched,
                                          c10::DispatchKey::FuncTorchGradWrapper,
                                          c10::DispatchKey::BatchedNestedTensor});

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

std::mutex ops_mutex;
std::deque<OpInfo> ops; // never shrinks: OpInfo addresses are stable
std::map<std::pair<std::string, std::string>, OpInfo*> ops_by_name;

OpInfo* intern(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> lock(ops_mutex);
  auto& op = ops_by_name[{name.name, name.overload_name}];
  if (op == nullptr) {
    const auto handle = c10::Dispatcher::singleton().findOp(name);
    const auto has = [&](c10::DispatchKey k) {
      return handle && handle->hasKernelForDispatchKey(k);
    };
    // The dispatcher's rule: an autograd key takes the CompositeImplicitAutograd
    // kernel unless the op has its own autograd, backend or
    // CompositeExplicitAutograd kernel.
    bool transparent = has(c10::DispatchKey::CompositeImplicitAutograd);
    for (const auto k :
         {c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA, c10::DispatchKey::CPU,
          c10::DispatchKey::CUDA, c10::DispatchKey::CompositeExplicitAutograd,
          c10::DispatchKey::CompositeExplicitAutogradNonFunctional}) {
      transparent = transparent && !has(k);
    }
    ops.push_back(OpInfo{static_cast<int32_t>(ops.size()), name.name, name.overload_name,
                         transparent,
                         name.name == "aten::lift_fresh" || name.name == "aten::lift",
                         handle && handle->hasSchema() ? &handle->schema() : nullptr});
    op = &ops.back();
  }
  return op;
}

// ---------------------------------------------------------------- the record
struct TraceImpl;

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

// Node and group names, interned (NOTE [The record allocates little]).
const std::string* intern_name(std::string name) {
  static std::mutex mutex;
  static ska::flat_hash_map<std::string, std::unique_ptr<std::string>> names;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = names[name];
  if (!slot) {
    slot = std::make_unique<std::string>(std::move(name));
  }
  return slot.get();
}

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

std::atomic<int64_t> next_trace_id{0};

struct NodeHook;

// What the thread is doing; see NOTE [Which trace records an op].
struct ThreadState {
  std::vector<std::shared_ptr<TraceImpl>> blocks; // active trace() blocks, innermost last
  int depth = 0; // dispatcher ops running on this thread that our callback saw start
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

thread_local ThreadState tls;

void ensure_callback(ThreadState& s);

const NodeHook* traced_hook(const Node& n);

// The Python number the arg parser wrapped in a 0-dim tensor. Under a
// torch.func transform the number may reach the op wrapped again (a
// TensorWrapper of a grad level: no storage of its own); its value is the
// wrapped tensor's. One that still has no readable storage (a fake tensor)
// is listed as a tensor.
c10::IValue wrapped_number(const at::Tensor& wrapped) {
  const at::Tensor t = wrapped.has_storage() ? wrapped : functorch::innermost(wrapped);
  if (!t.has_storage() || !t.is_cpu() || t.numel() != 1) {
    return wrapped;
  }
  switch (t.scalar_type()) {
    case c10::ScalarType::Double:
      return *t.const_data_ptr<double>();
    case c10::ScalarType::Long:
      return *t.const_data_ptr<int64_t>();
    case c10::ScalarType::Bool:
      return *t.const_data_ptr<bool>();
    case c10::ScalarType::ComplexDouble:
      return *t.const_data_ptr<c10::complex<double>>();
    default:
      return wrapped;
  }
}

struct TraceImpl : std::enable_shared_from_this<TraceImpl> {
  const int64_t id = next_trace_id++;
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

  // Room for a small trace made up front, so that a block of a few hundred
  // ops grows nothing while tensors come and go (NOTE [The record allocates
  // little]).
  TraceImpl() {
    values.reserve(512);
    entries.reserve(256);
    ints.reserve(512);
    ids.reserve(512);
    saved.reserve(128);
  }

  // All below: `mu` held.
  int32_t new_value(const at::Tensor& t, int32_t num) {
    values.push_back(Value{num, -1, -1, Layout(t)});
    const auto v = static_cast<int32_t>(values.size() - 1);
    ids[t.unsafeGetTensorImpl()] = v;
    return v;
  }

  int32_t add_input(const at::Tensor& t, std::string name, bool in_backward = false) {
    const auto v = new_value(t, -1 - static_cast<int32_t>(inputs.size()));
    const auto& fn = t.grad_fn();
    if (fn) {
      values[v].seq = static_cast<int64_t>(fn->sequence_nr());
    }
    if (name.empty()) {
      name = "arg" + std::to_string(unnamed++);
    }
    // NOTE [What a Trace holds]: inputs without a grad_fn, and those a
    // backward is first to use (a tensor autograd saved that no recorded op
    // made, e.g. one a checkpoint recomputed), as what replay needs.
    at::Tensor held = !fn ? t : in_backward ? t.detach() : at::Tensor();
    std::optional<WeakImpl> weak;
    if (!held.defined()) {
      weak.emplace(t.getIntrusivePtr());
    }
    inputs.push_back(Input{v, "%" + name, t.requires_grad(), std::move(held), std::move(weak)});
    ++version;
    return v;
  }

  // NOTE [A saved output is the value it saved]
  // Autograd saves an op's output as a new tensor on the same storage (no op
  // runs), and gives that tensor to the node's backward. An input that no
  // recorded op made is therefore first looked up among the outputs with a
  // grad_fn on its storage, newest first: one laid out the same way is that
  // value. (A storage address that came back after its storage died is
  // newer than every output on the dead one.)
  void note_saved(int32_t v) {
    const auto* storage = values[v].layout.storage;
    if (storage == nullptr) {
      return;
    }
    auto& last = saved[storage];
    if (last != 0) {
      saved_before[v] = last - 1;
    }
    last = v + 1; // 0: none
  }

  int32_t saved_value(const at::Tensor& t) {
    if (!t.has_storage() || t.is_nested()) {
      return -1;
    }
    const auto it = saved.find(t.storage().unsafeGetStorageImpl());
    for (int32_t v = it == saved.end() ? -1 : it->second - 1; v >= 0;) {
      if (values[v].layout.matches(t)) {
        ids[t.unsafeGetTensorImpl()] = v;
        return v;
      }
      const auto before = saved_before.find(v);
      v = before == saved_before.end() ? -1 : before->second;
    }
    return -1;
  }

  // The value of `t` used as an op's input (`in_backward`: by a backward).
  int32_t use(const at::Tensor& t, bool in_backward = false) {
    saw_transform = saw_transform || t.key_set().has_any(kTransformKeys);
    const auto it = ids.find(t.unsafeGetTensorImpl());
    int32_t v = it != ids.end() && values[it->second].layout.matches(t) ? it->second
                                                                         : saved_value(t);
    if (v < 0) {
      v = add_input(t, "", in_backward);
    }
    if (t.requires_grad()) {
      // A grad_fn made since the value was last seen: the node
      // torch.autograd.Function.apply attaches after its forward, or the new
      // grad_fn of a view whose base was since modified in place.
      const auto& fn = t.grad_fn();
      if (fn && values[v].seq != static_cast<int64_t>(fn->sequence_nr())) {
        values[v].seq = static_cast<int64_t>(fn->sequence_nr());
        const auto* hook = traced_hook(*fn);
        values[v].node = hook == nullptr ? tag(*fn) : index_in_this(hook);
      }
    }
    return v;
  }

  int32_t index_in_this(const NodeHook* hook) const;

  // Replaces the tensors in `iv` by their values' indices, noting where in `refs`.
  c10::IValue record(const c10::IValue& iv, bool out, uint32_t pos, Refs& refs,
                     bool in_backward = false) {
    if (iv.isTensor()) {
      const auto& t = iv.toTensor();
      if (!t.defined()) {
        return c10::IValue();
      }
      if (!out && t.unsafeGetTensorImpl()->is_wrapped_number()) {
        return wrapped_number(t); // `x * 3`: listed, and replayed, as 3
      }
      const auto v = out ? new_value(t, next_num++) : use(t, in_backward);
      refs.push_back(Ref{out, pos, -1, v});
      return c10::IValue(static_cast<int64_t>(v));
    }
    if (!iv.isList()) {
      return iv;
    }
    const auto items = iv.toListRef();
    bool any = false;
    bool ints_only = true;
    for (const auto& x : items) {
      any = any || x.isTensor();
      ints_only = ints_only && (x.isInt() || (x.isSymInt() && !x.toSymInt().is_heap_allocated()));
    }
    if (ints_only) { // into the pool: NOTE [The record allocates little]
      const auto offset = static_cast<int32_t>(ints.size());
      for (const auto& x : items) {
        ints.push_back(x.isInt() ? x.toInt() : x.toSymInt().as_int_unchecked());
      }
      refs.push_back(Ref{out, pos, offset, -1 - static_cast<int32_t>(items.size())});
      return c10::IValue();
    }
    if (!any) {
      return iv;
    }
    auto list = internals::any_list();
    for (const auto j : c10::irange(items.size())) {
      const auto& x = items[j];
      if (x.isTensor() && x.toTensor().defined()) {
        const auto& t = x.toTensor();
        const auto v = out ? new_value(t, next_num++) : use(t, in_backward);
        refs.push_back(Ref{out, pos, static_cast<int32_t>(j), v});
        list.push_back(c10::IValue(static_cast<int64_t>(v)));
      } else {
        list.push_back(c10::IValue());
      }
    }
    return list;
  }

  // Makes `n` record its backward here; returns its index.
  int32_t tag(Node& n);

  // NOTE [Finding the nodes an op created]
  // We run above autograd: when an op returns, its outputs have their
  // grad_fn. The nodes the op created are those reachable from them with a
  // sequence number taken during the op on this thread (an in-place op on a
  // view makes two: the view's new grad_fn and, under it, the CopySlices of
  // its base; hooks on the node CopySlices wraps never fire). The walk stops at
  // older nodes, so each op costs what it made. Nodes made outside any op
  // (torch.autograd.Function.apply's) are found when their output is next
  // used (`use`).
  int32_t tag_new(const c10::intrusive_ptr<Node>& root, uint64_t start_seq) {
    const auto thread = internals::current_thread_id();
    int32_t root_index = -1;
    std::vector<Node*> stack{root.get()};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (const auto* hook = traced_hook(*n)) {
        if (n == root.get()) {
          root_index = index_in_this(hook);
        }
        continue;
      }
      const auto seq = n->sequence_nr();
      if (seq == kAccumulateGradSeq || seq < start_seq || n->thread_id() != thread) {
        continue; // made before this op, or elsewhere
      }
      const auto index = tag(*n);
      if (n == root.get()) {
        root_index = index;
      }
      for (const auto& edge : n->next_edges()) {
        if (edge.function) {
          stack.push_back(edge.function.get());
        }
      }
    }
    return root_index;
  }

  int32_t pass_of(int64_t task) {
    const auto it = passes.find(task);
    if (it != passes.end()) {
      return it->second;
    }
    const auto pass = static_cast<int32_t>(passes.size() + 1);
    passes.emplace(task, pass);
    return pass;
  }

  // The group of a run, keyed (task, node index or -2 - seq, thread); makes it
  // with `name()` (called without `mu`: a Python node's name() takes the GIL).
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

// NOTE [How a node records its backward]
// Each node an op recorded into a trace creates gets a NodeHook (a C++
// pre-hook: no Python). The engine runs it on whatever thread runs the node,
// inside the node's evaluation, where it makes sure our callback is
// installed. The engine evaluates every node under a guard that restores
// the thread-local state the backward started with, RecordFunction
// callbacks included: a callback installed here is gone when the node is
// done, whether it returned or raised. Nothing to undo, and untraced nodes
// run with no callback. The NodeHook holds the trace: a trace lives as long
// as any node that records into it.
struct NodeHook final : internals::FunctionPreHook {
  NodeHook(std::shared_ptr<TraceImpl> trace_, int32_t index_)
      : trace(std::move(trace_)), index(index_) {}

  variable_list operator()(const variable_list& grads) override {
    auto& s = tls;
    ensure_callback(s);
    const int64_t task = internals::current_graph_task_id();
    const auto node = internals::current_node();
    trace->run_group({task, index, 0}, index, [&] {
      return node ? node->name() : std::string("?");
    });
    auto& tasks = s.task_traces;
    auto it = std::find_if(tasks.begin(), tasks.end(), [&](const auto& p) { return p.first == task; });
    if (it == tasks.end()) {
      if (tasks.size() == 16) {
        tasks.erase(tasks.begin()); // the oldest
      }
      tasks.emplace_back(task, trace);
    } else {
      it->second = trace;
    }
    return grads;
  }

  std::shared_ptr<TraceImpl> trace;
  const int32_t index;
};

// NOTE [AccumulateGrad runs]
// An AccumulateGrad belongs to its leaf, not to one graph: traces on two
// threads may run the same one. It gets one AccHook, shared, which lists the
// run in the trace of the last traced node that ran on this thread in the
// same backward call (the engine runs an AccumulateGrad right after the node
// that feeds it) as `%w.grad += %g`. The ops that store `.grad` are not
// recorded: the line says what they do. Like any hook registration in torch,
// adding it is not safe against another thread running that AccumulateGrad
// at the same moment (an untraced backward of the same parameters): the
// first trace to reach a parameter adds it, under a lock of ours only.
struct AccHook final : internals::FunctionPreHook {
  variable_list operator()(const variable_list& grads) override;
};

std::mutex acc_hook_mutex;

void ensure_acc_hook(Node& n) {
  if (!internals::is_accumulate_grad(n)) {
    return;
  }
  std::lock_guard<std::mutex> lock(acc_hook_mutex);
  for (const auto& h : internals::pre_hooks(n)) {
    if (typeid(*h) == typeid(AccHook)) {
      return;
    }
  }
  internals::add_pre_hook(n, std::make_unique<AccHook>());
}

const NodeHook* traced_hook(const Node& n) {
  for (const auto& h : internals::pre_hooks(n)) {
    if (typeid(*h) == typeid(NodeHook)) {
      return static_cast<const NodeHook*>(h.get());
    }
  }
  return nullptr;
}

int32_t TraceImpl::index_in_this(const NodeHook* hook) const {
  return hook->trace.get() == this ? hook->index : -1;
}

int32_t TraceImpl::tag(Node& n) {
  const auto index = next_node++;
  internals::add_pre_hook(n, std::make_unique<NodeHook>(shared_from_this(), index));
  for (const auto& edge : n.next_edges()) {
    if (edge.function) {
      ensure_acc_hook(*edge.function);
    }
  }
  return index;
}

const std::string* const accumulate_grad_name = intern_name("AccumulateGrad");

variable_list AccHook::operator()(const variable_list& grads) {
  auto& s = tls;
  if (grads.empty() || !grads[0].defined()) {
    return grads;
  }
  const int64_t task = internals::current_graph_task_id();
  std::shared_ptr<TraceImpl> trace;
  for (const auto& [t, ref] : s.task_traces) {
    if (t == task) {
      trace = ref.lock();
    }
  }
  const auto node = internals::current_node();
  const auto* leaf = internals::accumulated_leaf(node.get());
  if (trace == nullptr || leaf == nullptr) {
    return grads;
  }
  std::lock_guard<std::mutex> lock(trace->mu);
  Entry e{0, nullptr, {}, {}, {}};
  e.args.push_back(trace->record(c10::IValue(*leaf), false, 0, e.refs));
  e.args.push_back(trace->record(c10::IValue(grads[0]), false, 1, e.refs));
  trace->groups.push_back(Group{trace->pass_of(task), accumulate_grad_name, -1, e.refs[0].value});
  e.group = static_cast<int32_t>(trace->groups.size() - 1);
  trace->entries.push_back(std::move(e));
  ++trace->version;
  return grads;
}

// ------------------------------------------------------------- the callback
// NOTE [Knowing an op from its RecordFunction]
// RecordFunctions also wrap things that are not ops (the engine's
// "autograd::engine::evaluate_function: ..."): those have no operator name
// and are ignored, depth included. An op's name() points into its schema,
// which lives as long as the op: the pointer keys a per-thread cache (checked
// by comparing the names, in case an op was deregistered and its memory reused).
const OpInfo* op_of(ThreadState& s, const at::RecordFunction& fn) {
  const char* name = fn.name();
  const auto it = s.op_cache.find(name);
  if (it != s.op_cache.end() && it->second->name == name &&
      it->second->overload == fn.overload_name()) {
    return it->second;
  }
  const auto opname = fn.operator_name();
  if (!opname) {
    return nullptr;
  }
  const auto* op = intern(*opname);
  s.op_cache[name] = op;
  return op;
}

// NOTE [Nodes attached after the op]
// torch.autograd.Function.apply runs its forward with grad mode off, then
// attaches its node to the tensors the forward's last ops returned: no op
// of ours sees that node. So the outputs of an op recorded with grad mode
// off are looked at again when the next op starts (or the block exits); a
// node found then is hooked. (Later, `use` finds it on the op's inputs.)
void recheck_outputs(ThreadState& s) {
  if (s.recheck.empty()) {
    return;
  }
  const auto values = std::move(s.recheck);
  s.recheck.clear();
  const auto trace = s.recheck_trace.lock();
  if (trace == nullptr) {
    return;
  }
  std::vector<at::Tensor> alive; // dropped after `mu` is released
  std::lock_guard<std::mutex> lock(trace->mu);
  for (const auto& [v, ref] : values) {
    auto impl = ref.lock();
    if (!impl) {
      continue;
    }
    alive.emplace_back(std::move(impl));
    const auto& t = alive.back();
    const auto& fn = t.requires_grad() ? t.grad_fn() : c10::intrusive_ptr<Node>();
    if (fn && trace->values[v].seq != static_cast<int64_t>(fn->sequence_nr())) {
      trace->values[v].seq = static_cast<int64_t>(fn->sequence_nr());
      const auto* hook = traced_hook(*fn);
      trace->values[v].node = hook == nullptr ? trace->tag(*fn) : trace->index_in_this(hook);
      ++trace->version;
    }
  }
}

void begin_op(ThreadState& s, const at::RecordFunction& fn, const OpInfo* op) {
  recheck_outputs(s);
  std::shared_ptr<TraceImpl> trace;
  int32_t group = 0;
  const auto node = internals::current_node();
  if (node) {
    const NodeHook* hook = nullptr;
    for (const auto& h : internals::pre_hooks(*node)) {
      const auto& type = typeid(*h);
      if (type == typeid(AccHook)) {
        return; // NOTE [AccumulateGrad runs]
      }
      if (type == typeid(NodeHook)) {
        hook = static_cast<const NodeHook*>(h.get());
        break;
      }
    }
    if (hook == nullptr && s.blocks.empty()) {
      return;
    }
    const int64_t task = internals::current_graph_task_id();
    if (hook != nullptr) {
      trace = hook->trace;
      group = trace->run_group({task, hook->index, 0}, hook->index, [&] { return node->name(); });
    } else {
      trace = s.blocks.back();
      group = trace->run_group(
          {task, -2 - static_cast<int64_t>(node->sequence_nr()), node->thread_id()}, -1,
          [&] { return node->name() + " (untraced node)"; });
    }
  } else if (!s.blocks.empty()) {
    trace = s.blocks.back();
    const int64_t task = internals::current_graph_task_id();
    if (task != -1) { // inside a backward call, but in no node
      group = trace->run_group({task, -1, 0}, -1, [] { return std::string("(engine)"); });
    }
  } else {
    return;
  }
  s.start_seq = internals::next_sequence_nr();
  s.uncaught = std::uncaught_exceptions();
  s.op = op;
  s.group = group;
  s.args.clear();
  s.refs.clear();
  const auto inputs = fn.inputs();
  std::lock_guard<std::mutex> lock(trace->mu);
  if (op->lifts && !inputs.empty() && inputs[0].isTensor() && inputs[0].toTensor().defined()) {
    const auto v = trace->add_input(inputs[0].toTensor(), "");
    s.refs.push_back(Ref{false, 0, -1, v});
    s.args.push_back(c10::IValue(static_cast<int64_t>(v)));
  }
  const bool in_backward = group != 0;
  for (auto i = s.args.size(); i < inputs.size(); ++i) {
    s.args.push_back(
        trace->record(inputs[i], false, static_cast<uint32_t>(i), s.refs, in_backward));
  }
  s.trace = std::move(trace);
}

void end_op(ThreadState& s, TraceImpl& trace, const std::vector<c10::IValue>& outputs) {
  std::lock_guard<std::mutex> lock(trace.mu);
  Entry e{s.group, s.op, std::move(s.args), {}, std::move(s.refs)};
  const auto first_out = e.refs.size();
  for (const auto i : c10::irange(outputs.size())) {
    e.outs.push_back(trace.record(outputs[i], true, static_cast<uint32_t>(i), e.refs));
  }
  for (auto r = first_out; r < e.refs.size(); ++r) {
    const auto& ref = e.refs[r];
    if (ref.value < 0) {
      continue; // an int list
    }
    const auto& out = outputs[ref.pos];
    const auto& t = ref.elem < 0 ? out.toTensor() : out.toListRef()[ref.elem].toTensor();
    if (t.requires_grad()) {
      const auto& fn = t.grad_fn();
      if (fn) {
        trace.values[ref.value].seq = static_cast<int64_t>(fn->sequence_nr());
        trace.values[ref.value].node = trace.tag_new(fn, s.start_seq);
        trace.note_saved(ref.value);
      }
    }
  }
  if (!c10::GradMode::is_enabled()) {
    s.recheck.clear();
    for (auto r = first_out; r < e.refs.size(); ++r) {
      const auto& ref = e.refs[r];
      if (ref.value < 0) {
        continue;
      }
      const auto& out = outputs[ref.pos];
      const auto& t = ref.elem < 0 ? out.toTensor() : out.toListRef()[ref.elem].toTensor();
      s.recheck.emplace_back(ref.value, WeakImpl(t.getIntrusivePtr()));
    }
    s.recheck_trace = trace.shared_from_this();
  }
  trace.entries.push_back(std::move(e));
  ++trace.version;
}

// An observer must not throw into the op it observes: a failure to record
// is said, never silent.
void warn_unrecorded(const at::RecordFunction& fn, const std::exception& e) {
  // One line: torch's own errors without their C++ backtrace.
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  TORCH_WARN(
      "torch_autobatch.trace: could not record ", fn.name(),
      "; the trace lacks this op and will not replay it right. Cause: ",
      c10_error != nullptr ? c10_error->what_without_backtrace() : e.what());
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  auto& s = tls;
  const auto* op = op_of(s, fn);
  if (op == nullptr || op->transparent || s.depth++ != 0) {
    return nullptr;
  }
  try {
    begin_op(s, fn, op);
  } catch (const std::exception& e) {
    s.trace.reset(); // not recorded, but the op runs
    warn_unrecorded(fn, e);
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  auto& s = tls;
  const auto* op = op_of(s, fn);
  if (op == nullptr || op->transparent || s.depth == 0 || --s.depth != 0 || !s.trace) {
    return;
  }
  const auto trace = std::move(s.trace);
  s.trace.reset();
  if (std::uncaught_exceptions() > s.uncaught) {
    return; // the op raised: nothing ran to record
  }
  try {
    end_op(s, *trace, fn.outputs());
  } catch (const std::exception& e) {
    warn_unrecorded(fn, e);
  }
}

bool callback_installed(const ThreadState& s) {
  return s.handle != 0 && internals::thread_local_callback_installed(s.handle);
}

void ensure_callback(ThreadState& s) {
  if (!callback_installed(s)) {
    s.handle = internals::add_thread_local_callback(
        at::RecordFunctionCallback(on_start, on_end)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION}));
  }
}

// ----------------------------------------------------------------- Python
void push_block(const std::shared_ptr<TraceImpl>& trace) {
  auto& s = tls;
  s.blocks.push_back(trace);
  ensure_callback(s);
}

void pop_block(const std::shared_ptr<TraceImpl>& trace) {
  auto& s = tls;
  recheck_outputs(s);
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) {
    if (*it == trace) {
      s.blocks.erase(std::next(it).base());
      break;
    }
  }
  if (!s.blocks.empty() || !callback_installed(s)) {
    return;
  }
  const auto node = internals::current_node();
  if (node && traced_hook(*node) != nullptr) {
    return; // the engine removes it when the node is done
  }
  internals::remove_callback(s.handle);
  s.handle = 0;
}

std::shared_ptr<TraceImpl> current_trace() {
  const auto node = internals::current_node();
  if (node) {
    if (const auto* hook = traced_hook(*node)) {
      return hook->trace;
    }
  }
  auto& s = tls;
  return s.blocks.empty() ? nullptr : s.blocks.back();
}

// Locks `t.mu` from Python: waits without the GIL (a thread holding `mu`
// may need the GIL, e.g. to name a Python node).
std::unique_lock<std::mutex> lock_from_python(TraceImpl& t) {
  std::unique_lock<std::mutex> lock(t.mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    py::gil_scoped_release no_gil;
    lock.lock();
  }
  return lock;
}

py::object opt_index(int32_t i) {
  return i < 0 ? py::object(py::none()) : py::object(py::int_(i));
}

// An argument (or return) as the op's function sees it: NOTE [Op values
// reach Python by their schema type] (python_interop.h). With no schema
// argument, by the value alone.
py::object arg_to_py(const c10::IValue& iv, const c10::Argument* arg) {
  return to_py(iv, arg == nullptr ? *c10::AnyType::get() : *arg->real_type());
}

} // namespace

void bind_tracer(py::module_& m) {
  py::class_<TraceImpl, std::shared_ptr<TraceImpl>>(m, "_TraceImpl")
      .def(py::init<>())
      .def_readonly("id", &TraceImpl::id)
      .def_property_readonly(
          "version",
          [](TraceImpl& t) {
            const auto lock = lock_from_python(t);
            return t.version;
          })
      .def(
          "add_input",
          [](TraceImpl& t, const at::Tensor& x, std::string name) {
            const auto lock = lock_from_python(t);
            const auto it = t.ids.find(x.unsafeGetTensorImpl());
            if (it != t.ids.end() && t.values[it->second].num < 0 &&
                t.values[it->second].layout.matches(x)) {
              return it->second;
            }
            return t.add_input(x, std::move(name));
          })
      .def_property_readonly(
          "saw_transform",
          [](TraceImpl& t) {
            const auto lock = lock_from_python(t);
            return t.saw_transform;
          })
      .def(
          "value_of",
          [](TraceImpl& t, const at::Tensor& x) {
            const auto lock = lock_from_python(t);
            const auto it = t.ids.find(x.unsafeGetTensorImpl());
            return it != t.ids.end() && t.values[it->second].layout.matches(x) ? it->second : -1;
          })
      .def(
          "input_tensor",
          [](TraceImpl& t, int32_t k) -> py::object {
            at::Tensor x;
            {
              const auto lock = lock_from_python(t);
              const auto& input = t.inputs.at(k);
              x = input.held.defined() ? input.held : at::Tensor(input.weak->lock());
            }
            if (!x.defined()) {
              return py::none();
            }
            return py::reinterpret_steal<py::object>(THPVariable_Wrap(x));
          })
      .def(
          "snapshot",
          [](TraceImpl& t) {
            // (values, inputs, groups, entries) in plain Python objects; a
            // value in `entries` is its index into `values`.
            auto lock = lock_from_python(t);
            const auto values = t.values;
            const auto inputs = t.inputs;
            const auto groups = t.groups;
            const auto entries = t.entries;
            const auto ints = t.ints;
            lock.unlock();
            py::list vs;
            for (const auto& v : values) {
              const auto& sizes = v.layout.sizes;
              py::tuple shape(sizes.size());
              for (const auto i : c10::irange(sizes.size())) {
                shape[i] = sizes[i];
              }
              vs.append(py::make_tuple(
                  v.num, shape,
                  py::reinterpret_borrow<py::object>(
                      reinterpret_cast<PyObject*>(torch::getTHPDtype(v.layout.dtype))),
                  opt_index(v.node)));
            }
            py::list is;
            for (const auto& i : inputs) {
              is.append(py::make_tuple(i.value, i.name, i.requires_grad));
            }
            py::list gs;
            for (const auto& g : groups) {
              gs.append(py::make_tuple(
                  g.pass, *g.name, opt_index(g.node),
                  opt_index(g.value)));
            }
            py::list es;
            for (const auto& e : entries) {
              py::list args, outs;
              const auto* schema = e.op == nullptr ? nullptr : e.op->schema;
              auto typed = [&](bool out, size_t i) -> const c10::Argument* {
                if (schema == nullptr) {
                  return nullptr;
                }
                const auto& list = out ? schema->returns() : schema->arguments();
                return i < list.size() ? &list[i] : nullptr;
              };
              for (const auto i : c10::irange(e.args.size())) {
                args.append(arg_to_py(e.args[i], typed(false, i)));
              }
              for (const auto i : c10::irange(e.outs.size())) {
                outs.append(arg_to_py(e.outs[i], typed(true, i)));
              }
              for (const auto& r : e.refs) {
                if (r.value < 0) { // an int list in the pool (a ScalarType[] too)
                  c10::List<int64_t> list;
                  for (auto k = r.elem; k < r.elem - 1 - r.value; ++k) {
                    list.push_back(ints[k]);
                  }
                  (r.out ? outs : args)[r.pos] = arg_to_py(list, typed(r.out, r.pos));
                }
              }
              py::list refs;
              for (const auto& r : e.refs) {
                if (r.value >= 0) {
                  refs.append(py::make_tuple(r.out, r.pos, r.elem, r.value));
                }
              }
              es.append(py::make_tuple(
                  e.group, e.op == nullptr ? -1 : e.op->id, args, outs, refs));
            }
            return py::make_tuple(vs, is, gs, es);
          })
      .def("__len__", [](TraceImpl& t) {
        const auto lock = lock_from_python(t);
        return t.entries.size();
      });
  m.def("_op_name", [](int32_t id) {
    std::lock_guard<std::mutex> lock(ops_mutex);
    const auto& op = ops.at(static_cast<size_t>(id));
    return py::make_tuple(op.name, op.overload);
  });
  m.def("_trace_push", &push_block);
  m.def("_trace_pop", &pop_block);
  m.def("_current_trace", &current_trace);
  m.def("_tracing_installed", [] { return callback_installed(tls); });
}

} // namespace torch_autobatch
