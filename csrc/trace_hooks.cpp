// The autograd node hooks: NodeHook (a traced node's backward records into its
// trace), AccHook (an AccumulateGrad run is listed as `%w.grad += %g`), and the
// TraceImpl methods that hook the nodes an op made.
#include "trace_record.h"

#include <algorithm>
#include <typeinfo>

namespace torch_autobatch::tracer {
namespace {

using internals::kAccumulateGradSeq;

const std::string* const accumulate_grad_name = intern_name("AccumulateGrad");

std::mutex acc_hook_mutex;

// Adds the (shared) AccHook to `n` if it is an AccumulateGrad without one:
// NOTE [AccumulateGrad runs].
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

} // namespace

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
variable_list NodeHook::operator()(const variable_list& grads) {
  auto& s = tls;
  ensure_callback(s);
  const int64_t task = internals::current_graph_task_id();
  const auto node = internals::current_node();
  trace->run_group({task, index, 0}, index, [&] { return node ? node->name() : std::string("?"); });
  auto& tasks = s.task_traces;
  auto it =
      std::find_if(tasks.begin(), tasks.end(), [&](const auto& p) { return p.first == task; });
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

// NOTE [Finding the nodes an op created]
// We run above autograd: when an op returns, its outputs have their
// grad_fn. The nodes the op created are those reachable from them with a
// sequence number taken during the op on this thread (an in-place op on a
// view makes two: the view's new grad_fn and, under it, the CopySlices of
// its base; hooks on the node CopySlices wraps never fire). The walk stops at
// older nodes, so each op costs what it made. Nodes made outside any op
// (torch.autograd.Function.apply's) are found when their output is next
// used (`use`).
int32_t TraceImpl::tag_new(const c10::intrusive_ptr<Node>& root, uint64_t start_seq) {
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

} // namespace torch_autobatch::tracer
