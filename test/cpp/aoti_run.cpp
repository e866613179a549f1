// Runs an AOTInductor package with libtorch alone, no Python: what a C++
// deployment of a model using torch_autobatch ops does (test/test_aoti.py).
//
//   aoti_run PACKAGE.pt2 OUTPUT.bin INPUT.bin:D0,D1,... [INPUT.bin:D0,...]...
//
// Inputs are raw float32 (C order) with their shapes; the first output is
// written raw float32.
#include <ATen/ops/from_blob.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

at::Tensor read_input(const std::string& spec) {
  const auto colon = spec.rfind(':');
  std::vector<int64_t> shape;
  std::stringstream dims(spec.substr(colon + 1));
  for (std::string d; std::getline(dims, d, ',');) {
    shape.push_back(std::stoll(d));
  }
  std::ifstream in(spec.substr(0, colon), std::ios::binary | std::ios::ate);
  std::vector<float> data(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(
      reinterpret_cast<char*>(data.data()),
      static_cast<std::streamsize>(data.size() * sizeof(float)));
  return at::from_blob(data.data(), shape, at::kFloat).clone();
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s PACKAGE.pt2 OUTPUT.bin INPUT.bin:D0,D1,...\n", argv[0]);
    return 2;
  }
  std::vector<at::Tensor> inputs;
  for (int i = 3; i < argc; ++i) {
    inputs.push_back(read_input(argv[i]));
  }
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  const at::Tensor out = loader.run(inputs).at(0).contiguous();
  std::ofstream(argv[2], std::ios::binary)
      .write(
          reinterpret_cast<const char*>(out.data_ptr<float>()),
          static_cast<std::streamsize>(out.numel() * sizeof(float)));
  return 0;
}
