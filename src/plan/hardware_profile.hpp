// A hardware profile: what `laga plan` needs to know about one device and the
// links between devices (docs/planning.md, "Profiles", has the schema and the
// public source of every shipped number).
//
//   {
//     "name": "h100",
//     "description": "...",
//     "device": {
//       "peak_flops": {"fp32": 67e12, "bf16": 989.4e12,    // FLOP/s; null: not published
//                      "fp8": 1978.9e12},                  // optional (--fp8)
//       "efficiency": {"gemm": 0.6, "attention": 0.4},     // achieved / peak, in (0, 1]
//       "elementwise_bytes_per_s": 3.35e12,                // optional; default: memory_bytes_per_s
//       "exp_per_s": 2e8,                                  // optional; default: not priced
//       "memory_bytes": 80e9,                              // device memory
//       "memory_bytes_per_s": 3.35e12                      // device memory bandwidth
//     },
//     "devices_per_node": 8,
//     "shared_cores": 2,                                   // optional: ranks as host threads
//     "intra_node": {"bytes_per_s": 450e9, "latency_us": 3, "topology": "switch"},
//     "inter_node": {"bytes_per_s": 50e9, "latency_us": 5, "topology": "switch"},
//     "measured_shapes": {                                 // optional: `laga plan --measure`
//       "dtype": "fp32",                                   // optional: the timings' element type
//       "gemm": [{"trans_a": false, "trans_b": true, "m": 512, "n": 272, "k": 256,
//                 "lda": 256, "ldb": 256, "ldc": 272, "accumulate": false,
//                 "seconds": 1.2e-4}, ...],
//       "attention": [{"kernel": "flash", "pass": "forward", "B": 1, "Sq": 1024,
//                      "Sk": 1024, "Hq": 2, "Hk": 2, "dqk": 32, "dv": 16,
//                      "causal": true, "seconds": 4.1e-3}, ...]
//     }
//   }
//
// Link bandwidths are per direction per device (comm/link_model.hpp); the
// inter-node link is one device's share of its node's network. Every field
// but elementwise_bytes_per_s, exp_per_s and measured_shapes is required; an unknown
// key, a missing one, a wrong type, a non-finite, zero or negative number is
// a laga::Error naming the source and the field.
//
// exp_per_s: the exponentials one device evaluates a second in the
// elementwise kernels that call one per element (SwiGLU's silu, the MoE
// gate's sigmoid, the cross-entropy's softmax), each loop at that rate
// (`laga plan --measure` times swiglu_forward, one exp and a division per
// element, on one thread). On a CPU these loops run at a few ns an element,
// ten times what their bytes cost at the copy bandwidth; on a GPU the
// special-function units keep them memory-bound, so the shipped GPU
// profiles leave it out and the time model prices their bytes alone.
//
// shared_cores: the ranks do not each have a device but run as threads of
// one host of this many cores, as laga's in-process ranks do (`laga plan
// --measure` writes it: this machine's cores). The time model then runs the
// ranks' timelines together and shares the cores among the ranks computing
// at once (plan/time_model.hpp, group_step_time); the ranks are one node,
// whatever devices_per_node says. Absent: one device per rank.
//
// measured_shapes: the seconds one call of each GEMM and attention kernel
// shape took on one device, as `laga plan --measure` times them for the
// shapes of the plan it is given (fp32, laga's own kernels, one thread), or
// as scripts/time_shapes_torch.py times the shapes `laga plan --list-shapes`
// lists on a GPU (bf16, cuBLAS and torch's attention). `dtype` says which
// element type the timings are of (default fp32); the time model uses a
// shape's own time for plans of that dtype, where the profile has it, and
// the efficiency figures otherwise (plan/time_model.hpp).
//
// The shipped profiles (profiles/*.json) are compiled into the binary by
// CMake (src/plan/CMakeLists.txt), so `laga plan --profile h100` works from
// the build tree, an install or a fresh clone alike; --profile FILE reads
// any other.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/link_model.hpp"
#include "core/precision.hpp"
#include "mla/ops.hpp"

namespace laga {

// The element type a plan is made for: bf16 (training's) or fp32 (what laga
// runs on the CPU).
enum class PlanDType { fp32, bf16 };
const char* to_string(PlanDType t);  // "fp32", "bf16"
PlanDType parse_plan_dtype(const std::string& s);
std::int64_t element_bytes(PlanDType t);  // 4, 2
// The bytes of one gradient element a plan holds and all-reduces: 4 unless
// a bf16 plan reduces its gradients in bf16 (--grad-reduce bf16). A bf16
// trainer keeps fp32 gradients by default: laga's runs reduce in fp32
// (core/precision.hpp, GradReduce), Megatron forces fp32 gradient
// accumulation and all-reduce under bf16 unless --grad-reduce-in-bf16, and
// DeepSeek-V3 keeps its weight gradients in fp32.
std::int64_t gradient_bytes(PlanDType t, GradReduce g);
// The run precision a plan of `t` stands for (what check_grad_reduce
// reads: bf16 gradients need a bf16 plan).
Precision precision_of(PlanDType t);

struct DeviceProfile {
  std::optional<double> peak_flops_fp32, peak_flops_bf16;  // absent: not published
  std::optional<double> peak_flops_fp8;                    // optional key; absent: not published
  double gemm_efficiency = 0, attention_efficiency = 0;    // achieved fraction of peak
  double elementwise_bytes_per_s = 0;                      // what memory-bound ops reach
  double exp_per_s = 0;  // the elementwise kernels' exponentials a second; 0: not priced
  double memory_bytes = 0;
  double memory_bytes_per_s = 0;
};

// Seconds per call of each kernel shape, measured in `dtype` on one device.
struct ShapeTimes {
  PlanDType dtype = PlanDType::fp32;  // the plans these timings cost
  std::map<ops::GemmCall, double> gemm;
  std::map<ops::AttentionCall, double> attention;
};

struct HardwareProfile {
  std::string name, description;
  std::string source;  // "built-in h100" or the file's path
  DeviceProfile device;
  int devices_per_node = 1;
  int shared_cores = 0;  // 0: one device per rank; else the host's cores all ranks share
  LinkModel intra_node, inter_node;
  ShapeTimes measured_shapes;  // empty unless measured (laga plan --measure)

  // Peak FLOP/s in `t`; a laga::Error naming the profile when not published.
  double peak_flops(PlanDType t) const;
  // Dense FP8 GEMM FLOP/s (`laga plan --model --fp8`); a laga::Error naming
  // the profile when it has none.
  double peak_flops_fp8() const;
};

// Parses and validates one profile; `source` names it in every error.
HardwareProfile parse_profile(const std::string& json_text, const std::string& source);
// A built-in profile by name (builtin_profile_names()), else a file's path.
HardwareProfile load_profile(const std::string& name_or_path);
std::vector<std::string> builtin_profile_names();
// The profile as JSON in the schema above (parse_profile reads it back).
std::string profile_json(const HardwareProfile& p);
// The GEMM and attention call shapes of `calls` in measured_shapes' fields,
// each with its "calls" and "flops" instead of "seconds" (`laga plan
// --list-shapes`: what a device timer, scripts/time_shapes_torch.py, times).
// Attention calls whose extents do not say what they cost are left out
// (AttentionCall::costed_by_extents: empty calls, document starts).
std::string shape_list_json(const ops::OpCounts& calls);

}  // namespace laga
