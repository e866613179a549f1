// The torch internals the tracer (trace_*.cpp) and register_vjp's backward
// (vjp_residuals.cpp) rely on that are not public or stable C++ API: the
// RecordFunction thread-local callbacks, the engine's current node and graph
// task, sequence numbers, AccumulateGrad, the hook lists of autograd nodes,
// c10's untyped list. This is the one place to fix when a torch release
// moves or changes them (as of torch 2.13 to 2.15: NOTE [Supported torch
// window], torch_autobatch/_version.py); those .cpp files reach them only
// through the names below. (functorch's internals have their own wrapper:
// functorch.h.)
#pragma once

#include <ATen/SequenceNumber.h>
#include <ATen/core/List.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
// (brings in ATen/LegacyBatchedTensorImpl.h: a file that uses functorch.h too
// includes that first, or functorch's headers fail to compile)
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace torch_autobatch::internals {

using Node = torch::autograd::Node;
using FunctionPreHook = torch::autograd::FunctionPreHook;
using variable_list = torch::autograd::variable_list;
using CallbackHandle = at::CallbackHandle;

// AccumulateGrad's sequence_nr: its constructor gives it UINT64_MAX, so that
// the engine runs it after every other node ready at the same time.
constexpr uint64_t kAccumulateGradSeq = UINT64_MAX;

// ------------------------------------------------------------ the engine
// The node the autograd engine is evaluating on this thread (for its
// pre-hooks, its backward and the gradient sums it feeds), or null.
inline c10::intrusive_ptr<Node> current_node() {
  return torch::autograd::get_current_node();
}

// The id of the backward call (graph task) running on this thread; -1: none.
inline int64_t current_graph_task_id() {
  return torch::autograd::get_current_graph_task_id();
}

// Does the backward call running on this thread keep its graph
// (retain_graph)? True where none runs.
inline bool current_graph_task_keeps_graph() {
  return torch::autograd::get_current_graph_task_keep_graph();
}

// The sequence_nr the next node made on this thread will get.
inline uint64_t next_sequence_nr() {
  return at::sequence_number::peek();
}

// This thread's id as Node::thread_id() records it for the nodes made here.
inline uint64_t current_thread_id() {
  return at::RecordFunction::currentThreadId();
}

// ------------------------------------------------------------ nodes
inline const std::vector<std::unique_ptr<FunctionPreHook>>& pre_hooks(const Node& n) {
  return n.pre_hooks();
}

inline void add_pre_hook(Node& n, std::unique_ptr<FunctionPreHook> hook) {
  n.add_pre_hook(std::move(hook));
}

inline bool is_accumulate_grad(const Node& n) {
  return n.sequence_nr() == kAccumulateGradSeq &&
         dynamic_cast<const torch::autograd::AccumulateGrad*>(&n) != nullptr;
}

// The leaf an AccumulateGrad accumulates into; nullptr if `n` is none.
inline const at::Tensor* accumulated_leaf(const Node* n) {
  const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(n);
  return acc == nullptr ? nullptr : &acc->variable;
}

// ------------------------------------------------------------ RecordFunction
inline CallbackHandle add_thread_local_callback(at::RecordFunctionCallback callback) {
  return at::addThreadLocalCallback(std::move(callback));
}

inline void remove_callback(CallbackHandle handle) {
  at::removeCallback(handle);
}

// Is the thread-local callback `handle` installed on this thread now? (The
// engine restores a thread's callbacks after each node it evaluates: NOTE [How
// a node records its backward], trace_hooks.cpp.)
inline bool thread_local_callback_installed(CallbackHandle handle) {
  for (const auto& entry : at::get_record_function_tls_().sorted_tls_callbacks_) {
    if (entry.handle_ == handle) {
      return true;
    }
  }
  return false;
}

// Is `handle` the only RecordFunction callback that would see a call on this
// thread (no global callback, no other thread-local one)?
inline bool only_callback(CallbackHandle handle) {
  const auto& callbacks = at::get_record_function_tls_().sorted_tls_callbacks_;
  return !at::hasGlobalCallbacks() && callbacks.size() == 1 && callbacks[0].handle_ == handle;
}

// ------------------------------------------------------------ IValues
// An empty list of any IValues (c10::impl::GenericList, the type of an
// IValue's list): its untyped constructor is not public API.
inline c10::List<c10::IValue> any_list() {
  return c10::impl::GenericList(c10::AnyType::get());
}

} // namespace torch_autobatch::internals
