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

// This thread's precision: fp32 (the default) unless a UsePrecision scope says.
inline thread_local Precision op_precision = Precision::fp32;

// Runs this thread's ops at `p` while it lives.
class UsePrecision {
 public:
  explicit UsePrecision(Precision p) : previous_(std::exchange(op_precision, p)) {}
  ~UsePrecision() { op_precision = previous_; }
  UsePrecision(const UsePrecision&) = delete;
  UsePrecision& operator=(const UsePrecision&) = delete;

 private:
  Precision previous_;
};

}  // namespace laga
