// The invariant mode's two primitives behind the op layer (docs/invariance.md):
// the kernel table's gemm_invariant row, which alone takes a GEMM in the mode,
// and the canonical reduction over tokens (mla/canonical_sum.hpp): the same bits at every P from 1
// to 8, with even and uneven shards (a rank may hold no token), in double, fp32 and bf16 mixed
// precision; close to the double sum; and the mutation -- the pieces
// combined in rank order, as an all-reduce of partial sums would -- caught by
// the same comparison.
#include "mla/canonical_sum.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "core/bf16.hpp"
#include "core/memory_pool.hpp"
#include "core/precision.hpp"
#include "kernels/attention_flash.hpp"

namespace laga::ops {
namespace {

// Rank r's tokens: [cut[r], cut[r + 1]).
TokenShards shards_of(std::int64_t B, std::int64_t S, const std::vector<std::int64_t>& cut) {
  TokenShards t;
  t.B = B, t.S = S;
  for (std::size_t r = 0; r + 1 < cut.size(); ++r)
    t.begin.push_back(cut[r]), t.end.push_back(cut[r + 1]);
  return t;
}

// Cuts of S among P ranks: even (the block's split) or uneven (the first
// rank holds 3 tokens, the second none where P > 2, the rest split evenly).
std::vector<std::int64_t> cuts(std::int64_t S, int P, bool uneven) {
  std::vector<std::int64_t> c{0};
  if (uneven && P > 1) {
    c.push_back(3);
    if (P > 2) c.push_back(3);
    const int rest = P - int(c.size()) + 1;
    for (int i = 1; i <= rest; ++i) c.push_back(3 + (S - 3) * i / rest);
    return c;
  }
  for (int i = 1; i <= P; ++i) c.push_back(S * i / P);
  return c;
}

// dst = (7 + rank-independent start) + the canonical sum of a^T b over B rows
// of S tokens held by P ranks; rank 0's result (every rank's is checked equal).
template <class T>
std::vector<T> run_sum(int P, bool uneven, std::int64_t B, std::int64_t S, std::int64_t m,
                       std::int64_t n, Precision precision) {
  const std::vector<T> a = test::random_vector<T>(B * S * m, 1),
                       b = test::random_vector<T>(B * S * n, 2);
  const TokenShards sh = shards_of(B, S, cuts(S, P, uneven));
  std::vector<std::vector<T>> out(static_cast<std::size_t>(P));
  run_local_ranks(P, [&](Communicator& comm) {
    const UsePrecision prec(precision);
    const int r = comm.rank();
    const std::int64_t len = sh.end[r] - sh.begin[r];
    Tensor<T> la({std::max<std::int64_t>(B * len, 0), m}),
        lb({std::max<std::int64_t>(B * len, 0), n});
    for (std::int64_t bb = 0; bb < B; ++bb)
      for (std::int64_t t = 0; t < len; ++t) {
        std::memcpy(la.data() + (bb * len + t) * m, a.data() + (bb * S + sh.begin[r] + t) * m,
                    sizeof(T) * m);
        std::memcpy(lb.data() + (bb * len + t) * n, b.data() + (bb * S + sh.begin[r] + t) * n,
                    sizeof(T) * n);
      }
    std::vector<T> dst(static_cast<std::size_t>(m * n), T(0.25));
    canonical_token_sum<T>(comm, Mat<T>{dst.data(), m, n, n}, mat(std::as_const(la)),
                           mat(std::as_const(lb)), sh, "canonical test");
    out[r] = dst;
  });
  for (int r = 1; r < P; ++r)
    EXPECT_EQ(0, std::memcmp(out[r].data(), out[0].data(), sizeof(T) * out[0].size()))
        << "rank " << r << " of " << P << " differs from rank 0";
  return out[0];
}

template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), sizeof(T) * x.size()) == 0;
}

