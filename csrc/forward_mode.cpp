// Forward-mode AD of a torch_autobatch operator: the tangents of its outputs.
//
// NOTE [Forward mode]
// An input has a tangent (jvp, jacfwd, forward_ad): the primal outputs come
// from the same single run below autograd as always (so lower levels and
// the reverse-mode node are as usual); the output tangents come from the
// registered jvp, or, when none is registered, from forward-mode AD of the
// op's own function (run again, above autograd, on the dual inputs). Each
// runs at the level of the Autograd kernel that sees the tangents, so outer
// levels differentiate the tangent computation itself (jvp(jvp), grad(jvp));
// and the grad node saves the dual inputs, so forward mode over its backward
// sees their tangents (jacfwd(jacrev)).
//
// NOTE [Forward mode under vmap]
// Under vmap the batched kernel runs the op once for every level below it.
// Without a registered jvp, the composite's own forward-mode AD gives the
// tangents of the Jvp levels below in that same run. With one, the jvp runs
// at each Jvp level below vmap like a grad node's backward: on that level's
// primals and tangents, re-entering the vmap levels above so it sees each
// example's shapes (set_jvp_tangents_below_vmap).
//
// NOTE [One gate for every user tangent]
// Whatever path produced it (the Autograd kernel's, or the batched kernel's at
// a Jvp level below vmap, at any nesting), what a user's jvp returned goes
// through check_jvp_result before any of it reaches an output: one tangent
// per output (None or a Tensor; a list of them for a Tensor[] output), each
// of its output's shape, dtype, device and layout. A path that skipped it
// would set a float32 tangent on a float64 output, or read a Python int as a
// tensor (a crash).
#include "forward_mode.h"

#include "functorch.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <sstream>

