// NOTE [nlohmann stub]
// ATen/functorch/Interpreter.h includes <nlohmann/json.hpp>, which the torch
// wheel does not ship. It needs it only for Interpreter::serialize /
// deserialize, which torch_autobatch never calls. This stub declares just
// enough for that header to compile; calling it throws. It is included only
// through csrc/functorch.h, and the extension is built with
// -fvisibility=hidden, so nothing of it is visible outside our module.
#pragma once

#include <stdexcept>
#include <string>

namespace nlohmann {

class json {
 public:
  json() = default;
  template <typename T>
  json(const T&) {}
  std::string dump() const {
    throw std::logic_error("torch_autobatch: nlohmann::json stub called");
  }
  static json parse(const std::string&) {
    throw std::logic_error("torch_autobatch: nlohmann::json stub called");
  }
  template <typename T>
  T get() const {
    throw std::logic_error("torch_autobatch: nlohmann::json stub called");
  }
};

} // namespace nlohmann