struct Case {
  std::int64_t B, S;
};
const Case kCases[] = {{1, 100}, {2, 67}, {1, 256}, {3, 9}};

template <class T>
void check_every_p(Precision precision) {
  for (const Case& c : kCases)
    for (bool uneven : {false, true}) {
      SCOPED_TRACE("B " + std::to_string(c.B) + " S " + std::to_string(c.S) +
                   (uneven ? " uneven" : ""));
      const std::vector<T> one = run_sum<T>(1, false, c.B, c.S, 5, 33, precision);
      // Close to the sum in double (it is the sum).
      const std::vector<T> a = test::random_vector<T>(c.B * c.S * 5, 1),
                           b = test::random_vector<T>(c.B * c.S * 33, 2);
      std::vector<double> want(5 * 33, 0.25);
      for (std::int64_t t = 0; t < c.B * c.S; ++t)
        for (int i = 0; i < 5; ++i)
          for (int j = 0; j < 33; ++j) {
            double x = double(a[t * 5 + i]), y = double(b[t * 33 + j]);
            if (precision == Precision::bf16)
              x = double(to_float(to_bf16(float(x)))), y = double(to_float(to_bf16(float(y))));
            want[i * 33 + j] += x * y;
          }
      EXPECT_TRUE(test::all_close("sum", one, want, 1e-4, 1e-4));
      for (int P = 2; P <= 8; ++P) {
        SCOPED_TRACE("P " + std::to_string(P));
        EXPECT_TRUE(same_bits(run_sum<T>(P, uneven, c.B, c.S, 5, 33, precision), one));
      }
    }
}

TEST(CanonicalSum, SameBitsAtEveryPInDouble) {
  check_every_p<double>(Precision::fp32);
}
TEST(CanonicalSum, SameBitsAtEveryPInFp32) {
  check_every_p<float>(Precision::fp32);
}
TEST(CanonicalSum, SameBitsAtEveryPInBf16) {
  check_every_p<float>(Precision::bf16);
}

// The latent's reduce-scatter (canonical_reduce_scatter): the global (B S, n)
// result of a (B S, K) b (K, n), K sharded like heads (`heads` of `kv` columns
// each, uneven where asked) and the rows like tokens; rank 0's assembled
// copy of every rank's rows.
template <class T>
std::vector<T> run_reduce_scatter(int P, bool uneven, std::int64_t B, std::int64_t S,
                                  std::int64_t heads, std::int64_t kv, std::int64_t n,
                                  Precision precision) {
  const std::int64_t K = heads * kv, R = B * S;
  const std::vector<T> a = test::random_vector<T>(R * K, 7), b = test::random_vector<T>(K * n, 8);
  std::vector<std::int64_t> head_cut = cuts(heads, P, uneven && heads > 3);
  for (std::int64_t& c : head_cut) c *= kv;
  const TokenShards index = shards_of(1, K, head_cut), rows = shards_of(B, S, cuts(S, P, uneven));
  std::vector<T> out(static_cast<std::size_t>(R * n));
  run_local_ranks(P, [&](Communicator& comm) {
    const UsePrecision prec(precision);
    const int r = comm.rank();
    const std::int64_t k0 = index.begin[r], kr = index.end[r] - k0;
    const std::int64_t len = rows.end[r] - rows.begin[r];
    Tensor<T> la({R, kr}), lb({kr, n}), d({B * len, n});
    // std::copy_n, not memcpy: a rank without heads (kr 0) or tokens (len 0)
    // holds empty tensors, whose data() is null (memcpy's UB even for 0 bytes).
    for (std::int64_t i = 0; i < R; ++i) std::copy_n(a.data() + i * K + k0, kr, la.data() + i * kr);
    std::copy_n(b.data() + k0 * n, kr * n, lb.data());
    canonical_reduce_scatter<T>(comm, mat(d), mat(std::as_const(la)), mat(std::as_const(lb)), index,
                                rows, "canonical test");
    for (std::int64_t bb = 0; bb < B; ++bb)
      std::copy_n(d.data() + bb * len * n, len * n, out.data() + (bb * S + rows.begin[r]) * n);
  });
  return out;
}

