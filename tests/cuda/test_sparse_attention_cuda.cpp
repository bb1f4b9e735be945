// The CUDA backend's sparse attention rows (DeepSeek Sparse Attention;
// cuda/sparse_attention.hpp, src/cuda/op_table_cuda.cpp): which shapes and
// dtypes the sparse_gather_cuda rows take, the refusals naming the value, and
// that the entry points refuse before any CUDA call. Needs no device; the
// kernels' numbers against the CPU are laga_cuda_check's (check_main.cpp,
// "sparse_gather_cuda"), run on a GPU by scripts/gpu_check.sh.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "cuda/sparse_attention.hpp"
#include "mla/op_table.hpp"
#include "mla/ops_sparse.hpp"

namespace laga::ops {
namespace {

// DeepSeek-V3.2's sparse attention: per head (192/128, H 128) and in latent
// space (one key head, [c | k_pe] 576, c 512), index_topk 2048, S 32k.
OpShape v32_heads() {
  OpShape s;
  s.attn.B = 1, s.attn.Sq = 32768, s.attn.Sk = 32768, s.attn.Hq = 128, s.attn.Hk = 128;
  s.attn.dqk = 192, s.attn.dv = 128, s.attn.scale = 0.07;
  s.k = 2048;
  return s;
}
OpShape v32_latent() {
  OpShape s = v32_heads();
  s.attn.Hk = 1, s.attn.dqk = 576, s.attn.dv = 512;
  return s;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const KernelRow* cuda_row(Op op) {
  for (const KernelRow& r : cuda_kernel_rows())
    if (r.op == op) return &r;
  return nullptr;
}

TEST(CudaSparseAttention, RowsTakeV32ShapesInFp32AndBf16) {
  for (const Op op : {Op::sparse_attention_forward, Op::sparse_attention_backward}) {
    const KernelRow* r = cuda_row(op);
    ASSERT_NE(r, nullptr) << "no CUDA row for op " << int(op);
    EXPECT_STREQ(r->name, "sparse_gather_cuda");
    // bf16 operands as bf16 (ops_sparse.cpp hands them so and checks).
    EXPECT_EQ(r->operands, Bf16Operands::bf16);
    for (const RunDtype d : {RunDtype::fp32, RunDtype::bf16}) {
      EXPECT_FALSE(r->why_not(d, v32_heads())) << *r->why_not(d, v32_heads());
      EXPECT_FALSE(r->why_not(d, v32_latent())) << *r->why_not(d, v32_latent());
    }
    const auto w = r->why_not(RunDtype::fp64, v32_heads());
    ASSERT_TRUE(w);
    EXPECT_TRUE(has(*w, "dtype fp64 (it takes fp32 or bf16)")) << *w;
  }
}

TEST(CudaSparseAttention, RowsRefuseNamingTheValue) {
  const KernelRow* r = cuda_row(Op::sparse_attention_forward);
  ASSERT_NE(r, nullptr);
  OpShape s = v32_latent();
  s.attn.dqk = 640;
  auto w = r->why_not(RunDtype::fp32, s);
  ASSERT_TRUE(w);
  EXPECT_TRUE(has(*w, "head dim dqk 640 is above 576")) << *w;
  s = v32_latent();
  s.attn.dv = 520;
  w = r->why_not(RunDtype::bf16, s);
  ASSERT_TRUE(w);
  EXPECT_TRUE(has(*w, "head dim dv 520 is above 512")) << *w;
  s = v32_heads();
  s.attn.Hk = 3;
  w = r->why_not(RunDtype::fp32, s);
  ASSERT_TRUE(w);
  EXPECT_TRUE(has(*w, "query heads (128) must be a positive multiple of key/value heads (3)"))
      << *w;
  s = v32_heads();  // 2^37 (row, head) warps: past one launch's 2^31 - 1 blocks
  s.attn.Sq = s.attn.Sk = std::int64_t(1) << 30;
  w = r->why_not(RunDtype::fp32, s);
  ASSERT_TRUE(w);
  EXPECT_TRUE(has(*w, "B 1 Sq 1073741824 Sk 1073741824 K 2048 is beyond one launch's grid")) << *w;
  s.attn.B = 8, s.attn.Sq = s.attn.Sk = std::int64_t(1) << 31;  // B Sk Sq = 2^65
  w = r->why_not(RunDtype::fp32, s);
  ASSERT_TRUE(w);
  EXPECT_TRUE(has(*w, "does not fit the 64-bit sort key")) << *w;
}

// The entry points check the shape before they touch the device, so a bad
// call is laga::Error naming the value on a machine with no GPU too.
TEST(CudaSparseAttention, EntryPointsRefuseBeforeAnyDeviceCall) {
  SparseAttnShape s{v32_latent().attn, 64};
  s.attn.dqk = 640;
  try {
    cuda::sparse_attention_forward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    ADD_FAILURE() << "a 640-wide key was taken";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "head dim dqk 640 is above 576")) << e.what();
  }
  s = SparseAttnShape{v32_heads().attn, 0};
  try {
    cuda::sparse_attention_backward<bf16>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                          nullptr, nullptr, nullptr, nullptr, nullptr, 0);
    ADD_FAILURE() << "K 0 was taken";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "K (slots per query row, index_topk) must be positive, got 0"))
        << e.what();
  }
}

