// Flash attention with the latent up-projection fused in (contract:
// kernels/attention_flash_latent.hpp).
//
// Loop order: key chunks outside, query blocks inside. A chunk's K_nope and V
// are up-projected once for all H heads (one GEMM of (chunk, C) by
// (C, H (dn + dv))) and then read by every query block of every head. The
// other order (query blocks outside, as attention_flash_impl.inc walks)
// would up-project each chunk again for every query block: Sq / kBr times
// 2 Sk C H (dn + dv) FLOPs, at V3's dims 6.4 times the attention's own. So the
// online-softmax state of every query row (m, l and the unnormalised o, which
// is the output buffer itself) persists across chunks: (B, H, Sq) scalars
// beside o, no (Sq, Sk) buffer.
//
// Backward likewise: per chunk, K_nope and V recomputed, then each head's
// tiles by one thread (it owns that head's columns of the chunk's dK_nope,
// dV and dk_pe, and its rows of dq), then the chunk's dc = dkv w_kv and
// dw_kv += dkv^T c as two GEMMs over all heads.
#include "kernels/attention_flash_latent.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_invariant.hpp"

// The flash kernels' vector exp2 (a degree-7 polynomial, NaN in NaN out), in
// this file's own namespace: attention_flash_simd.hpp is compiled once per
// includer's instruction set and must not share a name (it says why). The
// build's AVX2+FMA flags select its AVX2 copy here.
#define LAGA_FLASH_NS flash_latent_avx2
#include "kernels/attention_flash_simd.hpp"
#undef LAGA_FLASH_NS

