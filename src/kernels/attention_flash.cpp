// Fused flash-style attention on the CPU (contract: kernels/attention.hpp).
//
// Virtual rows. Key/value head hk is read by the g = Hq / Hk query heads
// hk*g .. hk*g+g-1. Their rows, token-major, form one sequence of R = Sq * g
// "virtual rows" r = i * g + t (token i = r / g, head hk * g + r % g), and
// attention of that sequence against the Sk keys of hk is plain one-head
// attention whose causal limit depends on the token only. So multi-head
// (g = 1), grouped and the latent variant (Hk = 1, g = Hq) share one code
// path, and in the latent variant a block of virtual rows covers every head of
// a few tokens: each K/V block is read once for all heads of the shard.
//
// Tiles are computed transposed, keys by rows: S^T (Bc, Br) = K_j Q_i^T. The
// softmax statistics of a row then live in one vector lane across the loop
// over keys, K_j is read in place from its (B, Sk, Hk, d) tensor, and only the
// query block is transposed, once per block. Scores are kept in base 2: Q is
// packed times scale * log2(e), so p = 2^(s2 - m2) and lse = (m2 + log2 l) ln 2.
//
// Backward recomputes P^T and dS^T tile by tile from the saved lse. dK_j and
// dV_j are sums over query blocks, dQ_i a sum over key blocks; each sum is
// taken in ascending block order by exactly one thread, so the result does not
// depend on the thread count or schedule (bitwise), and no (Sq, Sk) buffer or
// atomic is needed. Two schedules reach that:
//  - per head: one thread owns all of (b, hk) and walks query blocks outside,
//    key blocks inside, accumulating dK_j, dV_j straight into the outputs;
//  - two passes (when there are too few (b, hk) heads to keep every thread
//    busy, e.g. the latent variant at B = 1): a dK/dV pass parallel over key
//    blocks and a dQ pass parallel over query blocks, recomputing the scores
//    in both (about 40% more FLOPs for dims 192/128).
#include "kernels/attention_flash.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/attention_flash_simd.hpp"

