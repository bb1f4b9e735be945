// Issue 52: count-only predicts the device peak as it predicts the host's.
// The CUDA rows' own scratch (D of the tiled and fused attention backward,
// 4 B Hq Sq: cuda/op_table_cuda.cpp's delta_bytes) is their workspace, which
// the op layer makes a pool tensor before it asks whether the call computes
// (ops::row_workspace), so a count-only run through the CUDA rows holds it.
// On main the rows allocated it for themselves when they ran (a DeviceBuffer
// in the rank's pool), so a GPU run's pool peak could exceed the count-only
// run's by it (16 MB at S 32k, H 128). Needs no device: count-only runs no
// kernel. (The sparse attention's scratch: test_sparse_attention_cuda.cpp.)
#include <gtest/gtest.h>

#include <string>

#include "core/memory_pool.hpp"
#include "core/precision.hpp"
#include "mla/form_spec.hpp"  // AttentionKind
#include "mla/op_table.hpp"
#include "mla/ops_attention.hpp"

namespace laga::ops {
namespace {

// DeepSeek-V3's per-head attention at S 32k (192/128, H 128).
AttnShape v3_heads() {
  AttnShape s;
  s.B = 1, s.Sq = 32768, s.Sk = 32768, s.Hq = 128, s.Hk = 128;
  s.dqk = 192, s.dv = 128, s.scale = 0.07, s.causal = true;
  return s;
}

struct CountOnlyOnCuda {
  MemoryPool pool;
  CountOnlyOnCuda() {
    register_kernel_rows(Device::cuda, cuda_kernel_rows());
    pool.set_count_only(true);
    pool.set_live_tracking(true);
  }
};

TEST(CudaCountOnly, TiledAttentionBackwardHoldsItsD) {
  CountOnlyOnCuda run;
  const UseDevice on_cuda(Device::cuda);
  const PoolScope scope(run.pool);
  const AttnShape s = v3_heads();
  attention_backward<float>(AttentionKind::flash, s, nullptr, nullptr, nullptr, nullptr, nullptr,
                            nullptr, nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(run.pool.peak_working(), 4 * s.B * s.Hq * s.Sq);  // D (B, Hq, Sq) fp32: 16 MiB
  EXPECT_NE(run.pool.working_peak_snapshot().where.find("attention backward scratch"),
            std::string::npos)
      << run.pool.working_peak_snapshot().where;
  EXPECT_EQ(run.pool.current_total(), 0);
}

TEST(CudaCountOnly, FusedLatentBackwardHoldsItsD) {
  CountOnlyOnCuda run;
  const UseDevice on_cuda(Device::cuda);
  const PoolScope scope(run.pool);
  FusedLatentOperands<float> a;
  a.shape = v3_heads();
  a.shape.Sq = a.shape.Sk = 4096;
  a.C = 512, a.dn = 128;
  FusedLatentKept<float> kept;
  fused_latent_attention_backward<float>(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                         kept);
  EXPECT_EQ(run.pool.peak_working(), 4 * a.shape.B * a.shape.Hq * a.shape.Sq);  // 2 MiB
  EXPECT_NE(run.pool.working_peak_snapshot().where.find("fused latent backward scratch"),
            std::string::npos)
      << run.pool.working_peak_snapshot().where;
}

// Under bf16 the attention call's one scratch tensor holds the operands'
// bf16 copies and the picked row's own workspace: the CUDA rows' (cuDNN's
// none, the tiled rows' D), not the CPU flash kernel's, which main made on
// the device for every bf16 call (counted, never read).
TEST(CudaCountOnly, Bf16AttentionScratchIsTheCopiesAndTheRowsOwn) {
  CountOnlyOnCuda run;
  const UseDevice on_cuda(Device::cuda);
  const UsePrecision at(Precision::bf16);
  const PoolScope scope(run.pool);
  AttnShape s = v3_heads();
  s.Sq = s.Sk = 4096;
  OpShape os;
  os.attn = s, os.attention = AttentionKind::flash;
  const KernelChoice row = supports(Device::cuda, Op::attention_backward, RunDtype::bf16, os);
  ASSERT_TRUE(row) << row.why_not;
  const auto lines = [](std::int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const std::int64_t copies =
      lines(2 * s.B * s.Sq * s.Hq * s.dqk) + lines(2 * s.B * s.Sk * s.Hk * s.dqk) +
      lines(2 * s.B * s.Sk * s.Hk * s.dv) + lines(2 * s.B * s.Sq * s.Hq * s.dv);
  const std::int64_t own =
      std::string(row.name()) == "attention_cuda_tiled" ? 4 * s.B * s.Hq * s.Sq : 0;
  attention_backward<float>(AttentionKind::flash, s, nullptr, nullptr, nullptr, nullptr, nullptr,
                            nullptr, nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(run.pool.peak_working(), copies + own) << row.name();
}

// The CPU's fp32 rows declare no scratch: the same calls on the CPU hold
// nothing (the CPU figures do not move).
TEST(CudaCountOnly, CpuRowsHoldNoScratch) {
  MemoryPool pool;
  pool.set_count_only(true);
  const PoolScope scope(pool);
  attention_backward<float>(AttentionKind::flash, v3_heads(), nullptr, nullptr, nullptr, nullptr,
                            nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(pool.peak_working(), 0);
}

}  // namespace
}  // namespace laga::ops
