// The grad node of a torch_autobatch operator: what setup_context saves, and
// the backward that calls the user's (grad_node.h).
#include "grad_node.h"

#include "functorch.h"
#include "torch_internals.h"
#include "vmap_frames.h"

#include <ATen/ExpandUtils.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <sstream>

namespace torch_autobatch {

using torch::autograd::Node;
using torch::autograd::variable_list;

// NOTE [Saved tensors belong to the call]
// ctx.saved_tensors is read inside the user's backward (and jvp), but the ctx
// is shared: by every run of the node (two threads may run backward(retain_
// graph=True) of one graph at once), and by the nodes the batched kernel
// attaches at each autograd level, each with the saved tensors of its own
// level, batched at the vmap levels its run re-entered. So the saved tensors
// are never stored on the ctx: each call pushes (ctx, saved) on a
// thread-local stack for its duration (SavedTensorsScope), and the
// descriptor that BackwardContext.saved_tensors is looks up the innermost
// entry of this thread for that ctx. Per call, in C, with no Python frame; a
// read outside any call (setup_context, after the backward) finds no entry and
// raises, as autograd.Function's does. A thread the user's backward starts
// itself does not see the call's saved tensors: read them first.
namespace {

struct SavedCall {
  PyObject* ctx; // borrowed: the scope's owner holds it
  PyObject* saved; // owned by the entry
};
thread_local std::vector<SavedCall> t_saved_calls;

PyObject* saved_tensors_get(PyObject* self, PyObject* obj, PyObject* /*type*/) {
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(self);
    return self;
  }
  for (auto it = t_saved_calls.rbegin(); it != t_saved_calls.rend(); ++it) {
    if (it->ctx == obj) {
      Py_INCREF(it->saved);
      return it->saved;
    }
  }
  PyErr_SetString(
      PyExc_RuntimeError,
      "ctx.saved_tensors is only available inside the backward function; "
      "call ctx.save_for_backward(...) in setup_context to save tensors.");
  return nullptr;
}

int saved_tensors_set(PyObject* /*self*/, PyObject* obj, PyObject* /*value*/) {
  // An AttributeError with name and obj set, so that op/_custom_op.py can tell
  // this one apart and name the op (CustomOpDef._call_setup_context).
  py::gil_scoped_acquire gil;
  try {
    py::dict kwargs;
    kwargs["name"] = "saved_tensors";
    kwargs["obj"] = py::handle(obj);
    py::object err = py::handle(PyExc_AttributeError)(
        "ctx.saved_tensors is read-only, as autograd.Function's: call "
        "ctx.save_for_backward(*tensors) instead.",
        **kwargs);
    PyErr_SetObject(PyExc_AttributeError, err.ptr());
  } catch (py::error_already_set& e) {
    e.restore();
  }
  return -1;
}

PyObject* make_saved_tensors_type() {
  static PyType_Slot slots[] = {
      {Py_tp_descr_get, reinterpret_cast<void*>(&saved_tensors_get)},
      {Py_tp_descr_set, reinterpret_cast<void*>(&saved_tensors_set)},
      {Py_tp_doc,
       const_cast<char*>("ctx.saved_tensors: what setup_context passed to save_for_backward, "
                         "readable inside the backward (and jvp) call only (NOTE [Saved "
                         "tensors belong to the call], csrc/grad_node.cpp).")},
      {0, nullptr},
  };
  static PyType_Spec spec = {
      "torch_autobatch._C._SavedTensors", sizeof(PyObject), 0, Py_TPFLAGS_DEFAULT, slots,
  };
  return PyType_FromSpec(&spec);
}

} // namespace

SavedTensorsScope::SavedTensorsScope(py::handle ctx, py::handle saved) {
  t_saved_calls.push_back({ctx.ptr(), saved.inc_ref().ptr()});
}

SavedTensorsScope::~SavedTensorsScope() {
  // Scopes nest on a thread: this one is the last entry.
  Py_DECREF(t_saved_calls.back().saved);
  t_saved_calls.pop_back();
}