namespace laga {

namespace {

using flash::Simd;
using flash::tile_gemm;

// Virtual query rows and keys per tile. Br is a multiple of every vector width
// (the softmax walks whole vectors of rows); 64 x 64 keeps the packed Q^T,
// the two score tiles and one K/V block within L2 at d = 576.
constexpr std::int64_t kBr = 64;
constexpr std::int64_t kBc = 64;
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// The virtual rows of key/value head hk of batch b.
struct HeadView {
  const AttnShape& s;
  std::int64_t b, hk, g, R;
  HeadView(const AttnShape& shape, std::int64_t b_, std::int64_t hk_)
      : s(shape), b(b_), hk(hk_), g(shape.Hq / shape.Hk), R(shape.Sq * (shape.Hq / shape.Hk)) {}
  std::int64_t token(std::int64_t r) const { return r / g; }
  std::int64_t head(std::int64_t r) const { return hk * g + r % g; }
  // Offset of virtual row r in a (B, Sq, Hq, d) tensor.
  std::int64_t row_off(std::int64_t r, std::int64_t d) const {
    return ((b * s.Sq + r / g) * s.Hq + hk * g + r % g) * d;
  }
  // Rows of a block are equally spaced in memory unless 1 < g < Hq (grouped
  // heads jump from the last head of a group to the next token).
  bool uniform() const { return g == 1 || g == s.Hq; }
  std::int64_t row_stride(std::int64_t d) const { return g == 1 ? s.Hq * d : d; }
  // Offset of key j in a (B, Sk, Hk, d) tensor.
  std::int64_t key_off(std::int64_t j, std::int64_t d) const {
    return ((b * s.Sk + j) * s.Hk + hk) * d;
  }
  // Index of virtual row r in a (B, Hq, Sq) array (lse, D).
  std::int64_t stat_off(std::int64_t r) const { return (b * s.Hq + head(r)) * s.Sq + token(r); }
};

// One row block: rows [r0, r0 + rows) of a head.
struct RowBlock {
  std::int64_t r0, rows;
  std::int64_t kend;     // keys [0, kend) are visible to its last row
  std::int64_t kend_lo;  // ... and [0, kend_lo) to its first: no mask needed below
  RowBlock(const HeadView& hv, std::int64_t rb)
      : r0(rb * kBr), rows(std::min(kBr, hv.R - rb * kBr)) {
    kend = hv.s.key_end(hv.token(r0 + rows - 1));
    kend_lo = hv.s.key_end(hv.token(r0));
  }
  // Keys of the tile starting at j0: trimmed at kend, past which every row of
  // the block is masked (the causal diagonal block).
  std::int64_t cols(std::int64_t j0) const { return std::min(kBc, kend - j0); }
};

// Per-thread scratch, all of tile size.
template <class T>
struct Scratch {
  std::vector<T> qt;                    // (dqk, Br)  Q_i^T of the block, times scale * log2(e)
  std::vector<T> dot;                   // (dv, Br)   dO_i^T
  std::vector<T> rows_q;                // (Br, dqk)  Q_i rows, packed when not equally spaced
  std::vector<T> rows_do;               // (Br, dv)   dO_i rows, likewise
  std::vector<T> st;                    // (Bc, Br)   S^T, then P^T
  std::vector<T> dpt;                   // (Bc, Br)   dP^T, then dS^T
  std::vector<T> acc;                   // (Br, max(dqk, dv))  O_i (forward) or dQ_i (backward)
  std::vector<T> m, l, alpha, lse2, D;  // (Br) per-row statistics
  explicit Scratch(const AttnShape& s, bool backward)
      : qt(static_cast<size_t>(s.dqk * kBr)),
        st(static_cast<size_t>(kBc * kBr)),
        acc(static_cast<size_t>(kBr * std::max(s.dqk, s.dv))),
        m(kBr),
        l(kBr),
        alpha(kBr),
        lse2(kBr),
        D(kBr) {
    if (backward) {
      dot.resize(static_cast<size_t>(s.dv * kBr));
      dpt.resize(static_cast<size_t>(kBc * kBr));
      rows_q.resize(static_cast<size_t>(kBr * s.dqk));
      rows_do.resize(static_cast<size_t>(kBr * s.dv));
    }
  }
};

// out (d, Br): column r = row r0 + r of x (B, Sq, Hq, d), times mult.
template <class T>
void pack_transposed(const HeadView& hv, const T* x, std::int64_t d, const RowBlock& rb, T mult,
                     T* out) {
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    const T* src = x + hv.row_off(rb.r0 + r, d);
    for (std::int64_t c = 0; c < d; ++c) out[c * kBr + r] = src[c] * mult;
  }
}

// The block's rows of x (B, Sq, Hq, d) as (ptr, ld): in place when equally
// spaced, else copied into buf (Br, d).
template <class T>
const T* rows_view(const HeadView& hv, const T* x, std::int64_t d, const RowBlock& rb, T* buf,
                   std::int64_t& ld) {
  if (hv.uniform()) {
    ld = hv.row_stride(d);
    return x + hv.row_off(rb.r0, d);
  }
  for (std::int64_t r = 0; r < rb.rows; ++r)
    std::memcpy(buf + r * d, x + hv.row_off(rb.r0 + r, d), sizeof(T) * static_cast<size_t>(d));
  ld = d;
  return buf;
}

// Sets S^T (c, r) to -inf where key j0 + c is past row r's causal limit. Only
// the tiles that straddle the diagonal get here.
template <class T>
void mask_tile(const HeadView& hv, const RowBlock& rb, std::int64_t j0, std::int64_t cols, T* st) {
  if (!hv.s.causal || j0 + cols <= rb.kend_lo) return;
  const T ninf = -std::numeric_limits<T>::infinity();
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    const std::int64_t e = std::max<std::int64_t>(hv.s.key_end(hv.token(rb.r0 + r)) - j0, 0);
    for (std::int64_t c = e; c < cols; ++c) st[c * kBr + r] = ninf;
  }
}

