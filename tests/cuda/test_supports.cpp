// What the CUDA backend's attention says it runs and refuses (cuda/attention.hpp
// attention_refusal, cuda/sdpa_cudnn.hpp cudnn_sdpa_refusal): each refusal
// names the value. Needs no device: the shared-memory limit is given (H100
// and H200 give 232448 bytes a block).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/attention.hpp"
#include "cuda/sdpa_cudnn.hpp"

namespace laga::cuda {
namespace {

constexpr std::int64_t kHopperSmem = 232448;

AttnShape v3_heads() {  // DeepSeek-V3's per-head attention: 192/128, H 128
  AttnShape s;
  s.B = 1, s.Sq = 4096, s.Sk = 4096, s.Hq = 128, s.Hk = 128, s.dqk = 192, s.dv = 128;
  s.scale = 0.07;
  return s;
}

AttnShape v3_latent() {  // the absorbed form's latent space: keys [c | k_pe] 576, values c 512
  AttnShape s = v3_heads();
  s.Hk = 1, s.dqk = 576, s.dv = 512;
  return s;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CudaSupports, OwnKernelsTakeV3ShapesOnHopper) {
  EXPECT_EQ(attention_refusal(AttnKernel::dense, v3_heads(), DType::f32, kHopperSmem), "");
  EXPECT_EQ(attention_refusal(AttnKernel::dense, v3_heads(), DType::bf16, kHopperSmem), "");
  EXPECT_EQ(attention_refusal(AttnKernel::dense, v3_latent(), DType::f32, kHopperSmem), "");
  EXPECT_EQ(attention_refusal(AttnKernel::fused_latent, v3_heads(), DType::f32, kHopperSmem), "");
  // The fused kernel's bf16 variant (tensor-core up-projection) takes V3's
  // heads too, packed documents and a ring step (Sq < Sk) included: its
  // operands are fp32 containers, so its shared memory is the fp32 kernel's.
  EXPECT_EQ(attention_refusal(AttnKernel::fused_latent, v3_heads(), DType::bf16, kHopperSmem), "");
  AttnShape ring = v3_heads();
  ring.Sq = 512;
  static const std::int64_t docs[4096] = {};
  ring.doc_start = docs;  // never read: a device pointer to the kernels
  EXPECT_EQ(attention_refusal(AttnKernel::fused_latent, ring, DType::bf16, kHopperSmem), "");
  // The latent space's blocks need more than the 48 KiB every device gives.
  EXPECT_GT(attention_smem_bytes(AttnKernel::dense, 576, 512), 48 * 1024);
  EXPECT_LE(attention_smem_bytes(AttnKernel::dense, 576, 512), kHopperSmem);
}

TEST(CudaSupports, OwnKernelsRefuseNamingTheValue) {
  AttnShape s = v3_heads();
  s.dqk = 640;
  std::string m = attention_refusal(AttnKernel::dense, s, DType::f32, kHopperSmem);
  EXPECT_TRUE(has(m, "head dim dqk 640 is above 576")) << m;
  s = v3_heads();
  s.dv = 520;
  m = attention_refusal(AttnKernel::dense, s, DType::f32, kHopperSmem);
  EXPECT_TRUE(has(m, "head dim dv 520 is above 512")) << m;
  m = attention_refusal(AttnKernel::dense, v3_latent(), DType::f32, 100 * 1024);
  EXPECT_TRUE(has(m, "need ")) << m;
  EXPECT_TRUE(has(m, "the device gives 102400")) << m;
  m = attention_refusal(AttnKernel::dense, v3_heads(), DType::f64, kHopperSmem);
  EXPECT_TRUE(has(m, "f64 is not run on the device")) << m;
  m = attention_refusal(AttnKernel::fused_latent, v3_heads(), DType::f64, kHopperSmem);
  EXPECT_TRUE(has(m, "f64 is not run on the device")) << m;
  m = attention_refusal(AttnKernel::fused_latent, v3_latent(), DType::bf16, kHopperSmem);
  EXPECT_TRUE(has(m, "Hq 128 != Hk 1")) << m;
  s = v3_heads();
  s.dv = 520;
  m = attention_refusal(AttnKernel::fused_latent, s, DType::bf16, kHopperSmem);
  EXPECT_TRUE(has(m, "head dim dv 520 is above 512")) << m;
  m = attention_refusal(AttnKernel::fused_latent, v3_latent(), DType::f32, kHopperSmem);
  EXPECT_TRUE(has(m, "Hq 128 != Hk 1")) << m;
  s = v3_heads();
  s.Hk = 3;
  m = attention_refusal(AttnKernel::dense, s, DType::f32, kHopperSmem);
  EXPECT_TRUE(has(m, "query heads (128) must be a positive multiple of key/value heads (3)")) << m;
  s = v3_heads();
  s.causal = false;
  static const std::int64_t docs[1] = {0};
  s.doc_start = docs;  // never read: a device pointer to the kernels
  m = attention_refusal(AttnKernel::dense, s, DType::f32, kHopperSmem);
  EXPECT_TRUE(has(m, "needs the causal mask")) << m;
  s.B = 70000, s.doc_start = nullptr;
  m = attention_refusal(AttnKernel::dense, s, DType::f32, kHopperSmem);
  EXPECT_TRUE(has(m, "B 70000 or Hq 128 is above 65535")) << m;
}

TEST(CudaSupports, CudnnSdpaRefusesNamingTheValue) {
  if (!cudnn_sdpa_built()) {
    EXPECT_TRUE(has(cudnn_sdpa_refusal(v3_heads(), DType::bf16), "scripts/setup.sh --cuda"));
    return;
  }
  EXPECT_EQ(cudnn_sdpa_refusal(v3_heads(), DType::bf16), "");
  std::string m = cudnn_sdpa_refusal(v3_heads(), DType::f32);
  EXPECT_TRUE(has(m, "dtype f32 is not taken by cuDNN's fused SDPA")) << m;
  EXPECT_TRUE(has(m, "cudnn sdpa (B 1, Sq 4096, Sk 4096, Hq 128, Hk 128, dqk 192, dv 128, causal)"))
      << m;
  m = cudnn_sdpa_refusal(v3_latent(), DType::bf16);
  EXPECT_TRUE(has(m, "head dim dqk 576 is not one cuDNN's fused SDPA takes")) << m;
  AttnShape s = v3_heads();
  s.dv = 100;
  m = cudnn_sdpa_refusal(s, DType::bf16);
  EXPECT_TRUE(has(m, "head dim dv 100")) << m;
  // Packed documents: a ragged batch where Sq == Sk (read on the host,
  // sdpa_ragged.hpp); a ring step's (Sq < Sk) and a broken structure are
  // refused, naming why.
  s = v3_heads();
  std::vector<std::int64_t> docs(static_cast<std::size_t>(s.B * s.Sk));
  for (std::int64_t t = 0; t < s.Sk; ++t) docs[static_cast<std::size_t>(t)] = t < 1000 ? 0 : 1000;
  s.doc_start = docs.data();
  EXPECT_EQ(cudnn_sdpa_refusal(s, DType::bf16), "");
  AttnShape ring = s;
  ring.Sq = 1024;
  m = cudnn_sdpa_refusal(ring, DType::bf16);
  EXPECT_TRUE(has(m, "packed documents with Sq != Sk")) << m;
  docs[1500] = 7;
  m = cudnn_sdpa_refusal(s, DType::bf16);
  EXPECT_TRUE(has(m, "batch row 0 token 1500 starts its document at 7")) << m;
}

}  // namespace
}  // namespace laga::cuda