template <class T>
void check_reduce_scatter_every_p(Precision precision) {
  for (bool uneven : {false, true}) {
    SCOPED_TRACE(uneven ? "uneven" : "even");
    const std::vector<T> one = run_reduce_scatter<T>(1, false, 2, 37, 16, 12, 9, precision);
    // Close to the product in double (bf16: of the rounded operands, and
    // the result rounded once).
    const std::vector<T> a = test::random_vector<T>(74 * 192, 7),
                         b = test::random_vector<T>(192 * 9, 8);
    std::vector<double> want(74 * 9, 0.0);
    const auto val = [&](T x) {
      return precision == Precision::bf16 ? double(to_float(to_bf16(float(x)))) : double(x);
    };
    for (int i = 0; i < 74; ++i)
      for (int k = 0; k < 192; ++k)
        for (int j = 0; j < 9; ++j) want[i * 9 + j] += val(a[i * 192 + k]) * val(b[k * 9 + j]);
    const double tol = precision == Precision::bf16 ? 1e-2 : 1e-4;
    EXPECT_TRUE(test::all_close("reduce-scatter", one, want, tol, tol));
    for (int P = 2; P <= 8; ++P) {
      SCOPED_TRACE("P " + std::to_string(P));
      EXPECT_TRUE(same_bits(run_reduce_scatter<T>(P, uneven, 2, 37, 16, 12, 9, precision), one));
    }
  }
}

TEST(CanonicalReduceScatter, SameBitsAtEveryPInDouble) {
  check_reduce_scatter_every_p<double>(Precision::fp32);
}
TEST(CanonicalReduceScatter, SameBitsAtEveryPInFp32) {
  check_reduce_scatter_every_p<float>(Precision::fp32);
}
TEST(CanonicalReduceScatter, SameBitsAtEveryPInBf16) {
  check_reduce_scatter_every_p<float>(Precision::bf16);
}
TEST(CanonicalReduceScatter, ARankOrderedCombinationIsCaught) {
  struct Restore {
    ~Restore() { canonical_sum_rank_order = false; }
  } restore;
  const std::vector<float> one =
      run_reduce_scatter<float>(1, false, 2, 37, 16, 12, 9, Precision::fp32);
  canonical_sum_rank_order = true;
  int differ = 0;
  for (int P = 2; P <= 8; ++P)
    differ +=
        !same_bits(run_reduce_scatter<float>(P, true, 2, 37, 16, 12, 9, Precision::fp32), one);
  EXPECT_GT(differ, 0) << "a rank-ordered combination gave P 1's bits at every P 2..8";
}

// The plain sum's reduce-scatter (canonical_parts_reduce_scatter: the
// latent's gradient over heads in absorbed and laga_fused): the global (B S,
// n) sum of `heads` parts, the heads sharded (uneven where asked, ranks
// without heads) and the rows like tokens; rank 0's assembled copy.
template <class T>
std::vector<T> run_parts_reduce_scatter(int P, bool uneven, std::int64_t B, std::int64_t S,
                                        std::int64_t heads, std::int64_t n, Precision precision) {
  const std::int64_t R = B * S;
  const std::vector<T> a = test::random_vector<T>(heads * R * n, 9);
  const TokenShards index = shards_of(1, heads, cuts(heads, P, uneven && heads > 3)),
                    rows = shards_of(B, S, cuts(S, P, uneven));
  std::vector<T> out(static_cast<std::size_t>(R * n));
  run_local_ranks(P, [&](Communicator& comm) {
    const UsePrecision prec(precision);
    const int r = comm.rank();
    const std::int64_t h0 = index.begin[r], hr = index.end[r] - h0;
    const std::int64_t len = rows.end[r] - rows.begin[r];
    Tensor<T> parts({hr, R, n}), d({B * len, n});
    std::copy_n(a.data() + h0 * R * n, hr * R * n, parts.data());
    canonical_parts_reduce_scatter<T>(comm, mat(d), parts, index, rows, "canonical test");
    for (std::int64_t bb = 0; bb < B; ++bb)
      std::copy_n(d.data() + bb * len * n, len * n, out.data() + (bb * S + rows.begin[r]) * n);
  });
  return out;
}

