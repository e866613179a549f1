// The Python/C++ boundary helpers of python_interop.h.
#include "python_interop.h"

#include <c10/util/SmallVector.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

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

const std::vector<PythonSideName>& python_side() {
  // In PyNames' field order. nargs: the arguments each call passes after
  // self; -1 for an attribute that is read, not called.
  static const std::vector<PythonSideName> names{
      {"_setup_autograd", 3, "op"}, // (inputs, output, needs_input_grad)
      {"_run_backward", 2, "op"}, // (ctx, grads)
      {"_run_jvp", 4, "op"}, // (inputs, outputs, tangents, needs_input_grad)
      {"_composite_tangents", 2, "op"}, // (positional, kwargs)
      {"_run_vmap_rule", 2, "op"}, // (positional, kwargs)
      {"_check_aliasing", 3, "op"}, // (args, kwargs, result)
      {"_dissolves_in_trace", 0, "op"},
      {"_run_vmapped_companion", 1, "op"}, // (args)
      {"_backward_fn_name", -1, "op"},
      {"_jvp_fn_name", -1, "op"},
      {"_verify_vjp_fwd", 5, "op"}, // (args, kwargs, result, check, keyed)
      {"_backend_fns", -1, "op"}, // torch's CustomOpDef attribute
      {"to_save", -1, "ctx"},
      {"non_differentiable", -1, "ctx"},
      {"materialize_grads", -1, "ctx"},
  };
  return names;
}

const PyNames& py_names() {
  static_assert(sizeof(PyNames) == 15 * sizeof(PyObject*), "python_side() lists 15 names");
  static const PyNames names = [] {
    const auto& side = python_side();
    TORCH_INTERNAL_ASSERT(side.size() == 15, "python_side() and PyNames disagree");
    auto intern = [&](size_t i) { return PyUnicode_InternFromString(side[i].name); };
    return PyNames{intern(0),  intern(1),  intern(2),  intern(3),  intern(4),
                   intern(5),  intern(6),  intern(7),  intern(8),  intern(9),
                   intern(10), intern(11), intern(12), intern(13), intern(14)};
  }();
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

namespace {

py::object borrowed(PyObject* obj) {
  return py::reinterpret_borrow<py::object>(obj);
}

// Does a value of `type` need its schema type to reach Python right?
bool schema_typed(const c10::Type& type) {
  switch (type.kind()) {
    case c10::TypeKind::ScalarTypeType:
    case c10::TypeKind::LayoutType:
    case c10::TypeKind::MemoryFormatType:
      return true;
    case c10::TypeKind::OptionalType:
      return schema_typed(*type.castRaw<c10::OptionalType>()->getElementType());
    case c10::TypeKind::ListType:
      return schema_typed(*type.castRaw<c10::ListType>()->getElementType());
    default:
      return false;
  }
}

} // namespace

py::object to_py(const c10::IValue& value, const c10::Type& type) {
  switch (type.kind()) {
    case c10::TypeKind::ScalarTypeType:
      if (value.isInt()) {
        return borrowed(
            reinterpret_cast<PyObject*>(
                torch::getTHPDtype(static_cast<c10::ScalarType>(value.toInt()))));
      }
      break;
    case c10::TypeKind::LayoutType:
      if (value.isInt()) {
        return borrowed(
            reinterpret_cast<PyObject*>(
                torch::getTHPLayout(static_cast<c10::Layout>(value.toInt()))));
      }
      break;
    case c10::TypeKind::MemoryFormatType:
      if (value.isInt()) {
        return borrowed(
            torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(value.toInt())));
      }
      break;
    case c10::TypeKind::OptionalType:
      if (!value.isNone()) {
        return to_py(value, *type.castRaw<c10::OptionalType>()->getElementType());
      }
      break;
    case c10::TypeKind::ListType: {
      const auto& elem = *type.castRaw<c10::ListType>()->getElementType();
      if (value.isList() && schema_typed(elem)) {
        const auto items = value.toListRef();
        py::list out(items.size());
        for (size_t i = 0; i < items.size(); ++i) {
          out[i] = to_py(items[i], elem);
        }
        return std::move(out);
      }
      break;
    }
    default:
      break;
  }
  return torch::jit::toPyObject(value);
}

py::tuple to_py_tuple(c10::ArrayRef<c10::IValue> values, const std::vector<c10::Argument>& schema) {
  TORCH_INTERNAL_ASSERT(values.size() == schema.size());
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    out[i] = to_py(values[i], *schema[i].real_type());
  }
  return out;
}

namespace {

bool is_default(const c10::IValue& value, const c10::Argument& arg) {
  const auto& def = arg.default_value();
  return def.has_value() && *def == value;
}

} // namespace

PassedArguments passed_arguments(
    c10::ArrayRef<c10::IValue> values,
    const std::vector<c10::Argument>& schema) {
  TORCH_INTERNAL_ASSERT(values.size() == schema.size());
  PassedArguments passed;
  size_t first_kwarg = 0;
  while (first_kwarg < schema.size() && !schema[first_kwarg].kwarg_only()) {
    ++first_kwarg;
  }
  passed.num_positional = first_kwarg;
  while (passed.num_positional > 0 &&
         is_default(values[passed.num_positional - 1], schema[passed.num_positional - 1])) {
    --passed.num_positional;
  }
  for (size_t a = first_kwarg; a < schema.size(); ++a) {
    if (!is_default(values[a], schema[a])) {
      passed.keywords.push_back(a);
    }
  }
  return passed;
}

std::pair<py::tuple, py::dict> to_py_call(
    c10::ArrayRef<c10::IValue> values,
    const std::vector<c10::Argument>& schema) {
  const PassedArguments passed = passed_arguments(values, schema);
  py::tuple args(passed.num_positional);
  for (size_t a = 0; a < passed.num_positional; ++a) {
    args[a] = to_py(values[a], *schema[a].real_type());
  }
  py::dict kwargs;
  for (size_t a : passed.keywords) {
    kwargs[py::str(schema[a].name())] = to_py(values[a], *schema[a].real_type());
  }
  return {std::move(args), std::move(kwargs)};
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

} // namespace torch_autobatch
