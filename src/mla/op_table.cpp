// The kernel table's lookup (op_table.hpp); each backend's rows are in its
// own file (op_table_cpu.cpp, the CUDA backend's).
#include "mla/op_table.hpp"

#include "core/error.hpp"

namespace laga::ops {

const char* to_string(Device d) {
  return d == Device::cuda ? "cuda" : "cpu";
}

const char* to_string(Op op) {
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
    case Op::embedding_forward:
      return "embedding_forward";
    case Op::embedding_backward:
      return "embedding_backward";
    case Op::swiglu_forward:
      return "swiglu_forward";
    case Op::swiglu_backward:
      return "swiglu_backward";
    case Op::cross_entropy:
      return "cross_entropy";
    case Op::adamw:
      return "adamw";
  }
  return "unknown op";
}

std::span<const KernelRow> kernel_rows(Device device) {
  switch (device) {
    case Device::cpu:
      return cpu_kernel_rows();
    case Device::cuda:
#if defined(LAGA_HAVE_CUDA)
      return cuda_kernel_rows();
#else
      return {};
#endif
  }
  return {};
}

std::vector<Device> devices_built() {
  std::vector<Device> d{Device::cpu};
#if defined(LAGA_HAVE_CUDA)
  d.push_back(Device::cuda);
#endif
  return d;
}

KernelChoice supports(Device device, Op op, RunDtype dtype, const OpShape& shape) {
  KernelChoice best;
  std::string refusals;
  bool any_row = false;
  for (const KernelRow& r : kernel_rows(device)) {
    if (r.op != op) continue;
    any_row = true;
    const std::optional<std::string> why = r.why_not ? r.why_not(dtype, shape) : std::nullopt;
    if (why) {
      refusals += std::string(refusals.empty() ? "" : "; ") + r.name + ": " + *why;
      continue;
    }
    if (!best.row || r.rank < best.row->rank) best.row = &r;
  }
  if (best.row) return best;
  best.why_not = std::string(to_string(op)) + " " + to_string(dtype) + " on " + to_string(device);
  if (!any_row)
    best.why_not += ": no kernel for this op on " + std::string(to_string(device)) +
                    (device == Device::cuda && kernel_rows(device).empty()
                         ? " (this build has no CUDA backend; build with nvcc present)"
                         : "");
  else
    best.why_not += ": no kernel takes it (" + refusals + ")";
  return best;
}

const KernelRow& pick(Device device, Op op, RunDtype dtype, const OpShape& shape) {
  const KernelChoice c = supports(device, op, dtype, shape);
  if (!c) fail(c.why_not);
  return *c.row;
}

}  // namespace laga::ops