template <class T>
void check_parts_every_p(Precision precision) {
  // 13 heads: not a power of two, so the tree has absent leaves.
  const std::vector<T> one = run_parts_reduce_scatter<T>(1, false, 2, 37, 13, 9, precision);
  const std::vector<T> a = test::random_vector<T>(13 * 74 * 9, 9);
  std::vector<double> want(74 * 9, 0.0);
  for (int h = 0; h < 13; ++h)
    for (int e = 0; e < 74 * 9; ++e) want[e] += double(a[h * 74 * 9 + e]);
  EXPECT_TRUE(test::all_close("parts sum", one, want, 1e-5, 1e-5));
  // Sums only: a bf16 run rounds nothing.
  if (precision == Precision::bf16) {
    EXPECT_TRUE(
        same_bits(run_parts_reduce_scatter<T>(1, false, 2, 37, 13, 9, Precision::fp32), one));
  }
  for (bool uneven : {false, true})
    for (int P = 2; P <= 8; ++P) {
      SCOPED_TRACE("P " + std::to_string(P) + (uneven ? " uneven" : " even"));
      EXPECT_TRUE(same_bits(run_parts_reduce_scatter<T>(P, uneven, 2, 37, 13, 9, precision), one));
    }
}

TEST(CanonicalPartsReduceScatter, SameBitsAtEveryPInDouble) {
  check_parts_every_p<double>(Precision::fp32);
}
TEST(CanonicalPartsReduceScatter, SameBitsAtEveryPInFp32AndBf16) {
  check_parts_every_p<float>(Precision::fp32);
  check_parts_every_p<float>(Precision::bf16);
}
TEST(CanonicalPartsReduceScatter, ARankOrderedCombinationIsCaught) {
  struct Restore {
    ~Restore() { canonical_sum_rank_order = false; }
  } restore;
  const std::vector<float> one =
      run_parts_reduce_scatter<float>(1, false, 2, 37, 13, 9, Precision::fp32);
  canonical_sum_rank_order = true;
  int differ = 0;
  for (int P = 2; P <= 8; ++P)
    differ +=
        !same_bits(run_parts_reduce_scatter<float>(P, true, 2, 37, 13, 9, Precision::fp32), one);
  EXPECT_GT(differ, 0) << "a rank-ordered combination gave P 1's bits at every P 2..8";
}

// The mutation: combined in rank order, the sum's bits follow P, and the
// comparison above sees it at some P.
TEST(CanonicalSum, ARankOrderedCombinationIsCaught) {
  struct Restore {
    ~Restore() { canonical_sum_rank_order = false; }
  } restore;
  const std::vector<float> one = run_sum<float>(1, false, 1, 256, 5, 33, Precision::fp32);
  canonical_sum_rank_order = true;
  int differ = 0;
  for (int P = 2; P <= 8; ++P)
    differ += !same_bits(run_sum<float>(P, true, 1, 256, 5, 33, Precision::fp32), one);
  EXPECT_GT(differ, 0) << "a rank-ordered combination gave P 1's bits at every P 2..8: the test "
                          "would not catch it";
}