namespace torch_autobatch {

RngStates::RngStates(const std::vector<at::Tensor>& inputs) {
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

void RngStates::add(const at::Generator& gen) {
  for (const auto& s : states_) {
    if (s.first == gen) {
      return;
    }
  }
  at::Generator g = gen;
  std::lock_guard<std::mutex> lock(g.mutex());
  states_.emplace_back(gen, g.get_state());
}

RngStates RngStates::current() const {
  RngStates now;
  for (const auto& s : states_) {
    now.add(s.first);
  }
  return now;
}

bool RngStates::changed() const {
  for (const auto& [gen, before] : states_) {
    at::Generator g = gen;
    std::lock_guard<std::mutex> lock(g.mutex());
    const at::Tensor now = g.get_state();
    if (now.nbytes() != before.nbytes() ||
        std::memcmp(now.const_data_ptr(), before.const_data_ptr(), before.nbytes()) != 0) {
      return true;
    }
  }
  return false;
}

void RngStates::restore() const {
  for (const auto& [gen, state] : states_) {
    at::Generator g = gen;
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
}

PrimalDraws::PrimalDraws(const std::optional<RngStates>& before) {
  if (before) {
    after_.emplace(before->current());
    before->restore();
  }
}

PrimalDraws::~PrimalDraws() {
  if (after_) {
    try {
      after_->restore();
    } catch (const std::exception&) {
      // (a state read back from its own generator: set_state does not refuse it)
    }
  }
}

namespace {

// As an in-place aten op sets its `self`'s tangent: an existing one is
// updated in place. Called as the kernel (not from user Python's state).
void set_inplace_fw_grad(const at::Tensor& t, const at::Tensor& tangent) {
  if (!torch::autograd::isDifferentiableType(t.scalar_type())) {
    return;
  }
  if (torch::autograd::isFwGradDefined(t)) {
    t._fw_grad(0).copy_(tangent);
  } else {
    t._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/true);
  }
}

} // namespace

PreMutationArgs::PreMutationArgs(
    const c10::FunctionSchema& schema,
    const std::vector<c10::IValue>& args)
    : args_(args) {
  for (size_t a = 0; a < args.size(); ++a) {
    const auto* info = schema.arguments()[a].alias_info();
    if (info != nullptr && info->isWrite()) {
      mutated_.push_back(a);
      args_[a] = map_tensors(
          args[a], [](const at::Tensor& t, size_t) { return t.defined() ? t.clone() : t; });
    }
  }
}

void PreMutationArgs::copy_tangents_to(const std::vector<c10::IValue>& originals) const {
  for (size_t a : mutated_) {
    std::vector<at::Tensor> clones;
    map_tensors(args_[a], [&](const at::Tensor& t, size_t) {
      clones.push_back(t);
      return t;
    });
    map_tensors(originals[a], [&](const at::Tensor& t, size_t k) {
      const at::Tensor& clone = clones[k];
      if (t.defined() && clone.defined() && torch::autograd::isFwGradDefined(clone)) {
        set_inplace_fw_grad(t, clone._fw_grad(0));
      }
      return t;
    });
  }
}

namespace {

py::object wrap(const at::Tensor& t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

std::string type_name(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__name__"));
}

// What is wrong with tangent `t` of output `out` ("" if nothing is).
std::string tangent_mismatch(const at::Tensor& t, const at::Tensor& out, const std::string& where) {
  std::ostringstream msg;
  if (!t.sym_sizes().equals(out.sym_sizes())) {
    msg << "returned a tangent of shape " << t.sym_sizes() << " for " << where
        << ", which has shape " << out.sym_sizes() << ". Return a tangent of the output's shape.";
  } else if (t.scalar_type() != out.scalar_type()) {
    msg << "returned a tangent of dtype " << t.scalar_type() << " for " << where
        << ", which has dtype " << out.scalar_type() << ". Cast it with .to(output.dtype).";
  } else if (t.device() != out.device()) {
    msg << "returned a tangent on device " << t.device() << " for " << where << ", which is on "
        << out.device() << ". Move it with .to(output.device).";
  } else if (t.layout() != out.layout()) {
    msg << "returned a tangent of layout " << t.layout() << " for " << where
        << ", which has layout " << out.layout() << ". Return a tangent of the output's layout.";
  }
  return msg.str();
}

// NOTE [One gate for every user tangent]. `result`: what CustomOpDef._run_jvp
// returned (a tuple, one entry per schema return); `outputs`: the op's flat
// tensor outputs as the jvp saw them. Returns one tangent per flat output
// (undefined: none), without tangents of their own. Requires the GIL.
std::vector<at::Tensor> check_jvp_result(
    const OpState& state,
    py::handle opdef,
    py::handle result,
    const std::vector<Slot>& ret_slots,
    const std::vector<at::Tensor>& outputs) {
  auto fail = [&](const std::string& what) {
    const std::string fn = py::str(opdef.attr(py_names().jvp_fn_name));
    TORCH_CHECK(false, "torch_autobatch: the jvp of ", state.qualname, " (", fn, ") ", what);
  };
  const size_t num_returns = ret_slots.size();
  if (!PyTuple_Check(result.ptr()) || py::len(result) != num_returns) {
    const std::string got = PyTuple_Check(result.ptr())
                                ? std::to_string(py::len(result)) + " tangent(s)"
                                : type_name(result);
    fail(
        "returned " + got + ", but the op has " + std::to_string(num_returns) +
        " output(s). Return one tangent per output (a tuple for several), None "
        "for non-differentiable ones.");
  }
  auto tuple = py::reinterpret_borrow<py::tuple>(result);
  std::vector<at::Tensor> tangents(outputs.size());
  auto check = [&](py::handle tangent, size_t k, const std::string& where) {
    if (!THPVariable_Check(tangent.ptr())) {
      fail(
          "returned a value of type " + type_name(tangent) + " as the tangent of " + where +
          "; expected a Tensor or None.");
    }
    const at::Tensor& t = THPVariable_Unpack(tangent.ptr());
    const at::Tensor& out = outputs[k];
    if (!out.defined() || !torch::autograd::isDifferentiableType(out.scalar_type())) {
      return; // a non-differentiable output has no tangent to set
    }
    const std::string mismatch = tangent_mismatch(t, out, where);
    if (!mismatch.empty()) {
      fail(mismatch);
    }
    // A tangent computed from the dual inputs would itself carry a tangent.
    tangents[k] = torch::autograd::isFwGradDefined(t) ? t._fw_primal(0) : t;
  };
  for (size_t r = 0; r < num_returns; ++r) {
    const Slot& s = ret_slots[r];
    const py::handle t = tuple[r];
    const std::string where = "output " + std::to_string(r);
    if (t.is_none()) {
      continue;
    }
    if (s.is_list) {
      if (!(PyList_Check(t.ptr()) || PyTuple_Check(t.ptr())) || py::len(t) != s.count) {
        fail(
            "returned " + std::string(py::repr(t)) + " as the tangent of " + where +
            ", a list of " + std::to_string(s.count) + " tensors. Return a list of " +
            std::to_string(s.count) + " tangents (Tensor or None), or None.");
      }
      auto seq = py::reinterpret_borrow<py::sequence>(t);
      for (size_t j = 0; j < s.count; ++j) {
        if (!seq[j].is_none()) {
          check(seq[j], s.first + j, where + " (element " + std::to_string(j) + ")");
        }
      }
    } else if (s.count == 1) {
      check(t, s.first, where);
    } else {
      fail(
          "returned a value of type " + type_name(t) + " as the tangent of " + where +
          ", which is not a Tensor (or was None). Return None for it.");
    }
  }
  return tangents;
}

// Replaces each tensor that has a tangent by a view of it without one.
c10::IValue strip_tangent(const c10::IValue& v) {
  return map_tensors(v, [](const at::Tensor& t, size_t) {
    return torch::autograd::isFwGradDefined(t) ? t._fw_primal(0) : t;
  });
}

// The tangent of `v` for the user's jvp: Tensor or None, a list for a list.
py::object tangent_of(const c10::IValue& v) {
  auto tangent = [](const at::Tensor& t) -> py::object {
    return torch::autograd::isFwGradDefined(t) ? wrap(t._fw_grad(0)) : py::none();
  };
  if (v.isTensor()) {
    return tangent(v.toTensor());
  }
  if (v.isTensorList() || is_optional_tensor_list(v)) {
    py::list l;
    map_tensors(v, [&](const at::Tensor& t, size_t) {
      l.append(tangent(t));
      return t;
    });
    return std::move(l);
  }
  return py::none();
}

// Python values of the op's arguments (or returns) for the jvp, with the
// tensors taken from `flat` (by `slots`); a tangent has None for non-tensors.
py::tuple rebuild(
    const std::vector<at::Tensor>& flat,
    const std::vector<Slot>& slots,
    c10::ArrayRef<c10::IValue> values,
    const std::vector<c10::Argument>& schema,
    bool as_tangent) {
  return slots_to_py(flat, slots, [&](size_t a) {
    return as_tangent ? py::none() : to_py(values[a], *schema[a].real_type());
  });
}

} // namespace

void set_output_tangents(
    const OpState& state,
    const std::vector<Slot>& ret_slots,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& tangents,
    bool skip_returned) {
  std::vector<bool> returned;
  if (state.returns_an_argument) {
    returned = returned_arguments(state, ret_slots, outputs.size());
  }
  for (size_t k = 0; k < outputs.size(); ++k) {
    const at::Tensor& out = outputs[k];
    if (!tangents[k].defined() || !out.defined() ||
        !torch::autograd::isDifferentiableType(out.scalar_type())) {
      continue;
    }
    if (returned.empty() || !returned[k]) {
      out._set_fw_grad(tangents[k], /*level=*/0, /*is_inplace_op=*/false);
    } else if (!skip_returned) {
      set_inplace_fw_grad(out, tangents[k]); // NOTE [Returned mutated arguments]
    }
  }
}

std::vector<at::Tensor> output_tangents(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const std::vector<c10::IValue>& args,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<Slot>& ret_slots,
    const std::vector<at::Tensor>& outputs,
    const std::optional<RngStates>& rng_before_primal,
    const std::optional<PreMutationArgs>& pre_mutation) {
  std::vector<at::Tensor> tangents(outputs.size());
  try {
    const py::object opdef = state.opdef();
    const PyNames& names = py_names();
    if (state.has_jvp.load()) {
      const size_t num_args = args.size();
      py::tuple primals(num_args);
      py::tuple py_tangents(num_args);
      py::tuple needs(num_args);
      for (size_t a = 0; a < num_args; ++a) {
        primals[a] = to_py(strip_tangent(args[a]), *schema.arguments()[a].real_type());
        py_tangents[a] = tangent_of(args[a]);
        needs[a] = py::bool_(any_requires_grad(args[a]));
      }
      py::object result;
      {
        // NOTE [A jvp that reruns the forward draws the primal's random numbers]
        PrimalDraws draws(rng_before_primal);
        result = call_method(
            opdef, names.run_jvp,
            {primals, to_py_tuple(returns, schema.returns()), py_tangents, needs});
      }
      tangents = check_jvp_result(state, opdef, result, ret_slots, outputs);
    } else {
      // NOTE [The function gets its arguments as torch passes them], NOTE
      // [Derived tangents of a mutating op]
      const auto& run_args = pre_mutation ? pre_mutation->args() : args;
      const auto [call_args, call_kwargs] = to_py_call(run_args, schema.arguments());
      py::tuple result;
      {
        PrimalDraws draws(
            rng_before_primal); // NOTE [Derived tangents draw the primal's random numbers]
        result = call_method(opdef, names.composite_tangents, {call_args, call_kwargs});
      }
      for (size_t k = 0; k < outputs.size(); ++k) {
        if (!result[k].is_none()) {
          tangents[k] = THPVariable_Unpack(result[k].ptr());
        }
      }
    }
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
  return tangents;
}

namespace {

// ctx.needs_input_grad as the Autograd kernel's path gives it: does the
// input, at this level, require grad?
py::tuple needs_input_grad(const std::vector<at::Tensor>& in, const std::vector<Slot>& arg_slots) {
  py::tuple needs(arg_slots.size());
  for (size_t a = 0; a < arg_slots.size(); ++a) {
    bool need = false;
    for (size_t k = arg_slots[a].first; k < arg_slots[a].first + arg_slots[a].count; ++k) {
      need = need || (in[k].defined() && in[k].requires_grad());
    }
    needs[a] = py::bool_(need);
  }
  return needs;
}

// The registered jvp on batched primals, outputs and tangents; returns the
// output tangents, checked. Requires the GIL.
std::vector<at::Tensor> call_jvp_batched(
    const OpState& state,
    const c10::FunctionSchema& schema,
    const std::vector<at::Tensor>& in,
    const std::vector<at::Tensor>& primals,
    const std::vector<at::Tensor>& outs,
    const std::vector<at::Tensor>& tangents,
    const std::vector<c10::IValue>& args,
    const std::vector<Slot>& arg_slots,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<Slot>& ret_slots,
    const std::optional<RngStates>& rng_before_primal) {
  try {
    const py::object opdef = state.opdef();
    // NOTE [A jvp that reruns the forward draws the primal's random numbers]
    PrimalDraws draws(rng_before_primal);
    py::object result = call_method(
        opdef, py_names().run_jvp,
        {rebuild(primals, arg_slots, args, schema.arguments(), false),
         rebuild(outs, ret_slots, returns, schema.returns(), false),
         rebuild(tangents, arg_slots, args, schema.arguments(), true),
         needs_input_grad(in, arg_slots)});
    return check_jvp_result(state, opdef, result, ret_slots, outs);
  } catch (py::error_already_set& e) {
    rethrow_python_error(e);
  }
}

} // namespace

void set_jvp_tangents_below_vmap(
    const OpState& state,
    const c10::FunctionSchema& schema,
    int64_t level,
    const std::vector<at::Tensor>& in,
    const std::vector<at::Tensor>& out,
    const std::vector<VmapFrame>& frames_inner_first,
    const std::vector<c10::IValue>& args,
    const std::vector<Slot>& arg_slots,
    c10::ArrayRef<c10::IValue> returns,
    const std::vector<Slot>& ret_slots,
    const std::optional<RngStates>& rng_before_primal) {
  // A tensor of this level: a TensorWrapper of the Jvp level, or at the base
  // a plain tensor (a dual tensor of forward-mode AD).
  auto at_this_level = [&](const at::Tensor& t) {
    return t.defined() && (level == kBaseLevel ? functorch::maybeGetTensorWrapper(t) == nullptr
                                               : functorch::is_wrapped_at(t, level));
  };
  std::vector<at::Tensor> primals(in.size());
  std::vector<at::Tensor> tangents(in.size());
  bool any = false;
  for (size_t k = 0; k < in.size(); ++k) {
    primals[k] = in[k];
    if (at_this_level(in[k]) && torch::autograd::isFwGradDefined(in[k])) {
      tangents[k] = in[k]._fw_grad(0);
      primals[k] = in[k]._fw_primal(0);
      any = true;
    }
  }
  if (!any) {
    return;
  }
  std::vector<at::Tensor> outs = out;
  std::vector<at::Tensor> out_tangents;
  {
    functorch::LowerToLevel lowered(level);
    const std::vector<VmapFrame> frames(frames_inner_first.rbegin(), frames_inner_first.rend());
    ReenteredFrames levels(frames); // NOTE [Re-entering the vmap levels]
    levels.enter(primals, &VmapFrame::in_bdims);
    levels.enter(tangents, &VmapFrame::in_bdims);
    levels.enter(outs, &VmapFrame::out_bdims);
    {
      py::gil_scoped_acquire gil;
      out_tangents = call_jvp_batched(
          state, schema, in, primals, outs, tangents, args, arg_slots, returns, ret_slots,
          rng_before_primal);
    }
    levels.leave(out_tangents, &VmapFrame::out_bdims);
  }
  std::vector<at::Tensor> at_level(out.size());
  for (size_t k = 0; k < out.size(); ++k) {
    if (at_this_level(out[k])) {
      at_level[k] = out[k];
    }
  }
  // As this level's kernel (the lowered stack and re-entered levels are gone).
  set_output_tangents(state, ret_slots, at_level, out_tangents, /*skip_returned=*/false);
}

} // namespace torch_autobatch
