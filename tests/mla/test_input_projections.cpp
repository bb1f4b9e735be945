// The input projections are one GEMM each way (docs/forms.md, "The input
// projections"): wq (or wq_a) and wkv_a both read x (N, D), so forward is
// one x in_proj^T (N = Nq + C + dr wide) and backward one dx = dproj in_proj
// and one in_proj gradient += dproj^T x, in every form and variant (the
// query-latent exchange, overlap on), rq 0 and > 0, P 1 and 2 ranks (the
// counted run's op list, mla/ops.hpp "Op counts", is the one laga plan
// reads). D is chosen apart from every other width (H dv, C, rq), so a GEMM
// with K = D forward, or N = D backward, is an input projection's.
#include <gtest/gtest.h>

#include "common/variants.hpp"
#include "mla/memory_model.hpp"
#include "mla/params.hpp"

namespace laga {
namespace {

MlaConfig config(std::int64_t rq) {
  MlaConfig c;
  c.dim = 40, c.n_heads = 4, c.kv_lora_rank = 16, c.qk_nope_head_dim = 8, c.qk_rope_head_dim = 4,
  c.v_head_dim = 6, c.q_lora_rank = rq;
  c.validate();
  return c;
}

// wq (wq_a) and wkv_a are rows of in_proj, which no consumer sees by name:
// for_each visits the same names and shapes as before, once each, and a
// clone's views are onto its own in_proj.
TEST(InputProjections, WeightsAreRowsOfOneMatrixSeenByTheirNames) {
  for (std::int64_t rq : {0, 12}) {
    SCOPED_TRACE("rq=" + std::to_string(rq));
    const MlaConfig cfg = config(rq);
    MlaParams<float> p = MlaParams<float>::zeros(cfg, MemCategory::parameters);
    init_params(p, 3);
    std::vector<std::pair<std::string, Shape>> seen;
    p.for_each([&](const std::string& n, Tensor<float>& t) { seen.push_back({n, t.shape()}); });
    EXPECT_EQ(seen, mla_param_shapes(cfg));
    const Tensor<float>& q_rows = rq == 0 ? p.wq : p.wq_a;
    const std::int64_t Nq = q_rows.dim(0);
    EXPECT_EQ(p.in_proj.shape(), (Shape{Nq + p.wkv_a.dim(0), cfg.dim}));
    EXPECT_EQ(q_rows.data(), p.in_proj.data());
    EXPECT_EQ(p.wkv_a.data(), p.in_proj.data() + Nq * cfg.dim);
    const MlaParams<float> c = p.clone(MemCategory::parameters);
    const Tensor<float>& c_rows = rq == 0 ? c.wq : c.wq_a;
    EXPECT_EQ(c_rows.data(), c.in_proj.data());
    EXPECT_EQ(c.wkv_a.data(), c.in_proj.data() + Nq * cfg.dim);
    for (std::int64_t i = 0; i < p.in_proj.numel(); ++i)
      ASSERT_EQ(c.in_proj[i], p.in_proj[i]) << "element " << i;
  }
}

TEST(InputProjections, OneGemmForwardOneForDxOneForTheWeightGradient) {
  for (std::int64_t rq : {0, 12}) {
    const MlaConfig cfg = config(rq);
    const std::int64_t D = cfg.dim;
    const std::int64_t Nq = rq == 0 ? cfg.n_heads * cfg.qk_head_dim() : rq;
    const std::int64_t out = Nq + cfg.kv_lora_rank + cfg.qk_rope_head_dim;
    for (int P : {1, 2}) {
      const SpLayout lay = SpLayout::even(1, 16, cfg.n_heads, P);
      const std::int64_t N = lay.seq_count[0];
      for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
        SCOPED_TRACE(to_string(v) + " rq=" + std::to_string(rq) + " P=" + std::to_string(P));
        ops::OpCounts counts;
        MemoryModelOptions o;
        o.op_counts = &counts;
        predict_memory(cfg, lay, v, AttentionKind::flash, 0, 4, o);
        // Every GEMM that reads x (K = D, x not transposed) or writes a
        // (., D) result from a gradient: the projections' three.
        std::vector<std::pair<ops::GemmCall, std::int64_t>> reads_x, to_dx, to_dw;
        for (const auto& [g, t] : counts.gemm_calls) {
          if (!g.trans_a && g.trans_b && g.k == D) reads_x.push_back({g, t.calls});
          if (!g.trans_a && !g.trans_b && g.n == D) to_dx.push_back({g, t.calls});
          if (g.trans_a && g.n == D) to_dw.push_back({g, t.calls});
        }
        const ops::GemmCall forward{false, true, N, out, D, D, D, out, false};
        const ops::GemmCall dx{false, false, N, D, out, out, D, D, false};
        const ops::GemmCall dw{true, false, out, D, N, out, D, D, true};
        ASSERT_EQ(reads_x.size(), 1u);
        EXPECT_EQ(reads_x[0].first, forward);
        EXPECT_EQ(reads_x[0].second, 1);
        ASSERT_EQ(to_dx.size(), 1u);
        EXPECT_EQ(to_dx[0].first, dx);
        EXPECT_EQ(to_dx[0].second, 1);
        ASSERT_EQ(to_dw.size(), 1u);
        EXPECT_EQ(to_dw[0].first, dw);
        EXPECT_EQ(to_dw[0].second, 1);
      }
    }
  }
}

}  // namespace
}  // namespace laga
