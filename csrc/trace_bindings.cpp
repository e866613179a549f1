// The tracer's Python bindings (bind_tracer, tracer.h): _C._TraceImpl, its
// snapshot in plain Python objects, and the functions that push, pop and query
// the thread's tracing state (the Python layer: torch_autobatch/tracing/_tracer.py).
#include "tracer.h"

#include "python_interop.h"
#include "trace_record.h"

#include <c10/util/irange.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>

namespace torch_autobatch::tracer {
namespace {

// Locks `t.mu` from Python: waits without the GIL (a thread holding `mu`
// may need the GIL, e.g. to name a Python node).
std::unique_lock<std::mutex> lock_from_python(TraceImpl& t) {
  std::unique_lock<std::mutex> lock(t.mu, std::try_to_lock);
  if (!lock.owns_lock()) {
    py::gil_scoped_release no_gil;
    lock.lock();
  }
  return lock;
}

py::object opt_index(int32_t i) {
  return i < 0 ? py::object(py::none()) : py::object(py::int_(i));
}

// An argument (or return) as the op's function sees it: NOTE [Op values
// reach Python by their schema type] (python_interop.h). With no schema
// argument, by the value alone.
py::object arg_to_py(const c10::IValue& iv, const c10::Argument* arg) {
  return to_py(iv, arg == nullptr ? *c10::AnyType::get() : *arg->real_type());
}

// ------------------------------------------------------------------ snapshot
// A snapshot is (values, inputs, groups, entries) in plain Python objects; a
// value in `entries` is its index into `values`.

py::list values_to_py(const std::vector<Value>& values) {
  py::list vs;
  for (const auto& v : values) {
    const auto& sizes = v.layout.sizes;
    py::tuple shape(sizes.size());
    for (const auto i : c10::irange(sizes.size())) {
      shape[i] = sizes[i];
    }
    vs.append(
        py::make_tuple(
            v.num, shape,
            py::reinterpret_borrow<py::object>(
                reinterpret_cast<PyObject*>(torch::getTHPDtype(v.layout.dtype))),
            opt_index(v.node)));
  }
  return vs;
}

py::list inputs_to_py(const std::vector<Input>& inputs) {
  py::list is;
  for (const auto& i : inputs) {
    is.append(py::make_tuple(i.value, i.name, i.requires_grad));
  }
  return is;
}

py::list groups_to_py(const std::vector<Group>& groups) {
  py::list gs;
  for (const auto& g : groups) {
    gs.append(py::make_tuple(g.pass, *g.name, opt_index(g.node), opt_index(g.value)));
  }
  return gs;
}

// (group, op id or -1, args, outs, refs): the int lists of the pool in place,
// the tensor values' places in `refs`.
py::tuple entry_to_py(const Entry& e, const std::vector<int64_t>& ints) {
  py::list args, outs;
  const auto* schema = e.op == nullptr ? nullptr : e.op->schema;
  auto typed = [&](bool out, size_t i) -> const c10::Argument* {
    if (schema == nullptr) {
      return nullptr;
    }
    const auto& list = out ? schema->returns() : schema->arguments();
    return i < list.size() ? &list[i] : nullptr;
  };
  for (const auto i : c10::irange(e.args.size())) {
    args.append(arg_to_py(e.args[i], typed(false, i)));
  }
  for (const auto i : c10::irange(e.outs.size())) {
    outs.append(arg_to_py(e.outs[i], typed(true, i)));
  }
  for (const auto& r : e.refs) {
    if (r.value < 0) { // an int list in the pool (a ScalarType[] too)
      c10::List<int64_t> list;
      for (auto k = r.elem; k < r.elem - 1 - r.value; ++k) {
        list.push_back(ints[k]);
      }
      (r.out ? outs : args)[r.pos] = arg_to_py(list, typed(r.out, r.pos));
    }
  }
  py::list refs;
  for (const auto& r : e.refs) {
    if (r.value >= 0) {
      refs.append(py::make_tuple(r.out, r.pos, r.elem, r.value));
    }
  }
  return py::make_tuple(e.group, e.op == nullptr ? -1 : e.op->id, args, outs, refs);
}

py::tuple snapshot(TraceImpl& t) {
  auto lock = lock_from_python(t);
  const auto values = t.values;
  const auto inputs = t.inputs;
  const auto groups = t.groups;
  const auto entries = t.entries;
  const auto ints = t.ints;
  lock.unlock();
  py::list es;
  for (const auto& e : entries) {
    es.append(entry_to_py(e, ints));
  }
  return py::make_tuple(values_to_py(values), inputs_to_py(inputs), groups_to_py(groups), es);
}

// ------------------------------------------------------------------ bindings
using TraceClass = py::class_<TraceImpl, std::shared_ptr<TraceImpl>>;

// What Python reads of a record: its state and how it knows a tensor.
void bind_trace_state(TraceClass& cls) {
  cls.def(py::init<>())
      .def_readonly("id", &TraceImpl::id)
      .def_property_readonly(
          "version",
          [](TraceImpl& t) {
            const auto lock = lock_from_python(t);
            return t.version;
          })
      .def_property_readonly(
          "saw_transform",
          [](TraceImpl& t) {
            const auto lock = lock_from_python(t);
            return t.saw_transform;
          })
      .def("snapshot", &snapshot)
      .def("__len__", [](TraceImpl& t) {
        const auto lock = lock_from_python(t);
        return t.entries.size();
      });
}

// The record's inputs and values, by tensor.
void bind_trace_tensors(TraceClass& cls) {
  cls.def(
         "add_input",
         [](TraceImpl& t, const at::Tensor& x, std::string name) {
           const auto lock = lock_from_python(t);
           const auto it = t.ids.find(x.unsafeGetTensorImpl());
           if (it != t.ids.end() && t.values[it->second].num < 0 &&
               t.values[it->second].layout.matches(x)) {
             return it->second;
           }
           return t.add_input(x, std::move(name));
         })
      .def(
          "value_of",
          [](TraceImpl& t, const at::Tensor& x) {
            const auto lock = lock_from_python(t);
            const auto it = t.ids.find(x.unsafeGetTensorImpl());
            return it != t.ids.end() && t.values[it->second].layout.matches(x) ? it->second : -1;
          })
      .def("input_tensor", [](TraceImpl& t, int32_t k) -> py::object {
        at::Tensor x;
        {
          const auto lock = lock_from_python(t);
          const auto& input = t.inputs.at(k);
          x = input.held.defined() ? input.held : at::Tensor(input.weak->lock());
        }
        if (!x.defined()) {
          return py::none();
        }
        return py::reinterpret_steal<py::object>(THPVariable_Wrap(x));
      });
}

// The thread's tracing state, and op names by id.
void bind_thread_state(py::module_& m) {
  m.def("_op_name", [](int32_t id) {
    const auto [name, overload] = op_name(id);
    return py::make_tuple(name, overload);
  });
  m.def("_trace_push", &push_block);
  m.def("_trace_pop", &pop_block);
  m.def("_current_trace", &current_trace);
  m.def("_tracing_installed", [] { return callback_installed(tls); });
}

} // namespace
} // namespace torch_autobatch::tracer

namespace torch_autobatch {

void bind_tracer(pybind11::module_& m) {
  tracer::TraceClass cls(m, "_TraceImpl");
  tracer::bind_trace_state(cls);
  tracer::bind_trace_tensors(cls);
  tracer::bind_thread_state(m);
}

} // namespace torch_autobatch
