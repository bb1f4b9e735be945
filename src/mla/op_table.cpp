// The kernel table's lookup (op_table.hpp); each backend's rows are in its
// own file (op_table_cpu.cpp, the CUDA backend's).
#include "mla/op_table.hpp"

#include <atomic>

#include "core/error.hpp"

namespace laga {

const char* to_string(ops::Op op) {
  using ops::Op;
  switch (op) {
    case Op::gemm:
      return "gemm";
    case Op::attention_forward:
      return "attention_forward";
    case Op::attention_backward:
      return "attention_backward";
    case Op::latent_attention_forward:
      return "latent_attention_forward";
    case Op::latent_attention_backward:
      return "latent_attention_backward";
    case Op::fused_latent_attention_forward:
      return "fused_latent_attention_forward";
    case Op::fused_latent_attention_backward:
      return "fused_latent_attention_backward";
    case Op::lse_merge:
      return "lse_merge";
    case Op::rmsnorm_forward:
      return "rmsnorm_forward";
    case Op::rmsnorm_backward:
      return "rmsnorm_backward";
    case Op::rope_forward:
      return "rope_forward";
    case Op::rope_backward:
      return "rope_backward";
    case Op::sparse_attention_forward:
      return "sparse_attention_forward";
    case Op::sparse_attention_backward:
      return "sparse_attention_backward";
    case Op::layernorm_forward:
      return "layernorm_forward";
    case Op::layernorm_backward:
      return "layernorm_backward";
    case Op::rope_halves_forward:
      return "rope_halves_forward";
    case Op::rope_halves_backward:
      return "rope_halves_backward";
    case Op::index_topk:
      return "index_topk";
    case Op::index_all_causal:
      return "index_all_causal";
    case Op::indexer_kl:
      return "indexer_kl";
    case Op::kv_fp8_round_trip:
      return "kv_fp8_round_trip";
    case Op::copy_rows:
      return "copy_rows";
    case Op::fill:
      return "fill";
    case Op::embedding_forward:
      return "embedding_forward";
    case Op::embedding_backward:
      return "embedding_backward";
    case Op::swiglu_forward:
      return "swiglu_forward";
    case Op::swiglu_backward:
      return "swiglu_backward";
    case Op::output_gate_forward:
      return "output_gate_forward";
    case Op::output_gate_backward:
      return "output_gate_backward";
    case Op::cross_entropy:
      return "cross_entropy";
    case Op::cross_entropy_backward:
      return "cross_entropy_backward";
    case Op::adamw:
      return "adamw";
  }
  return "unknown op";
}

}  // namespace laga

