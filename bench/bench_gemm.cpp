// sgemm on the shapes of an MLA block's projections, every GEMM library of
// bench/gemm_backends.hpp side by side (timed alternately, one row each), and
// laga::gemm itself, and the invariant mode's gemm_invariant: the measurement docs/performance.md
// chooses laga's GEMM library by. Per linear layer y = x W^T, W (out, in), T tokens, three
// products: forward NT (T, out, in), dx = dy W NN (T, in, out), dW = dy^T x TN
// (out, in, T). Layers: the D 2048 block of bench_block.cpp and DeepSeek-V3's
// (D 7168, H 128, rq 1536, C 512, dn 128, dr 64, dv 128). GFLOP = 2 M N K.
//
// #wrong: every element of a sample of C's rows (gemm_backends.hpp:
// sampled_rows, reference_rows) against plain double loops over the same
// float inputs, sharing no code with any library; wrong when farther than
// 1e-5 * max |ref| of the sample. Force an ISA to measure the other path:
// ONEDNN_MAX_CPU_ISA=AVX2, OPENBLAS_CORETYPE=Haswell|SkylakeX.
#include <omp.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "gemm_backends.hpp"
#include "harness.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_invariant.hpp"

namespace {

struct Linear {
  const char* what;
  std::int64_t in, out;
};

void laga_sgemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
                std::int64_t lda, const float* B, std::int64_t ldb, float* C, std::int64_t ldc) {
  laga::gemm<float>(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
}

// The invariant mode's GEMM (kernels/gemm_invariant.hpp,
// docs/invariance.md): its row beside the libraries' is that mode's cost.
void invariant_sgemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K,
                     const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float* C,
                     std::int64_t ldc) {
  laga::gemm_invariant<float>(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
}

}  // namespace