// In the mode the table gives every GEMM to gemm_invariant, in every dtype,
// and the library rows refuse naming the mode; out of it, nothing changes.
TEST(InvariantGemmRow, TakesEveryGemmInTheModeAndNoneOutsideIt) {
  OpShape s;
  s.m = 3, s.n = 4, s.k = 5;
  for (RunDtype d : {RunDtype::fp64, RunDtype::fp32, RunDtype::bf16}) {
    EXPECT_NE(std::string(pick(Device::cpu, Op::gemm, d, s).name), "gemm_invariant")
        << to_string(d);
    s.invariant = true;
    EXPECT_EQ(std::string(pick(Device::cpu, Op::gemm, d, s).name), "gemm_invariant")
        << to_string(d);
    s.invariant = false;
  }
  // The op layer copies the thread's mode into the call: a row of x W^T
  // through ops::linear has the same bits at M 1 and M 50 in the mode.
  const std::vector<float> x = test::random_vector<float>(50 * 70, 3);
  Tensor<float> w({33, 70});
  const std::vector<float> wv = test::random_vector<float>(33 * 70, 4);
  std::memcpy(w.data(), wv.data(), sizeof(float) * wv.size());
  for (Precision p : {Precision::fp32, Precision::bf16}) {
    const UsePrecision prec(p);
    const UseInvariant on(true);
    std::vector<float> all(50 * 33), one(33);
    linear(Mat<float>{all.data(), 50, 33, 33}, Mat<const float>{x.data(), 50, 70, 70}, w);
    linear(Mat<float>{one.data(), 1, 33, 33}, Mat<const float>{x.data() + 7 * 70, 1, 70, 70}, w);
    EXPECT_EQ(0, std::memcmp(one.data(), all.data() + 7 * 33, sizeof(float) * 33))
        << (p == Precision::bf16 ? "bf16" : "fp32");
  }
}

// The flash backward's dK, dV of a head in a call of 16 heads and in a call
// of 2 (a rank's share at P 8): the same bits with one_row_set (the mode's
// flag, which ops::attention_backward sets), not without it (below 8 heads
// the kernel sums two row sets), which is why the mode needs it.
TEST(InvariantAttention, AHeadsGradientsDoNotDependOnTheHeadsInItsCall) {
  const std::int64_t S = 200, H = 16, d = 24;
  const auto heads_of = [&](const std::vector<float>& x, std::int64_t h0, std::int64_t n) {
    std::vector<float> y(static_cast<std::size_t>(S * n * d));
    for (std::int64_t t = 0; t < S; ++t)
      std::memcpy(y.data() + (t * n) * d, x.data() + (t * H + h0) * d, sizeof(float) * n * d);
    return y;
  };
  const std::vector<float> q = test::random_vector<float>(S * H * d, 21),
                           k = test::random_vector<float>(S * H * d, 22),
                           v = test::random_vector<float>(S * H * d, 23),
                           dout = test::random_vector<float>(S * H * d, 24);
  const auto grads = [&](std::int64_t n, bool one_set) {
    AttnShape s{1, S, S, n, n, d, d, 0.2, true};
    s.one_row_set = one_set;
    const std::vector<float> qh = heads_of(q, 0, n), kh = heads_of(k, 0, n), vh = heads_of(v, 0, n),
                             dh = heads_of(dout, 0, n);
    std::vector<float> o(qh.size()), lse(static_cast<std::size_t>(n * S)), dq(qh.size()),
        dk(qh.size()), dv(qh.size());
    attention_flash_forward<float>(s, o.data(), lse.data(), qh.data(), kh.data(), vh.data());
    attention_flash_backward<float>(s, dq.data(), dk.data(), dv.data(), dh.data(), qh.data(),
                                    kh.data(), vh.data(), o.data(), lse.data());
    std::vector<float> both;
    for (std::int64_t t = 0; t < S; ++t)  // head 0 and 1's dk and dv, token by token
      for (const std::vector<float>* g : {&dk, &dv})
        both.insert(both.end(), g->begin() + (t * n) * d, g->begin() + (t * n + 2) * d);
    return both;
  };
  EXPECT_TRUE(same_bits(grads(2, true), grads(H, true)));
  EXPECT_FALSE(same_bits(grads(2, false), grads(H, false)))
      << "without one_row_set a 2-head call summed as a 16-head one: the flag's test shows nothing";
}

