// The lightning indexer's kernels (kernels/dsa_indexer.hpp) against the
// naive references (common/naive_dsa.hpp): the non-interleaved RoPE as
// DeepSeek's apply_rotary_emb(..., False) does it, LayerNorm, the scores and
// the top-k with its tie rule (exact ties), and the KL loss with its
// gradient checked by finite differences in double.
#include "kernels/dsa_indexer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/check.hpp"
#include "common/naive_dsa.hpp"
#include "core/error.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

RopeParams rope_params(std::int64_t dr, bool yarn) {
  RopeParams p;
  p.dim = dr, p.theta = 10000, p.yarn = yarn, p.factor = 40, p.original_seq_len = 8;
  return p;
}

TEST(RopeHalves, IsDeepSeeksNonInterleavedRotation) {
  for (bool yarn : {false, true}) {
    const std::int64_t dr = 8, dI = 12, L = 5, H = 3, pos0 = 3;
    const RopeTable table(rope_params(dr, yarn), 16);
    const std::vector<double> freqs = rope_frequencies(rope_params(dr, yarn));
    std::vector<double> x = random_vector<double>(L * H * dI, 11), want = x;
    rope_halves_apply(x.data(), L, H, H * dI, dI, pos0, nullptr, table, false);
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h) {
        std::vector<double> angle;
        for (double f : freqs) angle.push_back(double(pos0 + l) * f);
        test::naive_rope_halves(want.data() + (l * H + h) * dI, dr, angle);
      }
    EXPECT_TRUE(all_close("rope_halves", x, want, 1e-14, 1e-13)) << "yarn " << yarn;
    // Not the MLA's interleaved rotation: on the same data it differs.
    std::vector<double> inter = random_vector<double>(L * H * dI, 11);
    rope_apply(inter.data(), 1, L, H, H * dI, dI, pos0, table, false);
    EXPECT_FALSE(all_close("interleaved", inter, want, 1e-6, 0)) << "yarn " << yarn;
    // The inverse undoes it (backward is the transposed rotation).
    rope_halves_apply(x.data(), L, H, H * dI, dI, pos0, nullptr, table, true);
    EXPECT_TRUE(all_close("inverse", x, random_vector<double>(L * H * dI, 11), 1e-14, 1e-13));
  }
}

TEST(LayerNorm, ForwardAndFiniteDifferences) {
  const std::int64_t rows = 4, n = 10;
  std::vector<double> x = random_vector<double>(rows * n, 1, -2, 2);
  std::vector<double> w = random_vector<double>(n, 2, 0.5, 1.5), b = random_vector<double>(n, 3);
  const std::vector<double> G = random_vector<double>(rows * n, 4);
  auto loss = [&] {
    std::vector<double> y(static_cast<std::size_t>(rows * n)), mean(static_cast<std::size_t>(rows)),
        rstd(static_cast<std::size_t>(rows));
    layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, n,
                      1e-6);
    return test::dot(y.data(), G.data(), rows * n);
  };
  std::vector<double> y(static_cast<std::size_t>(rows * n)), mean(static_cast<std::size_t>(rows)),
      rstd(static_cast<std::size_t>(rows));
  layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, n,
                    1e-6);
  for (std::int64_t r = 0; r < rows; ++r) {  // the definition, naively
    double m = 0, v = 0;
    for (std::int64_t e = 0; e < n; ++e) m += x[std::size_t(r * n + e)] / double(n);
    for (std::int64_t e = 0; e < n; ++e)
      v += std::pow(x[std::size_t(r * n + e)] - m, 2) / double(n);
    for (std::int64_t e = 0; e < n; ++e)
      EXPECT_NEAR(y[std::size_t(r * n + e)],
                  (x[std::size_t(r * n + e)] - m) / std::sqrt(v + 1e-6) * w[std::size_t(e)] +
                      b[std::size_t(e)],
                  1e-13);
  }
  std::vector<double> dx(x.size()), dw(w.size(), 0.0), db(b.size(), 0.0);
  layernorm_backward(dx.data(), dw.data(), db.data(), G.data(), x.data(), w.data(), mean.data(),
                     rstd.data(), rows, n);
  test::GradientCheck gc;
  gc.add("x", x.data(), dx.data(), rows * n).add("w", w.data(), dw.data(), n);
  gc.add("b", b.data(), db.data(), n);
  EXPECT_TRUE(gc.run(loss, {}));
}