template <class T>
void forward_block(const AttnShape& s, const HeadView& hv, const RowBlock& rb, Scratch<T>& w, T* o,
                   T* lse, const T* q, const T* k, const T* v) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  const std::int64_t nr = ceil_div(rb.rows, W) * W;  // whole vectors of rows (<= Br)
  const std::int64_t ldk = s.Hk * s.dqk, ldv = s.Hk * s.dv;
  pack_transposed(hv, q, s.dqk, rb, static_cast<T>(s.scale * kLog2e), w.qt.data());
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<T>::infinity());
  std::fill(w.l.begin(), w.l.end(), T(0));
  std::fill(w.acc.begin(), w.acc.begin() + rb.rows * s.dv, T(0));
  T* st = w.st.data();
  for (std::int64_t j0 = 0; j0 < rb.kend; j0 += kBc) {
    const std::int64_t cols = rb.cols(j0);
    tile_gemm<T>(cols, rb.rows, s.dqk, k + hv.key_off(j0, s.dqk), ldk, 1, w.qt.data(), kBr, st, kBr,
                 false);
    mask_tile(hv, rb, j0, cols, st);
    // Online softmax, one lane per row. A row whose keys so far are all masked
    // has max -inf: shift by 0 instead, so p = 2^-inf = 0, not 2^(-inf+inf).
    for (std::int64_t r = 0; r < nr; r += W) {
      const V m_old = S::load(w.m.data() + r);
      V mx = m_old;
      for (std::int64_t c = 0; c < cols; ++c) mx = S::max(mx, S::load(st + c * kBr + r));
      const V mu = S::finite_or_zero(mx);
      const V alpha = S::exp2(S::sub(m_old, mu));
      V sum = S::zero();
      for (std::int64_t c = 0; c < cols; ++c) {
        const V p = S::exp2(S::sub(S::load(st + c * kBr + r), mu));
        S::store(st + c * kBr + r, p);
        sum = S::add(sum, p);
      }
      S::store(w.l.data() + r, S::fmadd(S::load(w.l.data() + r), alpha, sum));
      S::store(w.m.data() + r, mx);
      S::store(w.alpha.data() + r, alpha);
    }
    for (std::int64_t r = 0; r < rb.rows; ++r) {
      const T a = w.alpha[static_cast<size_t>(r)];
      if (a == T(1)) continue;
      T* row = w.acc.data() + r * s.dv;
      for (std::int64_t c = 0; c < s.dv; ++c) row[c] *= a;
    }
    // O_i (Br, dv) += P (Br, Bc) V_j (Bc, dv); P read from P^T.
    tile_gemm<T>(rb.rows, s.dv, cols, st, 1, kBr, v + hv.key_off(j0, s.dv), ldv, w.acc.data(), s.dv,
                 true);
  }
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    T* dst = o + hv.row_off(rb.r0 + r, s.dv);
    const T l = w.l[static_cast<size_t>(r)];
    if (l == T(0)) {  // every key masked: o = 0, lse = 0 by convention
      std::fill(dst, dst + s.dv, T(0));
      lse[hv.stat_off(rb.r0 + r)] = T(0);
      continue;
    }
    const T inv = T(1) / l;
    const T* src = w.acc.data() + r * s.dv;
    for (std::int64_t c = 0; c < s.dv; ++c) dst[c] = src[c] * inv;
    lse[hv.stat_off(rb.r0 + r)] =
        static_cast<T>((w.m[static_cast<size_t>(r)] + std::log2(l)) * kLn2);
  }
}

// State of one query block in backward: its packed operands and statistics.
template <class T>
struct BackwardRows {
  const T* q = nullptr;  // (rows, dqk) rows of Q, stride ldq
  const T* dout = nullptr;
  std::int64_t ldq = 0, ldo = 0;
};

template <class T>
BackwardRows<T> load_rows(const AttnShape& s, const HeadView& hv, const RowBlock& rb, Scratch<T>& w,
                          const T* q, const T* dout, const T* lse, const T* D) {
  BackwardRows<T> br;
  pack_transposed(hv, q, s.dqk, rb, static_cast<T>(s.scale * kLog2e), w.qt.data());
  pack_transposed(hv, dout, s.dv, rb, T(1), w.dot.data());
  br.q = rows_view(hv, q, s.dqk, rb, w.rows_q.data(), br.ldq);
  br.dout = rows_view(hv, dout, s.dv, rb, w.rows_do.data(), br.ldo);
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    w.lse2[static_cast<size_t>(r)] = static_cast<T>(lse[hv.stat_off(rb.r0 + r)] * kLog2e);
    w.D[static_cast<size_t>(r)] = D[hv.stat_off(rb.r0 + r)];
  }
  return br;
}

// P^T into w.st and dS^T (already times scale) into w.dpt for tile (rb, j0).
template <class T>
void backward_scores(const AttnShape& s, const HeadView& hv, const RowBlock& rb, std::int64_t j0,
                     std::int64_t cols, Scratch<T>& w, const T* k, const T* v) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  const std::int64_t nr = ceil_div(rb.rows, W) * W;
  T* st = w.st.data();
  T* dpt = w.dpt.data();
  tile_gemm<T>(cols, rb.rows, s.dqk, k + hv.key_off(j0, s.dqk), s.Hk * s.dqk, 1, w.qt.data(), kBr,
               st, kBr, false);
  tile_gemm<T>(cols, rb.rows, s.dv, v + hv.key_off(j0, s.dv), s.Hk * s.dv, 1, w.dot.data(), kBr,
               dpt, kBr, false);
  // Masked scores become -inf and so p = 0: fully masked rows (lse = 0 by
  // convention) pass no gradient.
  mask_tile(hv, rb, j0, cols, st);
  const V sc = S::set1(static_cast<T>(s.scale));
  for (std::int64_t c = 0; c < cols; ++c)
    for (std::int64_t r = 0; r < nr; r += W) {
      const V p = S::exp2(S::sub(S::load(st + c * kBr + r), S::load(w.lse2.data() + r)));
      S::store(st + c * kBr + r, p);
      const V ds =
          S::mul(S::mul(p, S::sub(S::load(dpt + c * kBr + r), S::load(w.D.data() + r))), sc);
      S::store(dpt + c * kBr + r, ds);
    }
}

