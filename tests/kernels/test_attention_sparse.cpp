// Sparse attention (kernels/attention_sparse.hpp): forward and backward
// against the naive dense-masked reference (common/naive_dsa.hpp), per-head
// and latent (one shared key/value head), with empty slots and slots in any
// order; finite differences in double; every causal key as the selection
// equals dense causal attention; the head-summed target; bad indices refused;
// the bf16 entry points against the float kernel on the same rounded
// operands (bit for bit: attention_sparse.hpp, "bf16 mixed precision").
#include "kernels/attention_sparse.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/check.hpp"
#include "common/naive_dsa.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"
#include "kernels/dsa_indexer.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

struct SparseCase {
  SparseAttnShape s;
  std::vector<double> q, k, v, dout;
  std::vector<std::int32_t> idx;
  // A selection of up to K earlier keys per row, in scrambled order, with
  // empty slots scattered (fewer keys than K in early rows).
  SparseCase(std::int64_t B, std::int64_t Sq, std::int64_t Sk, std::int64_t Hq, std::int64_t Hk,
             std::int64_t dqk, std::int64_t dv, std::int64_t K, std::uint64_t seed) {
    AttnShape& a = s.attn;
    a.B = B, a.Sq = Sq, a.Sk = Sk, a.Hq = Hq, a.Hk = Hk, a.dqk = dqk, a.dv = dv;
    a.scale = 1.0 / std::sqrt(double(dqk));
    s.K = K;
    q = random_vector<double>(B * Sq * Hq * dqk, seed);
    k = random_vector<double>(B * Sk * Hk * dqk, seed + 1);
    v = random_vector<double>(B * Sk * Hk * dv, seed + 2);
    dout = random_vector<double>(B * Sq * Hq * dv, seed + 3);
    test::TestRng rng(seed + 4);
    idx.assign(std::size_t(B * Sq * K), -1);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < Sq; ++i) {
        std::vector<std::int32_t> keys;
        for (std::int64_t j = 0; j <= i + Sk - Sq; ++j) keys.push_back(std::int32_t(j));
        for (std::size_t n = keys.size(); n > 1; --n)  // Fisher-Yates
          std::swap(keys[n - 1], keys[std::size_t(rng.next_u64() % n)]);
        std::int32_t* row = idx.data() + (b * Sq + i) * K;
        std::size_t next = 0;
        for (std::int64_t slot = 0; slot < K && next < keys.size(); ++slot)
          if (rng.uniform() < 0.8) row[slot] = keys[next++];
      }
  }
  test::NaiveSparseResult naive() const {
    const AttnShape& a = s.attn;
    return test::naive_sparse_attention(a.B, a.Sq, a.Sk, a.Hq, a.Hk, a.dqk, a.dv, a.scale, s.K, idx,
                                        q, k, v, &dout);
  }
  template <class T>
  void run(std::vector<T>& o, std::vector<T>& lse, std::vector<T>& dq, std::vector<T>& dk,
           std::vector<T>& dv) const {
    const AttnShape& a = s.attn;
    const std::vector<T> qt(q.begin(), q.end()), kt(k.begin(), k.end()), vt(v.begin(), v.end()),
        dt(dout.begin(), dout.end());
    o.assign(std::size_t(a.B * a.Sq * a.Hq * a.dv), T(0));
    lse.assign(std::size_t(a.B * a.Hq * a.Sq), T(0));
    dq.assign(q.size(), T(0)), dk.assign(k.size(), T(0)), dv.assign(v.size(), T(0));
    sparse_attention_forward(s, o.data(), lse.data(), qt.data(), kt.data(), vt.data(), idx.data());
    sparse_attention_backward(s, dq.data(), dk.data(), dv.data(), dt.data(), qt.data(), kt.data(),
                              vt.data(), o.data(), lse.data(), idx.data());
  }
};

TEST(SparseAttention, EqualsTheDenseMaskedReference) {
  // per-head (Hk = Hq), latent (Hk = 1), and a rank's queries over more keys.
  for (auto [Sq, Sk, Hq, Hk, K] :
       {std::tuple{9, 9, 3, 3, 4}, std::tuple{9, 9, 4, 1, 5}, std::tuple{5, 12, 2, 2, 6}}) {
    SparseCase c(2, Sq, Sk, Hq, Hk, 6, 5, K, 17);
    const auto want = c.naive();
    std::vector<double> o, lse, dq, dk, dv;
    c.run(o, lse, dq, dk, dv);
    EXPECT_TRUE(all_close("o", o, want.o, 1e-14, 1e-13));
    EXPECT_TRUE(all_close("lse", lse, want.lse, 1e-14, 1e-13));
    EXPECT_TRUE(all_close("dq", dq, want.dq, 1e-14, 1e-13));
    EXPECT_TRUE(all_close("dk", dk, want.dk, 1e-14, 1e-13));
    EXPECT_TRUE(all_close("dv", dv, want.dv, 1e-14, 1e-13));
    std::vector<float> of, lf, dqf, dkf, dvf;
    c.run(of, lf, dqf, dkf, dvf);
    EXPECT_TRUE(all_close("o fp32", of, want.o, 1e-6, 1e-5));
    EXPECT_TRUE(all_close("dq fp32", dqf, want.dq, 1e-6, 1e-5));
    EXPECT_TRUE(all_close("dk fp32", dkf, want.dk, 1e-6, 1e-5));
    EXPECT_TRUE(all_close("dv fp32", dvf, want.dv, 1e-6, 1e-5));
  }
}

