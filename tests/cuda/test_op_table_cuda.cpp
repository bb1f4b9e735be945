// The CUDA backend's rows in the kernel table (src/cuda/op_table_cuda.cpp,
// mla/op_table.hpp): which row the table picks for each op, and the
// refusals, naming the value. Needs no device: the rows answer by their rules.
// rules, not the GPU.
#include <gtest/gtest.h>

#include <string>

#include "cuda/sdpa_cudnn.hpp"
#include "mla/form_spec.hpp"
#include "mla/op_table.hpp"

namespace laga::ops {
namespace {

OpShape heads(AttentionKind kind = AttentionKind::flash) {
  OpShape s;
  s.attn.B = 1, s.attn.Sq = 4096, s.attn.Sk = 4096, s.attn.Hq = 128, s.attn.Hk = 128;
  s.attn.dqk = 192, s.attn.dv = 128, s.attn.scale = 0.07;
  s.attention = kind;
  return s;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The table's rule (op_table.hpp: the lowest rank among the rows that take
// the call) over the CUDA rows alone: laga_mla does not link them yet
// (src/mla/CMakeLists.txt says why), so supports(Device::cuda, ...) there
// has no rows; this asks cuda_kernel_rows() directly.
KernelChoice cuda_supports(Op op, RunDtype dtype, const OpShape& shape) {
  KernelChoice c;
  for (const KernelRow& r : cuda_kernel_rows()) {
    if (r.op != op) continue;
    const auto why = r.why_not(dtype, shape);
    if (!why) {
      if (!c.row || r.rank < c.row->rank) c.row = &r;
    } else {
      c.why_not += std::string(c.why_not.empty() ? "" : "; ") + r.name + ": " + *why;
    }
  }
  if (c.row) c.why_not.clear();
  if (!c.row && c.why_not.empty()) c.why_not = "no CUDA row";
  return c;
}

TEST(CudaOpTable, EveryRowIsACudaRowWithItsFunctions) {
  ASSERT_FALSE(cuda_kernel_rows().empty());
  for (const KernelRow& r : cuda_kernel_rows()) {
    EXPECT_EQ(r.device, Device::cuda) << r.name;
    EXPECT_NE(r.why_not, nullptr) << r.name;
    EXPECT_NE(r.run, nullptr) << r.name;
  }
}

TEST(CudaOpTable, PicksARowOrNamesTheValue) {
  OpShape g;
  g.m = 64, g.n = 32, g.k = 16, g.lda = 16, g.ldb = 32, g.ldc = 32;
  EXPECT_STREQ(cuda_supports(Op::gemm, RunDtype::fp32, g).name(), "gemm_cublaslt");
  EXPECT_STREQ(cuda_supports(Op::gemm, RunDtype::bf16, g).name(), "gemm_cublaslt");
  KernelChoice c = cuda_supports(Op::gemm, RunDtype::fp64, g);
  EXPECT_FALSE(c);
  EXPECT_TRUE(has(c.why_not, "dtype fp64 (it takes fp32 or bf16)")) << c.why_not;

  // bf16 per-head attention: cuDNN where the build has it, else laga's kernel.
  EXPECT_STREQ(cuda_supports(Op::attention_forward, RunDtype::bf16, heads()).name(),
               cuda::cudnn_sdpa_built() ? "attention_cudnn_sdpa" : "attention_cuda_tiled");
  EXPECT_STREQ(cuda_supports(Op::attention_backward, RunDtype::fp32, heads()).name(),
               "attention_cuda_tiled");
  c = cuda_supports(Op::attention_forward, RunDtype::fp32, heads(AttentionKind::eager));
  EXPECT_FALSE(c);
  EXPECT_TRUE(has(c.why_not, "attention eager")) << c.why_not;

  OpShape latent = heads();
  latent.attn.Hk = 1, latent.attn.dqk = 576, latent.attn.dv = 512;
  EXPECT_STREQ(cuda_supports(Op::latent_attention_forward, RunDtype::bf16, latent).name(),
               "latent_attention_cuda_tiled");
  c = cuda_supports(Op::latent_attention_forward, RunDtype::fp32, heads());
  EXPECT_TRUE(has(c.why_not, "Hk 128 (latent-space attention has one key head)")) << c.why_not;

  OpShape fused = heads();
  fused.C = 512, fused.dn = 128;
  EXPECT_STREQ(cuda_supports(Op::fused_latent_attention_forward, RunDtype::fp32, fused).name(),
               "fused_latent_cuda");
  // bf16: the kernel's bf16 variant, on fp32 containers of bf16 values (as
  // the CPU's flash_latent_fp32 row takes a bf16 call).
  for (Op op : {Op::fused_latent_attention_forward, Op::fused_latent_attention_backward}) {
    c = cuda_supports(op, RunDtype::bf16, fused);
    EXPECT_STREQ(c.name(), "fused_latent_cuda") << c.why_not;
    if (c) {
      EXPECT_EQ(c.row->operands, Bf16Operands::fp32_values);
    }
  }
  c = cuda_supports(Op::fused_latent_attention_backward, RunDtype::fp64, fused);
  EXPECT_TRUE(has(c.why_not, "dtype fp64 (it takes fp32 or bf16)")) << c.why_not;
  OpShape fused_wide = fused;
  fused_wide.attn.dv = 520;  // past what a lane holds: refused in bf16 as in fp32
  c = cuda_supports(Op::fused_latent_attention_forward, RunDtype::bf16, fused_wide);
  EXPECT_TRUE(has(c.why_not, "head dim dv 520 is above 512")) << c.why_not;

  // The forms' data movement (issue 52): copies, sums, the wire's
  // conversions and zeroing run on the device; a sum into bf16 and a bf16
  // fill are refused by name, as on the CPU.
  OpShape mv;
  mv.rows = 4, mv.cols = 6, mv.lda = 8, mv.ldc = 6;
  for (RunDtype d : {RunDtype::fp64, RunDtype::fp32, RunDtype::bf16})
    EXPECT_STREQ(cuda_supports(Op::copy_rows, d, mv).name(), "copy_rows_cuda") << to_string(d);
  mv.src_bf16 = true, mv.accumulate = true;
  EXPECT_STREQ(cuda_supports(Op::copy_rows, RunDtype::fp32, mv).name(), "copy_rows_cuda");
  c = cuda_supports(Op::copy_rows, RunDtype::bf16, mv);
  EXPECT_FALSE(c);
  EXPECT_TRUE(has(c.why_not, "a sum into bf16")) << c.why_not;
  c = cuda_supports(Op::copy_rows, RunDtype::fp64, mv);
  EXPECT_TRUE(has(c.why_not, "bf16 values into fp64")) << c.why_not;
  mv.lda = 2;
  c = cuda_supports(Op::copy_rows, RunDtype::fp32, mv);
  EXPECT_TRUE(has(c.why_not, "lda 2")) << c.why_not;
  EXPECT_STREQ(cuda_supports(Op::fill, RunDtype::fp32, mv).name(), "fill_cuda");
  c = cuda_supports(Op::fill, RunDtype::bf16, mv);
  EXPECT_TRUE(has(c.why_not, "dtype bf16")) << c.why_not;

  // No device rows for the model's ops yet.
  c = cuda_supports(Op::adamw, RunDtype::fp32, OpShape{});
  EXPECT_FALSE(c);
  EXPECT_EQ(c.why_not, "no CUDA row") << c.why_not;
}

}  // namespace
}  // namespace laga::ops