namespace laga::ops {

namespace {
// The CUDA rows, once registered: by use_cuda_backend from the module it
// loads (mla/cuda_backend.cpp), or by a program that links the backend
// (laga_mla itself does not link it: src/cuda/CMakeLists.txt says why).
std::atomic<const KernelRow*> cuda_rows{nullptr};
std::atomic<std::size_t> cuda_row_count{0};
std::span<const KernelRow> registered_cuda_rows() {
  return {cuda_rows.load(), cuda_row_count.load()};
}
}  // namespace

void register_kernel_rows(Device device, std::span<const KernelRow> rows) {
  LAGA_CHECK(device == Device::cuda, "register_kernel_rows: ", to_string(device),
             "'s rows are built in; only the CUDA backend registers its rows");
  cuda_row_count.store(0);
  cuda_rows.store(rows.data());
  cuda_row_count.store(rows.size());
}

std::span<const KernelRow> emulated_kernel_rows() {
  static const std::vector<KernelRow> rows = [] {
    std::vector<KernelRow> r(cpu_kernel_rows().begin(), cpu_kernel_rows().end());
    for (KernelRow& k : r) k.device = Device::emulated;
    return r;
  }();
  return rows;
}

namespace {
// Slots that hold host-side indices, not device operands: RoPE's per-token
// positions (the step's, in[0]; the CUDA row stages them to the device
// itself) and the model ops' token ids and targets (the model does not run
// on a device yet).
bool host_index_slot(Op op, int in_slot) {
  switch (op) {
    case Op::rope_forward:
    case Op::rope_backward:
      return in_slot == 0;
    case Op::embedding_forward:
      return in_slot == 0;
    case Op::embedding_backward:
    case Op::cross_entropy:
      return in_slot == 1;
    case Op::cross_entropy_backward:
      return in_slot == 2;
    default:
      return false;
  }
}

std::atomic<std::int64_t> calls_on[3];  // by Device
}  // namespace

std::int64_t kernel_calls(Device device) {
  return calls_on[static_cast<int>(device)].load();
}

void run_row(const KernelRow& row, const OpCall& c) {
  calls_on[static_cast<int>(row.device)].fetch_add(1, std::memory_order_relaxed);
  DeviceMemory* memory = row.device == Device::cpu ? nullptr : device_memory(row.device);
  if (row.device != Device::cpu)
    LAGA_CHECK(memory, to_string(c.op), " on ", to_string(row.device),
               ": no device memory is registered for it in this process");
  if (memory && memory->checks_operands()) {
    auto check = [&](const void* p, const char* side, int slot) {
      LAGA_CHECK(!p || memory->holds(p, 1), to_string(c.op), " on ", to_string(row.device), " (",
                 row.name, "): operand ", side, "[", slot,
                 "] is not device memory (a host buffer handed to a device kernel; every "
                 "operand of a device op must be a tensor of the rank's device pool)");
    };
    for (int i = 0; i < 8; ++i)
      if (!host_index_slot(c.op, i)) check(c.in[i], "in", i);
    for (int i = 0; i < 4; ++i) check(c.out[i], "out", i);
    // The workspace is where its bytes are (a call with none may point one
    // past its scratch's end).
    if (c.workspace_bytes > 0)
      LAGA_CHECK(memory->holds(c.workspace, c.workspace_bytes), to_string(c.op), " on ",
                 to_string(row.device), " (", row.name, "): its workspace (", c.workspace_bytes,
                 " bytes) is not device memory");
  }
  row.run(c);
  if (memory) memory->synchronize();
}

std::span<const KernelRow> kernel_rows(Device device) {
  switch (device) {
    case Device::cpu:
      return cpu_kernel_rows();
    case Device::emulated:
      return emulated_kernel_rows();
    case Device::cuda:
      return registered_cuda_rows();
  }
  return {};
}

std::vector<Device> devices_built() {
  std::vector<Device> d{Device::cpu, Device::emulated};
  if (!registered_cuda_rows().empty()) d.push_back(Device::cuda);
  return d;
}

KernelChoice supports(Device device, Op op, RunDtype dtype, const OpShape& shape) {
  KernelChoice best;
  bool any_row = false;
  for (const KernelRow& r : kernel_rows(device)) {
    if (r.op != op) continue;
    any_row = true;
    if (r.why_not && r.why_not(dtype, shape)) continue;
    if (!best.row || r.rank < best.row->rank) best.row = &r;
  }
  if (best.row) return best;
  // None takes it: every row's reason, asked again (a refusal is the rare
  // case; a call that is taken builds no message).
  best.why_not = std::string(to_string(op)) + " " + to_string(dtype) + " on " + to_string(device);
  if (!any_row) {
    best.why_not += ": no kernel for this op on " + std::string(to_string(device));
    if (device == Device::cuda && kernel_rows(device).empty())
      best.why_not +=
          " (no CUDA backend in this process: a build without nvcc has none; `laga --device "
          "cuda` loads its module, liblaga_cuda_backend.so, and registers its rows, and a "
          "program that links it registers them itself, as laga_cuda_forms does)";
    return best;
  }
  std::string refusals;
  for (const KernelRow& r : kernel_rows(device))
    if (r.op == op)
      refusals += std::string(refusals.empty() ? "" : "; ") + r.name + ": " +
                  r.why_not(dtype, shape).value_or("?");
  best.why_not += ": no kernel takes it (" + refusals + ")";
  return best;
}

const KernelRow& pick(Device device, Op op, RunDtype dtype, const OpShape& shape) {
  const KernelChoice c = supports(device, op, dtype, shape);
  if (!c) fail(c.why_not);
  return *c.row;
}

}  // namespace laga::ops