struct IndexerCase {
  IndexerShape s;
  std::vector<double> q, k, w;
  IndexerCase(std::int64_t B, std::int64_t Sq, std::int64_t Sk, std::int64_t HI, std::int64_t dI,
              std::int64_t topk, std::uint64_t seed) {
    s.attn.B = B, s.attn.Sq = Sq, s.attn.Sk = Sk, s.attn.Hq = HI, s.attn.Hk = 1, s.attn.dqk = dI;
    s.attn.dv = 1, s.attn.causal = true, s.topk = topk;
    q = random_vector<double>(B * Sq * HI * dI, seed);
    k = random_vector<double>(B * Sk * dI, seed + 1);
    w = random_vector<double>(B * Sq * HI, seed + 2);
  }
  std::vector<std::int32_t> topk() const {
    std::vector<std::int32_t> idx(std::size_t(s.attn.B * s.attn.Sq * s.topk));
    dsa_index_topk(s, idx.data(), q.data(), k.data(), w.data());
    return idx;
  }
  std::vector<double> naive_scores() const {
    return test::naive_index_scores(s.attn.B, s.attn.Sq, s.attn.Sk, s.attn.Hq, s.attn.dqk, q, k, w,
                                    s.attn.doc_start);
  }
};

TEST(IndexerTopk, EqualsTheNaiveFullSort) {
  // Sq == Sk (a whole sequence) and Sq < Sk (a rank's queries over every
  // earlier key, bottom-right aligned), topk below and above the row lengths.
  for (auto [Sq, Sk, topk] : {std::tuple{12, 12, 5}, std::tuple{6, 15, 4}, std::tuple{9, 9, 40}}) {
    IndexerCase c(2, Sq, Sk, 4, 6, topk, 5);
    const auto got = c.topk();
    const auto want = test::naive_topk(2 * Sq, Sk, topk, c.naive_scores());
    EXPECT_EQ(got, want) << "Sq " << Sq << " Sk " << Sk << " topk " << topk;
    std::vector<double> sc(static_cast<std::size_t>(2 * Sq * Sk));
    dsa_index_scores(c.s, sc.data(), c.q.data(), c.k.data(), c.w.data());
    std::vector<double> naive = c.naive_scores();
    for (std::size_t n = 0; n < sc.size(); ++n) {  // masked pairs: -inf on both sides
      EXPECT_EQ(std::isinf(sc[n]), std::isinf(naive[n])) << "pair " << n;
      if (std::isinf(sc[n])) sc[n] = naive[n] = 0;
    }
    EXPECT_TRUE(all_close("scores", sc, naive, 1e-14, 1e-13));
  }
}

TEST(IndexerTopk, PackedDocumentsSelectWithinTheirDocument) {
  IndexerCase c(1, 10, 10, 3, 4, 3, 9);
  const std::vector<std::int64_t> doc_start{0, 0, 0, 0, 4, 4, 4, 4, 4, 9};
  c.s.attn.doc_start = doc_start.data();
  EXPECT_EQ(c.topk(), test::naive_topk(10, 10, 3, c.naive_scores()));
  const auto idx = c.topk();
  for (std::int64_t i = 0; i < 10; ++i)
    for (std::int64_t r = 0; r < 3; ++r)
      if (idx[std::size_t(i * 3 + r)] >= 0) {
        EXPECT_GE(idx[std::size_t(i * 3 + r)], doc_start[std::size_t(i)]);
      }
}

// Exact ties at the boundary: the lower key position wins, in every row.
TEST(IndexerTopk, ExactTiesGoToTheLowerPosition) {
  // All weights 0: every score is exactly 0, so each row keeps its first
  // topk causal keys.
  IndexerCase zero(1, 10, 10, 2, 4, 3, 1);
  std::fill(zero.w.begin(), zero.w.end(), 0.0);
  const auto idx = zero.topk();
  for (std::int64_t i = 0; i < 10; ++i)
    for (std::int64_t r = 0; r < 3; ++r)
      EXPECT_EQ(idx[std::size_t(i * 3 + r)], r <= i ? r : -1) << "row " << i << " slot " << r;
  // Keys 2, 5 and 7 identical and the best: with topk 2 a query that sees
  // all three keeps 2 and 5 (tied with 7); in float as in double.
  IndexerCase c(1, 9, 9, 2, 4, 2, 3);
  for (std::int64_t e = 0; e < 4; ++e) {
    for (std::int64_t j = 0; j < 9; ++j) c.k[std::size_t(j * 4 + e)] = e == 0 ? -1.0 : 0.0;
    for (std::int64_t j : {2, 5, 7}) c.k[std::size_t(j * 4 + e)] = e == 0 ? 1.0 : 0.0;
  }
  for (std::int64_t i = 0; i < 9; ++i)
    for (std::int64_t h = 0; h < 2; ++h) {
      c.q[std::size_t((i * 2 + h) * 4)] = 1.0;  // q.k = 1 for the three, -1 (ReLU 0) else
      c.w[std::size_t(i * 2 + h)] = 0.5;
    }
  const auto t = c.topk();
  EXPECT_EQ((std::vector<std::int32_t>{t[16], t[17]}), (std::vector<std::int32_t>{2, 5}));
  EXPECT_EQ(t, test::naive_topk(9, 9, 2, c.naive_scores()));
  IndexerShape sf = c.s;
  std::vector<float> qf(c.q.begin(), c.q.end()), kf(c.k.begin(), c.k.end()),
      wf(c.w.begin(), c.w.end());
  std::vector<std::int32_t> tf(t.size());
  dsa_index_topk(sf, tf.data(), qf.data(), kf.data(), wf.data());
  EXPECT_EQ(tf, t);
}

