// The record: the op registry (OpInfo), interned names, and the TraceImpl
// methods that turn an op's arguments and results into values (the
// declarations: trace_record.h).
// functorch.h first: its ATen/functorch headers are ambiguous (isBatchedTensor)
// after ATen/LegacyBatchedTensorImpl.h, which torch_internals.h brings in.
#include "functorch.h"

#include "trace_record.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/irange.h>

#include <atomic>
#include <deque>
#include <map>

namespace torch_autobatch::tracer {
namespace {

const c10::DispatchKeySet kTransformKeys(
    {c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
     c10::DispatchKey::BatchedNestedTensor});

std::mutex ops_mutex;
std::deque<OpInfo> ops; // never shrinks: OpInfo addresses are stable
std::map<std::pair<std::string, std::string>, OpInfo*> ops_by_name;

std::atomic<int64_t> next_trace_id{0};

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

} // namespace

// ------------------------------------------------------------------ operators
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
    ops.push_back(
        OpInfo{
            static_cast<int32_t>(ops.size()), name.name, name.overload_name, transparent,
            name.name == "aten::lift_fresh" || name.name == "aten::lift",
            handle && handle->hasSchema() ? &handle->schema() : nullptr});
    op = &ops.back();
  }
  return op;
}

std::pair<std::string, std::string> op_name(int32_t id) {
  std::lock_guard<std::mutex> lock(ops_mutex);
  const auto& op = ops.at(static_cast<size_t>(id));
  return {op.name, op.overload};
}

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

// ---------------------------------------------------------------- the record
// Room for a small trace made up front, so that a block of a few hundred
// ops grows nothing while tensors come and go (NOTE [The record allocates
// little]).
TraceImpl::TraceImpl() : id(next_trace_id++) {
  values.reserve(512);
  entries.reserve(256);
  ints.reserve(512);
  ids.reserve(512);
  saved.reserve(128);
}

int32_t TraceImpl::new_value(const at::Tensor& t, int32_t num) {
  values.push_back(Value{num, -1, -1, Layout(t)});
  const auto v = static_cast<int32_t>(values.size() - 1);
  ids[t.unsafeGetTensorImpl()] = v;
  return v;
}

int32_t TraceImpl::add_input(const at::Tensor& t, std::string name, bool in_backward) {
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
void TraceImpl::note_saved(int32_t v) {
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

int32_t TraceImpl::saved_value(const at::Tensor& t) {
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

int32_t TraceImpl::use(const at::Tensor& t, bool in_backward) {
  saw_transform = saw_transform || t.key_set().has_any(kTransformKeys);
  const auto it = ids.find(t.unsafeGetTensorImpl());
  int32_t v = it != ids.end() && values[it->second].layout.matches(t) ? it->second : saved_value(t);
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

c10::IValue
TraceImpl::record(const c10::IValue& iv, bool out, uint32_t pos, Refs& refs, bool in_backward) {
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

int32_t TraceImpl::pass_of(int64_t task) {
  const auto it = passes.find(task);
  if (it != passes.end()) {
    return it->second;
  }
  const auto pass = static_cast<int32_t>(passes.size() + 1);
  passes.emplace(task, pass);
  return pass;
}

} // namespace torch_autobatch::tracer