void bind_saved_tensors(py::module_& m) {
  m.def(
      "_backward_level", &backward_level,
      "The functorch level of the grad node whose backward runs now (0: the base).");
  m.def(
      "_graph_task_keeps_graph", &internals::current_graph_task_keeps_graph,
      "Whether the backward call (graph task) running on this thread keeps its graph "
      "(retain_graph, create_graph's default); True where none runs. With grad mode on, "
      "the node's own grad level may differentiate the backward's result again "
      "(NOTE [vmap presets: the calling convention]).");
  PyObject* type = make_saved_tensors_type();
  if (type == nullptr) {
    throw py::error_already_set();
  }
  m.add_object("_SavedTensors", py::reinterpret_steal<py::object>(type));
  m.def(
      "_call_with_saved_tensors",
      [](py::handle fn, py::handle ctx, py::handle saved, py::args args) {
        SavedTensorsScope scope(ctx, saved);
        py::tuple call(args.size() + 1);
        call[0] = ctx;
        for (size_t i = 0; i < args.size(); ++i) {
          call[i + 1] = args[i];
        }
        return fn(*call);
      },
      "fn(ctx, *args) with ctx.saved_tensors == saved for the call's duration "
      "(NOTE [Saved tensors belong to the call]).");
}

CustomOpNode::CustomOpNode(
    std::shared_ptr<OpState> state,
    std::vector<Slot> arg_slots,
    std::vector<Slot> ret_slots,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& logical_inputs,
    std::vector<VmapFrame> frames,
    size_t num_passed_positional)
    : Node(torch::autograd::collect_next_edges(inputs)),
      state_(std::move(state)),
      arg_slots_(std::move(arg_slots)),
      ret_slots_(std::move(ret_slots)),
      frames_(std::move(frames)),
      num_passed_positional_(num_passed_positional) {
  logical_meta_.reserve(logical_inputs.size());
  for (const auto& t : logical_inputs) {
    // (an undefined entry: a Tensor?[]'s None, which gets no gradient)
    logical_meta_.push_back(
        t.defined() ? torch::autograd::TypeAndSize(t) : torch::autograd::TypeAndSize());
    input_defined_.push_back(t.defined());
  }
}

void CustomOpNode::set_history(const std::vector<at::Tensor>& outputs) {
  differentiable_.reserve(outputs.size());
  std::vector<bool> returned; // empty unless the op returns an argument (hot path)
  if (state_->returns_an_argument) {
    returned = returned_arguments(*state_, ret_slots_, outputs.size());
  }
  for (size_t k = 0; k < outputs.size(); ++k) {
    const at::Tensor& out = outputs[k];
    const bool diff = out.defined() && torch::autograd::isDifferentiableType(out.scalar_type());
    if (diff && !returned.empty() && returned[k]) {
      // A returned mutated argument: its history moves onto this node, as an
      // in-place op's does (a view's base gets a CopySlices): NOTE
      // [Returned mutated arguments].
      const auto nr = add_input_metadata(out);
      torch::autograd::impl::rebase_history(out, {getptr(), nr});
    } else if (diff) {
      torch::autograd::set_history(out, getptr());
    } else {
      add_input_metadata(Node::undefined_input());
    }
    differentiable_.push_back(diff);
  }
  outputs_for_saving_ = outputs;
}

void CustomOpNode::save(
    py::handle ctx,
    const std::vector<at::Tensor>& saved,
    const std::vector<at::Tensor>& outputs,
    const std::vector<bool>& non_differentiable) {
  // Like autograd.Function: a non-differentiable output keeps its slot (its
  // gradient arrives as zeros or None) but gets no history.
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (non_differentiable[k] && outputs[k].defined()) {
      torch::autograd::impl::set_gradient_edge(outputs[k], torch::autograd::Edge());
    }
  }
  materialize_grads_ = ctx.attr(py_names().materialize_grads).cast<bool>();
  saved_.reserve(saved.size());
  for (const auto& t : saved) {
    if (!t.defined()) {
      saved_.emplace_back();
      continue;
    }
    // An output is saved without its grad_fn (this node): no reference cycle.
    const bool is_output = std::any_of(
        outputs_for_saving_.begin(), outputs_for_saving_.end(), [&](const at::Tensor& out) {
          return out.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
        });
    saved_.emplace_back(t, is_output);
  }
  outputs_for_saving_.clear();
  ctx_ = PyRef(py::reinterpret_borrow<py::object>(ctx));
  // The node may outlive the op object (a redefined op, a dropped
  // reference): its backward still runs (NOTE [Kernels die with their op]).
  opdef_ = PyRef(state_->opdef());
}

