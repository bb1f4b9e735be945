// laga kernels: a backend's kernel table as this process has it
// (mla/op_table.hpp), one row per kernel: the op, the kernel's name, its rank
// among the rows of that op. --device cuda loads the CUDA backend's module
// (mla/cuda_backend.hpp) and lists its rows, with or without a GPU: what the
// host test tools_cuda_backend_module compares with the CPU's table.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "mla/cuda_backend.hpp"
#include "mla/op_table.hpp"
#include "tools/cli_common.hpp"
#include "tools/commands.hpp"
#include "tools/device_option.hpp"

namespace laga::tools {
namespace {

using ojson = nlohmann::ordered_json;

struct KernelsOptions {
  std::string json;
  Device device = Device::cpu;
};

void run_kernels(const KernelsOptions& o) {
  vet_outputs({{"--json", o.json}});
  ojson doc = {{"device", to_string(o.device)}};
  std::span<const ops::KernelRow> rows = ops::kernel_rows(o.device);
  if (o.device == Device::cuda) {
    // The module's rows, without asking for a device: listing runs nothing.
    try {
      const ops::CudaBackendApi& api = ops::load_cuda_backend();
      rows = api.rows();
      doc["module"] = ops::cuda_backend_path();
      doc["abi_version"] = api.abi_version;
      doc["device_missing"] = api.device_unavailable_reason();
    } catch (const Error& e) {
      fail("laga kernels --device cuda: ", e.what());
    }
  }
  ojson list = ojson::array();
  for (const ops::KernelRow& r : rows)
    list.push_back({{"op", laga::to_string(r.op)}, {"kernel", r.name}, {"rank", r.rank}});
  doc["kernels"] = list;
  if (o.json != "-") {
    std::cout << to_string(o.device) << ": " << rows.size() << " kernels\n";
    for (const ops::KernelRow& r : rows)
      std::cout << "  " << laga::to_string(r.op) << "  " << r.name << "  (rank " << r.rank << ")\n";
  }
  if (!o.json.empty()) write_output(o.json, doc.dump(2) + "\n");
}

void register_kernels(CLI::App& app) {
  auto o = std::make_shared<KernelsOptions>();
  auto device = std::make_shared<ops::Device>(ops::Device::cpu);
  CLI::App* c = app.add_subcommand(
      "kernels", "List a backend's kernel table: each op's kernels, in the order they are picked");
  c->add_option("--json", o->json, "write the table as JSON to this file ('-' for stdout)");
  add_device_option(*c, device);
  c->callback([o, device] {
    o->device = *device;
    run_kernels(*o);
  });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_kernels);

}  // namespace laga::tools