namespace laga {

namespace {

// Every product of the kernel: the library's GEMM, or in the invariant mode
// (LatentAttnParams::invariant) gemm_invariant's one tree.
template <class T>
void product(bool invariant, bool trans_a, bool trans_b, std::int64_t M, std::int64_t N,
             std::int64_t K, T alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb,
             T beta, T* C, std::int64_t ldc) {
  (invariant ? &gemm_invariant<T> : &gemm<T>)(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb,
                                              beta, C, ldc);
}

constexpr double kLog2e = 1.4426950408889634;

// x[c] = e^(x[c] - mu) for c < n, as 2^((x - mu) log2 e) by the vector exp2
// (the scalar one in double); returns their sum, lanes in a fixed order.
template <class T>
T exp_shifted(T* x, std::int64_t n, T mu) {
  using S = flash_latent_avx2::Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  const V l2e = S::set1(static_cast<T>(kLog2e)), m = S::set1(mu);
  V acc = S::zero();
  std::int64_t c = 0;
  for (; c + W <= n; c += W) {
    const V p = S::exp2(S::mul(S::sub(S::load(x + c), m), l2e));
    S::store(x + c, p);
    acc = S::add(acc, p);
  }
  T sum = 0;
  if constexpr (W > 1)
    sum = S::hsum(acc);
  else
    sum = acc;
  for (; c < n; ++c) sum += (x[c] = std::exp2((x[c] - mu) * static_cast<T>(kLog2e)));
  return sum;
}

constexpr std::int64_t kBr = 64;  // query rows per tile
constexpr std::int64_t kKc = kLatentKeyChunk;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// double runs on OpenBLAS, whose thread safety under an outer OpenMP team
// depends on how it was built: the double kernel (tests, finite differences)
// runs its tiles on one thread.
template <class T>
constexpr bool kTilesInParallel = std::is_same_v<T, float>;

// One tile: query rows [i0, i0 + rows) of head h, batch b, against the keys
// [lo, lo + cols) of chunk [j0, j1) that some of its rows see. Row r sees the
// tile's columns [rlo[r], rhi[r]) (both non-decreasing in r: attention.hpp).
struct Tile {
  std::int64_t b = 0, h = 0, i0 = 0, rows = 0, lo = 0, cols = 0;
  std::int64_t rlo[kBr], rhi[kBr];
  bool masked = false;  // some row sees only part of the columns
  // False when no row of the block sees a key of the chunk.
  bool make(const AttnShape& s, std::int64_t b_, std::int64_t h_, std::int64_t qb, std::int64_t j0,
            std::int64_t j1) {
    b = b_, h = h_, i0 = qb * kBr, rows = std::min(kBr, s.Sq - qb * kBr);
    lo = std::max(j0, s.key_begin(b, i0));
    const std::int64_t hi = std::min(j1, s.key_end(i0 + rows - 1));
    if (hi <= lo) return false;
    cols = hi - lo;
    masked = false;
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto in_tile = [&](std::int64_t j) {
        return std::clamp<std::int64_t>(j - lo, 0, cols);
      };
      rlo[r] = in_tile(s.key_begin(b, i0 + r));
      rhi[r] = std::max(rlo[r], in_tile(s.key_end(i0 + r)));
      masked = masked || rlo[r] != 0 || rhi[r] != cols;
    }
    return true;
  }
};

// Rows (or keys) of a masked tile taken together: each group's common range
// by one GEMM, the rest of each row's (key's) range, at most a few pairs
// past the diagonal, by a loop. Groups of one row each would make 64 GEMM
// calls per product on every diagonal tile, which at 2k tokens cost more
// than the attention itself (oneDNN's per-call overhead on 1-row products).
constexpr std::int64_t kGroup = 8;

// c (n) += sum over j in [a, b) of x[j] y (j, n): one row's (or key's) pairs
// outside its group's common range.
template <class T>
void add_pairs(const T* x, std::int64_t x_step, const T* y, std::int64_t ldy, std::int64_t n,
               std::int64_t a, std::int64_t b, T* c) {
  for (std::int64_t j = a; j < b; ++j) {
    const T xv = x[j * x_step];
    const T* yj = y + j * ldy;
    for (std::int64_t e = 0; e < n; ++e) c[e] += xv * yj[e];
  }
}

// C (rows, n) += X (rows, cols) Y (cols, n), X the tile (stride kKc): row r
// sums over its own columns [rlo, rhi) only. A masked pair holds p = 0 (or a
// NaN dS), but 0 * NaN is NaN: it is left out by selection, never multiplied
// (attention.hpp, "Every sum ... runs over the unmasked pairs only"). In a
// group of kGroup rows every row sees [rlo(last), rhi(first)) (both ends are
// non-decreasing): one GEMM there, each row's remainder by add_pairs.
template <class T>
void rows_times_keys(bool invariant, const Tile& t, const T* x, const T* y, std::int64_t ldy,
                     std::int64_t n, T* c, std::int64_t ldc) {
  if (!t.masked) {
    product<T>(invariant, false, false, t.rows, n, t.cols, T(1), x, kKc, y, ldy, T(1), c, ldc);
    return;
  }
  for (std::int64_t r0 = 0; r0 < t.rows; r0 += kGroup) {
    const std::int64_t r1 = std::min(t.rows, r0 + kGroup);
    const std::int64_t lo = t.rlo[r1 - 1], hi = t.rhi[r0];
    const bool common = hi > lo;
    if (common)
      product<T>(invariant, false, false, r1 - r0, n, hi - lo, T(1), x + r0 * kKc + lo, kKc,
                 y + lo * ldy, ldy, T(1), c + r0 * ldc, ldc);
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * kKc;
      T* cr = c + r * ldc;
      if (common) {
        add_pairs(xr, 1, y, ldy, n, t.rlo[r], lo, cr);
        add_pairs(xr, 1, y, ldy, n, hi, t.rhi[r], cr);
      } else {
        add_pairs(xr, 1, y, ldy, n, t.rlo[r], t.rhi[r], cr);
      }
    }
  }
}