void CustomOpNode::release_variables() {
  // Like autograd.Function: only saved tensors are freed (a second backward
  // through a node that saved none is fine); ctx's attributes stay.
  std::lock_guard<std::mutex> lock(mutex_);
  released_ = released_ || !saved_.empty();
  saved_.clear();
}

variable_list CustomOpNode::apply(variable_list&& grads) {
  std::vector<at::Tensor> saved;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!released_, torch::autograd::ERR_BACKWARD_TWICE);
    saved.reserve(saved_.size());
    for (const auto& sv : saved_) {
      saved.push_back(sv.unpack(getptr()));
    }
  }
  return run_backward(std::move(saved), std::move(grads));
}

variable_list CustomOpNode::run_backward(std::vector<at::Tensor> saved, variable_list grads) {
  // The backward may run after the levels it was made under have exited
  // (vmap(vjp(op)): the pullback runs outside vjp's level).
  for (auto* ts : {&saved, &grads}) {
    for (auto& t : *ts) {
      if (t.defined()) {
        t = functorch::strip_dead_wrappers(std::move(t));
      }
    }
  }
  // Like autograd.Function: an unused differentiable output gets zeros
  // (unless ctx.set_materialize_grads(False)).
  for (size_t i = 0; i < grads.size() && materialize_grads_; ++i) {
    if (!grads[i].defined() && differentiable_[i]) {
      grads[i] = input_metadata(i).zeros_like();
    }
  }

  // NOTE [Free batching rule], backward half: the user's backward sees each
  // example's shapes and runs batched (NOTE [Re-entering the vmap levels]).
  ReenteredFrames levels(frames_);
  levels.enter(grads, &VmapFrame::out_bdims);
  levels.enter(saved, &VmapFrame::saved_bdims);
  variable_list out = call_backward(saved, grads);
  saved.clear();
  grads.clear();
  levels.leave(out, &VmapFrame::in_bdims);
  return out;
}

namespace {
thread_local int64_t t_backward_level = 0;
} // namespace

int64_t backward_level() {
  return t_backward_level;
}