// The ledger records the pieces' collectives at their closed forms, the
// comm buffers each call holds are its closed form's `held`, and a
// count-only run of a rank registers the pool bytes the real run does (the
// memory model is the count-only run: docs/architecture.md).
TEST(CanonicalSum, LedgerIsTheClosedFormAndCountOnlyIsThePool) {
  const std::int64_t B = 2, S = 67, m = 5, n = 33, heads = 16, kv = 12;
  for (int P : {1, 3, 8}) {
    const TokenShards sh = shards_of(B, S, cuts(S, P, true));
    std::vector<std::int64_t> head_cut = cuts(heads, P, true);
    for (std::int64_t& c : head_cut) c *= kv;
    const TokenShards index = shards_of(1, heads * kv, head_cut);
    std::vector<std::int64_t> real;
    for (bool count_only : {false, true}) {
      std::vector<std::int64_t> peaks(static_cast<std::size_t>(P));
      run_local_ranks(P, [&](Communicator& comm) {
        const int r = comm.rank();
        MemoryPool pool;
        pool.set_count_only(count_only);
        const PoolScope scope(pool);
        const std::int64_t rows = sh.local_rows(r), k = index.end[r] - index.begin[r];
        Tensor<float> a({rows, m}), b({rows, n}), dst = Tensor<float>::zeros({m, n});
        Tensor<float> ra({B * S, k}), rb({k, n}), rdst({rows, n});
        if (!count_only) {
          std::fill_n(a.data(), a.numel(), 0.5f), std::fill_n(b.data(), b.numel(), 0.25f);
          std::fill_n(ra.data(), ra.numel(), 0.5f), std::fill_n(rb.data(), rb.numel(), 0.25f);
        }
        const PieceBytes sum = canonical_token_sum_elements(sh, r, m * n);
        const PieceBytes rs = canonical_reduce_scatter_elements(index, sh, r, n);
        pool.reset_peaks();
        const std::int64_t base = pool.current(MemCategory::comm_buffers);
        canonical_token_sum<float>(comm, mat(dst), mat(std::as_const(a)), mat(std::as_const(b)), sh,
                                   "sum");
        EXPECT_EQ(pool.peak(MemCategory::comm_buffers) - base, sum.held * 4)
            << "the sum's buffer, rank " << r << " of " << P;
        peaks[r] = pool.peak_total();
        pool.reset_peaks();
        canonical_reduce_scatter<float>(comm, mat(rdst), mat(std::as_const(ra)),
                                        mat(std::as_const(rb)), index, sh, "rs");
        EXPECT_EQ(pool.peak(MemCategory::comm_buffers) - base, rs.held * 4)
            << "the reduce-scatter's buffers, rank " << r << " of " << P;
        peaks[r] = std::max(peaks[r], pool.peak_total());
        // The sum of parts over the heads (absorbed's, laga_fused's): its
        // bytes and buffers are canonical_reduce_scatter_elements' over the
        // head index.
        const TokenShards head_index = shards_of(1, heads, cuts(heads, P, true));
        Tensor<float> parts({head_index.end[r] - head_index.begin[r], B * S, n}), pdst({rows, n});
        if (!count_only) std::fill_n(parts.data(), parts.numel(), 0.5f);
        const PieceBytes ps = canonical_reduce_scatter_elements(head_index, sh, r, n);
        pool.reset_peaks();
        canonical_parts_reduce_scatter<float>(comm, mat(pdst), parts, head_index, sh, "parts");
        EXPECT_EQ(pool.peak(MemCategory::comm_buffers) - base, ps.held * 4)
            << "the parts sum's buffers, rank " << r << " of " << P;
        peaks[r] = std::max(peaks[r], pool.peak_total());
        std::int64_t sent_sum = 0, recv_sum = 0, sent_rs = 0, recv_rs = 0, sent_ps = 0, recv_ps = 0;
        for (const auto& [key, e] : comm.ledger().entries()) {
          if (key.second == "sum") sent_sum += e.bytes_sent, recv_sum += e.bytes_received;
          if (key.second == "rs") sent_rs += e.bytes_sent, recv_rs += e.bytes_received;
          if (key.second == "parts") sent_ps += e.bytes_sent, recv_ps += e.bytes_received;
        }
        EXPECT_EQ(sent_ps, ps.sent * 4) << "rank " << r << " of " << P;
        EXPECT_EQ(recv_ps, ps.received * 4) << "rank " << r << " of " << P;
        EXPECT_EQ(sent_sum, sum.sent * 4) << "rank " << r << " of " << P;
        EXPECT_EQ(recv_sum, sum.received * 4) << "rank " << r << " of " << P;
        EXPECT_EQ(sent_rs, rs.sent * 4) << "rank " << r << " of " << P;
        EXPECT_EQ(recv_rs, rs.received * 4) << "rank " << r << " of " << P;
        if (P == 1) {
          EXPECT_EQ(sum.sent + rs.sent, 0);
        }
      });
      if (!count_only) {
        real = peaks;
      } else {
        EXPECT_EQ(peaks, real) << "P " << P << ": count-only peaks differ from the real run's";
      }
    }
  }
}