// C (cols, n) += X^T Y, Y (rows, n): column (key) c sums over the rows that
// see it, [first(c), last(c)), contiguous and non-decreasing in c because rlo
// and rhi are. Groups of kGroup keys as in rows_times_keys.
template <class T>
void keys_times_rows(bool invariant, const Tile& t, const T* x, const T* y, std::int64_t ldy,
                     std::int64_t n, T* c, std::int64_t ldc) {
  if (!t.masked) {
    product<T>(invariant, true, false, t.cols, n, t.rows, T(1), x, kKc, y, ldy, T(1), c, ldc);
    return;
  }
  // first(c): the first row with rhi > c; last(c): the first row with rlo > c.
  std::int64_t first[kKc], last[kKc];
  for (std::int64_t col = 0, f = 0, l = 0; col < t.cols; ++col) {
    while (f < t.rows && t.rhi[f] <= col) ++f;
    while (l < t.rows && t.rlo[l] <= col) ++l;
    first[col] = f, last[col] = std::max(f, l);
  }
  for (std::int64_t c0 = 0; c0 < t.cols; c0 += kGroup) {
    const std::int64_t c1 = std::min(t.cols, c0 + kGroup);
    const std::int64_t f = first[c1 - 1], l = last[c0];
    const bool common = l > f;
    if (common)
      product<T>(invariant, true, false, c1 - c0, n, l - f, T(1), x + f * kKc + c0, kKc,
                 y + f * ldy, ldy, T(1), c + c0 * ldc, ldc);
    for (std::int64_t col = c0; col < c1; ++col) {
      const T* xc = x + col;
      T* cc = c + col * ldc;
      if (common) {
        add_pairs(xc, kKc, y, ldy, n, first[col], f, cc);
        add_pairs(xc, kKc, y, ldy, n, l, last[col], cc);
      } else {
        add_pairs(xc, kKc, y, ldy, n, first[col], last[col], cc);
      }
    }
  }
}

// The extents every loop reads, and the operands of head h's tiles.
template <class T>
struct Layout {
  const LatentAttnParams<T>& p;
  const AttnShape& s;
  std::int64_t H, dn, dr, dqk, dv, KV, ldkv, nqb;
  explicit Layout(const LatentAttnParams<T>& params)
      : p(params),
        s(params.shape),
        H(s.Hq),
        dn(params.dn),
        dr(params.dr()),
        dqk(s.dqk),
        dv(s.dv),
        KV(params.dn + s.dv),
        ldkv(s.Hq * (params.dn + s.dv)),
        nqb(ceil_div(s.Sq, kBr)) {}
  // Row i0 of head h in a (B, Sq, H, d) tensor.
  std::int64_t row(const Tile& t, std::int64_t d) const {
    return ((t.b * s.Sq + t.i0) * H + t.h) * d;
  }
  std::int64_t stat(const Tile& t, std::int64_t r) const {
    return (t.b * H + t.h) * s.Sq + t.i0 + r;
  }
  // The chunk's up-projection kv (chunk, H (dn + dv)) = c_chunk w_kv^T.
  void up_project(std::int64_t b, std::int64_t j0, std::int64_t n, T* kv) const {
    product<T>(p.invariant, false, true, n, ldkv, p.C, T(1), p.c + (b * s.Sk + j0) * p.ld_c, p.ld_c,
               p.w_kv, p.C, T(0), kv, ldkv);
  }
  // S (rows, cols) = scale (q_nope k_nope^T + q_pe k_pe^T), masked pairs
  // -inf whatever they held (a NaN from an unseen key included).
  void scores(const Tile& t, std::int64_t j0, const T* kv, T* st) const {
    const T sc = static_cast<T>(s.scale);
    const T* q = p.q + row(t, dqk);
    product<T>(p.invariant, false, true, t.rows, t.cols, dn, sc, q, H * dqk,
               kv + (t.lo - j0) * ldkv + t.h * KV, ldkv, T(0), st, kKc);
    product<T>(p.invariant, false, true, t.rows, t.cols, dr, sc, q + dn, H * dqk,
               p.k_pe + (t.b * s.Sk + t.lo) * p.ld_k_pe, p.ld_k_pe, T(1), st, kKc);
    if (!t.masked) return;
    const T ninf = -std::numeric_limits<T>::infinity();
    for (std::int64_t r = 0; r < t.rows; ++r) {
      T* x = st + r * kKc;
      std::fill(x, x + t.rlo[r], ninf);
      std::fill(x + t.rhi[r], x + t.cols, ninf);
    }
  }
};

