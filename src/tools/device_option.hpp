// --device cpu|cuda on laga forward, verify and compare (issue 52; docs/
// build.md, "The CUDA backend"). Parsed to ops::Device (mla/op_table.hpp),
// never kept as a string.
//
// --device emulated runs the blocks on the emulated device (core/device.hpp):
// the device code path on the CPU, its results the CPU's bit for bit.
// --device cuda loads the CUDA backend's module (mla/cuda_backend.hpp) and
// registers its rows and device memory; it is refused, with one sentence
// naming what is missing, where there is no module (a build without CUDA, no
// file at the path), dlopen fails (its words), the module's ABI differs, or
// there is no usable device (cuda/device.hpp's reason).
#pragma once

#include <memory>
#include <string>

#include "mla/op_table.hpp"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace laga::tools {

struct CommOptions;  // tools/cli_common.hpp

// Adds --device to `app`, writing the parsed enum into *device (default cpu).
CLI::Option* add_device_option(CLI::App& app, std::shared_ptr<ops::Device> device);

// Empty when `laga <command>` runs its blocks on `device` with `comm` here
// (for cuda: after loading and registering the backend, and with --comm
// nccl after picking this process's GPU); otherwise the refusal, one
// sentence. cuda takes --comm local (ranks as threads sharing the GPU) or
// nccl (one process per GPU), not mpi (it moves host buffers); nccl takes
// cuda only.
std::string device_refusal(ops::Device device, const std::string& command, const CommOptions& comm);
// Throws laga::Error with device_refusal's words when it is not empty.
void require_device(ops::Device device, const std::string& command, const CommOptions& comm);

}  // namespace laga::tools
