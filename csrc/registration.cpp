// Registering our kernels for an operator, and taking them away with it.
//
// NOTE [Kernels die with their op]
// torch.library lets an op's name be defined again (custom_op destroys the
// old definition's Library; a Library the user made may be destroyed and its
// op defined anew). Our kernels are registered by name: left behind, they
// would serve the next op of that name, running the old op's function under
// vmap, silently. So our registration lives no longer than the definition it
// was made for, in three ways, each covering what the others cannot:
// - torch's own teardown: the registration is a RegistrationHandle on the
//   op's torch Library (CustomOpDef._lib, op/_custom_op.py), so torch
//   destroying that Library (a redefinition, Library._destroy) deregisters
//   ours at once;
// - garbage collection: the op object owns the registration, and OpState
//   holds the op only weakly (each grad node holds it strongly, for its
//   backward), so no reference cycle keeps a dropped op's kernels alive;
// - anyone else deregistering the schema (the Library of an op we upgraded,
//   destroyed by its owner): a dispatcher listener marks the state
//   `defined = false`. It runs under the dispatcher's lock, where
//   deregistering is impossible, so the first call that reaches one of our
//   kernels afterwards deregisters them and redispatches the call to what the
//   dispatcher has without them.
#include "op_state.h"

#include <algorithm>
#include <unordered_map>

namespace torch_autobatch {

py::object OpState::opdef() const {
  PyObject* obj = PyWeakref_GetObject(opdef_weakref.get().ptr()); // borrowed
  TORCH_CHECK(
      obj != nullptr && obj != Py_None, "torch_autobatch: the operator object of ", qualname,
      " is gone (garbage-collected or redefined) while a kernel of it still "
      "ran. Keep a reference to the op while you use it.");
  return py::reinterpret_borrow<py::object>(obj);
}

void OpState::deregister() {
  registered.store(false);
  std::unique_ptr<torch::Library> dropped;
  {
    std::lock_guard<std::mutex> guard(lib_mutex);
    dropped = std::move(lib);
  }
  // Deregistering takes the dispatcher's lock: outside ours.
  dropped.reset();
}

void redispatch_without_us(
    OpState& state,
    c10::OperatorKernel* kernel,
    const c10::OperatorHandle& op,
    c10::DispatchKeySet ks,
    torch::jit::Stack* stack) {
  // Deregistering frees our kernel objects: this one stays alive until it
  // returns.
  const auto keep = c10::intrusive_ptr<c10::OperatorKernel>::reclaim_copy(kernel);
  state.deregister();
  op.redispatchBoxed(ks, stack);
}

namespace {

// Every OpState by operator name, for the listener.
struct Registry {
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<std::weak_ptr<OpState>>> states;
};
Registry& registry() {
  static auto* r = new Registry(); // leaked: the dispatcher outlives us at exit
  return *r;
}

class DefinitionListener final : public c10::OpRegistrationListener {
 public:
  void onOperatorRegistered(const c10::OperatorHandle&) override {}
  // Called with the dispatcher's lock held: only mark.
  void onOperatorDeregistered(const c10::OperatorHandle& op) override {
    const auto& name = op.operator_name();
    const std::string qualname =
        name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    auto& r = registry();
    std::lock_guard<std::mutex> guard(r.mutex);
    auto it = r.states.find(qualname);
    if (it == r.states.end()) {
      return;
    }
    for (const auto& weak : it->second) {
      if (auto state = weak.lock()) {
        state->defined.store(false);
      }
    }
    r.states.erase(it);
  }
};

void listen_once() {
  static const bool listening = [] {
    // The handle is leaked: the listener stays for the process.
    new c10::RegistrationHandleRAII(
        c10::Dispatcher::singleton().addRegistrationListener(
            std::make_unique<DefinitionListener>()));
    return true;
  }();
  (void)listening;
}

void remember(const std::shared_ptr<OpState>& state) {
  auto& r = registry();
  std::lock_guard<std::mutex> guard(r.mutex);
  auto& states = r.states[state->qualname];
  states.erase(
      std::remove_if(states.begin(), states.end(), [](const auto& w) { return w.expired(); }),
      states.end());
  states.push_back(state);
}

} // namespace

c10::OperatorHandle find_op(const std::string& qualname) {
  const auto sep = qualname.find("::");
  TORCH_CHECK(
      sep != std::string::npos,
      "torch_autobatch: expected a qualified name 'namespace::name', got '", qualname, "'");
  // "ns::name" or "ns::name.overload", as torch.library.custom_op takes it.
  const auto name = qualname.substr(sep + 2);
  const auto dot = name.find('.');
  return c10::Dispatcher::singleton().findSchemaOrThrow(
      (qualname.substr(0, sep + 2) + name.substr(0, dot)).c_str(),
      dot == std::string::npos ? "" : name.substr(dot + 1).c_str());
}

std::shared_ptr<OpState> register_op(const std::string& qualname, py::handle opdef) {
  listen_once();
  const auto sep = qualname.find("::");
  const auto name = qualname.substr(sep + 2);
  const auto op = find_op(qualname);
  auto state = std::make_shared<OpState>();
  state->qualname = qualname;
  std::string node_suffix = name;
  std::replace(node_suffix.begin(), node_suffix.end(), '.', '_');
  state->node_name = "GeneratedBackwardFor_" + qualname.substr(0, sep) + "_" + node_suffix;
  for (const auto& arg : op.schema().arguments()) {
    state->arg_names.push_back(arg.name());
  }
  PyObject* weak = PyWeakref_NewRef(opdef.ptr(), nullptr);
  if (weak == nullptr) {
    throw py::error_already_set();
  }
  state->opdef_weakref = PyRef(py::reinterpret_steal<py::object>(weak));
  state->functional_schema = has_functional_schema(op.schema());
  state->return_aliases = return_aliases(op.schema());
  state->returns_an_argument = std::any_of(
      state->return_aliases.begin(), state->return_aliases.end(), [](int64_t a) { return a >= 0; });

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
  // All or nothing: if an impl fails, `lib` takes what it registered with it.
  auto lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, qualname.substr(0, sep), std::nullopt, __FILE__, __LINE__);
  lib->impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd, autograd_kernel(state)));
  lib->impl(
      name.c_str(), torch::dispatch(c10::DispatchKey::FuncTorchBatched, batched_kernel(state)));
  {
    std::lock_guard<std::mutex> guard(state->lib_mutex);
    state->lib = std::move(lib);
  }
  remember(state);
  return state;
}

} // namespace torch_autobatch
