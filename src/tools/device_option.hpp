// --device cpu|cuda on laga forward, verify and compare (issue 52; docs/
// build.md, "The CUDA backend"). Parsed to ops::Device (mla/op_table.hpp),
// never kept as a string.
//
// What --device cuda does today: it is refused, with one sentence naming
// what is missing and what to do. In a build without the CUDA backend the
// backend is missing; in one with it, on a machine without a usable GPU,
// the device is (cuda/device.hpp's reason); and with a GPU, the forms:
// the CUDA backend's ops are in the kernel table and laga_cuda_check runs
// each against the CPU, but no form routes its block through them yet.
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
