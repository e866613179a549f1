// What compiled autograd sees of an op's grad node: CustomOpNode's
// compiled_args and apply_with_saved (grad_node.h), and the Python object
// that stands for the node in the compiled backward
// (torch_autobatch/graphs/_compiled_autograd.py).
#include "grad_node.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

namespace torch_autobatch {

using torch::autograd::variable_list;
using torch::dynamo::autograd::CompiledNodeArgs;
using torch::dynamo::autograd::SwapSavedVariables;

// NOTE [Compiled autograd sees an autograd.Function]
// Compiled autograd asks each node of the graph for compiled_args (its cache
// key, and the tensors to lift into graph inputs) and, on a cache miss, runs
// apply_with_saved with the saved tensors swapped for proxies, to record the
// node's backward in an FX graph that Dynamo then compiles. A node whose
// backward is C++ code (CppNode) is recorded as a call bound to the first
// node's state, so its non-tensor state must all be in the key; ours runs
// the user's Python backward with a ctx of arbitrary attributes, which no
// key can hold. So the node presents itself as autograd.Function's PyNode
// does: compiled_args hands compiled autograd a fresh Python object for this
// node (a graph input, like a hook: _compiled_autograd.CompiledNode, which
// holds the op, the ctx and the node's slots and metadata), and
// apply_with_saved records `call_backward(that object, saved tensors,
// *grads)`. Dynamo then traces the user's backward into the compiled graph,
// guarding on what it reads of the object (the op, ctx attributes), as it
// does for an autograd.Function's ctx: a second op, or a changed attribute,
// recompiles instead of reusing a stale graph. What Dynamo cannot trace
// (numpy, our C++ checks of an unusual gradient) runs eagerly between
// compiled graphs, with the registered rule. The key holds what shapes the
// recorded graph: the op, the saved tensors (lifted to graph inputs), and
// per input and output whether it is defined, differentiable, and its
// metadata.

namespace {

// Python's handle on a grad node (autograd owns nodes by intrusive_ptr): it
// keeps the node alive while CompiledNode holds it.
struct NodeRef {
  c10::intrusive_ptr<torch::autograd::Node> node;
  CustomOpNode& get() const {
    return static_cast<CustomOpNode&>(*node);
  }
};

} // namespace

void CustomOpNode::compiled_args(CompiledNodeArgs& args) const {
  TORCH_CHECK(!released_, torch::autograd::ERR_BACKWARD_TWICE);
  TORCH_CHECK(
      level_ == 0, "torch_autobatch: compiled autograd reached the grad node of ", state_->qualname,
      " made at a torch.func grad level; compiled autograd runs .backward() of eager graphs "
      "only. Disable compiled autograd around this backward.");
  args.collect(state_->node_name);
  args.collect(saved_, true);
  args.collect(materialize_grads_);
  args.collect(differentiable_);
  args.collect(input_defined_);
  args.collect(num_passed_positional_);
  for (const auto& meta : logical_meta_) {
    args.collect(meta.options.device());
    args.collect(c10::typeMetaToScalarType(meta.options.dtype()));
    args.collect(meta.options.layout());
    args.collect_size(meta.sym_sizes.size());
    for (const auto& s : meta.sym_sizes) {
      args.collect(s.guard_int(__FILE__, __LINE__)); // specialised: NOTE above
    }
  }
  py::gil_scoped_acquire gil;
  try {
    py::object obj =
        py::module_::import("torch_autobatch.graphs._compiled_autograd")
            .attr("CompiledNode")(
                opdef_.get(), ctx_.get(), NodeRef{const_cast<CustomOpNode*>(this)->getptr()});
    args.collect_pynode_objs(
        this, c10::SafePyObject(obj.release().ptr(), getPyInterpreter()), std::nullopt, {});
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

variable_list CustomOpNode::apply_with_saved(
    const variable_list& inputs,
    SwapSavedVariables& saved) {
  saved.before(saved_);
  variable_list result;
  {
    py::gil_scoped_acquire gil;
    try {
      result = record_backward_call(inputs, saved);
    } catch (py::error_already_set& e) {
      rethrow_python_error(e);
    }
  }
  saved.after(saved_);
  return result;
}

variable_list CustomOpNode::record_backward_call(
    const variable_list& inputs,
    SwapSavedVariables& saved) {
  // Like autograd.Function's (PyNode::to_py_args): zeros for an unused
  // differentiable output, unless ctx.set_materialize_grads(False).
  py::tuple grads(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor g = inputs[i];
    if (!g.defined() && materialize_grads_ && differentiable_[i]) {
      g = input_metadata(i).zeros_like();
    }
    grads[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(g));
  }
  // What compiled autograd makes the recorded call's outputs of.
  py::tuple metas = edge_metadata();
  py::tuple saved_tensors(saved_.size());
  for (size_t i = 0; i < saved_.size(); ++i) {
    saved_tensors[i] =
        py::reinterpret_steal<py::object>(THPVariable_Wrap(saved_[i].unpack(getptr())));
  }
  auto [bwd_idx, state_idx, opaque] = saved.retrieve_pynode_objs(this);
  (void)state_idx;
  (void)opaque;
  py::object r =
      py::handle(saved.get_py_compiler())
          .attr("proxy_call_backward")(
              grads, metas, saved_tensors, bwd_idx,
              py::module_::import("torch_autobatch.graphs._compiled_autograd").attr("CompiledNode"),
              py::none(), py::list());
  variable_list out(logical_meta_.size());
  auto results = py::reinterpret_borrow<py::tuple>(r);
  for (size_t k = 0; k < out.size() && k < results.size(); ++k) {
    if (!results[k].is_none()) {
      out[k] = THPVariable_Unpack(results[k].ptr());
    }
  }
  return out;
}

py::tuple CustomOpNode::compiled_info() const {
  auto to_py = [](const std::vector<Slot>& slots) {
    py::tuple out(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      out[i] = py::make_tuple(slots[i].first, slots[i].count, slots[i].is_list);
    }
    return out;
  };
  return py::make_tuple(
      to_py(ret_slots_), to_py(arg_slots_), edge_metadata(), state_->returns_an_argument);
}

py::tuple CustomOpNode::edge_metadata() const {
  py::tuple edges(logical_meta_.size());
  for (size_t k = 0; k < logical_meta_.size(); ++k) {
    if (!input_defined_[k] || !next_edge(k).is_valid()) {
      edges[k] = py::none();
      continue;
    }
    const auto& meta = logical_meta_[k];
    py::tuple size(meta.sym_sizes.size());
    for (size_t d = 0; d < meta.sym_sizes.size(); ++d) {
      size[d] = py::int_(meta.sym_sizes[d].guard_int(__FILE__, __LINE__));
    }
    edges[k] = py::make_tuple(
        py::handle(reinterpret_cast<PyObject*>(torch::getTHPLayout(meta.options.layout()))),
        py::reinterpret_steal<py::object>(THPDevice_New(meta.options.device())),
        py::handle(
            reinterpret_cast<PyObject*>(
                torch::getTHPDtype(c10::typeMetaToScalarType(meta.options.dtype())))),
        size);
  }
  return edges;
}

void bind_compiled_autograd(py::module_& m) {
  py::class_<NodeRef>(m, "_CustomOpNode")
      .def(
          "compiled_info", [](const NodeRef& ref) { return ref.get().compiled_info(); },
          "(return slots, argument slots, edges, returns_an_argument): a slot is (first, count, "
          "is_list); an edge (layout, device, dtype, size) of the input, None where no gradient is "
          "wanted.")
      .def(
          "run_backward",
          [](NodeRef& ref, const py::sequence& saved, const py::sequence& grads) {
            auto tensors = [](const py::sequence& seq) {
              std::vector<at::Tensor> out;
              out.reserve(py::len(seq));
              for (py::handle t : seq) {
                out.push_back(t.is_none() ? at::Tensor() : THPVariable_Unpack(t.ptr()));
              }
              return out;
            };
            variable_list grads_in = tensors(grads);
            std::vector<at::Tensor> saved_in = tensors(saved);
            variable_list out;
            {
              py::gil_scoped_release no_gil;
              out = ref.get().run_backward(std::move(saved_in), std::move(grads_in));
            }
            py::tuple result(out.size());
            for (size_t k = 0; k < out.size(); ++k) {
              result[k] = py::reinterpret_steal<py::object>(THPVariable_Wrap(out[k]));
            }
            return result;
          },
          "What apply() returns, given the saved tensors and the incoming gradients: the "
          "eager backward, re-entering the vmap levels the forward ran under.")
      .def_property_readonly(
          "has_frames", [](const NodeRef& ref) { return ref.get().has_frames(); })
      .def(
          "input_grads",
          [](const NodeRef& ref, py::handle result) {
            variable_list grads = ref.get().checked_input_grads(result);
            py::tuple out(grads.size());
            for (size_t k = 0; k < grads.size(); ++k) {
              out[k] = py::reinterpret_steal<py::object>(THPVariable_Wrap(grads[k]));
            }
            return out;
          },
          "The per-input gradients apply() would return for the backward's `result`, "
          "checked as apply() checks them (one per next edge, None where none).");
}

} // namespace torch_autobatch
