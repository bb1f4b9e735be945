// `laga plan --profile this` and `laga plan --measure FILE`: a hardware
// profile of the machine laga runs on, measured with laga's own kernels and
// communicator (docs/planning.md, "Measuring this machine"). A device is one
// core: laga's in-process ranks run one per core when P <= cores.
//
//   peak_flops.fp32   the larger of the FMA throughput of one core (8
//                     independent AVX2 FMA chains: 16 FLOPs per instruction)
//                     and the GEMM rate below (OpenBLAS may use AVX-512)
//   efficiency.gemm   laga::gemm<float> on one thread, (512 x 256) by (256 x 512),
//                     against that peak
//   efficiency.attention  flash forward + backward on one thread (B 1, S 1024,
//                     causal, 4 heads, dqk 48, dv 32: the small preset's
//                     heads), its useful FLOPs (what the time model counts)
//                     against that peak
//   elementwise_bytes_per_s, memory_bytes_per_s  one thread copying 64 MiB
//                     buffers (read + write)
//   exp_per_s         swiglu_forward on one thread, 16K elements a call (one
//                     exp each): the rate of the loops that call exp per element
//   memory_bytes      physical memory / cores
//   intra_node        2 in-process ranks: the latency of a 4-byte all-to-all
//                     round, the bandwidth of 8 MiB ones (the copy between
//                     threads), topology switch; inter_node the same (one node)
//   peak_flops.bf16   null: no bf16 shape is timed (laga's bf16 path has its
//                     own benchmarks: laga_bench gemm_bf16, flash_bf16)
// Takes a few seconds. The efficiencies cost only the shapes a profile has
// not timed: measure_shapes below times the plan's own GEMM and attention
// shapes (measured_shapes), which is what the time model uses first.
#pragma once

#include <functional>
#include <string>

#include "plan/hardware_profile.hpp"

namespace laga {

HardwareProfile measure_this_machine(const std::function<void(const std::string&)>& progress);

// Times one call of every GEMM and attention shape in `calls` that `times`
// does not hold yet, on this thread (one core, fp32, laga's own kernels on
// random operands with the call's strides): the median of 9 samples of the
// thread's CPU time, each enough back-to-back calls to last ~2 ms, cycling
// over copies of the operands four times the size of L2 (so they come from
// L3, as inside a step). Shapes too large to repeat (one
// call over 2e10 FLOPs or 1 GiB of operands) and attention with document
// starts (its work depends on where they fall) are left out; the time model
// costs those at the profile's efficiency. Returns how many were timed.
int measure_shapes(const ops::OpCounts& calls, ShapeTimes& times,
                   const std::function<void(const std::string&)>& progress);
// Whether measure_shapes times this shape (`tally`: its calls and FLOPs).
bool shape_timeable(const ops::GemmCall& g, const ops::CallTally& tally);
bool shape_timeable(const ops::AttentionCall& a, const ops::CallTally& tally);

}  // namespace laga
