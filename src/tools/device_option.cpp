#include "tools/device_option.hpp"

#include <CLI/CLI.hpp>

#include "core/error.hpp"
#if defined(LAGA_HAVE_CUDA)
#include "cuda/device.hpp"
#endif

namespace laga::tools {

CLI::Option* add_device_option(CLI::App& app, std::shared_ptr<ops::Device> device) {
  return app
      .add_option_function<std::string>(
          "--device",
          [device](const std::string& s) {
            *device = s == "cuda" ? ops::Device::cuda : ops::Device::cpu;
          },
          "where the blocks run: cpu, or cuda (the CUDA backend: refused until the forms run on "
          "it; laga_cuda_check runs its ops, docs/build.md)")
      ->check(CLI::IsMember({to_string(ops::Device::cpu), to_string(ops::Device::cuda)}))
      ->default_str("cpu");
}

std::string device_refusal(ops::Device device, const std::string& command) {
  if (device == ops::Device::cpu) return {};
  const std::string who = "laga " + command + " --device cuda: ";
#if defined(LAGA_HAVE_CUDA)
  const std::string missing = cuda::device_unavailable_reason();
  if (!missing.empty()) return who + missing;
  return who +
         "the forms do not run on the GPU yet: the CUDA backend's ops are in the kernel table, and "
         "laga_cuda_check runs each of them against the CPU reference (scripts/gpu_check.sh, "
         "docs/performance.md); use --device cpu for the blocks";
#else
  return who +
         "this laga was built without the CUDA backend (LAGA_CUDA=OFF, or CMake found no nvcc "
         "when it was configured); configure on a machine with the CUDA toolkit (docs/build.md, "
         "\"The CUDA backend\"), or use --device cpu";
#endif
}

void require_device(ops::Device device, const std::string& command) {
  const std::string why = device_refusal(device, command);
  LAGA_CHECK(why.empty(), why);
}

}  // namespace laga::tools