TEST(SparseAttention, BackwardMatchesFiniteDifferences) {
  for (std::int64_t Hk : {3, 1}) {
    SparseCase c(1, 6, 6, 3, Hk, 4, 3, 3, 5);
    std::vector<double> o, lse, dq, dk, dv;
    c.run(o, lse, dq, dk, dv);
    auto loss = [&] {
      std::vector<double> oo(o.size()), ll(lse.size());
      sparse_attention_forward(c.s, oo.data(), ll.data(), c.q.data(), c.k.data(), c.v.data(),
                               c.idx.data());
      return test::dot(oo.data(), c.dout.data(), std::int64_t(oo.size()));
    };
    test::GradientCheck gc;
    gc.add("q", c.q.data(), dq.data(), std::int64_t(c.q.size()))
        .add("k", c.k.data(), dk.data(), std::int64_t(c.k.size()))
        .add("v", c.v.data(), dv.data(), std::int64_t(c.v.size()));
    EXPECT_TRUE(gc.run(loss, {})) << "Hk " << Hk;
  }
}

// Every causal key selected is dense causal attention.
TEST(SparseAttention, AllCausalKeysIsDenseAttention) {
  SparseCase c(2, 8, 8, 2, 2, 4, 4, 8, 3);
  IndexerShape is;
  is.attn = c.s.attn, is.attn.Hk = 1, is.topk = 8;
  dsa_all_causal(is, c.idx.data());
  std::vector<double> o, lse, dq, dk, dv;
  c.run(o, lse, dq, dk, dv);
  std::vector<double> o_ref(o.size()), lse_ref(lse.size()), dq_ref(dq.size()), dk_ref(dk.size()),
      dv_ref(dv.size());
  AttnShape a = c.s.attn;
  a.causal = true;
  attention_reference_forward(a, o_ref.data(), lse_ref.data(), c.q.data(), c.k.data(), c.v.data());
  attention_reference_backward(a, dq_ref.data(), dk_ref.data(), dv_ref.data(), c.dout.data(),
                               c.q.data(), c.k.data(), c.v.data());
  EXPECT_TRUE(all_close("o", o, o_ref, 1e-14, 1e-13));
  EXPECT_TRUE(all_close("lse", lse, lse_ref, 1e-14, 1e-13));
  EXPECT_TRUE(all_close("dq", dq, dq_ref, 1e-14, 1e-13));
  EXPECT_TRUE(all_close("dk", dk, dk_ref, 1e-14, 1e-13));
  EXPECT_TRUE(all_close("dv", dv, dv_ref, 1e-14, 1e-13));
}

TEST(SparseAttention, HeadSummedProbsAreTheMainAttentionsDistribution) {
  SparseCase c(1, 7, 7, 4, 1, 5, 5, 4, 8);
  std::vector<double> o, lse, dq, dk, dv;
  c.run(o, lse, dq, dk, dv);
  std::vector<double> p(std::size_t(7 * 4));
  sparse_attention_head_summed_probs(c.s, p.data(), c.q.data(), c.k.data(), lse.data(),
                                     c.idx.data());
  for (std::int64_t i = 0; i < 7; ++i) {
    double sum = 0;
    bool any = false;
    for (std::int64_t r = 0; r < 4; ++r) {
      const std::int32_t j = c.idx[std::size_t(i * 4 + r)];
      if (j < 0) {
        EXPECT_EQ(p[std::size_t(i * 4 + r)], 0.0);
        continue;
      }
      any = true;
      double want = 0;
      for (std::int64_t h = 0; h < 4; ++h) {
        double d = 0;
        for (std::int64_t e = 0; e < 5; ++e)
          d += c.q[std::size_t((i * 4 + h) * 5 + e)] * c.k[std::size_t(j * 5 + e)];
        want += std::exp(d * c.s.attn.scale - lse[std::size_t(h * 7 + i)]) / 4;
      }
      EXPECT_NEAR(p[std::size_t(i * 4 + r)], want, 1e-15);
      sum += p[std::size_t(i * 4 + r)];
    }
    if (any) {
      EXPECT_NEAR(sum, 1.0, 1e-14);
    }
  }
}