// Runs body(tile) for every (head, query block) of batch row b that sees a
// key of chunk [j0, j1), per head on one thread, in ascending block order.
template <class T, class Body>
void for_head_tiles(const Layout<T>& ly, std::int64_t b, std::int64_t j0, std::int64_t j1,
                    Body&& body) {
#pragma omp parallel for schedule(dynamic, 1) if (kTilesInParallel <T> && ly.H > 1)
  for (std::int64_t h = 0; h < ly.H; ++h) {
    Tile t;
    for (std::int64_t qb = 0; qb < ly.nqb; ++qb)
      if (t.make(ly.s, b, h, qb, j0, j1)) body(t);
  }
}

}  // namespace

template <class T>
void LatentAttnParams<T>::validate() const {
  shape.validate();
  LAGA_CHECK(shape.Hq == shape.Hk, "latent attention: every head has its own keys (Hq = Hk), not ",
             shape.Hq, " query heads over ", shape.Hk, " key/value heads");
  LAGA_CHECK(C > 0, "latent attention: the latent width C must be positive, not ", C);
  LAGA_CHECK(dn >= 0 && dn <= shape.dqk, "latent attention: dn (", dn,
             ") must lie in [0, dqk = dn + dr = ", shape.dqk, "]");
  LAGA_CHECK(ld_c >= C && ld_k_pe >= dr(), "latent attention: row strides ld_c ", ld_c,
             " and ld_k_pe ", ld_k_pe, " must be at least C ", C, " and dr ", dr());
  const bool any = shape.B * shape.Sq > 0 && shape.Sk > 0;
  LAGA_CHECK(!any || (q && c && w_kv && (k_pe || dr() == 0)),
             "latent attention: q, c, k_pe and w_kv must not be null");
}

template <class T>
void attention_flash_latent_forward(const LatentAttnParams<T>& p, T* o, T* lse) {
  p.validate();
  const Layout<T> ly(p);
  const AttnShape& s = p.shape;
  const std::int64_t nstat = s.B * ly.H * s.Sq;
  std::fill_n(o, s.B * s.Sq * ly.H * ly.dv, T(0));
  // m, l: each row's running max and sum (natural base), kept across chunks.
  std::vector<T> m(static_cast<size_t>(nstat), -std::numeric_limits<T>::infinity());
  std::vector<T> l(static_cast<size_t>(nstat), T(0));
  std::vector<T> kv(static_cast<size_t>(kKc * ly.ldkv));
  std::vector<std::vector<T>> tiles(static_cast<size_t>(std::max(1, omp_get_max_threads())));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t j0 = 0; j0 < s.Sk; j0 += kKc) {
      const std::int64_t j1 = std::min(s.Sk, j0 + kKc);
      ly.up_project(b, j0, j1 - j0, kv.data());
      for_head_tiles(ly, b, j0, j1, [&](const Tile& t) {
        std::vector<T>& buf = tiles[static_cast<size_t>(omp_get_thread_num())];
        buf.resize(static_cast<size_t>(kBr * kKc));
        T* st = buf.data();
        ly.scores(t, j0, kv.data(), st);
        T* orow = o + ly.row(t, ly.dv);
        for (std::int64_t r = 0; r < t.rows; ++r) {
          // A row whose keys so far are all masked has max -inf: shift by 0,
          // so p = e^-inf = 0, not e^(-inf + inf). NaN scores stay out of
          // the max (every comparison with NaN is false) and reach p, l, o.
          T* x = st + r * kKc;
          const std::int64_t si = ly.stat(t, r);
          const T m_old = m[static_cast<size_t>(si)];
          T mx = m_old;
          for (std::int64_t c = 0; c < t.cols; ++c) mx = x[c] > mx ? x[c] : mx;
          const T mu = std::isfinite(mx) ? mx : T(0);
          const T alpha = std::exp(m_old - mu);
          const T sum = exp_shifted(x, t.cols, mu);
          l[static_cast<size_t>(si)] = l[static_cast<size_t>(si)] * alpha + sum;
          m[static_cast<size_t>(si)] = mx;
          if (alpha != T(1))
            for (std::int64_t e = 0; e < ly.dv; ++e) orow[r * ly.H * ly.dv + e] *= alpha;
        }
        // O (rows, dv) += P V over each row's keys.
        rows_times_keys(ly.p.invariant, t, st,
                        kv.data() + (t.lo - j0) * ly.ldkv + t.h * ly.KV + ly.dn, ly.ldkv, ly.dv,
                        orow, ly.H * ly.dv);
      });
    }
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < ly.H; ++h)
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        const std::int64_t si = (b * ly.H + h) * s.Sq + i;
        T* dst = o + ((b * s.Sq + i) * ly.H + h) * ly.dv;
        const T sum = l[static_cast<size_t>(si)];
        if (sum == T(0)) {
          // Every key masked: o = 0, lse = 0 by convention; visible keys
          // whose scores are all -inf: NaN, as the flash kernel gives.
          const bool masked = s.key_end(i) <= s.key_begin(b, i);
          const T fill = masked ? T(0) : std::numeric_limits<T>::quiet_NaN();
          std::fill(dst, dst + ly.dv, fill);
          lse[si] = fill;
          continue;
        }
        const T inv = T(1) / sum;
        for (std::int64_t e = 0; e < ly.dv; ++e) dst[e] *= inv;
        lse[si] = m[static_cast<size_t>(si)] + std::log(sum);
      }
}

