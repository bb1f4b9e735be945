#include "tools/device_option.hpp"

#include <CLI/CLI.hpp>

#include "core/error.hpp"
#include "mla/cuda_backend.hpp"
#include "tools/cli_common.hpp"

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
          "(the GPU: loads the CUDA backend, liblaga_cuda_backend.so beside laga or "
          "$LAGA_CUDA_BACKEND; ranks as threads share the one GPU, or on compare and forward "
          "--comm nccl under mpirun puts one rank on each GPU; docs/build.md, \"The CUDA "
          "backend\")")
      ->check(CLI::IsMember(
          {to_string(Device::cpu), to_string(Device::emulated), to_string(Device::cuda)}))
      ->default_str("cpu");
}

std::string device_refusal(ops::Device device, const std::string& command,
                           const CommOptions& comm) {
  const std::string who = "laga " + command + " --device " + to_string(device) + ": ";
  if (comm.backend == Backend::nccl && device != Device::cuda)
    return who +
           "--comm nccl moves GPU buffers; add --device cuda (one process per GPU under mpirun), "
           "or use --comm local or mpi";
  if (device != Device::cuda) return {};
  if (comm.backend == Backend::mpi)
    return who +
           "--comm mpi moves host buffers and the ranks' blocks are on the GPU; use --comm nccl "
           "(one process per GPU under mpirun; laga compare and forward) or --comm local (ranks "
           "as threads sharing one GPU: the device-local transport)";
  try {
    if (comm.backend == Backend::nccl) {
      // The device's absence first (the same words on every rank), then
      // this process's GPU, before anything is made on one.
      const std::string missing = ops::load_cuda_backend().device_unavailable_reason();
      LAGA_CHECK(missing.empty(), missing);
      pick_nccl_device(comm);
    }
    ops::use_cuda_backend();
  } catch (const Error& e) {
    return who + e.what();
  }
  return {};
}

void require_device(ops::Device device, const std::string& command, const CommOptions& comm) {
  const std::string why = device_refusal(device, command, comm);
  LAGA_CHECK(why.empty(), why);
}

}  // namespace laga::tools