// Issue 52: count-only predicts the device peak. The rows' scratch (the
// selection's device copy; the backward's D, sort keys, key offsets and
// cub's storage) is their workspace, which the op layer makes a pool tensor
// before it asks whether the call computes: a count-only run through the
// CUDA rows holds it, at V3.2's latent S 32k 1.38 GB in backward. The bytes
// below are written out from the kernel's buffers (sparse_attention.cu), not
// read from the description; on main the count-only run held none of them.
TEST(CudaSparseAttention, CountOnlyRunHoldsTheRowsScratch) {
  register_kernel_rows(Device::cuda, cuda_kernel_rows());
  const UseDevice on_cuda(Device::cuda);
  MemoryPool pool;
  pool.set_count_only(true);
  pool.set_live_tracking(true);
  const PoolScope scope(pool);
  const OpShape v = v32_latent();
  const SparseAttnShape s{v.attn, v.k};
  const std::int64_t B = 1, Sq = 32768, Sk = 32768, Hq = 128, K = 2048;
  const std::int64_t selection = 4 * B * Sq * K;  // int32 (B, Sq, K), a multiple of 256
  const std::int64_t delta = 4 * B * Hq * Sq, keys = 2 * 8 * B * Sq * K;
  const std::int64_t offsets = (8 * (B * Sk + 1) + 255) / 256 * 256;
  // cub's storage: its onesweep bins, lookback and counters for 2^26 keys of
  // 31 bits (the sentinel B Sk Sq = 2^30), 18 MB here; a bound, not a figure
  // (cub's tuning picks it), so only its range is held here; its part is
  // rounded to 256 bytes as every part is.
  const std::int64_t sort = (cuda::sparse_sort_storage_bound(B * Sq * K, 31) + 255) / 256 * 256;
  EXPECT_EQ(cuda::sparse_sort_key_bits(s), 31);
  EXPECT_GT(sort, 4 * 256 * 8);             // at least the bins of 4 passes of 256 digits
  EXPECT_LT(sort, std::int64_t(32) << 20);  // far below one key buffer (512 MiB)

  ops::sparse_attention_forward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(pool.peak_working(), selection);
  EXPECT_EQ(pool.current_total(), 0);
  pool.reset_peaks();
  ops::sparse_attention_backward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                        nullptr, nullptr, nullptr, nullptr);
  const std::int64_t backward = selection + delta + keys + offsets + sort;
  EXPECT_EQ(pool.peak_working(), backward);
  EXPECT_GT(backward, std::int64_t(1'370'000'000));  // the header's 1.38 GB
  EXPECT_NE(pool.working_peak_snapshot().where.find("sparse attention scratch"), std::string::npos)
      << pool.working_peak_snapshot().where;
  EXPECT_EQ(pool.current_total(), 0);
  // The description the rows and the kernel read says the same.
  EXPECT_EQ(cuda::sparse_attention_scratch(s, true).total(), backward);
  EXPECT_EQ(cuda::sparse_attention_scratch(s, false).total(), selection);
}

// The backward refuses a scratch smaller than the description, naming both
// sizes, before any device call.
TEST(CudaSparseAttention, BackwardRefusesAShortScratch) {
  const OpShape v = v32_heads();
  const SparseAttnShape s{v.attn, v.k};
  const std::int64_t need = cuda::sparse_attention_scratch(s, true).backward_part();
  char byte = 0;
  try {
    cuda::sparse_attention_backward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                           nullptr, nullptr, nullptr, nullptr, &byte, need - 1);
    ADD_FAILURE() << "a short scratch was taken";
  } catch (const Error& e) {
    EXPECT_TRUE(
        has(e.what(), cat("a scratch of ", need - 1, " bytes where the shape needs ", need)))
        << e.what();
  }
}

}  // namespace
}  // namespace laga::ops
