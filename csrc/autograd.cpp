// The Autograd-key kernel of every torch_autobatch operator, and the grad node
// it attaches.
//
// NOTE [Why our own Autograd kernel]
// torch.library.custom_op wraps the user's backward in an autograd.Function
// whose forward takes ctx; torch.func refuses that ("must override the
// setup_context staticmethod") and forward-mode AD silently sees zeros. A C++
// kernel at the Autograd alias key that (1) redispatches below
// ADInplaceOrView, so the user's Python forward runs once and is never
// recorded, and (2) attaches a plain autograd Node, is what every functorch
// Grad level expects: functorch re-enables the Autograd keys per level and our
// kernel runs once per level, on that level's TensorWrappers.
#include "autobatch.h"
#include "functorch.h"
#include "grad_node.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ExpandUtils.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <mutex>
#include <sstream>

namespace torch_autobatch {

void PyRef::reset() {
  if (obj_ == nullptr) {
    return;
  }
  // At interpreter shutdown the object is leaked rather than touched.
  if (Py_IsInitialized() && !_Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    Py_DECREF(obj_);
  }
  obj_ = nullptr;
}

const PyNames& py_names() {
  static const PyNames names{
      PyUnicode_InternFromString("_setup_autograd"),
      PyUnicode_InternFromString("_run_backward"),
      PyUnicode_InternFromString("to_save"),
      PyUnicode_InternFromString("non_differentiable"),
      PyUnicode_InternFromString("materialize_grads"),
  };
  return names;
}

py::object call_method(py::handle self, PyObject* name, std::initializer_list<py::handle> args) {
  // self, then the arguments: PyObject_VectorcallMethod's layout.
  c10::SmallVector<PyObject*, 6> argv;
  argv.push_back(self.ptr());
  for (py::handle a : args) {
    argv.push_back(a.ptr());
  }
  PyObject* out = PyObject_VectorcallMethod(name, argv.data(), argv.size(), nullptr);
  if (out == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(out);
}

void rethrow_python_error(py::error_already_set& e) {
  // Hand the exception over as torch's python_error: torch's bindings and the
  // autograd engine re-raise it in Python unchanged (type, message, traceback)
  // on whatever thread the op or the backward was called from.
  py::gil_scoped_acquire gil;
  e.restore();
  ::python_error err;
  err.persist();
  throw err;
}

std::vector<Slot> flatten_tensors(
    c10::ArrayRef<c10::IValue> values,
    std::vector<at::Tensor>& tensors) {
  std::vector<Slot> slots;
  slots.reserve(values.size());
  for (const auto& v : values) {
    Slot slot{tensors.size(), 0, false};
    if (v.isTensor()) {
      tensors.push_back(v.toTensor());
      slot.count = 1;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        tensors.push_back(t);
      }
      slot.count = tensors.size() - slot.first;
      slot.is_list = true;
    }
    slots.push_back(slot);
  }
  return slots;
}

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

bool aliases(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) {
    return false;
  }
  if (a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl()) {
    return true;
  }
  // BatchedTensors and TensorWrappers may have no storage of their own.
  const auto pa = functorch::innermost(a);
  const auto pb = functorch::innermost(b);
  return pa.has_storage() && pb.has_storage() && pa.is_alias_of(pb);
}

} // namespace

std::optional<Aliasing> find_aliasing(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs) {
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (size_t p = 0; p < o; ++p) {
      if (aliases(outputs[o], outputs[p])) {
        return Aliasing{o, p};
      }
    }
    for (const auto& in : inputs) {
      if (aliases(outputs[o], in)) {
        return Aliasing{o, std::nullopt};
      }
    }
  }
  return std::nullopt;
}

