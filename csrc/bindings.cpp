// The Python bindings of torch_autobatch._C: registers our C++ kernels for an
// operator that torch_autobatch.custom_op has defined. Python stays the thin, typed layer;
// this module holds no Python-visible state but the registrations.
#include "grad_node.h"
#include "op_state.h"
#include "tracer.h"

namespace torch_autobatch {

std::shared_ptr<OpState> register_op(const std::string& qualname, py::handle opdef);
// NOTE [The unbatched call's fast path] (fast_call.cpp).
py::object make_fast_call_function(const std::shared_ptr<OpState>& state);
std::pair<int64_t, int64_t> fast_calls_on_this_thread();
void install_call_slot(py::handle cls);

namespace {

// Python's handle on an operator's C++ kernels: keeps them registered until
// it is dropped or destroy() is called (NOTE [Kernels die with their op],
// registration.cpp); grad nodes already made keep their OpState.
struct Registration {
  explicit Registration(std::shared_ptr<OpState> s) : state(std::move(s)) {}
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration() {
    state->deregister();
  }
  const std::shared_ptr<OpState> state;
};

} // namespace
} // namespace torch_autobatch

PYBIND11_MODULE(_C, m) {
  namespace tab = torch_autobatch;
  namespace py = pybind11;
  m.doc() = "C++ kernels of torch_autobatch (internal; use torch_autobatch.custom_op)";
  tab::init_composite_call();
  // The one definition of the batched kernel's modes (op_state.h) Python sees.
  py::enum_<tab::VmapMode>(m, "VmapMode")
      .value("composite", tab::VmapMode::Composite)
      .value("rule", tab::VmapMode::Rule)
      .value("loop", tab::VmapMode::Loop);
  py::class_<tab::Registration>(m, "_Registration")
      .def_property_readonly(
          "qualname", [](const tab::Registration& r) { return r.state->qualname; })
      .def(
          "set_vmap_mode",
          [](tab::Registration& r, tab::VmapMode mode) { r.state->vmap_mode.store(mode); },
          "How the batched kernel computes the op under vmap (VmapMode).")
      .def(
          "set_has_jvp", [](tab::Registration& r, bool has) { r.state->has_jvp.store(has); },
          "Whether the op has a registered jvp (register_jvp).")
      .def(
          "set_jvp_reruns_forward",
          [](tab::Registration& r, bool reruns) { r.state->jvp_reruns_forward.store(reruns); },
          "Whether the registered jvp's setup_context runs the forward again (a lifted legacy "
          "autograd.Function), so it must draw the primal run's random numbers.")
      .def(
          "set_has_vjp", [](tab::Registration& r, bool has) { r.state->has_vjp.store(has); },
          "Whether the op has a registered vjp (register_vjp).")
      .def(
          "set_cast_grad_dtypes",
          [](tab::Registration& r, bool cast) { r.state->cast_grad_dtypes.store(cast); },
          "Whether a gradient of another dtype than its input's is cast to it (a lifted "
          "autograd.Function, as autograd casts a Function's) rather than an error.")
      .def(
          "set_loop_on_failure",
          [](tab::Registration& r, bool loop) { r.state->loop_on_failure.store(loop); },
          "Whether a call under vmap whose function fails on batched tensors runs once per "
          "example instead (a lifted autograd.Function under vmap='auto').")
      .def(
          "set_closure",
          [](tab::Registration& r, const py::tuple& closure) {
            r.state->closure = tab::PyRef(closure);
            r.state->has_closure.store(closure.size() > 0);
          },
          "What the op's user code closes over: (function, variable, cell or value) triples "
          "(NOTE [What the function closes over]).")
      // NOTE [Residuals of register_vjp]
      .def(
          "answer_residual_request",
          [](tab::Registration& r, py::handle fwd, const py::tuple& args, const py::dict& kwargs) {
            return tab::answer_residual_request(*r.state, fwd, args, kwargs);
          },
          py::arg("fwd"), py::arg("args"), py::arg("kwargs"),
          "Runs fwd for this thread's open requests for the op's residuals and answers them: "
          "(output,), or None where none is open.")
      .def(
          "current_residuals",
          [](tab::Registration& r) -> py::object {
            for (auto* q = tab::t_residual_request; q != nullptr; q = q->prev) {
              if (q->op == r.state.get() && q->residuals) {
                return py::make_tuple(py::reinterpret_borrow<py::object>(q->residuals.get()));
              }
            }
            return py::none();
          },
          "(residuals,) of the innermost answered request for the op, or None (residuals may "
          "be None themselves).")
      // NOTE [fwd returns what the op returns] (torch_autobatch/op/_vjp_check.py)
      .def(
          "run_fwd",
          [](tab::Registration& r, py::handle fwd, const py::tuple& args, const py::dict& kwargs,
             bool check) { return tab::run_vjp_fwd(*r.state, fwd, args, kwargs, check); },
          py::arg("fwd"), py::arg("args"), py::arg("kwargs"), py::arg("check"),
          "register_vjp's fwd(*args, **kwargs): its (output, residuals), verified.")
      .def(
          "forget_fwd_checks", [](tab::Registration& r) { r.state->vjp_checked.clear(); },
          "fwd's output is checked anew (a new fwd or fake kernel).")
      .def(
          "fast_call_function",
          [](tab::Registration& r) { return tab::make_fast_call_function(r.state); },
          "fast_call(args) for the op: NOTE [The unbatched call's fast path].")
      .def(
          "destroy", [](tab::Registration& r) { r.state->deregister(); },
          "Deregisters the kernels now (idempotent).")
      .def_property_readonly("registered", [](const tab::Registration& r) {
        std::lock_guard<std::mutex> guard(r.state->lib_mutex);
        return r.state->lib != nullptr;
      });
  m.def(
      "_register_op",
      [](const std::string& qualname, py::object opdef) {
        try {
          return std::make_unique<tab::Registration>(tab::register_op(qualname, opdef));
        } catch (const c10::Error& e) {
          throw std::runtime_error(e.what_without_backtrace());
        }
      },
      py::arg("qualname"), py::arg("opdef"),
      "Registers torch_autobatch's C++ kernels (Autograd) for the operator "
      "`qualname`, calling back into `opdef`. Returns a handle that keeps them "
      "registered.");
  m.def(
      "_install_call_slot", &tab::install_call_slot, py::arg("cls"),
      "Sets the op class's tp_call to the C++ one (NOTE [The op's call slot], fast_call.cpp).");
  m.def(
      "_fast_calls", &tab::fast_calls_on_this_thread,
      "(skipped the dispatcher, sent to it by fast_call): the op calls on this thread that "
      "took each part of NOTE [The unbatched call's fast path]; for tests.");
  m.def(
      "_python_side_names",
      [] {
        py::dict out;
        for (const auto& n : tab::python_side()) {
          out[n.name] = py::make_tuple(n.nargs, n.on);
        }
        return out;
      },
      "{name: (arguments a call passes or -1 for an attribute, 'op' or 'ctx')}: "
      "what the kernels look up (NOTE [The Python side of the kernels]).");
  tab::bind_saved_tensors(m);
  tab::bind_vjp_residuals(m);
  tab::bind_compiled_autograd(m);
  tab::bind_tracer(m);
}