// bf16 mixed precision: the bf16 kernel reads bf16 q, k, v, dO, widens each
// exactly and runs the float kernel's arithmetic, so against the float kernel
// on the widened values the bound is 0 (every bit); against the naive double
// reference on the same rounded values it meets the fp32 bound of the test
// above (the float kernel's own error; the rounding of the operands is the
// same on both sides). Per-head, latent, a rank's queries over more keys.
TEST(SparseAttention, Bf16IsTheFloatKernelOnTheRoundedOperands) {
  for (auto [Sq, Sk, Hq, Hk, K] :
       {std::tuple{9, 9, 3, 3, 4}, std::tuple{9, 9, 4, 1, 5}, std::tuple{5, 12, 2, 2, 6}}) {
    SparseCase c(2, Sq, Sk, Hq, Hk, 6, 5, K, 23);
    const auto round = [](std::vector<double>& x, std::vector<bf16>& h, std::vector<float>& f) {
      for (double& e : x) {
        h.push_back(to_bf16(float(e)));
        f.push_back(to_float(h.back()));
        e = double(f.back());
      }
    };
    std::vector<bf16> qh, kh, vh, dh;
    std::vector<float> qf, kf, vf, df;
    round(c.q, qh, qf), round(c.k, kh, kf), round(c.v, vh, vf), round(c.dout, dh, df);
    const AttnShape& a = c.s.attn;
    const std::size_t no = std::size_t(a.B * a.Sq * a.Hq * a.dv),
                      nl = std::size_t(a.B * a.Hq * a.Sq);
    // the float kernel on the widened values
    std::vector<float> of, lf, dqf, dkf, dvf;
    c.run(of, lf, dqf, dkf, dvf);
    // the bf16 kernel on the bf16 storage
    std::vector<float> ob(no), lb(nl), dqb(qf.size()), dkb(kf.size()), dvb(vf.size());
    sparse_attention_forward_bf16(c.s, ob.data(), lb.data(), qh.data(), kh.data(), vh.data(),
                                  c.idx.data());
    sparse_attention_backward_bf16(c.s, dqb.data(), dkb.data(), dvb.data(), dh.data(), qh.data(),
                                   kh.data(), vh.data(), ob.data(), lb.data(), c.idx.data());
    EXPECT_EQ(ob, of) << "o";
    EXPECT_EQ(lb, lf) << "lse";
    EXPECT_EQ(dqb, dqf) << "dq";
    EXPECT_EQ(dkb, dkf) << "dk";
    EXPECT_EQ(dvb, dvf) << "dv";
    const auto want = c.naive();  // double, on the rounded values
    EXPECT_TRUE(all_close("o bf16", ob, want.o, 1e-6, 1e-5));
    EXPECT_TRUE(all_close("lse bf16", lb, want.lse, 1e-6, 1e-5));
    EXPECT_TRUE(all_close("dq bf16", dqb, want.dq, 1e-6, 1e-5));
    EXPECT_TRUE(all_close("dk bf16", dkb, want.dk, 1e-6, 1e-5));
    EXPECT_TRUE(all_close("dv bf16", dvb, want.dv, 1e-6, 1e-5));
    // the head-summed target over the same rounded q, k
    std::vector<float> pf(std::size_t(a.B * a.Sq * K)), pb(pf.size());
    sparse_attention_head_summed_probs(c.s, pf.data(), qf.data(), kf.data(), lf.data(),
                                       c.idx.data());
    sparse_attention_head_summed_probs_bf16(c.s, pb.data(), qh.data(), kh.data(), lb.data(),
                                            c.idx.data());
    EXPECT_EQ(pb, pf) << "head-summed p";
    for (std::int64_t row = 0; row < a.B * a.Sq; ++row) {
      double sum = 0;
      bool any = false;
      for (std::int64_t r = 0; r < K; ++r) {
        sum += pb[std::size_t(row * K + r)];
        any = any || c.idx[std::size_t(row * K + r)] >= 0;
      }
      if (any) {
        EXPECT_NEAR(sum, 1.0, 1e-6) << "row " << row;
      }
    }
  }
}

TEST(SparseAttention, BadIndicesAreRefusedNamingTheSlot) {
  SparseCase c(1, 4, 4, 1, 1, 2, 2, 2, 1);
  c.idx = {0, -1, 1, 0, 2, 5, 3, 2};
  EXPECT_THROW(
      {
        try {
          sparse_attention_check_indices(c.s, c.idx.data());
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("idx[b=0, i=2, slot=1] = 5"), std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  c.idx = {0, -1, 1, 1, 2, 0, 3, 2};
  EXPECT_THROW(sparse_attention_check_indices(c.s, c.idx.data()), Error);
  c.idx = {0, -1, 1, 0, 2, 0, 3, 2};
  EXPECT_NO_THROW(sparse_attention_check_indices(c.s, c.idx.data()));
}

}  // namespace
}  // namespace laga