LAGA_BENCH(gemm, "sgemm per library (oneDNN, OpenBLAS, BLIS; alternating) on the block's shapes") {
  const bool quick = ctx.options().quick;
  const std::int64_t T = quick ? 256 : 2048;  // tokens
  const std::int64_t s = quick ? 8 : 1;       // --quick divides the widths by 8
  // in -> out per layer: D 2048 block (H 16, rq 0) and DeepSeek-V3 (H 128).
  // The query and latent projections share their input and run as one GEMM
  // each way (docs/forms.md, "The input projections"): the fused rows are
  // the block's; the separate ones show what fusing saves.
  const std::vector<Linear> layers = {
      {"D2048 wq | wkv_a fused: D -> H(dn+dr) + C+dr", 2048 / s, 3648 / s},
      {"D2048 wq: D -> H(dn+dr)", 2048 / s, 3072 / s},
      {"D2048 wkv_a: D -> C+dr", 2048 / s, 576 / s},
      {"D2048 wkv_b: C -> H(dn+dv)", 512 / s, 4096 / s},
      {"D2048 wo: H dv -> D", 2048 / s, 2048 / s},
      {"V3 wq_a | wkv_a fused: D -> rq + C+dr", 7168 / s, 2112 / s},
      {"V3 wq_a: D -> rq", 7168 / s, 1536 / s},
      {"V3 wq_b: rq -> H(dn+dr)", 1536 / s, 24576 / s},
      {"V3 wkv_a: D -> C+dr", 7168 / s, 576 / s},
      {"V3 wkv_b: C -> H(dn+dv)", 512 / s, 32768 / s},
      {"V3 wo: H dv -> D", 16384 / s, 7168 / s},
  };
  std::vector<laga::bench::GemmBackend> libs = laga::bench::gemm_backends(ctx.options().threads);
  for (const auto& b : libs)
    ctx.note(laga::cat(b.name, ": runs its ", b.kernels, " kernels here (", b.isa, ")"));
  // laga::gemm's own row: whatever it routes to, the rows above say which.
  libs.push_back({"laga", laga::gemm_kernels(), laga::bench::gemm_isa(), &laga_sgemm});
  // The invariant mode's GEMM: its own loops, vectorised by the compiler for
  // the widest ISA the CPU has (target_clones), mul and add apart.
  libs.push_back({"invariant", "gemm_invariant (pairwise tree over K)", laga::bench::gemm_isa(),
                  &invariant_sgemm});
  ctx.note(laga::cat("T ", T, " tokens; #wrong on ", laga::bench::sampled_rows(T).size(),
                     "+ sampled rows of C vs double loops"));
  ctx.header();

  struct Product {
    const char* name;  // the op column, with "/library" appended
    bool ta, tb;
    std::int64_t M, N, K;
    const float* A;  // op(A) (M, K), row stride lda
    std::int64_t lda;
    const float* B;  // op(B) (K, N), row stride ldb
    std::int64_t ldb;
  };
  for (const Linear& layer : layers) {
    if (!laga::bench::case_selected(ctx.options(), layer.what)) continue;
    const std::int64_t in = layer.in, out = layer.out;
    // x (T, in), W (out, in), dy (T, out).
    std::vector<float> x(size_t(T * in)), w(size_t(out * in)), dy(size_t(T * out));
    laga::fill_normal(x.data(), T * in, 1, 0, 0, 1.0);
    laga::fill_normal(w.data(), out * in, 1, 1, 0, 1.0);
    laga::fill_normal(dy.data(), T * out, 1, 2, 0, 1.0);
    ctx.note(layer.what);
    const std::vector<Product> products = {
        {"fwd_nt", false, true, T, out, in, x.data(), in, w.data(), in},    // y = x W^T
        {"dx_nn", false, false, T, in, out, dy.data(), out, w.data(), in},  // dx = dy W
        {"dw_tn", true, false, out, in, T, dy.data(), out, x.data(), in},   // dW = dy^T x
    };
    for (const Product& p : products) {
      const std::vector<std::int64_t> rows = laga::bench::sampled_rows(p.M);
      const std::vector<double> ref =
          laga::bench::reference_rows(rows, p.ta, p.tb, p.N, p.K, p.A, p.lda, p.B, p.ldb);
      std::vector<std::vector<float>> c(libs.size(), std::vector<float>(size_t(p.M * p.N)));
      std::vector<laga::bench::Candidate> cands;
      const std::string shape = laga::cat(p.M, "x", p.N, "x", p.K);
      // OpenBLAS' and BLIS' own pthreads spin for a while after a call
      // (OpenBLAS: 2^28 cycles, ~0.1 s) on the cores the next library's
      // OpenMP threads need: the call timed next ran up to 2x slower. So a
      // call after one of theirs first waits, untimed, until they sleep.
      bool pthreads_spinning = false;
      const auto quiet_cores = [&] {
        if (pthreads_spinning) std::this_thread::sleep_for(std::chrono::milliseconds(250));
        pthreads_spinning = false;
      };
      for (size_t l = 0; l < libs.size(); ++l) {
        float* C = c[l].data();
        const laga::bench::SgemmFn fn = libs[l].sgemm;
        const bool own_pthreads = libs[l].name == "openblas" || libs[l].name == "blis";
        const Product q = p;
        cands.push_back({laga::cat(p.name, "/", libs[l].name), shape,
                         2e-9 * double(p.M) * double(p.N) * double(p.K), libs[l].isa,
                         [=, &pthreads_spinning] {
                           fn(q.ta, q.tb, q.M, q.N, q.K, q.A, q.lda, q.B, q.ldb, C, q.N);
                           pthreads_spinning = own_pthreads;
                         },
                         [&, C] {
                           std::vector<float> got;
                           for (std::int64_t i : rows)
                             got.insert(got.end(), C + i * p.N, C + (i + 1) * p.N);
                           return laga::bench::count_wrong(got.data(), ref.data(),
                                                           std::int64_t(ref.size()), 1e-5);
                         }});
      }
      ctx.run_alternating(cands, quiet_cores);
    }
  }
}
