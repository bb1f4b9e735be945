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
            for (Device d : {Device::cpu, Device::cuda, Device::emulated})
              if (s == to_string(d)) *device = d;
          },
          "where the blocks run: cpu; emulated (the device code path on the CPU: a device "
          "pool, uploads at the block's boundary, the device-local transport, the CPU's "
          "kernels checked to read device memory; for testing, docs/architecture.md); or cuda "
          "(refused by this tool: laga_cuda_check forms runs the forms on a GPU, docs/build.md)")
      ->check(CLI::IsMember(
          {to_string(Device::cpu), to_string(Device::emulated), to_string(Device::cuda)}))
      ->default_str("cpu");
}

std::string device_refusal(ops::Device device, const std::string& command) {
  if (device != Device::cuda) return {};
  const std::string who = "laga " + command + " --device cuda: ";
#if defined(LAGA_HAVE_CUDA)
  const std::string missing = cuda::device_unavailable_reason();
  if (!missing.empty()) return who + missing;
  return who +
         "this tool does not load the CUDA backend (cuBLASLt, cuDNN and NCCL would cost every "
         "laga start ~250 MB resident); run the forms on the GPU with laga_cuda_check forms "
         "(scripts/gpu_check.sh, docs/build.md), or use --device cpu or emulated";
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
