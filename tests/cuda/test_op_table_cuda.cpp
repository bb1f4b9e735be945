// The CUDA backend's rows in the kernel table (src/cuda/op_table_cuda.cpp,
// mla/op_table.hpp): which row the table picks for each op, and the
// refusals, naming the value. Needs no device: supports() asks the rows'
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

TEST(CudaOpTable, TheBuildListsCudaRows) {
  const auto devices = devices_built();
  ASSERT_EQ(devices.size(), 2u);
  EXPECT_EQ(devices[1], Device::cuda);
  EXPECT_FALSE(kernel_rows(Device::cuda).empty());
}

TEST(CudaOpTable, PicksARowOrNamesTheValue) {
  OpShape g;
  g.m = 64, g.n = 32, g.k = 16, g.lda = 16, g.ldb = 32, g.ldc = 32;
  EXPECT_STREQ(supports(Device::cuda, Op::gemm, RunDtype::fp32, g).name(), "gemm_cublaslt");
  EXPECT_STREQ(supports(Device::cuda, Op::gemm, RunDtype::bf16, g).name(), "gemm_cublaslt");
  KernelChoice c = supports(Device::cuda, Op::gemm, RunDtype::fp64, g);
  EXPECT_FALSE(c);
  EXPECT_TRUE(has(c.why_not, "dtype fp64 (it takes fp32 or bf16)")) << c.why_not;

  // bf16 per-head attention: cuDNN where the build has it, else laga's kernel.
  EXPECT_STREQ(supports(Device::cuda, Op::attention_forward, RunDtype::bf16, heads()).name(),
               cuda::cudnn_sdpa_built() ? "attention_cudnn_sdpa" : "attention_cuda_tiled");
  EXPECT_STREQ(supports(Device::cuda, Op::attention_backward, RunDtype::fp32, heads()).name(),
               "attention_cuda_tiled");
  c = supports(Device::cuda, Op::attention_forward, RunDtype::fp32, heads(AttentionKind::eager));
  EXPECT_FALSE(c);
  EXPECT_TRUE(has(c.why_not, "attention eager")) << c.why_not;

  OpShape latent = heads();
  latent.attn.Hk = 1, latent.attn.dqk = 576, latent.attn.dv = 512;
  EXPECT_STREQ(supports(Device::cuda, Op::latent_attention_forward, RunDtype::bf16, latent).name(),
               "latent_attention_cuda_tiled");
  c = supports(Device::cuda, Op::latent_attention_forward, RunDtype::fp32, heads());
  EXPECT_TRUE(has(c.why_not, "Hk 128 (latent-space attention has one key head)")) << c.why_not;

  OpShape fused = heads();
  fused.C = 512, fused.dn = 128;
  EXPECT_STREQ(
      supports(Device::cuda, Op::fused_latent_attention_forward, RunDtype::fp32, fused).name(),
      "fused_latent_cuda");
  c = supports(Device::cuda, Op::fused_latent_attention_backward, RunDtype::bf16, fused);
  EXPECT_TRUE(has(c.why_not, "dtype bf16 (it takes fp32)")) << c.why_not;

  // No device rows for the model's ops yet: the table says so.
  c = supports(Device::cuda, Op::adamw, RunDtype::fp32, OpShape{});
  EXPECT_FALSE(c);
  EXPECT_FALSE(c.why_not.empty());
}

}  // namespace
}  // namespace laga::ops