CustomOpNode::CustomOpNode(
    std::shared_ptr<OpState> state,
    std::vector<Slot> arg_slots,
    std::vector<Slot> ret_slots,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& logical_inputs,
    std::vector<VmapFrame> frames)
    : Node(torch::autograd::collect_next_edges(inputs)),
      state_(std::move(state)),
      arg_slots_(std::move(arg_slots)),
      ret_slots_(std::move(ret_slots)),
      frames_(std::move(frames)) {
  logical_meta_.reserve(logical_inputs.size());
  for (const auto& t : logical_inputs) {
    logical_meta_.emplace_back(t);
  }
}

void CustomOpNode::set_history(const std::vector<at::Tensor>& outputs) {
  differentiable_.reserve(outputs.size());
  for (const auto& out : outputs) {
    const bool diff = out.defined() &&
        torch::autograd::isDifferentiableType(out.scalar_type());
    if (diff) {
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
        outputs_for_saving_.begin(),
        outputs_for_saving_.end(),
        [&](const at::Tensor& out) {
          return out.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
        });
    saved_.emplace_back(t, is_output);
  }
  outputs_for_saving_.clear();
  ctx_ = PyRef(py::reinterpret_borrow<py::object>(ctx));
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

  // NOTE [Free batching rule], backward half: re-enter the vmap levels that
  // were above this node in the forward, outermost first, so the user's
  // backward sees each example's shapes and runs batched.
  std::vector<std::unique_ptr<functorch::VmapLevelGuard>> levels;
  for (const auto& f : frames_) {
    levels.push_back(std::make_unique<functorch::VmapLevelGuard>(
        f.batch_size, static_cast<functorch::RandomnessType>(f.randomness)));
    const int64_t lvl = levels.back()->level();
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) {
        grads[i] = at::functorch::makeBatched(grads[i], f.out_bdims[i], lvl);
      }
    }
    for (size_t i = 0; i < saved.size(); ++i) {
      if (saved[i].defined()) {
        saved[i] = at::functorch::makeBatched(saved[i], f.saved_bdims[i], lvl);
      }
    }
  }

  variable_list out;
  {
    py::gil_scoped_acquire gil;
    try {
      py::tuple py_saved(saved.size());
      for (size_t i = 0; i < saved.size(); ++i) {
        py_saved[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(saved[i]));
      }
      py::object result = call_method(
          state_->opdef.get(), py_names().run_backward, {ctx_.get(), py_saved, wrap_grads(grads)});
      out = unwrap_input_grads(result);
    } catch (py::error_already_set& e) {
      rethrow_python_error(e);
    }
  }
  saved.clear();
  grads.clear();

  // Back to this node's level, innermost vmap level first.
  for (size_t k = frames_.size(); k-- > 0;) {
    const VmapFrame& f = frames_[k];
    std::vector<std::optional<int64_t>> have(out.size());
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].defined()) {
        std::tie(out[i], have[i]) =
            at::functorch::unwrapTensorAtLevel(out[i], levels[k]->level());
      }
    }
    levels[k]->pop();
    levels.pop_back();
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].defined()) {
        out[i] = functorch::match_bdim(out[i], have[i], f.in_bdims[i], f.batch_size);
      }
    }
  }
  return out;
}

py::tuple CustomOpNode::wrap_grads(const variable_list& grads) const {
  auto wrap = [](const at::Tensor& t) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  };
  py::tuple out(ret_slots_.size());
  for (size_t r = 0; r < ret_slots_.size(); ++r) {
    const Slot& s = ret_slots_[r];
    if (s.is_list) {
      py::list l(s.count);
      for (size_t k = 0; k < s.count; ++k) {
        l[k] = wrap(grads[s.first + k]);
      }
      out[r] = l;
    } else {
      out[r] = s.count == 1 ? wrap(grads[s.first]) : py::none();
    }
  }
  return out;
}

void CustomOpNode::fail_backward(const std::string& what) const {
  std::string fn = py::str(state_->opdef.get().attr("_backward_fn_name"));
  TORCH_CHECK(
      false,
      "torch_autobatch: the backward of ",
      state_->qualname,
      " (",
      fn,
      ") ",
      what);
}