template <class T>
void attention_flash_latent_backward(const LatentAttnParams<T>& p, const LatentAttnGrads<T>& g,
                                     const T* dout, const T* o, const T* lse) {
  p.validate();
  const Layout<T> ly(p);
  const AttnShape& s = p.shape;
  LAGA_CHECK(
      g.dq && g.dc && g.dw_kv && (g.dk_pe || ly.dr == 0) && g.ld_dc >= p.C && g.ld_dk_pe >= ly.dr,
      "latent attention backward: dq, dc, dk_pe, dw_kv must not be null and ld_dc ", g.ld_dc,
      ", ld_dk_pe ", g.ld_dk_pe, " at least C ", p.C, " and dr ", ly.dr);
  const std::int64_t H = ly.H, dv = ly.dv, dqk = ly.dqk, dr = ly.dr, dn = ly.dn;
  // D_i = do_i . o_i, (B, H, Sq) as lse.
  std::vector<T> D(static_cast<size_t>(s.B * H * s.Sq));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t i = 0; i < s.Sq; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t x = ((b * s.Sq + i) * H + h) * dv;
        T acc = 0;
        for (std::int64_t e = 0; e < dv; ++e) acc += dout[x + e] * o[x + e];
        D[static_cast<size_t>((b * H + h) * s.Sq + i)] = acc;
      }
  std::fill_n(g.dq, s.B * s.Sq * H * dqk, T(0));
  std::vector<T> kv(static_cast<size_t>(kKc * ly.ldkv)), dkv(kv.size());
  std::vector<T> dkpe(static_cast<size_t>(H * kKc * dr));  // (H, chunk, dr): each head's sum
  struct TileBufs {
    std::vector<T> st, dpt;
  };
  std::vector<TileBufs> tiles(static_cast<size_t>(std::max(1, omp_get_max_threads())));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t j0 = 0; j0 < s.Sk; j0 += kKc) {
      const std::int64_t j1 = std::min(s.Sk, j0 + kKc), n = j1 - j0;
      ly.up_project(b, j0, n, kv.data());
      std::fill_n(dkv.data(), n * ly.ldkv, T(0));
      std::fill(dkpe.begin(), dkpe.end(), T(0));
      for_head_tiles(ly, b, j0, j1, [&](const Tile& t) {
        TileBufs& w = tiles[static_cast<size_t>(omp_get_thread_num())];
        w.st.resize(static_cast<size_t>(kBr * kKc));
        w.dpt.resize(static_cast<size_t>(kBr * kKc));
        T* st = w.st.data();
        T* dpt = w.dpt.data();
        const T* q = p.q + ly.row(t, dqk);
        const T* dorow = dout + ly.row(t, dv);
        const T* kn = kv.data() + (t.lo - j0) * ly.ldkv + t.h * ly.KV;  // (cols, dn), ld ldkv
        const T* vv = kn + dn;                                          // (cols, dv)
        const T* kp = p.k_pe + (b * s.Sk + t.lo) * p.ld_k_pe;           // (cols, dr)
        ly.scores(t, j0, kv.data(), st);
        // dP (rows, cols) = dO V^T
        product<T>(ly.p.invariant, false, true, t.rows, t.cols, dv, T(1), dorow, H * dv, vv,
                   ly.ldkv, T(0), dpt, kKc);
        const T sc = static_cast<T>(s.scale);
        for (std::int64_t r = 0; r < t.rows; ++r) {
          const T ls = lse[ly.stat(t, r)], d = D[static_cast<size_t>(ly.stat(t, r))];
          T* pr = st + r * kKc;
          T* ds = dpt + r * kKc;
          exp_shifted(pr, t.cols, ls);  // p = e^(s - lse)
          for (std::int64_t c = 0; c < t.cols; ++c)
            ds[c] = pr[c] * (ds[c] - d) * sc;  // dS, times scale
        }
        T* dkn = dkv.data() + (t.lo - j0) * ly.ldkv + t.h * ly.KV;
        // dV += P^T dO, dK_nope += dS^T Q_nope, dk_pe[h] += dS^T Q_pe
        keys_times_rows(ly.p.invariant, t, st, dorow, H * dv, dv, dkn + dn, ly.ldkv);
        keys_times_rows(ly.p.invariant, t, dpt, q, H * dqk, dn, dkn, ly.ldkv);
        keys_times_rows(ly.p.invariant, t, dpt, q + dn, H * dqk, dr,
                        dkpe.data() + (t.h * kKc + t.lo - j0) * dr, dr);
        // dQ += dS K = [dS K_nope | dS k_pe]
        T* dq = g.dq + ly.row(t, dqk);
        rows_times_keys(ly.p.invariant, t, dpt, kn, ly.ldkv, dn, dq, H * dqk);
        rows_times_keys(ly.p.invariant, t, dpt, kp, p.ld_k_pe, dr, dq + dn, H * dqk);
      });
      // dk_pe of the chunk's keys: every head's, summed in head order.
      for (std::int64_t j = 0; j < n; ++j) {
        T* dst = g.dk_pe + (b * s.Sk + j0 + j) * g.ld_dk_pe;
        std::fill_n(dst, dr, T(0));
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t e = 0; e < dr; ++e)
            dst[e] += dkpe[static_cast<size_t>((h * kKc + j) * dr + e)];
      }
      // dc = dkv w_kv (overwritten), dw_kv += dkv^T c.
      product<T>(ly.p.invariant, false, false, n, p.C, ly.ldkv, T(1), dkv.data(), ly.ldkv, p.w_kv,
                 p.C, T(0), g.dc + (b * s.Sk + j0) * g.ld_dc, g.ld_dc);
      product<T>(ly.p.invariant, true, false, ly.ldkv, p.C, n, T(1), dkv.data(), ly.ldkv,
                 p.c + (b * s.Sk + j0) * p.ld_c, p.ld_c, T(1), g.dw_kv, p.C);
    }
}