variable_list CustomOpNode::call_backward(
    const std::vector<at::Tensor>& saved,
    const variable_list& grads) const {
  py::gil_scoped_acquire gil;
  try {
    TORCH_INTERNAL_ASSERT(opdef_, "the grad node of ", state_->qualname, " was never saved");
    py::tuple py_saved(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      py_saved[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(saved[i]));
    }
    SavedTensorsScope scope(ctx_.get(), py_saved);
    const int64_t outer_level = t_backward_level;
    t_backward_level = level_;
    struct Restore {
      int64_t level;
      ~Restore() {
        t_backward_level = level;
      }
    } restore{outer_level};
    py::object result =
        call_method(opdef_.get(), py_names().run_backward, {ctx_.get(), wrap_grads(grads)});
    return unwrap_input_grads(result);
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

py::tuple CustomOpNode::wrap_grads(const variable_list& grads) const {
  return slots_to_py(grads, ret_slots_, [](size_t) { return py::none(); });
}

void CustomOpNode::fail_backward(const std::string& what) const {
  std::string fn = py::str(opdef_.get().attr(py_names().backward_fn_name));
  TORCH_CHECK(false, "torch_autobatch: the backward of ", state_->qualname, " (", fn, ") ", what);
}

variable_list CustomOpNode::unwrap_input_grads(py::handle result) const {
  const auto& arg_names = state_->arg_names;
  auto res = py::reinterpret_borrow<py::tuple>(result);
  // One gradient per input, or (as torch.library counts them) per argument
  // the call passed: the inputs left to their defaults then get None, which
  // is right only if none of them needs a gradient.
  bool per_passed = res.size() == num_passed_positional_ && res.size() < arg_slots_.size();
  for (size_t a = res.size(); per_passed && a < arg_slots_.size(); ++a) {
    for (size_t k = arg_slots_[a].first; k < arg_slots_[a].first + arg_slots_[a].count; ++k) {
      per_passed = per_passed && !next_edge(k).is_valid();
    }
  }
  if (res.size() != arg_slots_.size() && !per_passed) {
    std::ostringstream names;
    for (size_t a = 0; a < arg_names.size(); ++a) {
      names << (a ? ", " : "") << arg_names[a];
    }
    fail_backward(
        "returned " + std::to_string(res.size()) + " gradient(s), but the op has " +
        std::to_string(arg_slots_.size()) + " input(s) (" + names.str() +
        "). Return one gradient per input, None for non-tensor inputs and for "
        "inputs that need no gradient.");
  }
  variable_list out(logical_meta_.size());
  for (size_t a = 0; a < res.size(); ++a) {
    const Slot& s = arg_slots_[a];
    py::handle g = res[a];
    if (g.is_none()) {
      require_gradient_of_returned_argument(a);
      continue;
    }
    if (s.count == 0 && !s.is_list) {
      fail_backward(
          "returned a value of type " + std::string(py::str(py::type::of(g).attr("__name__"))) +
          " for input '" + arg_names[a] +
          "', which is not a Tensor (or was None). Return None for it.");
    }
    if (!s.is_list) {
      out[s.first] = check_input_grad(g, s.first, a);
      continue;
    }
    if (!py::isinstance<py::sequence>(g) || py::len(g) != s.count) {
      fail_backward(
          "returned " + std::string(py::str(py::repr(g))) + " for input '" + arg_names[a] +
          "', a list of " + std::to_string(s.count) + " tensors. Return a list of " +
          std::to_string(s.count) + " gradients (Tensor or None), or None.");
    }
    auto seq = py::reinterpret_borrow<py::sequence>(g);
    for (size_t k = 0; k < s.count; ++k) {
      if (!seq[k].is_none()) {
        out[s.first + k] = check_input_grad(seq[k], s.first + k, a);
      }
    }
  }
  return out;
}

void CustomOpNode::require_gradient_of_returned_argument(size_t arg) const {
  // NOTE [Mutating ops]: the op mutated and returned this argument, which
  // required grad; a None would silently drop its history's gradient.
  if (!state_->returns_an_argument) {
    return;
  }
  const auto& aliases = state_->return_aliases;
  if (std::find(aliases.begin(), aliases.end(), static_cast<int64_t>(arg)) == aliases.end()) {
    return;
  }
  const Slot& s = arg_slots_[arg];
  for (size_t k = s.first; k < s.first + s.count; ++k) {
    if (next_edge(k).is_valid()) {
      fail_backward(
          "returned None for input '" + state_->arg_names[arg] +
          "', which the op mutates and returns, and which required grad before the "
          "call. Return its gradient with respect to its value before the mutation "
          "(for x.add_(y): the incoming gradient).");
    }
  }
}

at::Tensor CustomOpNode::check_input_grad(py::handle grad, size_t edge, size_t arg) const {
  if (!input_defined_[edge]) {
    return at::Tensor(); // a None entry of a Tensor?[]: nothing to differentiate
  }
  const std::string& arg_name = state_->arg_names[arg];
  if (!THPVariable_Check(grad.ptr())) {
    fail_backward(
        "returned a value of type " + std::string(py::str(py::type::of(grad).attr("__name__"))) +
        " as the gradient of input '" + arg_name + "'; expected a Tensor or None.");
  }
  at::Tensor g = THPVariable_Unpack(grad.ptr());
  const auto& meta = logical_meta_[edge];
  if (!g.sym_sizes().equals(meta.sym_sizes)) {
    // As the autograd engine does (validate_outputs): a gradient of a shape
    // the input broadcasts to is summed back to the input's shape.
    if (!at::is_expandable_to(meta.sym_sizes, g.sym_sizes())) {
      std::ostringstream msg;
      msg << "returned a gradient of shape " << g.sym_sizes() << " for input '" << arg_name
          << "', which has shape " << c10::SymIntArrayRef(meta.sym_sizes)
          << ". Return a gradient of the input's shape, or of a shape the input "
             "broadcasts to (it is then summed to the input's shape).";
      fail_backward(msg.str());
    }
    g = at::sum_to(std::move(g), meta.sym_sizes);
  }
  const auto dtype = c10::typeMetaToScalarType(meta.options.dtype());
  if (g.scalar_type() != dtype && state_->cast_grad_dtypes.load(std::memory_order_relaxed)) {
    g = g.to(dtype);
  } else if (g.scalar_type() != dtype) {
    std::ostringstream msg;
    msg << "returned a gradient of dtype " << g.scalar_type() << " for input '" << arg_name
        << "', which has dtype " << dtype << ". Cast it with .to(input.dtype).";
    fail_backward(msg.str());
  }
  // An input that does not require grad has no edge: drop its gradient.
  return next_edge(edge).is_valid() ? g : at::Tensor();
}

py::object call_setup_context(
    const OpState& state,
    const c10::FunctionSchema& schema,
    c10::ArrayRef<c10::IValue> args,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<at::Tensor>& outputs,
    const std::vector<bool>& needs_input_grad,
    std::vector<at::Tensor>& saved,
    std::vector<bool>& non_differentiable) {
  try {
    // NOTE [Op values reach Python by their schema type]
    py::tuple py_args = to_py_tuple(args, schema.arguments());
    py::tuple needs(args.size());
    for (size_t a = 0; a < args.size(); ++a) {
      needs[a] = py::bool_(needs_input_grad[a]);
    }
    py::object py_output;
    if (returns.size() == 1) {
      py_output = to_py(returns[0], *schema.returns()[0].real_type());
    } else {
      py_output = to_py_tuple(returns, schema.returns());
    }
    const PyNames& names = py_names();
    py::object ctx = call_method(state.opdef(), names.setup_autograd, {py_args, py_output, needs});
    // NOTE [ctx is torch's FunctionCtx] (core/_autograd.py): what its methods recorded.
    py::object to_save = ctx.attr(names.to_save);
    if (!to_save.is_none()) {
      // ctx.save_for_backward is torch's own (NOTE [The per-call Python of a
      // grad node]): what it recorded is checked here.
      size_t index = 0;
      for (py::handle item : to_save) {
        const size_t i = index++;
        if (item.is_none()) {
          saved.emplace_back();
          continue;
        }
        if (!THPVariable_Check(item.ptr())) {
          const std::string msg = "ctx.save_for_backward: argument " + std::to_string(i) +
                                  " is of type " +
                                  std::string(py::str(py::type::handle_of(item).attr("__name__"))) +
                                  "; it saves tensors or None only. Store other values as "
                                  "attributes instead (ctx.name = value).";
          PyErr_SetString(PyExc_TypeError, msg.c_str());
          throw py::error_already_set();
        }
        saved.push_back(THPVariable_Unpack(item.ptr()));
      }
      ctx.attr(names.to_save) = py::none();
    }
    non_differentiable.assign(outputs.size(), false);
    py::object marked = ctx.attr(names.non_differentiable);
    if (!marked.is_none()) {
      for (py::handle item : marked) {
        const auto* impl = THPVariable_Check(item.ptr())
                               ? THPVariable_Unpack(item.ptr()).unsafeGetTensorImpl()
                               : nullptr;
        bool found = false;
        for (size_t k = 0; k < outputs.size(); ++k) {
          if (outputs[k].defined() && outputs[k].unsafeGetTensorImpl() == impl) {
            non_differentiable[k] = found = true;
          }
        }
        TORCH_CHECK(
            found, "torch_autobatch: the setup_context of ", state.qualname,
            " passed ctx.mark_non_differentiable a value that is not one of the "
            "op's outputs; pass output tensors only.");
      }
    }
    return ctx;
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

} // namespace torch_autobatch