// The pieces' closed form (canonical_piece_count: popcounts of the shard's
// ends) is the number canonical_pieces cuts, for every shard of every row
// length up to 70 (and 2^k + 1 about the powers of two), B 1 to 3: the
// sequence's end inside a row, at a power of two and not, a shard ending at
// the end of the sequence (the last node clipped there) and not, empty ones.
TEST(CanonicalSum, PieceCountClosedFormIsThePieces) {
  std::vector<std::int64_t> lengths;
  for (std::int64_t S = 1; S <= 70; ++S) lengths.push_back(S);
  for (std::int64_t k : {7, 10, 12}) lengths.push_back((std::int64_t(1) << k) + 1);
  std::int64_t checked = 0;
  for (std::int64_t B : {1, 2, 3})
    for (std::int64_t S : lengths) {
      const std::int64_t step = S > 70 ? S / 13 : 1;
      for (std::int64_t lo = 0; lo <= S; lo += step)
        for (std::int64_t hi = lo; hi <= S; hi += step) {
          const TokenShards sh = shards_of(B, S, {0, lo, hi, S});
          for (int r = 0; r < 3; ++r, ++checked)
            ASSERT_EQ(canonical_piece_count(sh, r), std::int64_t(canonical_pieces(sh, r).size()))
                << "B " << B << " S " << S << " rank " << r << " of cuts 0, " << lo << ", " << hi
                << ", " << S;
        }
    }
  EXPECT_GT(checked, 100000);
}

// A rank's pieces are maximal aligned nodes covering its tokens exactly.
TEST(CanonicalSum, PiecesAreAlignedAndCoverTheRanksTokens) {
  const TokenShards sh = shards_of(2, 100, {0, 3, 3, 50, 100});
  for (int r = 0; r < 4; ++r) {
    std::int64_t covered = 0, row = 0;
    for (const TreePiece& p : canonical_pieces(sh, r)) {
      const std::int64_t size = p.stop - p.start;
      std::int64_t node = 1;
      while (node < size) node *= 2;
      EXPECT_EQ(p.start % node, 0) << "piece [" << p.start << ", " << p.stop << ") of rank " << r;
      EXPECT_EQ(p.row, row);
      covered += size, row += size;
    }
    EXPECT_EQ(covered, sh.local_rows(r));
  }
  EXPECT_EQ(canonical_pieces(sh, 3).size(), 9u);  // [50, 100): from 50 52 56 64 96;
  // [150, 200): from 150 152 160 192 (the last node clipped at the end, 200)
}

}  // namespace
}  // namespace laga::ops
