// sgemm through laga::gemm (OpenBLAS) on the shapes of an MLA block: the
// yardstick for what "% of peak" a tuned library reaches on this machine.
// GFLOP = 2 M N K. Reference: dgemm of the same (float) inputs, once per shape.
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "harness.hpp"
#include "kernels/gemm.hpp"

namespace {

struct GemmShape {
  const char* what;
  std::int64_t M, N, K;
};

}  // namespace

LAGA_BENCH(gemm, "sgemm (OpenBLAS via laga::gemm), C = A B^T as in y = x W^T") {
  const bool quick = ctx.options().quick;
  const std::int64_t T = quick ? 256 : 2048;  // tokens
  const std::vector<GemmShape> shapes = {
      {"square", T, T, T},
      {"wkv_a: x(T,D) W^T, D 2048->576", T, 576, 2048},
      {"wkv_b: c(T,C) W^T, C 512->16x256", T, 4096, 512},
      {"wo: o(T,16x128) W^T ->2048", T, 2048, 2048},
  };
  ctx.header();
  for (const GemmShape& g : shapes) {
    if (!laga::bench::case_selected(ctx.options(), g.what)) continue;
    std::vector<float> a(static_cast<size_t>(g.M * g.K)), b(static_cast<size_t>(g.N * g.K)),
        c(static_cast<size_t>(g.M * g.N));
    laga::fill_normal(a.data(), g.M * g.K, 1, 0, 0, 1.0);
    laga::fill_normal(b.data(), g.N * g.K, 1, 1, 0, 1.0);
    std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end());
    std::vector<double> ref(c.size());
    laga::gemm<double>(false, true, g.M, g.N, g.K, 1.0, ad.data(), g.K, bd.data(), g.K, 0.0,
                       ref.data(), g.N);
    const std::string shape = laga::cat(g.M, "x", g.N, "x", g.K);
    ctx.note(g.what);
    ctx.run(
        "sgemm_nt", shape, 2e-9 * double(g.M) * double(g.N) * double(g.K), laga::bench::blas_isa(),
        [&] {
          laga::gemm<float>(false, true, g.M, g.N, g.K, 1.0f, a.data(), g.K, b.data(), g.K, 0.0f,
                            c.data(), g.N);
        },
        [&] { return laga::bench::count_wrong(c.data(), ref.data(), g.M * g.N, 1e-5); });
  }
}