// dV_j (cols, dv) += P_ij^T dO_i, dK_j (cols, dqk) += dS_ij^T Q_i, in place in
// the outputs.
template <class T>
void backward_kv(const AttnShape& s, const HeadView& hv, const RowBlock& rb, std::int64_t j0,
                 std::int64_t cols, Scratch<T>& w, const BackwardRows<T>& br, T* dk, T* dv) {
  tile_gemm<T>(cols, s.dv, rb.rows, w.st.data(), kBr, 1, br.dout, br.ldo, dv + hv.key_off(j0, s.dv),
               s.Hk * s.dv, true);
  tile_gemm<T>(cols, s.dqk, rb.rows, w.dpt.data(), kBr, 1, br.q, br.ldq, dk + hv.key_off(j0, s.dqk),
               s.Hk * s.dqk, true);
}

// dQ_i (rows, dqk) += dS_ij K_j into the scratch accumulator.
template <class T>
void backward_q(const AttnShape& s, const HeadView& hv, const RowBlock& rb, std::int64_t j0,
                std::int64_t cols, Scratch<T>& w, const T* k) {
  tile_gemm<T>(rb.rows, s.dqk, cols, w.dpt.data(), 1, kBr, k + hv.key_off(j0, s.dqk), s.Hk * s.dqk,
               w.acc.data(), s.dqk, true);
}

template <class T>
void store_dq(const AttnShape& s, const HeadView& hv, const RowBlock& rb, const Scratch<T>& w,
              T* dq) {
  for (std::int64_t r = 0; r < rb.rows; ++r)
    std::memcpy(dq + hv.row_off(rb.r0 + r, s.dqk), w.acc.data() + r * s.dqk,
                sizeof(T) * static_cast<size_t>(s.dqk));
}

template <class T>
void zero_keys(const AttnShape& s, const HeadView& hv, std::int64_t j0, std::int64_t j1, T* dk,
               T* dv) {
  for (std::int64_t j = j0; j < j1; ++j) {
    std::fill_n(dk + hv.key_off(j, s.dqk), s.dqk, T(0));
    std::fill_n(dv + hv.key_off(j, s.dv), s.dv, T(0));
  }
}

// First row block that sees key j0 (the causal limit grows with the token).
std::int64_t first_row_block(const AttnShape& s, std::int64_t g, std::int64_t j0) {
  if (!s.causal) return 0;
  const std::int64_t i_min = std::max<std::int64_t>(0, j0 + s.Sq - s.Sk);
  return i_min * g / kBr;
}

}  // namespace

template <class T>
void attention_flash_forward(const AttnShape& s, T* o, T* lse, const T* q, const T* k, const T* v) {
  s.validate();
  const std::int64_t g = s.Hq / s.Hk, heads = s.B * s.Hk, nrb = ceil_div(s.Sq * g, kBr);
  const std::int64_t units = heads * nrb;
  if (units == 0) return;
#pragma omp parallel if (units > 1)
  {
    Scratch<T> w(s, false);
    // Heaviest (last, under the causal mask) row blocks first.
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t u = 0; u < units; ++u) {
      const std::int64_t bh = u % heads, rb = nrb - 1 - u / heads;
      const HeadView hv(s, bh / s.Hk, bh % s.Hk);
      forward_block(s, hv, RowBlock(hv, rb), w, o, lse, q, k, v);
    }
  }
}