// A rank that keeps its own query rows and gathers every earlier key (the
// query-local gather form's indexer) selects, row by row, exactly what the
// whole sequence selects: the scores of a pair are computed alike wherever
// the row is, and the tie rule reads only scores and positions. Uneven
// shards of 13 rows on 3 ranks, in float (where a different summation
// would show first) and double.
template <class T>
void check_query_local() {
  IndexerCase whole(1, 13, 13, 4, 6, 4, 77);
  for (std::int64_t i = 0; i < 13; i += 3)  // exact ties too: zero-weight rows
    for (std::int64_t h = 0; h < 4; ++h) whole.w[std::size_t(i * 4 + h)] = 0;
  const std::vector<T> q(whole.q.begin(), whole.q.end()), k(whole.k.begin(), whole.k.end()),
      w(whole.w.begin(), whole.w.end());
  std::vector<std::int32_t> all(13 * 4);
  dsa_index_topk(whole.s, all.data(), q.data(), k.data(), w.data());
  std::int64_t s0 = 0;
  for (std::int64_t L : {5, 3, 5}) {
    IndexerShape rank = whole.s;
    rank.attn.Sq = L, rank.attn.Sk = s0 + L;  // its rows, every key up to its last
    std::vector<std::int32_t> mine(static_cast<std::size_t>(L * 4));
    dsa_index_topk(rank, mine.data(), q.data() + s0 * 4 * 6, k.data(), w.data() + s0 * 4);
    EXPECT_EQ(mine, std::vector<std::int32_t>(all.begin() + s0 * 4, all.begin() + (s0 + L) * 4))
        << "rows from " << s0;
    s0 += L;
  }
}
TEST(IndexerTopk, QueryLocalRowsSelectAsTheWholeSequence) {
  check_query_local<float>();
  check_query_local<double>();
}

TEST(IndexerKl, LossAndGradientAgainstNaiveAndFiniteDifferences) {
  // Over the selected set (the sparse stage) and over every causal key (the
  // dense warm-up), with a target that is a distribution over each row.
  for (bool dense : {false, true}) {
    IndexerCase c(2, 7, 7, 3, 5, 3, 21);
    const std::int64_t rows = 2 * 7;
    std::vector<std::int32_t> idx;
    std::int64_t K = c.s.topk;
    if (dense) {
      K = 7;
      idx.resize(static_cast<std::size_t>(rows * K));
      dsa_all_causal(c.s, idx.data());
    } else {
      idx = c.topk();
    }
    std::vector<double> p = random_vector<double>(rows * K, 31, 0.1, 1.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      double z = 0;
      for (std::int64_t s = 0; s < K; ++s)
        if (idx[std::size_t(r * K + s)] < 0) {
          p[std::size_t(r * K + s)] = 0;
        } else {
          z += p[std::size_t(r * K + s)];
        }
      for (std::int64_t s = 0; s < K; ++s) p[std::size_t(r * K + s)] /= z;
    }
    std::vector<double> loss(static_cast<std::size_t>(rows)), dq(c.q.size()), dk(c.k.size()),
        dw(c.w.size());
    dsa_indexer_kl(c.s, K, idx.data(), p.data(), c.q.data(), c.k.data(), c.w.data(), loss.data(),
                   dq.data(), dk.data(), dw.data());
    double total = 0;
    for (double l : loss) total += l;
    EXPECT_NEAR(total, test::naive_indexer_kl(rows, 7, K, idx, p, c.naive_scores()), 1e-12);
    EXPECT_GT(total, 0.0);
    auto f = [&] { return test::naive_indexer_kl(rows, 7, K, idx, p, c.naive_scores()); };
    test::GradientCheck gc;
    gc.add("q", c.q.data(), dq.data(), std::int64_t(c.q.size()))
        .add("k", c.k.data(), dk.data(), std::int64_t(c.k.size()))
        .add("w", c.w.data(), dw.data(), std::int64_t(c.w.size()));
    EXPECT_TRUE(gc.run(f, {})) << (dense ? "dense" : "sparse");
  }
}

TEST(IndexerShapeCheck, RefusesWhatItCannotTake) {
  IndexerShape s;
  s.attn.Hq = 2, s.attn.Hk = 2;
  EXPECT_THROW(s.validate(), Error);
  s.attn.Hk = 1, s.topk = 0;
  EXPECT_THROW(s.validate(), Error);
  s.topk = 4, s.attn.causal = false;
  EXPECT_THROW(s.validate(), Error);
  s.attn.causal = true;
  EXPECT_NO_THROW(s.validate());
}

}  // namespace
}  // namespace laga
