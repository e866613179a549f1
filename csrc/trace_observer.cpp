// The RecordFunction observer: the thread's tracing state (tls), the callback
// that records each outermost op (op_of, begin_op, end_op, on_start, on_end),
// its installation, and the trace() blocks (push_block, pop_block, current_trace).
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
#include "trace_record.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <exception>
#include <iterator>
#include <typeinfo>

namespace torch_autobatch::tracer {

thread_local ThreadState tls;

namespace {

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

// NOTE [Nested calls are not observed]
// Only the outermost op is recorded, but every dispatcher call the op makes
// inside (a linear's addmm, a custom op's aten ops, their own callees) would
// pay for a RecordFunction and a copy of its inputs and outputs, only for our
// callback to count its depth: on a small model that was most of what tracing
// cost. When ours is the only RecordFunction callback (no profiler, no
// other observer), RecordFunction is turned off on this thread for the
// outermost op's duration, and back on when it ends (on_end runs for it
// either way, exceptions included: the RecordFunction that started it ends
// it). Where another callback is installed, nothing is turned off: it sees
// every call as before. The depth count stays, so a call that slips through
// (a guard inside the op that turns RecordFunction back on) is still not
// recorded.
std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  auto& s = tls;
  const auto* op = op_of(s, fn);
  if (op == nullptr || op->transparent || s.depth++ != 0) {
    return nullptr;
  }
  if (internals::only_callback(s.handle)) {
    s.muted = true;
    at::enableRecordFunction(false);
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
  if (op == nullptr || op->transparent || s.depth == 0 || --s.depth != 0) {
    return;
  }
  if (s.muted) {
    s.muted = false;
    at::enableRecordFunction(true);
  }
  if (!s.trace) {
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

} // namespace

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

// ------------------------------------------------------------ trace() blocks
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

} // namespace torch_autobatch::tracer