template <class T>
void attention_flash_backward(const AttnShape& s, T* dq, T* dk, T* dv, const T* dout, const T* q,
                              const T* k, const T* v, const T* o, const T* lse) {
  s.validate();
  const std::int64_t g = s.Hq / s.Hk, heads = s.B * s.Hk, R = s.Sq * g;
  const std::int64_t nrb = ceil_div(R, kBr), nkb = ceil_div(s.Sk, kBc);
  // D_i = do_i . o_i, in the (B, Hq, Sq) layout of lse.
  std::vector<T> D(static_cast<size_t>(s.B * s.Hq * s.Sq));
  const std::int64_t nrows = s.B * s.Sq * s.Hq;
#pragma omp parallel for schedule(static) if (nrows * s.dv > (1 << 16))
  for (std::int64_t x = 0; x < nrows; ++x) {
    const std::int64_t h = x % s.Hq, i = (x / s.Hq) % s.Sq, b = x / (s.Hq * s.Sq);
    const T* a = dout + x * s.dv;
    const T* c = o + x * s.dv;
    T acc = 0;
    for (std::int64_t e = 0; e < s.dv; ++e) acc += a[e] * c[e];
    D[static_cast<size_t>((b * s.Hq + h) * s.Sq + i)] = acc;
  }
  if (heads == 0) return;

  // One thread per head when the heads share the threads out evenly enough
  // (the busiest thread within 30% of ideal); else the two-pass schedule.
  // Called from inside a parallel region with nesting exhausted, the regions
  // below get one thread whatever omp_get_max_threads() says.
  const std::int64_t nt =
      omp_get_active_level() >= omp_get_max_active_levels() ? 1 : omp_get_max_threads();
  const bool per_head = ceil_div(heads, nt) * nt * 10 <= heads * 13;
  if (per_head) {
#pragma omp parallel if (heads > 1)
    {
      Scratch<T> w(s, true);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t bh = 0; bh < heads; ++bh) {
        const HeadView hv(s, bh / s.Hk, bh % s.Hk);
        zero_keys(s, hv, 0, s.Sk, dk, dv);
        for (std::int64_t ib = 0; ib < nrb; ++ib) {
          const RowBlock rb(hv, ib);
          const BackwardRows<T> br = load_rows(s, hv, rb, w, q, dout, lse, D.data());
          std::fill(w.acc.begin(), w.acc.begin() + rb.rows * s.dqk, T(0));
          for (std::int64_t j0 = 0; j0 < rb.kend; j0 += kBc) {
            const std::int64_t cols = rb.cols(j0);
            backward_scores(s, hv, rb, j0, cols, w, k, v);
            backward_kv(s, hv, rb, j0, cols, w, br, dk, dv);
            backward_q(s, hv, rb, j0, cols, w, k);
          }
          store_dq(s, hv, rb, w, dq);
        }
      }
    }
    return;
  }
#pragma omp parallel if (heads * std::max(nkb, nrb) > 1)
  {
    Scratch<T> w(s, true);
    // dK/dV pass; key blocks in ascending order, the first see the most rows.
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t u = 0; u < heads * nkb; ++u) {
      const std::int64_t bh = u % heads, j0 = (u / heads) * kBc;
      const HeadView hv(s, bh / s.Hk, bh % s.Hk);
      zero_keys(s, hv, j0, std::min(j0 + kBc, s.Sk), dk, dv);
      for (std::int64_t ib = first_row_block(s, g, j0); ib < nrb; ++ib) {
        const RowBlock rb(hv, ib);
        if (rb.kend <= j0) continue;
        const BackwardRows<T> br = load_rows(s, hv, rb, w, q, dout, lse, D.data());
        const std::int64_t cols = rb.cols(j0);
        backward_scores(s, hv, rb, j0, cols, w, k, v);
        backward_kv(s, hv, rb, j0, cols, w, br, dk, dv);
      }
    }
    // dQ pass; the implicit barrier above is not needed for correctness (the
    // passes write different outputs) but keeps the two loads balanced.
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t u = 0; u < heads * nrb; ++u) {
      const std::int64_t bh = u % heads, ib = nrb - 1 - u / heads;
      const HeadView hv(s, bh / s.Hk, bh % s.Hk);
      const RowBlock rb(hv, ib);
      load_rows(s, hv, rb, w, q, dout, lse, D.data());
      std::fill(w.acc.begin(), w.acc.begin() + rb.rows * s.dqk, T(0));
      for (std::int64_t j0 = 0; j0 < rb.kend; j0 += kBc) {
        const std::int64_t cols = rb.cols(j0);
        backward_scores(s, hv, rb, j0, cols, w, k, v);
        backward_q(s, hv, rb, j0, cols, w, k);
      }
      store_dq(s, hv, rb, w, dq);
    }
  }
}

#define LAGA_INSTANTIATE(T)                                                                   \
  template void attention_flash_forward<T>(const AttnShape&, T*, T*, const T*, const T*,      \
                                           const T*);                                         \
  template void attention_flash_backward<T>(const AttnShape&, T*, T*, T*, const T*, const T*, \
                                            const T*, const T*, const T*, const T*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
