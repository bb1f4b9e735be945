// The arithmetic precision the block's ops run at on this thread (issue 27,
// --dtype): fp32, or bf16 mixed precision, where every GEMM and attention
// operand is rounded to bf16 and summed in fp32 (src/mla/ops.hpp says what is
// rounded where). It lives here, in core, and not beside ops::CountOps,
// because the in-process communicator starts the rank threads
// (comm/local_comm.cpp) and gives each the precision of the thread that
// started them, and comm does not see the op layer.
//
// A thread-local, set by a scope, in the style of ops::CountOps: form code
// never passes it, so one description of a form runs at either precision.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "core/error.hpp"

namespace laga {

enum class Precision { fp32, bf16 };

inline const char* to_string(Precision p) {
  return p == Precision::bf16 ? "bf16" : "fp32";
}
// "fp32" (or forward's and verify's "float32") or "bf16" (--dtype's
// values); laga::Error naming both otherwise.
inline Precision parse_precision(std::string_view s) {
  if (s == "fp32" || s == "float32") return Precision::fp32;
  if (s == "bf16") return Precision::bf16;
  fail("unknown dtype '", std::string(s), "'; use fp32 or bf16");
}

// What the gradient all-reduce moves under bf16 mixed precision
// (--grad-reduce; src/mla/wire.hpp): fp32, the default, as mixed-precision
// trainers keep it (Megatron-Core's accumulate_allreduce_grads_in_fp32),
// or bf16, half the bytes, each rank's gradient rounded to bf16 and their
// fp32 sum rounded once (comm/communicator.hpp, DType). Under fp32 it is
// always fp32.
// The element types a run can take, as every command's --dtype names them
// (tools/cli_common.hpp, add_dtype_option): fp32 and bf16 (Precision), and
// fp64, the kernels in double (laga verify and laga forward).
enum class RunDtype { fp32, bf16, fp64 };
inline const char* to_string(RunDtype d) {
  return d == RunDtype::fp64 ? "fp64" : d == RunDtype::bf16 ? "bf16" : "fp32";
}
// laga verify's and laga forward's own spellings, which their outputs (JSON,
// file metadata) carry: float32, bf16, float64.
inline const char* float_name(RunDtype d) {
  return d == RunDtype::fp64 ? "float64" : d == RunDtype::bf16 ? "bf16" : "float32";
}
inline std::optional<RunDtype> parse_run_dtype(std::string_view s) {
  if (s == "fp32" || s == "float32") return RunDtype::fp32;
  if (s == "bf16") return RunDtype::bf16;
  if (s == "fp64" || s == "float64") return RunDtype::fp64;
  return std::nullopt;
}

enum class GradReduce { fp32, bf16 };

inline const char* to_string(GradReduce g) {
  return g == GradReduce::bf16 ? "bf16" : "fp32";
}
inline GradReduce parse_grad_reduce(std::string_view s) {
  if (s == "fp32") return GradReduce::fp32;
  if (s == "bf16") return GradReduce::bf16;
  fail("unknown --grad-reduce '", std::string(s), "'; use fp32 or bf16");
}
// bf16 gradients on the wire need bf16 mixed precision: refused otherwise,
// naming both options.
inline void check_grad_reduce(Precision p, GradReduce g) {
  LAGA_CHECK(g == GradReduce::fp32 || p == Precision::bf16,
             "--grad-reduce bf16 needs --dtype bf16 (an fp32 run reduces its gradients in fp32)");
}

// This thread's precision: fp32 (the default) unless a UsePrecision scope says.
inline thread_local Precision op_precision = Precision::fp32;
inline thread_local GradReduce op_grad_reduce = GradReduce::fp32;

// Runs this thread's ops at `p`, its gradient all-reduce at `g`, while it lives.
class UsePrecision {
 public:
  explicit UsePrecision(Precision p, GradReduce g = GradReduce::fp32)
      : previous_(op_precision), previous_reduce_(op_grad_reduce) {
    check_grad_reduce(p, g);
    op_precision = p, op_grad_reduce = g;
  }
  ~UsePrecision() { op_precision = previous_, op_grad_reduce = previous_reduce_; }
  UsePrecision(const UsePrecision&) = delete;
  UsePrecision& operator=(const UsePrecision&) = delete;

 private:
  Precision previous_;
  GradReduce previous_reduce_;
};

}  // namespace laga