// --- the reference ---------------------------------------------------------

namespace {

// k (B, Sk, H, dqk), v (B, Sk, H, dv) of every key, and kv (B Sk, H KV).
template <class T>
struct UpProjected {
  std::vector<T> kv, k, v;
  explicit UpProjected(const LatentAttnParams<T>& p) {
    const Layout<T> ly(p);
    const AttnShape& s = p.shape;
    const std::int64_t rows = s.B * s.Sk;
    kv.resize(static_cast<size_t>(rows * ly.ldkv));
    k.resize(static_cast<size_t>(rows * ly.H * ly.dqk));
    v.resize(static_cast<size_t>(rows * ly.H * ly.dv));
    gemm_reference<T>(false, true, rows, ly.ldkv, p.C, T(1), p.c, p.ld_c, p.w_kv, p.C, T(0),
                      kv.data(), ly.ldkv);
    for (std::int64_t x = 0; x < rows; ++x)
      for (std::int64_t h = 0; h < ly.H; ++h) {
        const T* src = kv.data() + x * ly.ldkv + h * ly.KV;
        T* kd = k.data() + (x * ly.H + h) * ly.dqk;
        std::copy_n(src, ly.dn, kd);
        std::copy_n(p.k_pe + x * p.ld_k_pe, ly.dr, kd + ly.dn);
        std::copy_n(src + ly.dn, ly.dv, v.data() + (x * ly.H + h) * ly.dv);
      }
  }
};

}  // namespace

