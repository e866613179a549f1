// torch_autobatch.trace's recorder: C++, so that recording an op costs no trip
// into Python. The Python layer (torch_autobatch/tracing/_tracer.py) names, lists and
// replays what it recorded. The recorder's files: trace_record.h (what they
// share), trace_record.cpp, trace_hooks.cpp, trace_observer.cpp,
// trace_bindings.cpp (this function), torch_internals.h (the torch internals
// they use).
#pragma once

#include <pybind11/pybind11.h>

namespace torch_autobatch {

// Adds _C._TraceImpl and the functions that push, pop and query the
// thread's tracing state.
void bind_tracer(pybind11::module_& m);

} // namespace torch_autobatch
