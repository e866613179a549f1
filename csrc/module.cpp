// torch_autobatch._C: registers our C++ kernels for an operator that
// torch_autobatch.custom_op has defined. Python stays the thin, typed layer;
// this module holds no Python-visible state but the registrations.
#include "autobatch.h"
#include "tracer.h"

namespace torch_autobatch {
namespace {

// Keeps an operator's C++ kernels registered while it lives; dropping it
// deregisters them (grad nodes already made keep their OpState).
struct Registration {
  std::shared_ptr<OpState> state;
  std::unique_ptr<torch::Library> lib;
};

std::unique_ptr<Registration> register_op(
    const std::string& qualname,
    py::object opdef) {
  const auto sep = qualname.find("::");
  TORCH_CHECK(
      sep != std::string::npos,
      "torch_autobatch: expected a qualified name 'namespace::name', got '",
      qualname,
      "'");
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(qualname.c_str(), "");
  auto state = std::make_shared<OpState>();
  state->qualname = qualname;
  state->node_name = "GeneratedBackwardFor_" + qualname.substr(0, sep) + "_" +
      qualname.substr(sep + 2);
  for (const auto& arg : op.schema().arguments()) {
    state->arg_names.push_back(arg.name());
  }
  state->opdef = PyRef(std::move(opdef));
  state->functional_schema = has_functional_schema(op.schema());

  // NOTE [Upgrading an existing op] (torch_autobatch/_upgrade.py): an op
  // that torch.library.custom_op made has Python kernels at these keys; ours
  // replace them while this registration lives (the dispatcher restores
  // theirs when it is dropped). Replacing them is the point, so the
  // dispatcher's "Overriding a previously registered kernel" warning is not
  // shown.
  struct Silent final : c10::WarningHandler {
    void process(const c10::Warning&) override {}
  } silent;
  c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  auto reg = std::make_unique<Registration>();
  reg->state = state;
  reg->lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, qualname.substr(0, sep), std::nullopt, __FILE__, __LINE__);
  const auto name = qualname.substr(sep + 2);
  reg->lib->impl(
      name.c_str(), torch::dispatch(c10::DispatchKey::Autograd, autograd_kernel(state)));
  reg->lib->impl(
      name.c_str(),
      torch::dispatch(c10::DispatchKey::FuncTorchBatched, batched_kernel(state)));
  return reg;
}

} // namespace
} // namespace torch_autobatch

PYBIND11_MODULE(_C, m) {
  namespace tab = torch_autobatch;
  namespace py = pybind11;
  m.doc() = "C++ kernels of torch_autobatch (internal; use torch_autobatch.custom_op)";
  tab::init_composite_call();
  py::class_<tab::Registration>(m, "_Registration")
      .def_property_readonly(
          "qualname", [](const tab::Registration& r) { return r.state->qualname; })
      .def(
          "set_vmap_mode",
          [](tab::Registration& r, int mode) {
            TORCH_CHECK(mode >= 0 && mode <= 2, "bad vmap mode ", mode);
            r.state->vmap_mode.store(static_cast<tab::VmapMode>(mode));
          },
          "0: composite (default), 1: the register_vmap rule, 2: per-example loop")
      .def(
          "set_has_jvp",
          [](tab::Registration& r, bool has) { r.state->has_jvp.store(has); },
          "Whether the op has a registered jvp (register_jvp).");
  m.def(
      "_register_op",
      [](const std::string& qualname, py::object opdef) {
        try {
          return tab::register_op(qualname, std::move(opdef));
        } catch (const c10::Error& e) {
          throw std::runtime_error(e.what_without_backtrace());
        }
      },
      py::arg("qualname"),
      py::arg("opdef"),
      "Registers torch_autobatch's C++ kernels (Autograd) for the operator "
      "`qualname`, calling back into `opdef`. Returns a handle that keeps them "
      "registered.");
  tab::bind_tracer(m);
}
