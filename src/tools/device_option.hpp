// --device cpu|cuda on laga forward, verify and compare (issue 52; docs/
// build.md, "The CUDA backend"). Parsed to ops::Device (mla/op_table.hpp),
// never kept as a string.
//
// --device emulated runs the blocks on the emulated device (core/device.hpp):
// the device code path on the CPU, its results the CPU's bit for bit. --device
// cuda is refused, with one sentence naming what is missing: the backend (a
// build without it), the device (cuda/device.hpp's reason), or, with a GPU,
// this tool's CUDA rows (it does not load cuBLASLt/cuDNN/NCCL; the program
// that runs the forms on a GPU is laga_cuda_check forms).
#pragma once

#include <memory>
#include <string>

#include "mla/op_table.hpp"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace laga::tools {

// Adds --device to `app`, writing the parsed enum into *device (default cpu).
CLI::Option* add_device_option(CLI::App& app, std::shared_ptr<ops::Device> device);

// Empty when `laga <command>` runs its blocks on `device` here; otherwise the
// refusal, one sentence.
std::string device_refusal(ops::Device device, const std::string& command);
// Throws laga::Error with device_refusal's words when it is not empty.
void require_device(ops::Device device, const std::string& command);

}  // namespace laga::tools