variable_list CustomOpNode::unwrap_input_grads(py::handle result) const {
  const auto& arg_names = state_->arg_names;
  auto res = py::reinterpret_borrow<py::tuple>(result);
  if (res.size() != arg_slots_.size()) {
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
  for (size_t a = 0; a < arg_slots_.size(); ++a) {
    const Slot& s = arg_slots_[a];
    py::handle g = res[a];
    if (g.is_none()) {
      continue;
    }
    if (s.count == 0 && !s.is_list) {
      fail_backward(
          "returned a value of type " +
          std::string(py::str(py::type::of(g).attr("__name__"))) +
          " for input '" + arg_names[a] +
          "', which is not a Tensor (or was None). Return None for it.");
    }
    if (!s.is_list) {
      out[s.first] = check_input_grad(g, s.first, a);
      continue;
    }
    if (!py::isinstance<py::sequence>(g) || py::len(g) != s.count) {
      fail_backward(
          "returned " + std::string(py::str(py::repr(g))) + " for input '" +
          arg_names[a] + "', a list of " + std::to_string(s.count) +
          " tensors. Return a list of " + std::to_string(s.count) +
          " gradients (Tensor or None), or None.");
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

at::Tensor CustomOpNode::check_input_grad(py::handle grad, size_t edge, size_t arg)
    const {
  const std::string& arg_name = state_->arg_names[arg];
  if (!THPVariable_Check(grad.ptr())) {
    fail_backward(
        "returned a value of type " +
        std::string(py::str(py::type::of(grad).attr("__name__"))) +
        " as the gradient of input '" + arg_name + "'; expected a Tensor or None.");
  }
  at::Tensor g = THPVariable_Unpack(grad.ptr());
  const auto& meta = logical_meta_[edge];
  if (!g.sym_sizes().equals(meta.sym_sizes)) {
    // As the autograd engine does (validate_outputs): a gradient of a shape
    // the input broadcasts to is summed back to the input's shape.
    if (!at::is_expandable_to(meta.sym_sizes, g.sym_sizes())) {
      std::ostringstream msg;
      msg << "returned a gradient of shape " << g.sym_sizes() << " for input '"
          << arg_name << "', which has shape " << c10::SymIntArrayRef(meta.sym_sizes)
          << ". Return a gradient of the input's shape, or of a shape the input "
             "broadcasts to (it is then summed to the input's shape).";
      fail_backward(msg.str());
    }
    g = at::sum_to(std::move(g), meta.sym_sizes);
  }
  const auto dtype = c10::typeMetaToScalarType(meta.options.dtype());
  if (g.scalar_type() != dtype) {
    std::ostringstream msg;
    msg << "returned a gradient of dtype " << g.scalar_type() << " for input '"
        << arg_name << "', which has dtype " << dtype
        << ". Cast it with .to(input.dtype).";
    fail_backward(msg.str());
  }
  // An input that does not require grad has no edge: drop its gradient.
  return next_edge(edge).is_valid() ? g : at::Tensor();
}

void check_no_aliasing(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    bool torch_check) {
  const auto found = find_aliasing(inputs, outputs);
  if (!found) {
    return;
  }
  if (torch_check) {
    // torch.library's error, as backend_impl would have raised it.
    py::gil_scoped_acquire gil;
    const auto as_tuple = [](const std::vector<at::Tensor>& ts) {
      py::tuple t(ts.size());
      for (size_t k = 0; k < ts.size(); ++k) {
        t[k] = py::cast(ts[k]);
      }
      return t;
    };
    state.opdef.get().attr("_check_aliasing")(
        as_tuple(inputs), py::dict(), as_tuple(outputs));
  }
  TORCH_CHECK(
      !found->other_output,
      "torch_autobatch: ",
      state.qualname,
      " returned outputs ",
      found->other_output.value_or(0),
      " and ",
      found->output,
      " that alias each other (share memory), which its schema `",
      schema,
      "` does not declare. Return distinct tensors: e.g. `y, y.clone()` "
      "instead of `y, y`.");
  TORCH_CHECK(
      false,
      "torch_autobatch: ",
      state.qualname,
      " returned an output (tensor ",
      found->output,
      ") that aliases one of its inputs, which its schema `",
      schema,
      "` does not declare. Operators made by torch_autobatch.custom_op "
      "must return new tensors: return `x.clone()` instead of `x` or a "
      "view of it.");
}

py::object call_setup_context(
    const OpState& state,
    c10::ArrayRef<c10::IValue> args,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<at::Tensor>& outputs,
    const std::vector<bool>& needs_input_grad,
    std::vector<at::Tensor>& saved,
    std::vector<bool>& non_differentiable) {
  try {
    py::tuple py_args(args.size());
    py::tuple needs(args.size());
    for (size_t a = 0; a < args.size(); ++a) {
      py_args[a] = torch::jit::toPyObject(args[a]);
      needs[a] = py::bool_(needs_input_grad[a]);
    }
    py::object py_output;
    if (returns.size() == 1) {
      py_output = torch::jit::toPyObject(returns[0]);
    } else {
      py::tuple outs(returns.size());
      for (size_t r = 0; r < returns.size(); ++r) {
        outs[r] = torch::jit::toPyObject(returns[r]);
      }
      py_output = outs;
    }
    const PyNames& names = py_names();
    py::object ctx =
        call_method(state.opdef.get(), names.setup_autograd, {py_args, py_output, needs});
    // NOTE [ctx is torch's FunctionCtx] (_autograd.py): what its methods recorded.
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
          const std::string msg = "ctx.save_for_backward: argument " +
              std::to_string(i) + " is of type " +
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
            found,
            "torch_autobatch: the setup_context of ",
            state.qualname,
            " passed ctx.mark_non_differentiable a value that is not one of the "
            "op's outputs; pass output tensors only.");
      }
    }
    return ctx;
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

namespace {

// Replaces each tensor that has a tangent by a view of it without one.
c10::IValue strip_tangent(const c10::IValue& v) {
  auto strip = [](const at::Tensor& t) {
    return torch::autograd::isFwGradDefined(t) ? t._fw_primal(0) : t;
  };
  if (v.isTensor()) {
    return strip(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) {
      out.push_back(strip(t));
    }
    return out;
  }
  return v;
}

// The tangent of `v` for the user's jvp: Tensor or None, a list for a list.
py::object tangent_of(const c10::IValue& v) {
  auto wrap = [](const at::Tensor& t) -> py::object {
    if (!torch::autograd::isFwGradDefined(t)) {
      return py::none();
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t._fw_grad(0)));
  };
  if (v.isTensor()) {
    return wrap(v.toTensor());
  }
  if (v.isTensorList()) {
    py::list l;
    for (const at::Tensor& t : v.toTensorList()) {
      l.append(wrap(t));
    }
    return l;
  }
  return py::none();
}

py::tuple to_py_tuple(c10::ArrayRef<c10::IValue> values) {
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    out[i] = torch::jit::toPyObject(values[i]);
  }
  return out;
}

// NOTE [Derived tangents draw the primal's random numbers]
// Without a registered jvp the tangents come from running the function again
// on the dual inputs (NOTE [Forward mode]). A random op inside (dropout) must
// draw there exactly what the primal run drew, or the tangent belongs to
// another mask: silently wrong. So the default generators of the inputs'
// devices (and the CPU's) are put back to their state before the primal run
// for the tangent run, and to their state after it once it is done: the
// caller's random stream advances once, as for the plain function.
class RngStates {
 public:
  explicit RngStates(const std::vector<at::Tensor>& inputs) {
    add(at::detail::getDefaultCPUGenerator());
    for (const auto& t : inputs) {
      if (t.defined() && !t.is_cpu() && t.device().type() != c10::DeviceType::Meta) {
        try {
          add(at::globalContext().defaultGenerator(t.device()));
        } catch (const c10::Error&) {
          // A device without a default generator draws no random numbers.
        }
      }
    }
  }
  void restore() const {
    for (const auto& [gen, state] : states_) {
      at::Generator g = gen;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }

 private:
  void add(const at::Generator& gen) {
    for (const auto& s : states_) {
      if (s.first == gen) {
        return;
      }
    }
    at::Generator g = gen;
    std::lock_guard<std::mutex> lock(g.mutex());
    states_.emplace_back(gen, g.get_state());
  }
  std::vector<std::pair<at::Generator, at::Tensor>> states_;
};

class AutogradKernel final : public c10::OperatorKernel {
 public:
  explicit AutogradKernel(std::shared_ptr<OpState> state)
      : state_(std::move(state)) {}

  void operator()(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet ks,
      torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const size_t num_args = schema.arguments().size();
    const size_t num_returns = schema.returns().size();
    const auto args = torch::jit::last(*stack, num_args);

    std::vector<at::Tensor> inputs;
    auto arg_slots = flatten_tensors(args, inputs);
    bool any_requires_grad = false;
    bool any_tangent = false;
    for (const auto& t : inputs) {
      any_tangent |= torch::autograd::isFwGradDefined(t);
      any_requires_grad |= t.defined() && t.requires_grad();
    }
    const bool needs_node = any_requires_grad && c10::GradMode::is_enabled();
    if (needs_node && schema.is_mutable()) {
      check_mutated_need_no_grad(schema, args);
    }
    std::vector<c10::IValue> saved_args;
    if (needs_node || any_tangent) {
      saved_args.assign(args.begin(), args.end());
    }
    // NOTE [Derived tangents draw the primal's random numbers]
    std::optional<RngStates> rng_before_primal;
    if (any_tangent && !state_->has_jvp.load()) {
      rng_before_primal.emplace(inputs);
    }

    bool called_directly = false;
    {
      // The user's forward runs once, below autograd: never recorded. A
      // mutating op goes through ADInplaceOrView, whose kernel (torch's,
      // registered by CustomOpDef) bumps the mutated inputs' versions, so a
      // tensor saved for backward and mutated here is caught as autograd
      // does (NOTE [Mutating ops]).
      const bool mutates = schema.is_mutable();
      std::optional<at::AutoDispatchBelowAutograd> below_autograd;
      std::optional<at::AutoDispatchBelowADInplaceOrView> below_ad_inplace;
      if (mutates) {
        below_autograd.emplace();
      } else {
        below_ad_inplace.emplace();
      }
      // NOTE [The kernel sees grad mode off when a node is made]
      // As in torch.library (the kernel runs in autograd.Function.forward),
      // the backend kernel runs with grad mode off when this call makes a
      // node for tensors that really require grad, so `.numpy()` and
      // `torch.is_grad_enabled()` in it behave alike. Only at the base: at a
      // functorch Grad level, grad mode must stay on for the levels below
      // (they read it to decide whether to attach their own node), and the
      // kernel sees unwrapped tensors that need no grad anyway.
      const auto layer = at::functorch::maybeCurrentDynamicLayer();
      std::optional<c10::AutoGradMode> no_grad;
      if (needs_node && !layer.has_value()) {
        no_grad.emplace(false);
      }
      const bool ad_level = layer.has_value() &&
          (layer->key() == functorch::TransformType::Grad ||
           layer->key() == functorch::TransformType::Jvp);
      SentDownFromAD sent_down(ad_level ? layer->layerId() : 0);
      if (mutates) {
        op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
      } else {
        called_directly =
            run_backend(*state_, op, ks & c10::after_ADInplaceOrView_keyset, stack);
      }
    }

    const auto returns = torch::jit::last(*stack, num_returns);
    std::vector<at::Tensor> outputs;
    auto ret_slots = flatten_tensors(returns, outputs);
    check_no_aliasing(*state_, schema, inputs, outputs, called_directly);
    if (!needs_node && !any_tangent) {
      return;
    }

    c10::intrusive_ptr<CustomOpNode> node;
    if (needs_node) {
      node = c10::make_intrusive<CustomOpNode>(
          state_, std::move(arg_slots), ret_slots, inputs, inputs,
          std::vector<VmapFrame>{});
      node->set_history(outputs);
    }
    py::gil_scoped_acquire gil;
    // setup_context and the jvp are user Python: NOTE [User Python sees a
    // plain caller's state].
    functorch::AsPlainCaller plain;
    if (any_tangent) {
      // Before the node saves anything: a saved output keeps its tangent.
      std::optional<RngStates> rng_after_primal;
      if (rng_before_primal) {
        rng_after_primal.emplace(inputs);
        rng_before_primal->restore();
      }
      set_tangents(saved_args, returns, ret_slots, outputs);
      if (rng_after_primal) {
        rng_after_primal->restore();
      }
    }
    if (node) {
      std::vector<bool> needs_input_grad(num_args, false);
      for (size_t a = 0; a < num_args; ++a) {
        needs_input_grad[a] = requires_grad(saved_args[a]);
      }
      std::vector<at::Tensor> saved;
      std::vector<bool> non_differentiable;
      py::object ctx = call_setup_context(
          *state_, saved_args, returns, outputs, needs_input_grad, saved,
          non_differentiable);
      node->save(ctx, saved, outputs, non_differentiable);
    }
  }

 private:
  // NOTE [Forward mode]
  // An input has a tangent (jvp, jacfwd, forward_ad): the primal outputs come
  // from the same single run below autograd as always (so lower levels and
  // the reverse-mode node are as usual); the output tangents come from the
  // registered jvp, or, when none is registered, from forward-mode AD of the
  // op's own function (run again, above autograd, on the dual inputs). Each
  // runs at this level, so outer levels differentiate the tangent computation
  // itself (jvp(jvp), grad(jvp)); and the grad node saves the dual inputs, so
  // forward mode over its backward sees their tangents (jacfwd(jacrev)).
  // Requires the GIL.
  void set_tangents(
      const std::vector<c10::IValue>& args,
      c10::ArrayRef<c10::IValue> returns,
      const std::vector<Slot>& ret_slots,
      const std::vector<at::Tensor>& outputs) const {
    std::vector<at::Tensor> tangents(outputs.size());
    try {
      const py::handle opdef = state_->opdef.get();
      if (state_->has_jvp.load()) {
        const size_t num_args = args.size();
        py::tuple primals(num_args);
        py::tuple py_tangents(num_args);
        py::tuple needs(num_args);
        for (size_t a = 0; a < num_args; ++a) {
          primals[a] = torch::jit::toPyObject(strip_tangent(args[a]));
          py_tangents[a] = tangent_of(args[a]);
          needs[a] = py::bool_(requires_grad(args[a]));
        }
        py::tuple result = opdef.attr("_run_jvp")(
            primals, to_py_tuple(returns), py_tangents, needs);
        for (size_t r = 0; r < ret_slots.size(); ++r) {
          const Slot& s = ret_slots[r];
          py::handle t = result[r];
          if (t.is_none()) {
            continue;
          }
          if (!s.is_list) {
            tangents[s.first] = check_tangent(t, outputs, s.first, r);
            continue;
          }
          auto seq = py::reinterpret_borrow<py::sequence>(t);
          for (size_t k = 0; k < s.count; ++k) {
            if (!seq[k].is_none()) {
              tangents[s.first + k] = check_tangent(seq[k], outputs, s.first + k, r);
            }
          }
        }
      } else {
        py::tuple result = opdef.attr("_composite_tangents")(to_py_tuple(args));
        for (size_t k = 0; k < outputs.size(); ++k) {
          if (!result[k].is_none()) {
            tangents[k] = THPVariable_Unpack(result[k].ptr());
          }
        }
      }
    } catch (py::error_already_set& e) {
      rethrow_python_error(e);
    }
    for (size_t k = 0; k < outputs.size(); ++k) {
      if (tangents[k].defined() && outputs[k].defined() &&
          torch::autograd::isDifferentiableType(outputs[k].scalar_type())) {
        outputs[k]._set_fw_grad(tangents[k], /*level=*/0, /*is_inplace_op=*/false);
      }
    }
  }

  at::Tensor check_tangent(
      py::handle tangent,
      const std::vector<at::Tensor>& outputs,
      size_t k,
      size_t ret) const {
    auto fail = [&](const std::string& what) {
      std::string fn = py::str(state_->opdef.get().attr("_jvp_fn_name"));
      TORCH_CHECK(
          false, "torch_autobatch: the jvp of ", state_->qualname, " (", fn,
          ") ", what);
    };
    if (!THPVariable_Check(tangent.ptr())) {
      fail(
          "returned a value of type " +
          std::string(py::str(py::type::of(tangent).attr("__name__"))) +
          " as the tangent of output " + std::to_string(ret) +
          "; expected a Tensor or None.");
    }
    const at::Tensor& t = THPVariable_Unpack(tangent.ptr());
    const at::Tensor& out = outputs[k];
    if (!t.sym_sizes().equals(out.sym_sizes())) {
      std::ostringstream msg;
      msg << "returned a tangent of shape " << t.sym_sizes() << " for output " << ret
          << ", which has shape " << out.sym_sizes()
          << ". Return a tangent of the output's shape.";
      fail(msg.str());
    }
    if (t.scalar_type() != out.scalar_type()) {
      std::ostringstream msg;
      msg << "returned a tangent of dtype " << t.scalar_type() << " for output " << ret
          << ", which has dtype " << out.scalar_type()
          << ". Cast it with .to(output.dtype).";
      fail(msg.str());
    }
    // A tangent computed from the dual inputs would itself carry a tangent.
    return torch::autograd::isFwGradDefined(t) ? t._fw_primal(0) : t;
  }

  // NOTE [Mutating ops]
  // An op may mutate inputs (mutates_args): its backward differentiates the
  // others. A mutated input that requires grad would need its history
  // rebased onto this op, as autograd does for in-place aten ops; the user's
  // backward has no gradient for "the input before the mutation", so that is
  // refused with a clear error rather than silently losing the mutation's
  // derivative.
  void check_mutated_need_no_grad(
      const c10::FunctionSchema& schema,
      c10::ArrayRef<c10::IValue> args) const {
    for (size_t a = 0; a < args.size(); ++a) {
      const auto& info = schema.arguments()[a].alias_info();
      TORCH_CHECK(
          !(info && info->isWrite() && requires_grad(args[a])),
          "torch_autobatch: ",
          state_->qualname,
          " mutates its argument '",
          schema.arguments()[a].name(),
          "' in place, and that tensor requires grad. A custom op's backward "
          "cannot differentiate through its own mutation: pass a tensor that "
          "does not require grad (e.g. a buffer, or x.detach().clone()), or make "
          "the op functional and return the new value.");
    }
  }

  static bool requires_grad(const c10::IValue& v) {
    if (v.isTensor()) {
      return v.toTensor().requires_grad();
    }
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        if (t.requires_grad()) {
          return true;
        }
      }
    }
    return false;
  }

  std::shared_ptr<OpState> state_;
};

} // namespace

torch::CppFunction autograd_kernel(const std::shared_ptr<OpState>& state) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(state));
}

} // namespace torch_autobatch