template <class T>
void attention_latent_reference_forward(const LatentAttnParams<T>& p, T* o, T* lse) {
  p.validate();
  const UpProjected<T> up(p);
  attention_reference_forward<T>(p.shape, o, lse, p.q, up.k.data(), up.v.data());
}

template <class T>
void attention_latent_reference_backward(const LatentAttnParams<T>& p, const LatentAttnGrads<T>& g,
                                         const T* dout) {
  p.validate();
  const Layout<T> ly(p);
  const AttnShape& s = p.shape;
  const UpProjected<T> up(p);
  std::vector<T> dk(up.k.size()), dv(up.v.size()), dkv(up.kv.size());
  attention_reference_backward<T>(s, g.dq, dk.data(), dv.data(), dout, p.q, up.k.data(),
                                  up.v.data());
  const std::int64_t rows = s.B * s.Sk;
  for (std::int64_t x = 0; x < rows; ++x) {
    T* dpe = g.dk_pe + x * g.ld_dk_pe;
    std::fill_n(dpe, ly.dr, T(0));
    for (std::int64_t h = 0; h < ly.H; ++h) {
      const T* dkh = dk.data() + (x * ly.H + h) * ly.dqk;
      T* dst = dkv.data() + x * ly.ldkv + h * ly.KV;
      std::copy_n(dkh, ly.dn, dst);
      std::copy_n(dv.data() + (x * ly.H + h) * ly.dv, ly.dv, dst + ly.dn);
      for (std::int64_t e = 0; e < ly.dr; ++e) dpe[e] += dkh[ly.dn + e];
    }
  }
  gemm_reference<T>(false, false, rows, p.C, ly.ldkv, T(1), dkv.data(), ly.ldkv, p.w_kv, p.C, T(0),
                    g.dc, g.ld_dc);
  gemm_reference<T>(true, false, ly.ldkv, p.C, rows, T(1), dkv.data(), ly.ldkv, p.c, p.ld_c, T(1),
                    g.dw_kv, p.C);
}

#define LAGA_INSTANTIATE(T)                                                                 \
  template struct LatentAttnParams<T>;                                                      \
  template void attention_flash_latent_forward<T>(const LatentAttnParams<T>&, T*, T*);      \
  template void attention_flash_latent_backward<T>(                                         \
      const LatentAttnParams<T>&, const LatentAttnGrads<T>&, const T*, const T*, const T*); \
  template void attention_latent_reference_forward<T>(const LatentAttnParams<T>&, T*, T*);  \
  template void attention_latent_reference_backward<T>(const LatentAttnParams<T>&,          \
                                                       const LatentAttnGrads<T>&, const T*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
