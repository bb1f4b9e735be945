// cuda gemm's argument checks (cuda/gemm_lt.hpp), which need no device, and
// on a device the product against kernels/gemm.hpp's double reference for
// every transpose pair and type.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "cuda/device.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/device_peak.hpp"
#include "cuda/gemm_lt.hpp"
#include "kernels/gemm.hpp"

namespace laga::cuda {
namespace {

std::string refusal(const GemmArgs& g) {
  try {
    check_gemm(g);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

GemmArgs good() {
  static float a[64], b[64], c[64];
  GemmArgs g;
  g.M = 4, g.N = 3, g.K = 5;
  g.A = a, g.lda = 5, g.B = b, g.ldb = 3, g.C = c, g.ldc = 3;
  return g;
}

TEST(CudaGemm, ChecksNameTheBadValue) {
  EXPECT_EQ(refusal(good()), "(accepted)");
  GemmArgs g = good();
  g.lda = 4;
  EXPECT_NE(refusal(g).find("lda 4 is shorter than A's stored row of 5 elements"),
            std::string::npos)
      << refusal(g);
  g = good();
  g.trans_a = true;  // A stored (K, M): rows of M = 4
  g.lda = 4;
  EXPECT_EQ(refusal(g), "(accepted)");
  g = good();
  g.trans_b = true;  // B stored (N, K): rows of K = 5
  EXPECT_NE(refusal(g).find("ldb 3 is shorter than B's stored row of 5"), std::string::npos)
      << refusal(g);
  g = good();
  g.ldc = 2;
  EXPECT_NE(refusal(g).find("ldc 2 is shorter than C's row of 3"), std::string::npos);
  g = good();
  g.M = -1;
  EXPECT_NE(refusal(g).find("extents must be >= 0"), std::string::npos);
  g = good();
  g.dtype = DType::f64;
  EXPECT_NE(refusal(g).find("not f64; double runs on the CPU (--device cpu)"), std::string::npos);
  g = good();
  g.c_dtype = DType::bf16;
  EXPECT_NE(refusal(g).find("f32 operands with a bf16 result"), std::string::npos);
  g = good();
  g.dtype = DType::bf16;
  EXPECT_EQ(refusal(g), "(accepted)");
  g.c_dtype = DType::bf16;
  EXPECT_EQ(refusal(g), "(accepted)");
  g = good();
  g.B = nullptr;
  EXPECT_NE(refusal(g).find("B is null"), std::string::npos) << refusal(g);
  g = good();
  g.beta = 0.5f;
  EXPECT_NE(refusal(g).find("beta 0.5 is not 0 or 1"), std::string::npos);
  // The message names the whole call.
  EXPECT_NE(refusal(g).find("cuda gemm (M 4 N 3 K 5, lda 5 ldb 3 ldc 3, f32 x f32 -> f32)"),
            std::string::npos)
      << refusal(g);
  // Empty products need no operands.
  g = good();
  g.M = 0, g.A = nullptr, g.C = nullptr;
  EXPECT_EQ(refusal(g), "(accepted)");
}

// On a device: every transpose pair, strided operands, beta 0 over NaN and
// beta 1, f32 and bf16 operands, against the double reference.
TEST(CudaGemm, MatchesReferenceOnDevice) {
  const std::string why = device_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << "needs a CUDA device: " << why;
  MemoryPool pool;
  PoolScope scope(pool);
  GemmContext ctx;
  const std::int64_t M = 37, N = 29, K = 70, pad = 3;
  for (const DType dt : {DType::f32, DType::bf16})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const float beta : {0.0f, 1.0f}) {
          const std::int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
          const std::int64_t a_rows = ta ? K : M, b_rows = tb ? N : K;
          std::vector<float> a(static_cast<size_t>(a_rows * lda)),
              b(static_cast<size_t>(b_rows * ldb)),
              c(static_cast<size_t>(M * ldc), beta == 0 ? NAN : 0.25f);
          for (size_t i = 0; i < a.size(); ++i)
            a[i] = to_float(to_bf16(std::sin(0.37f * float(i))));
          for (size_t i = 0; i < b.size(); ++i)
            b[i] = to_float(to_bf16(std::cos(0.11f * float(i))));
          std::vector<float> want = c;
          gemm_reference<float>(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, beta,
                                want.data(), ldc);
          const std::int64_t e = dt == DType::bf16 ? 2 : 4;
          DeviceBuffer da(static_cast<std::int64_t>(a.size()) * e, "a"),
              db(static_cast<std::int64_t>(b.size()) * e, "b"),
              dc(static_cast<std::int64_t>(c.size()) * 4, "c");
          if (dt == DType::bf16) {
            std::vector<bf16> ah(a.size()), bh(b.size());
            for (size_t i = 0; i < a.size(); ++i) ah[i] = to_bf16(a[i]);
            for (size_t i = 0; i < b.size(); ++i) bh[i] = to_bf16(b[i]);
            da.upload(ah.data(), da.bytes());
            db.upload(bh.data(), db.bytes());
          } else {
            da.upload(a.data(), da.bytes());
            db.upload(b.data(), db.bytes());
          }
          dc.upload(c.data(), dc.bytes());
          GemmArgs g;
          g.trans_a = ta, g.trans_b = tb, g.M = M, g.N = N, g.K = K, g.beta = beta;
          g.A = da.data(), g.lda = lda, g.B = db.data(), g.ldb = ldb, g.C = dc.data(), g.ldc = ldc;
          g.dtype = dt;
          ctx.gemm(g);
          dc.download(c.data(), dc.bytes());
          for (std::int64_t i = 0; i < M; ++i)
            for (std::int64_t j = 0; j < N; ++j)
              ASSERT_NEAR(c[size_t(i * ldc + j)], want[size_t(i * ldc + j)], 1e-4 * K)
                  << describe(g) << " at " << i << "," << j;
        }
}

// The cuBLASLt workspace is a size laga chooses, so the device peak's
// prediction adds it to the memory model's (cuda/device_peak.hpp): a
// GemmContext registers exactly those bytes, by name, in the pool current
// where it is made, and gives them back. Count-only here: no device is
// needed (the handle waits for the first GEMM).
TEST(CudaGemm, WorkspaceIsCountedAndIsWhatThePredictionAdds) {
  MemoryPool pool;
  pool.set_count_only(true);
  pool.set_live_tracking(true);
  PoolScope scope(pool);
  MemoryPrediction model;
  model.peak_working = 1000;
  const DevicePeakPrediction p = device_peak_prediction(model);
  {
    GemmContext ctx;
    EXPECT_EQ(ctx.workspace_bytes(), kCublasLtWorkspaceBytes);
    EXPECT_EQ(p.cublaslt_workspace, ctx.workspace_bytes());
    EXPECT_EQ(pool.current(MemCategory::comm_buffers), ctx.workspace_bytes());
    EXPECT_EQ(pool.current_total(), ctx.workspace_bytes());
    EXPECT_EQ(pool.working_peak_snapshot().where, "cublaslt_workspace");
    EXPECT_EQ(p.predicted(), 1000 + ctx.workspace_bytes());
  }
  EXPECT_EQ(pool.current_total(), 0);
}

}  // namespace
}  // namespace laga::cuda
