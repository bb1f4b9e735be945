// Flash attention on bf16 Q, K, V with fp32 accumulation, on AVX512_BF16's
// VDPBF16PS (contract and precision: kernels/attention_flash_bf16.hpp;
// masks and layout: kernels/attention.hpp). Compiled where the compiler
// takes the target pragma below (src/kernels/CMakeLists.txt), run by
// attention_flash_bf16.cpp only on CPUs with avx512f/vl/bw/dq and avx512bf16.
//
// The shape of the fp32 kernels (attention_flash_impl.inc, read it first):
// virtual rows (query heads of one key/value head, token-major), 64-row by
// 64-key tiles aligned at multiples of 64 keys (kBc below; trimmed to even
// keys, KeyTile), online softmax in base 2 with one row per vector lane,
// block ranges from RowBlock, and a backward either per head and row set
// (one thread owns one row set of a head; row_sets below) or in two passes
// (dK/dV parallel over key blocks, dQ over query blocks), where every sum
// runs in ascending block order in one thread: bitwise the same for any
// thread count. HeadView, RowBlock and TileRanges are copies of theirs
// (that file is compiled per ISA into its own namespace; sharing them
// would mean moving them out of it, for a few lines).
//
// dK, dV of the (B, Sk, Hk, d) tensors: written once per key block, in
// ascending order of the row blocks summed into them (both schedules).
//
// VDPBF16PS multiplies PAIRS: lane n of C gets a[2p] b[2p][n] + a[2p+1]
// b[2p+1][n] (two exact bf16 products added into fp32; bf16 denormal
// inputs count as zero, which converted tensors never hold, core/bf16.hpp). So every B
// operand is stored "pair-interleaved" along the reduction (VNNI layout):
// pair-row p holds, for each column n, the two bf16 of rows 2p and 2p+1
// side by side, and A is row-major bf16 whose pair (k, k+1) is one 32-bit
// broadcast. Reductions of odd length are padded with zeros, and a tile
// starts at an even key (an odd start, such as the fp32 kernel's trim to a
// document's first key, would split pairs): KeyTile rounds it down, and
// the one key of the earlier document that may leave in is masked.
//
// Products (rows in lanes, so statistics stay per lane, as in fp32):
//   S^T  (Bc, Br)  = K_j (Bc, dqk)   . [Q_i^T]         K rows padded (krow)
//   O^T  (dv, Br) += V_j^T (dv, Bc)  . [P_ij^T]         V^T per head (vt)
//   dP^T (Bc, Br)  = V_j (Bc, dv)    . [dO_i^T]         V rows padded (vrow)
//   dV_j (Bc, dv) += P_ij^T (Bc, Br) . [dO_i]           P^T rounded in place
//   dK_j (Bc,dqk) += dS_ij^T (Bc,Br) . [Q_i]
//   dQ^T (dqk,Br) += K_j^T (dqk, Bc) . [dS_ij^T]        K^T per head (kt)
// ([X]: the B operand, pair-interleaved along the reduction.)
//
// Masked pairs. A tile is dense (one product over all its pairs) where it
// holds no masked pair; where it does, P and dS are exactly 0 at masked
// pairs (selected, not computed), so the dense product is the sum over the
// unmasked pairs exactly -- provided the other operand is finite there (0 *
// NaN is NaN: kernels/attention.hpp wants a NaN in one token to reach only
// the rows that see it). So each key block and row block carries a flag "all
// finite", and a masked tile with a non-finite operand takes a scalar path
// that sums each row's (or key's) own range only. Only inputs with NaN or inf
// ever reach it.
#define LAGA_FLASH_NS flash_bf16
#define LAGA_FLASH_AVX512

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "core/bf16.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash_simd.hpp"

// No #include below this line (attention_flash_simd.hpp says why).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,prefer-vector-width=256")

namespace laga::flash_bf16 {
// workspace: workspace_bytes(s, pass) bytes, 64-byte aligned, that the call
// carves its buffers from; null: each buffer from aligned_alloc.
void forward(const AttnShape& s, float* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
             unsigned char* workspace);
// bound: the most of any shape no larger than s (every schedule).
std::int64_t workspace_bytes(const AttnShape& s, bool backward, bool bound = false);
std::int64_t allocated_peak();
void reset_allocated_peak();
void backward(const AttnShape& s, float* dq, float* dk, float* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* o, const float* lse,
              unsigned char* workspace);

namespace {

using S = Avx512Simd;
using V = S::V;
constexpr int W = S::W;

// Virtual rows and keys a tile. kBr: a multiple of W (the softmax walks
// whole vectors of rows) and even. kBc: even, so pairs never straddle
// tiles. 64 x 64 as the fp32 kernel: measured on a quiet Zen 5 (MLA dims,
// S 2048 and the latent shape), kBc 128 was as fast within noise (speedup
// over fp32 1.62-1.66x against 1.65-1.69x) and kBr 128 4-10% slower in
// forward; 64 keeps the fp32 tiles in L1 and computes less of a masked
// tile at a document's start.
constexpr std::int64_t kBr = 64;
constexpr std::int64_t kBc = 64;
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}
std::int64_t even_up(std::int64_t a) {
  return (a + 1) & ~std::int64_t(1);
}

__m512bh as_bh(__m512i x) {
  __m512bh r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}
__m512i as_si(__m512bh x) {
  __m512i r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}
__m256i as_si(__m256bh x) {
  __m256i r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}

// As attention_flash_impl.inc's HeadView: the virtual rows of key/value head
// hk of batch b.
struct HeadView {
  const AttnShape& s;
  std::int64_t b, hk, g, R;
  HeadView(const AttnShape& shape, std::int64_t b_, std::int64_t hk_)
      : s(shape), b(b_), hk(hk_), g(shape.Hq / shape.Hk), R(shape.Sq * (shape.Hq / shape.Hk)) {}
  std::int64_t token(std::int64_t r) const { return r / g; }
  std::int64_t head(std::int64_t r) const { return hk * g + r % g; }
  std::int64_t row_off(std::int64_t r, std::int64_t d) const {
    return ((b * s.Sq + r / g) * s.Hq + hk * g + r % g) * d;
  }
  std::int64_t key_off(std::int64_t j, std::int64_t d) const {
    return ((b * s.Sk + j) * s.Hk + hk) * d;
  }
  std::int64_t stat_off(std::int64_t r) const { return (b * s.Hq + head(r)) * s.Sq + token(r); }
  std::int64_t key_begin(std::int64_t r) const { return s.key_begin(b, token(r)); }
  std::int64_t key_end(std::int64_t r) const { return s.key_end(token(r)); }
};

// As attention_flash_impl.inc's RowBlock, but tiles are whole aligned key
// blocks (see the top of this file).
struct RowBlock {
  std::int64_t r0, rows;
  std::int64_t kbeg, kend, kbeg_hi, kend_lo;
  RowBlock(const HeadView& hv, std::int64_t rb)
      : r0(rb * kBr), rows(std::min(kBr, hv.R - rb * kBr)) {
    kbeg = hv.key_begin(r0);
    kend = hv.key_end(r0 + rows - 1);
    kbeg_hi = hv.key_begin(r0 + rows - 1);
    kend_lo = hv.key_end(r0);
  }
  std::int64_t first_key_block() const { return kbeg / kBc; }
  std::int64_t end_key_block() const { return ceil_div(kend, kBc); }
};

// Keys [j0, j0 + cols): key block kb whole (KeyTile(s, kb)), or, for row
// block rb, trimmed to the keys its rows see (KeyTile(s, rb, kb)): the start
// to kbeg rounded down to even and the end to kend rounded up, so that j0
// stays even and pairs stay whole (the top of this file). That saves the
// masked part of the diagonal tile (half a tile on average) and all but
// one key of earlier documents in a document's first tile.
struct KeyTile {
  std::int64_t j0, cols;
  KeyTile(const AttnShape& s, std::int64_t kb)
      : j0(kb * kBc), cols(std::min(kBc, s.Sk - kb * kBc)) {}
  KeyTile(const AttnShape& s, const RowBlock& rb, std::int64_t kb)
      : j0(std::max(kb * kBc, rb.kbeg & ~std::int64_t(1))),
        cols(std::min({kb * kBc + kBc, s.Sk, even_up(rb.kend)}) - j0) {}
};

bool tile_is_masked(const RowBlock& rb, const KeyTile& kt) {
  return !(kt.j0 >= rb.kbeg_hi && kt.j0 + kt.cols <= rb.kend_lo);
}

// Row r sees the tile's columns [lo[r], hi[r]); both non-decreasing in r.
struct TileRanges {
  std::int64_t lo[kBr], hi[kBr];
  TileRanges(const HeadView& hv, const RowBlock& rb, const KeyTile& kt) {
    auto in_tile = [&](std::int64_t j) { return std::clamp<std::int64_t>(j - kt.j0, 0, kt.cols); };
    for (std::int64_t r = 0; r < rb.rows; ++r) {
      lo[r] = in_tile(hv.key_begin(rb.r0 + r));
      hi[r] = std::max(lo[r], in_tile(hv.key_end(rb.r0 + r)));
    }
  }
};

// ---------------------------------------------------------------------------
// The product: C (M, N) [+]= A (M, 2 KP) B (2 KP, N), A row-major bf16 (row
// m at a + m * lda, pair p at a[m * lda + 2p]), B pair-interleaved (pair-row
// p at b + p * ldb: column n's two values at b[p * ldb + 2n], +1), C fp32.
// Register block of MR rows by NV vectors of 16 columns: 24 accumulators,
// 4 B vectors, 1 broadcast of the 32 zmm.
constexpr int MR = 6, NV = 4, NB = NV * W;

template <int M, bool TAIL, bool ACC>
void micro_kernel(std::int64_t KP, const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb,
                  float* c, std::int64_t ldc, int n) {
  __mmask16 mask[NV];
  for (int v = 0; v < NV; ++v) mask[v] = S::lanes(TAIL ? n - v * W : W);
  V acc[M][NV];
  const float* cm = c;
  for (int m = 0; m < M; ++m, cm += ldc)
    for (int v = 0; v < NV; ++v)
      acc[m][v] = !ACC   ? S::zero()
                  : TAIL ? _mm512_maskz_loadu_ps(mask[v], cm + v * W)
                         : _mm512_loadu_ps(cm + v * W);
  // KP >= 1 (bgemm): a do-while, so that GCC sees no path around the loop;
  // with one it merged the accumulators of both paths through the stack,
  // 48 extra loads and stores a call, a quarter of the time at KP = 32.
  std::int64_t p = 0;
  do {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v)
      bv[v] = as_bh(TAIL ? _mm512_maskz_loadu_epi32(mask[v], b + 2 * v * W)
                         : _mm512_loadu_si512(b + 2 * v * W));
    for (int m = 0; m < M; ++m) {
      std::int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * p, sizeof pair);
      const __m512bh am = as_bh(_mm512_set1_epi32(pair));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], am, bv[v]);
    }
    b += ldb;
  } while (++p < KP);
  asm("" : "+r"(c));  // as tile_gemm's micro_kernel: keeps GCC from spilling C's addresses
  for (int m = 0; m < M; ++m, c += ldc)
    for (int v = 0; v < NV; ++v) {
      if (TAIL)
        _mm512_mask_storeu_ps(c + v * W, mask[v], acc[m][v]);
      else
        _mm512_storeu_ps(c + v * W, acc[m][v]);
    }
}

using Kernel = void (*)(std::int64_t, const bf16*, std::int64_t, const bf16*, std::int64_t, float*,
                        std::int64_t, int);
template <bool TAIL, bool ACC>
constexpr Kernel kernel_for(int m) {
  switch (m) {
    case 1:
      return &micro_kernel<1, TAIL, ACC>;
    case 2:
      return &micro_kernel<2, TAIL, ACC>;
    case 3:
      return &micro_kernel<3, TAIL, ACC>;
    case 4:
      return &micro_kernel<4, TAIL, ACC>;
    case 5:
      return &micro_kernel<5, TAIL, ACC>;
    default:
      return &micro_kernel<6, TAIL, ACC>;
  }
}

// Blocked as tile_gemm: KC pairs at a time (a B panel of KC pair-rows by 64
// columns, 16 KiB, stays in L1 while A's row blocks stream past it).
void bgemm(std::int64_t M, std::int64_t N, std::int64_t KP, const bf16* a, std::int64_t lda,
           const bf16* b, std::int64_t ldb, float* c, std::int64_t ldc, bool accumulate) {
  constexpr std::int64_t KC = 64;
  if (KP == 0) {
    if (!accumulate)
      for (std::int64_t m = 0; m < M; ++m) std::fill(c + m * ldc, c + m * ldc + N, 0.0f);
    return;
  }
  for (std::int64_t k0 = 0; k0 < KP; k0 += KC) {
    const std::int64_t kc = std::min(KC, KP - k0);
    const bool acc = accumulate || k0 > 0;
    for (std::int64_t n0 = 0; n0 < N; n0 += NB) {
      const int n = static_cast<int>(std::min<std::int64_t>(NB, N - n0));
      for (std::int64_t m0 = 0; m0 < M; m0 += MR) {
        const int m = static_cast<int>(std::min<std::int64_t>(MR, M - m0));
        const Kernel f = n == NB ? (acc ? kernel_for<false, true>(m) : kernel_for<false, false>(m))
                                 : (acc ? kernel_for<true, true>(m) : kernel_for<true, false>(m));
        f(kc, a + m0 * lda + 2 * k0, lda, b + k0 * ldb + 2 * n0, ldb, c + m0 * ldc + n0, ldc, n);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Packed operands of a call, shared by all threads once made.

// Keys [j0, j1) of one head of x (B, Sk, Hk, d): rows copied into row
// (stride d_p, the padding column zeroed), then transposed into col (stride
// ldt, from the rows just copied, which sit in L1: the transpose's strided
// side reads a 64-row block, not the (B, Sk, Hk, d) tensor; none where col
// is null); an odd Sk's padding key zeroed. Returns whether every value is
// finite.
bool pack_key_block(const HeadView& hv, const bf16* x, std::int64_t d, std::int64_t d_p,
                    std::int64_t j0, std::int64_t j1, std::int64_t sk_p, std::int64_t ldt,
                    bf16* row, bf16* col) {
  std::uint16_t bad = 0;
  for (std::int64_t j = j0; j < j1; ++j) {
    const bf16* src = x + hv.key_off(j, d);
    bf16* dst = row + j * d_p;
    std::memcpy(dst, src, sizeof(bf16) * static_cast<size_t>(d));
    if (d_p > d) dst[d] = bf16{};
    // Exponent all ones: inf or NaN. An OR over the block, no branch, so
    // that it vectorises.
    for (std::int64_t e = 0; e < d; ++e)
      bad |= static_cast<std::uint16_t>((src[e].bits & 0x7F80u) == 0x7F80u);
  }
  for (std::int64_t e = 0; col && e < d; ++e) {
    bf16* dst = col + e * ldt;
    for (std::int64_t j = j0; j < j1; ++j) dst[j] = row[j * d_p + e];
    if (j1 < sk_p && j1 == hv.s.Sk) dst[j1] = bf16{};
  }
  return bad == 0;
}

// 64-byte aligned storage, left uninitialised (a packing writes it in full
// before anything reads it; std::vector would clear tens of MiB per call
// first). bgemm reads B and reads and writes C in whole 64-byte vectors at
// multiples of 64 bytes from a buffer's start (every pair-row and tile row
// is a multiple of 64 bytes long for the shapes that matter): from malloc's
// 16-byte alignment, each of those accesses would straddle two cache lines.
//
// Every byte these buffers hold is counted, process-wide, so a test can hold
// workspace_bytes (below: what a call holds, from its shape) to what the
// calls allocated (allocated_peak).
std::atomic<std::int64_t> g_live_bytes{0}, g_peak_bytes{0};

template <class T>
std::int64_t aligned_bytes(std::int64_t n) {
  return static_cast<std::int64_t>(
      (static_cast<size_t>(std::max<std::int64_t>(n, 1)) * sizeof(T) + 63) & ~size_t(63));
}

// The caller's workspace, handed out front to back (threads take their
// buffers at once, so the offset is atomic). The caller gave at least
// workspace_bytes(s, pass), the sum of every buffer the call takes
// (attention_flash_bf16.cpp checks the size), so a take past its end is a
// bug here: no exception can leave an OpenMP region, so it aborts, naming it.
// base null: no workspace, every buffer from aligned_alloc.
struct Arena {
  unsigned char* base = nullptr;
  std::int64_t size = 0;
  std::atomic<std::int64_t> used{0};
  Arena(unsigned char* b, std::int64_t n) : base(b), size(n) {}
  void* take(std::int64_t bytes) {
    const std::int64_t at = used.fetch_add(bytes);
    if (at + bytes > size) {
      std::fprintf(stderr,
                   "laga: internal error: the bf16 flash kernel took %lld bytes of a %lld-byte "
                   "workspace (workspace_bytes undercounts)\n",
                   static_cast<long long>(at + bytes), static_cast<long long>(size));
      std::abort();
    }
    return base + at;
  }
};

template <class T>
class Aligned {
 public:
  Aligned() = default;
  Aligned(std::int64_t n, Arena& arena)
      : n_(n),
        p_(static_cast<T*>(arena.base
                               ? arena.take(aligned_bytes<T>(n))
                               : std::aligned_alloc(64, static_cast<size_t>(aligned_bytes<T>(n)))),
           Free{aligned_bytes<T>(n), arena.base == nullptr}) {
    if (!p_) throw std::bad_alloc();
    const std::int64_t live = g_live_bytes += aligned_bytes<T>(n);
    std::int64_t peak = g_peak_bytes.load();
    while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
    }
  }
  T* data() const { return p_.get(); }
  T* get() const { return p_.get(); }
  T* begin() const { return p_.get(); }
  T* end() const { return p_.get() + n_; }
  T& operator[](size_t i) const { return p_.get()[i]; }

 private:
  struct Free {
    std::int64_t bytes = 0;
    bool owned = true;  // from aligned_alloc, not the caller's workspace
    void operator()(T* p) const {
      if (owned) std::free(p);
      g_live_bytes -= bytes;
    }
  };
  std::int64_t n_ = 0;
  std::unique_ptr<T, Free> p_;
};

template <class T>
Aligned<T> filled(std::int64_t n, T value, Arena& arena) {
  Aligned<T> a(n, arena);
  std::fill(a.begin(), a.end(), value);
  return a;
}
template <class T>
Aligned<T> zeroed(std::int64_t n, Arena& arena) {
  return filled(n, T{}, arena);
}

// K and V of key/value heads bh = b * Hk + hk, in the layouts the products
// read: rows padded to an even width (A of S^T, dP^T; V's rows also for
// forward's path around a non-finite value), and transposed with the keys
// padded to an even count: V^T in forward (A of O^T), K^T in backward (A of
// dQ^T). Each pass transposes only the one it reads (the transposing copy
// is scalar: packing was 8.7% of the forward's samples with both). Zeros
// in the padding, so a pair's partner past the end multiplies to 0. Either
// every head (KeyPacks::of_every_head: forward, the two-pass backward) or
// one at a time, packed again for each head a thread takes (the per-head
// backward: a thread's buffers, not every head's).
// The packs' extents, from the shape alone: what KeyPacks allocates, and
// what workspace_bytes counts without allocating it.
struct KeyPacksLayout {
  // ldt: the row stride of kt, vt. Those rows are the A operand of O^T and
  // dQ^T, six streams at once; at S 2048 a stride of sk_p would put them
  // exactly 4 KiB apart, all in one L1 set, so it is padded by 64 bytes
  // there.
  std::int64_t dqk_p, dv_p, sk_p, nkb, ldt;
  std::int64_t dqk, dv, heads;
  bool backward;  // K^T (backward) or V^T (forward)
  KeyPacksLayout(const AttnShape& s, std::int64_t held_heads, bool for_backward)
      : dqk_p(even_up(s.dqk)),
        dv_p(even_up(s.dv)),
        sk_p(even_up(s.Sk)),
        nkb(ceil_div(s.Sk, kBc)),
        ldt(ceil_div(sk_p, 32) * 32 % 2048 == 0 ? ceil_div(sk_p, 32) * 32 + 32
                                                : ceil_div(sk_p, 32) * 32),
        dqk(s.dqk),
        dv(s.dv),
        heads(held_heads),
        backward(for_backward) {}
  std::int64_t krow_n() const { return heads * sk_p * dqk_p; }
  std::int64_t vrow_n() const { return heads * sk_p * dv_p; }
  std::int64_t kt_n() const { return backward ? heads * dqk * ldt : 0; }
  std::int64_t vt_n() const { return backward ? 0 : heads * dv * ldt; }
  std::int64_t bytes() const {
    return aligned_bytes<bf16>(krow_n()) + aligned_bytes<bf16>(vrow_n()) +
           aligned_bytes<bf16>(kt_n()) + aligned_bytes<bf16>(vt_n()) +
           aligned_bytes<unsigned char>(heads * nkb);
  }
};

struct KeyPacks : KeyPacksLayout {
  std::int64_t h0 = 0;  // the first head held: heads [h0, h0 + heads)
  Aligned<bf16> krow, vrow, kt, vt;
  Aligned<unsigned char> finite;  // (heads, nkb): every K and V value of the block finite
  const bf16* krow_of(std::int64_t bh) const { return krow.get() + (bh - h0) * sk_p * dqk_p; }
  const bf16* vrow_of(std::int64_t bh) const { return vrow.get() + (bh - h0) * sk_p * dv_p; }
  const bf16* kt_of(std::int64_t bh) const { return kt.get() + (bh - h0) * dqk * ldt; }
  const bf16* vt_of(std::int64_t bh) const { return vt.get() + (bh - h0) * dv * ldt; }
  bool finite_of(std::int64_t bh, std::int64_t kb) const {
    return finite[static_cast<size_t>((bh - h0) * nkb + kb)] != 0;
  }

  // Room for held_heads heads, nothing packed yet.
  KeyPacks(const AttnShape& s, std::int64_t held_heads, bool for_backward, Arena& arena)
      : KeyPacksLayout(s, held_heads, for_backward),
        krow(krow_n(), arena),
        vrow(vrow_n(), arena),
        kt(kt_n(), arena),
        vt(vt_n(), arena),
        finite(filled<unsigned char>(heads * nkb, 1, arena)) {}

  // Key block kb of head bh (held).
  void pack(const AttnShape& s, const bf16* k, const bf16* v, std::int64_t bh, std::int64_t kb) {
    const HeadView hv(s, bh / s.Hk, bh % s.Hk);
    const std::int64_t j0 = kb * kBc, j1 = std::min(j0 + kBc, s.Sk), at = bh - h0;
    const bool ok_k =
        pack_key_block(hv, k, s.dqk, dqk_p, j0, j1, sk_p, ldt, krow.get() + at * sk_p * dqk_p,
                       backward ? kt.get() + at * dqk * ldt : nullptr);
    const bool ok_v =
        pack_key_block(hv, v, s.dv, dv_p, j0, j1, sk_p, ldt, vrow.get() + at * sk_p * dv_p,
                       backward ? nullptr : vt.get() + at * dv * ldt);
    finite[static_cast<size_t>(at * nkb + kb)] = ok_k && ok_v ? 1 : 0;
  }
  // A one-head pack made to hold head bh, packed (on this thread).
  void pack_head(const AttnShape& s, const bf16* k, const bf16* v, std::int64_t bh) {
    h0 = bh;
    for (std::int64_t kb = 0; kb < nkb; ++kb) pack(s, k, v, bh, kb);
  }
  static KeyPacks of_every_head(const AttnShape& s, const bf16* k, const bf16* v, bool for_backward,
                                Arena& arena) {
    KeyPacks kp(s, s.B * s.Hk, for_backward, arena);
#pragma omp parallel for schedule(static) if (kp.heads * kp.nkb > 1)
    for (std::int64_t u = 0; u < kp.heads * kp.nkb; ++u) kp.pack(s, k, v, u / kp.nkb, u % kp.nkb);
    return kp;
  }
};

// r[i] word j -> r[j] word i, for 16 x 16 32-bit words: pairs of rows
// interleaved by words, then by double words, then the 128-bit lanes
// shuffled twice.
void transpose_16x16_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// out (d_p / 2, kBr, 2): block rows of x (B, Sq, Hq, d) transposed and
// pair-interleaved along d (B of S^T, dP^T). Rows past the block and the
// padding column are 0. A pair is one 32-bit word, so this is a transpose
// of words, 16 rows by 16 pairs at a time (a word at a time, it was ~4% of
// the forward's samples and ~5% of the backward's).
void pack_rows_along_d(const HeadView& hv, const bf16* x, std::int64_t d, const RowBlock& rb,
                       bf16* out) {
  std::fill(out, out + even_up(d) * kBr, bf16{});
  const std::int64_t full = d / 2;  // whole pairs: one 32-bit word each
  for (std::int64_t r0 = 0; r0 < rb.rows; r0 += 16) {
    const std::int64_t nr = std::min<std::int64_t>(16, rb.rows - r0);
    const bf16* src[16];
    for (std::int64_t i = 0; i < nr; ++i) src[i] = x + hv.row_off(rb.r0 + r0 + i, d);
    for (std::int64_t p0 = 0; p0 < full; p0 += 16) {
      const int np = static_cast<int>(std::min<std::int64_t>(16, full - p0));
      const __mmask16 m = S::lanes(np);
      __m512i w[16];
      for (std::int64_t i = 0; i < 16; ++i)
        w[i] = i < nr ? _mm512_maskz_loadu_epi32(m, src[i] + 2 * p0) : _mm512_setzero_si512();
      transpose_16x16_words(w);
      // Word (p, r) at out + (p kBr + r) 2: row p0 + p's 16 words from r0
      // (rows past the block stored as the zeros they are).
      for (int p = 0; p < np; ++p) _mm512_storeu_si512(out + ((p0 + p) * kBr + r0) * 2, w[p]);
    }
    if (d & 1)
      for (std::int64_t i = 0; i < nr; ++i) out[(full * kBr + r0 + i) * 2] = src[i][d - 1];
  }
}

// out (kBr / 2, d, 2): block rows of x pair-interleaved along the rows (B of
// dV and dK). Rows past the block are 0. Returns whether every value is finite.
bool pack_rows_along_r(const HeadView& hv, const bf16* x, std::int64_t d, const RowBlock& rb,
                       bf16* out) {
  std::fill(out, out + kBr * d, bf16{});
  std::uint16_t bad = 0;
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    const bf16* src = x + hv.row_off(rb.r0 + r, d);
    for (std::int64_t e = 0; e < d; ++e) {
      out[((r >> 1) * d + e) * 2 + (r & 1)] = src[e];
      bad |= static_cast<std::uint16_t>((src[e].bits & 0x7F80u) == 0x7F80u);  // inf or NaN
    }
  }
  return bad == 0;
}

// Per-thread scratch.
struct Scratch {
  Aligned<float> st, dpt;   // (Bc, Br) S^T then P^T; dP^T then dS^T
  Aligned<bf16> pv;         // (Bc / 2, Br, 2) P^T or dS^T pair-interleaved along keys
  Aligned<bf16> pt, dst;    // (Bc, Br) P^T and dS^T rounded, rows as they are
  Aligned<float> acc;       // (max(dqk, dv), Br) O^T or dQ^T
  Aligned<float> dk, dv;    // (Bc, dqk), (Bc, dv) of one key block: row set 0's sums
  Aligned<float> dk1, dv1;  // the same of row set 1 (two-pass, with two row sets)
  Aligned<bf16> qv;         // forward's Q^T of the block (pack_rows_along_d)
  Aligned<float> m, l, alpha;
  Scratch(const AttnShape& s, Arena& arena)
      : st(zeroed<float>(kBc * kBr, arena)),
        dpt(zeroed<float>(kBc * kBr, arena)),
        pv(zeroed<bf16>(kBc * kBr, arena)),
        pt(zeroed<bf16>(kBc * kBr, arena)),
        dst(zeroed<bf16>(kBc * kBr, arena)),
        acc(zeroed<float>(std::max(s.dqk, s.dv) * kBr, arena)),
        dk(zeroed<float>(kBc * s.dqk, arena)),
        dv(zeroed<float>(kBc * s.dv, arena)),
        dk1(zeroed<float>(kBc * s.dqk, arena)),
        dv1(zeroed<float>(kBc * s.dv, arena)),
        qv(zeroed<bf16>(even_up(s.dqk) * kBr, arena)),
        m(zeroed<float>(kBr, arena)),
        l(zeroed<float>(kBr, arena)),
        alpha(zeroed<float>(kBr, arena)) {}
  // What the constructor allocates (tests/kernels/test_attention_flash_bf16
  // holds the two equal).
  static std::int64_t bytes(const AttnShape& s) {
    return 2 * aligned_bytes<float>(kBc * kBr) + 3 * aligned_bytes<bf16>(kBc * kBr) +
           aligned_bytes<float>(std::max(s.dqk, s.dv) * kBr) +
           2 * aligned_bytes<float>(kBc * s.dqk) + 2 * aligned_bytes<float>(kBc * s.dv) +
           aligned_bytes<bf16>(even_up(s.dqk) * kBr) + 3 * aligned_bytes<float>(kBr);
  }
};

// pv (cols_p / 2, Br, 2) = x (cols, Br) rounded to bf16, key pairs (c, c+1)
// interleaved per lane; the partner of an odd last key is 0.
void round_pairs_along_keys(const float* x, std::int64_t cols, std::int64_t nr, bf16* pv) {
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (std::int64_t c = 0; c < cols; c += 2)
    for (std::int64_t r = 0; r < nr; r += W) {
      const V lo = S::load(x + c * kBr + r);
      const V hi = c + 1 < cols ? S::load(x + (c + 1) * kBr + r) : S::zero();
      // cvtne2ps puts its first operand in the upper 16 values.
      const __m512i both = as_si(_mm512_cvtne2ps_pbh(hi, lo));
      _mm512_storeu_si512(pv + ((c >> 1) * kBr + r) * 2,
                          _mm512_permutexvar_epi16(interleave, both));
    }
}

// out (cols, Br) = x rounded to bf16, lanes at and past `rows` zero (they
// are terms of the sums over rows of dV and dK).
void round_rows(const float* x, std::int64_t cols, std::int64_t rows, bf16* out) {
  for (std::int64_t c = 0; c < cols; ++c)
    for (std::int64_t r = 0; r < kBr; r += W) {
      const __mmask16 live = S::lanes(static_cast<int>(rows - r));
      const V val = _mm512_maskz_loadu_ps(live, x + c * kBr + r);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c * kBr + r),
                          as_si(_mm512_cvtneps_pbh(val)));
    }
}

float value(bf16 x) {
  return to_float(x);
}

// ---------------------------------------------------------------------------
// Forward.

void forward_block(const AttnShape& s, const HeadView& hv, const RowBlock& rb, const KeyPacks& kp,
                   Scratch& w, float* o, float* lse, const bf16* q) {
  const std::int64_t bh = hv.b * s.Hk + hv.hk;
  const std::int64_t nr = ceil_div(rb.rows, W) * W;
  pack_rows_along_d(hv, q, s.dqk, rb, w.qv.data());
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  std::fill(w.acc.begin(), w.acc.begin() + s.dv * kBr, 0.0f);
  float* st = w.st.data();
  const V sc2 = S::set1(static_cast<float>(s.scale * kLog2e));
  const float ninf = -std::numeric_limits<float>::infinity();
  for (std::int64_t kb = rb.first_key_block(); kb < rb.end_key_block(); ++kb) {
    const KeyTile kt(s, rb, kb);
    const std::int64_t cols = kt.cols;
    bgemm(cols, nr, kp.dqk_p / 2, kp.krow_of(bh) + kt.j0 * kp.dqk_p, kp.dqk_p, w.qv.data(), 2 * kBr,
          st, kBr, false);
    // Scores in base 2, scaled here in fp32 (not folded into Q as the fp32
    // kernel does: that would round Q * scale to bf16 a second time).
    for (std::int64_t c = 0; c < cols; ++c)
      for (std::int64_t r = 0; r < nr; r += W)
        S::store(st + c * kBr + r, S::mul(S::load(st + c * kBr + r), sc2));
    const bool masked = tile_is_masked(rb, kt);
    if (masked) {
      const TileRanges tr(hv, rb, kt);
      for (std::int64_t r = 0; r < rb.rows; ++r) {
        for (std::int64_t c = 0; c < tr.lo[r]; ++c) st[c * kBr + r] = ninf;
        for (std::int64_t c = tr.hi[r]; c < cols; ++c) st[c * kBr + r] = ninf;
      }
    }
    // Online softmax as in the fp32 kernel (a row with every key so far
    // masked shifts by 0, so p = 2^-inf = 0).
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
    for (std::int64_t n = 0; n < s.dv; ++n)
      for (std::int64_t r = 0; r < nr; r += W)
        S::store(w.acc.data() + n * kBr + r,
                 S::mul(S::load(w.acc.data() + n * kBr + r), S::load(w.alpha.data() + r)));
    // O^T += V_j^T P^T with P rounded to bf16 (the l above summed it unrounded).
    round_pairs_along_keys(st, cols, nr, w.pv.data());
    if (!masked || kp.finite_of(bh, kb)) {
      bgemm(s.dv, nr, even_up(cols) / 2, kp.vt_of(bh) + kt.j0, kp.ldt, w.pv.data(), 2 * kBr,
            w.acc.data(), kBr, true);
    } else {
      // A non-finite value in the block: each row sums its own keys only.
      const TileRanges tr(hv, rb, kt);
      const bf16* vr = kp.vrow_of(bh);
      for (std::int64_t r = 0; r < rb.rows; ++r)
        for (std::int64_t c = tr.lo[r]; c < tr.hi[r]; ++c) {
          const float p = value(w.pv[static_cast<size_t>(((c >> 1) * kBr + r) * 2 + (c & 1))]);
          const bf16* vj = vr + (kt.j0 + c) * kp.dv_p;
          for (std::int64_t n = 0; n < s.dv; ++n)
            w.acc[static_cast<size_t>(n * kBr + r)] += p * value(vj[n]);
        }
    }
  }
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    float* dst = o + hv.row_off(rb.r0 + r, s.dv);
    const float l = w.l[static_cast<size_t>(r)];
    if (l == 0.0f) {
      // Every key masked: o = 0, lse = 0; visible keys all at -inf: NaN, as
      // the fp32 kernel.
      const bool none = hv.key_end(rb.r0 + r) <= hv.key_begin(rb.r0 + r);
      const float fill = none ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      std::fill(dst, dst + s.dv, fill);
      lse[hv.stat_off(rb.r0 + r)] = fill;
      continue;
    }
    const float inv = 1.0f / l;
    for (std::int64_t n = 0; n < s.dv; ++n) dst[n] = w.acc[static_cast<size_t>(n * kBr + r)] * inv;
    lse[hv.stat_off(rb.r0 + r)] =
        static_cast<float>((w.m[static_cast<size_t>(r)] + std::log2(l)) * kLn2);
  }
}

// ---------------------------------------------------------------------------
// Backward.

// Q and dO of row blocks, packed along d (B of S^T, dP^T: both passes) and
// along the rows (B of dK, dV), with each block's lse (base 2), D and
// whether its Q and dO are finite: every block of every head, packed once
// (the two-pass backward), or one block at a time, packed right before its
// tiles (the per-head backward).
// The packs' extents, from the shape alone, as KeyPacksLayout.
struct RowPacksLayout {
  bool every;                             // every block of every head, or one
  std::int64_t nrb;                       // row blocks of a head
  std::int64_t units;                     // blocks held
  std::int64_t qv_n, dov_n, qr_n, dor_n;  // per block
  RowPacksLayout(const AttnShape& s, bool every_block)
      : every(every_block),
        nrb(ceil_div(s.Sq * (s.Hq / s.Hk), kBr)),
        units(every ? s.B * s.Hk * nrb : std::min<std::int64_t>(nrb, 1)),
        qv_n(even_up(s.dqk) * kBr),
        dov_n(even_up(s.dv) * kBr),
        qr_n(kBr * s.dqk),
        dor_n(kBr * s.dv) {}
  std::int64_t bytes() const {
    return aligned_bytes<bf16>(units * qv_n) + aligned_bytes<bf16>(units * dov_n) +
           aligned_bytes<bf16>(units * qr_n) + aligned_bytes<bf16>(units * dor_n) +
           2 * aligned_bytes<float>(units * kBr) + aligned_bytes<unsigned char>(units);
  }
};

struct RowPacks : RowPacksLayout {
  Aligned<bf16> qv, dov, qr, dor;  // written in full by the packing
  Aligned<float> lse2, D;
  Aligned<unsigned char> finite;
  // Row block ib of head bh (held) as its index among the blocks held.
  std::int64_t at(std::int64_t bh, std::int64_t ib) const { return every ? bh * nrb + ib : 0; }
  const bf16* qv_of(std::int64_t bh, std::int64_t ib) const { return qv.get() + at(bh, ib) * qv_n; }
  const bf16* dov_of(std::int64_t bh, std::int64_t ib) const {
    return dov.get() + at(bh, ib) * dov_n;
  }
  const bf16* qr_of(std::int64_t bh, std::int64_t ib) const { return qr.get() + at(bh, ib) * qr_n; }
  const bf16* dor_of(std::int64_t bh, std::int64_t ib) const {
    return dor.get() + at(bh, ib) * dor_n;
  }
  const float* lse2_of(std::int64_t bh, std::int64_t ib) const {
    return lse2.data() + at(bh, ib) * kBr;
  }
  const float* D_of(std::int64_t bh, std::int64_t ib) const { return D.data() + at(bh, ib) * kBr; }
  bool finite_of(std::int64_t bh, std::int64_t ib) const {
    return finite[static_cast<size_t>(at(bh, ib))] != 0;
  }

  // Room for every block, or one, nothing packed yet.
  RowPacks(const AttnShape& s, bool every_block, Arena& arena)
      : RowPacksLayout(s, every_block),
        qv(units * qv_n, arena),
        dov(units * dov_n, arena),
        qr(units * qr_n, arena),
        dor(units * dor_n, arena),
        lse2(zeroed<float>(units * kBr, arena)),
        D(zeroed<float>(units * kBr, arena)),
        finite(filled<unsigned char>(units, 1, arena)) {}

  // Row block ib of head bh (in place of the one held, when one).
  void pack(const AttnShape& s, const bf16* q, const bf16* dout, const float* lse,
            const float* Dall, std::int64_t bh, std::int64_t ib) {
    const HeadView hv(s, bh / s.Hk, bh % s.Hk);
    const RowBlock rb(hv, ib);
    const std::int64_t u = at(bh, ib);
    pack_rows_along_d(hv, q, s.dqk, rb, qv.get() + u * qv_n);
    pack_rows_along_d(hv, dout, s.dv, rb, dov.get() + u * dov_n);
    const bool ok_q = pack_rows_along_r(hv, q, s.dqk, rb, qr.get() + u * qr_n);
    const bool ok_do = pack_rows_along_r(hv, dout, s.dv, rb, dor.get() + u * dor_n);
    finite[static_cast<size_t>(u)] = ok_q && ok_do ? 1 : 0;
    for (std::int64_t r = 0; r < rb.rows; ++r) {
      lse2[static_cast<size_t>(u * kBr + r)] =
          static_cast<float>(lse[hv.stat_off(rb.r0 + r)] * kLog2e);
      D[static_cast<size_t>(u * kBr + r)] = Dall[hv.stat_off(rb.r0 + r)];
    }
  }
  static RowPacks of_every_head(const AttnShape& s, const bf16* q, const bf16* dout,
                                const float* lse, const float* Dall, Arena& arena) {
    RowPacks rp(s, true, arena);
#pragma omp parallel for schedule(static) if (rp.units > 1)
    for (std::int64_t u = 0; u < rp.units; ++u)
      rp.pack(s, q, dout, lse, Dall, u / rp.nrb, u % rp.nrb);
    return rp;
  }
};

// P^T into w.st and dS^T (times scale) into w.dpt for tile (rb, kt), both
// exactly 0 at masked pairs and at lanes past the block's rows.
void backward_scores(const AttnShape& s, const HeadView& hv, const RowBlock& rb, const KeyTile& kt,
                     const KeyPacks& kp, const RowPacks& rp, Scratch& w) {
  const std::int64_t bh = hv.b * s.Hk + hv.hk, ib = rb.r0 / kBr, cols = kt.cols;
  const std::int64_t nr = ceil_div(rb.rows, W) * W;
  float* st = w.st.data();
  float* dpt = w.dpt.data();
  bgemm(cols, nr, kp.dqk_p / 2, kp.krow_of(bh) + kt.j0 * kp.dqk_p, kp.dqk_p, rp.qv_of(bh, ib),
        2 * kBr, st, kBr, false);
  bgemm(cols, nr, kp.dv_p / 2, kp.vrow_of(bh) + kt.j0 * kp.dv_p, kp.dv_p, rp.dov_of(bh, ib),
        2 * kBr, dpt, kBr, false);
  const float* lse2 = rp.lse2_of(bh, ib);
  const float* D = rp.D_of(bh, ib);
  const V sc2 = S::set1(static_cast<float>(s.scale * kLog2e));
  const V sc = S::set1(static_cast<float>(s.scale));
  for (std::int64_t c = 0; c < cols; ++c)
    for (std::int64_t r = 0; r < nr; r += W) {
      const __mmask16 live = S::lanes(static_cast<int>(rb.rows - r));
      const V p = _mm512_maskz_mov_ps(
          live, S::exp2(S::sub(S::mul(S::load(st + c * kBr + r), sc2), S::load(lse2 + r))));
      S::store(st + c * kBr + r, p);
      const V ds = S::mul(S::mul(p, S::sub(S::load(dpt + c * kBr + r), S::load(D + r))), sc);
      S::store(dpt + c * kBr + r, _mm512_maskz_mov_ps(live, ds));
    }
  // Masked pairs: p and dS selected to 0 (a masked dS may be NaN, 0 times a
  // NaN dP from a value row the query does not see). Fully masked rows
  // (lse = 0 by convention) thus pass no gradient.
  if (tile_is_masked(rb, kt)) {
    const TileRanges tr(hv, rb, kt);
    for (std::int64_t r = 0; r < rb.rows; ++r) {
      for (std::int64_t c = 0; c < tr.lo[r]; ++c) st[c * kBr + r] = dpt[c * kBr + r] = 0.0f;
      for (std::int64_t c = tr.hi[r]; c < cols; ++c) st[c * kBr + r] = dpt[c * kBr + r] = 0.0f;
    }
  }
}

// dV_j += P^T dO_i, dK_j += dS^T Q_i into dvb (cols, dv), dkb (cols, dqk):
// the key block's rows of w.dv, w.dk (two-pass) or of the head's sums
// (per head). The same calls either way, so the same bits.
void backward_kv(const AttnShape& s, const HeadView& hv, const RowBlock& rb, const KeyTile& kt,
                 const RowPacks& rp, Scratch& w, const bf16* q, const bf16* dout, float* dkb,
                 float* dvb) {
  const std::int64_t bh = hv.b * s.Hk + hv.hk, ib = rb.r0 / kBr;
  round_rows(w.st.data(), kt.cols, rb.rows, w.pt.data());
  round_rows(w.dpt.data(), kt.cols, rb.rows, w.dst.data());
  const std::int64_t kpairs = even_up(rb.rows) / 2;
  if (!tile_is_masked(rb, kt) || rp.finite_of(bh, ib)) {
    bgemm(kt.cols, s.dv, kpairs, w.pt.data(), kBr, rp.dor_of(bh, ib), 2 * s.dv, dvb, s.dv, true);
    bgemm(kt.cols, s.dqk, kpairs, w.dst.data(), kBr, rp.qr_of(bh, ib), 2 * s.dqk, dkb, s.dqk, true);
    return;
  }
  // A non-finite Q or dO in the block: key c sums over the rows that see it.
  const TileRanges tr(hv, rb, kt);
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    const bf16* qr = q + hv.row_off(rb.r0 + r, s.dqk);
    const bf16* dr = dout + hv.row_off(rb.r0 + r, s.dv);
    for (std::int64_t c = tr.lo[r]; c < tr.hi[r]; ++c) {
      const float p = value(w.pt[static_cast<size_t>(c * kBr + r)]);
      const float ds = value(w.dst[static_cast<size_t>(c * kBr + r)]);
      for (std::int64_t n = 0; n < s.dv; ++n) dvb[c * s.dv + n] += p * value(dr[n]);
      for (std::int64_t n = 0; n < s.dqk; ++n) dkb[c * s.dqk + n] += ds * value(qr[n]);
    }
  }
}

// dQ^T (dqk, Br) += K_j^T dS^T into w.acc.
void backward_q(const AttnShape& s, const HeadView& hv, const RowBlock& rb, const KeyTile& kt,
                const KeyPacks& kp, Scratch& w) {
  const std::int64_t bh = hv.b * s.Hk + hv.hk;
  const std::int64_t nr = ceil_div(rb.rows, W) * W;
  if (!tile_is_masked(rb, kt) || kp.finite_of(bh, kt.j0 / kBc)) {
    round_pairs_along_keys(w.dpt.data(), kt.cols, nr, w.pv.data());
    bgemm(s.dqk, nr, even_up(kt.cols) / 2, kp.kt_of(bh) + kt.j0, kp.ldt, w.pv.data(), 2 * kBr,
          w.acc.data(), kBr, true);
    return;
  }
  // A non-finite K in the block: row r sums over its own keys.
  round_rows(w.dpt.data(), kt.cols, rb.rows, w.dst.data());
  const TileRanges tr(hv, rb, kt);
  const bf16* kr = kp.krow_of(bh);
  for (std::int64_t r = 0; r < rb.rows; ++r)
    for (std::int64_t c = tr.lo[r]; c < tr.hi[r]; ++c) {
      const float ds = value(w.dst[static_cast<size_t>(c * kBr + r)]);
      const bf16* kj = kr + (kt.j0 + c) * kp.dqk_p;
      for (std::int64_t n = 0; n < s.dqk; ++n)
        w.acc[static_cast<size_t>(n * kBr + r)] += ds * value(kj[n]);
    }
}

// dQ rows of the block from the transposed accumulator w.acc (dqk, Br).
void store_dq(const AttnShape& s, const HeadView& hv, const RowBlock& rb, const Scratch& w,
              float* dq) {
  for (std::int64_t r = 0; r < rb.rows; ++r) {
    float* dst = dq + hv.row_off(rb.r0 + r, s.dqk);
    for (std::int64_t n = 0; n < s.dqk; ++n) dst[n] = w.acc[static_cast<size_t>(n * kBr + r)];
  }
}

// Keys [j0, j0 + n) of head hv in dk, dv (B, Sk, Hk, d) = the sums sk (n,
// dqk), sv (n, dv); += them with `add` (a row set's partial sums added to
// the other's).
void store_key_sums(const AttnShape& s, const HeadView& hv, std::int64_t j0, std::int64_t n,
                    const float* sk, const float* sv, bool add, float* dk, float* dv) {
  for (std::int64_t j = 0; j < n; ++j) {
    float* dk_j = dk + hv.key_off(j0 + j, s.dqk);
    float* dv_j = dv + hv.key_off(j0 + j, s.dv);
    const float* sk_j = sk + j * s.dqk;
    const float* sv_j = sv + j * s.dv;
    if (!add) {
      std::copy_n(sk_j, s.dqk, dk_j);
      std::copy_n(sv_j, s.dv, dv_j);
      continue;
    }
    for (std::int64_t e = 0; e < s.dqk; ++e) dk_j[e] += sk_j[e];
    for (std::int64_t e = 0; e < s.dv; ++e) dv_j[e] += sv_j[e];
  }
}

std::int64_t first_row_block(const AttnShape& s, std::int64_t g, std::int64_t j0) {
  if (!s.causal) return 0;
  const std::int64_t i_min = std::max<std::int64_t>(0, j0 + s.Sq - s.Sk);
  return i_min * g / kBr;
}

// The threads a `#pragma omp parallel` region opened here gets: one where it
// would nest past the active levels.
std::int64_t threads_here() {
  return omp_get_active_level() >= omp_get_max_active_levels() ? 1 : omp_get_max_threads();
}

// Row sets. dK_j and dV_j sum over a head's row blocks; with two row sets
// each is taken as two partial sums, over the even and over the odd row
// blocks (each in ascending order), and then added: a + b == b + a bitwise,
// so the two schedules below agree bit for bit whichever partial is ready
// first. Two sets let two threads share one head's backward without
// recomputing its scores (the latent shape at B = 1 is one head). From the
// shape alone, so that the bits never depend on the thread count; one set
// from 8 heads up, where the heads keep the threads busy by themselves and a
// second set would only pack each head's keys twice and add its sums once
// more. One set whatever the heads in the invariant mode
// (AttnShape::one_row_set).
std::int64_t row_sets(const AttnShape& s, std::int64_t heads) {
  return heads < 8 && !s.one_row_set ? 2 : 1;
}

// One thread per (head, row set) when those units share the threads out
// evenly enough (the fp32 kernel's rule): each tile's S and dP computed
// once, dK, dV summed in a per-thread head buffer. Else two passes, which
// recompute them. Both make the same product calls in the same order for
// every output (row blocks ascending within a row set for dK, dV; key
// blocks for dQ), so the choice, which depends on the thread count, does
// not change a bit.
bool backward_per_head(std::int64_t units, std::int64_t nt) {
  return ceil_div(units, nt) * nt * 10 <= units * 13;
}

// Forward by the same rule, over heads (a head's row blocks in one thread):
// each thread packs one head's K, V at a time instead of every head's up
// front. With fewer heads (the latent shape: one) the threads share row
// blocks of every head, whose packs they then share too.
bool forward_per_head(std::int64_t heads, std::int64_t nt) {
  return heads > 1 && backward_per_head(heads, nt);
}

}  // namespace

std::int64_t workspace_bytes(const AttnShape& s, bool backward, bool bound) {
  s.validate();
  const std::int64_t nt = threads_here(), heads = s.B * s.Hk;
  const KeyPacksLayout keys(s, heads, backward);
  // Every term grows with the extents. What a smaller shape may take more
  // of: threads' buffers (one thread where there is one unit) and another
  // schedule. The bound takes every thread, and each schedule a call of
  // B' <= B batch rows would take (the rules read only B' Hk and the thread
  // count), at s's extents: a ring step's calls at 16 heads all take the
  // per-head schedule, so their bound is not the two-pass packs of every
  // head (docs/performance.md, "bf16 flash workspace per head").
  const auto schedules = [&](auto per_head_rule) {
    std::pair<bool, bool> taken{false, false};  // {per head, the other}
    for (std::int64_t b = 1; b <= s.B; ++b)
      (per_head_rule(b * s.Hk) ? taken.first : taken.second) = true;
    return taken;
  };
  if (!backward) {
    const RowPacksLayout rows(s, true);
    if (rows.units == 0 && !bound) return 0;
    const std::int64_t per_head = nt * (Scratch::bytes(s) + KeyPacksLayout(s, 1, false).bytes());
    const std::int64_t shared =
        keys.bytes() + (rows.units > 1 || bound ? nt : 1) * Scratch::bytes(s);
    if (bound) {
      const auto [by_head, by_rows] =
          schedules([&](std::int64_t h) { return forward_per_head(h, nt); });
      return std::max(by_head ? per_head : 0, by_rows ? shared : 0);
    }
    return forward_per_head(heads, nt) ? per_head : shared;
  }
  const std::int64_t d_all = aligned_bytes<float>(s.B * s.Hq * s.Sq);
  if (heads == 0 && !bound) return d_all;
  const std::int64_t sets = row_sets(s, heads), units = heads * sets;
  // Per head: each thread one head's K, V packs, one row block's Q, dO
  // packs, its tiles and the head's dK, dV sums.
  const auto per_head = [&] {
    return d_all + (units > 1 || bound ? nt : 1) *
                       (Scratch::bytes(s) + aligned_bytes<float>(s.Sk * s.dqk) +
                        aligned_bytes<float>(s.Sk * s.dv) + KeyPacksLayout(s, 1, true).bytes() +
                        RowPacksLayout(s, false).bytes());
  };
  // Two passes: every head's packs, and each thread's tiles.
  const auto two_pass = [&] {
    const RowPacksLayout rows(s, true);
    return d_all + keys.bytes() + rows.bytes() +
           (heads * std::max(keys.nkb, rows.nrb) > 1 || bound ? nt : 1) * Scratch::bytes(s);
  };
  if (bound) {
    const auto [by_head, by_passes] = schedules(
        [&](std::int64_t h) { return h > 0 && backward_per_head(h * row_sets(s, h), nt); });
    return std::max(by_head ? per_head() : d_all, by_passes ? two_pass() : d_all);
  }
  return backward_per_head(units, nt) ? per_head() : two_pass();
}

std::int64_t allocated_peak() {
  return g_peak_bytes.load();
}

void reset_allocated_peak() {
  g_peak_bytes.store(g_live_bytes.load());
}

void forward(const AttnShape& s, float* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
             unsigned char* workspace) {
  s.validate();
  Arena arena(workspace, workspace ? workspace_bytes(s, false) : 0);
  const std::int64_t g = s.Hq / s.Hk, heads = s.B * s.Hk, nrb = ceil_div(s.Sq * g, kBr);
  const std::int64_t units = heads * nrb;
  if (units == 0) return;
  if (forward_per_head(heads, threads_here())) {
    // A thread per head: its K, V packed into the thread's buffers, its row
    // blocks in turn. Each row block is computed by one thread in one order
    // whichever schedule runs it, so the bits are the same.
#pragma omp parallel
    {
      Scratch w(s, arena);
      KeyPacks kp(s, 1, false, arena);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t bh = 0; bh < heads; ++bh) {
        kp.pack_head(s, k, v, bh);
        const HeadView hv(s, bh / s.Hk, bh % s.Hk);
        for (std::int64_t rb = nrb - 1; rb >= 0; --rb)
          forward_block(s, hv, RowBlock(hv, rb), kp, w, o, lse, q);
      }
    }
    return;
  }
  const KeyPacks kp = KeyPacks::of_every_head(s, k, v, false, arena);
#pragma omp parallel if (units > 1)
  {
    Scratch w(s, arena);
    // The heaviest (last, under the causal mask) row blocks first.
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t u = 0; u < units; ++u) {
      const std::int64_t bh = u / nrb, rb = nrb - 1 - u % nrb;
      const HeadView hv(s, bh / s.Hk, bh % s.Hk);
      forward_block(s, hv, RowBlock(hv, rb), kp, w, o, lse, q);
    }
  }
}

void backward(const AttnShape& s, float* dq, float* dk, float* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* o, const float* lse,
              unsigned char* workspace) {
  s.validate();
  Arena arena(workspace, workspace ? workspace_bytes(s, true) : 0);
  const std::int64_t g = s.Hq / s.Hk, heads = s.B * s.Hk;
  // D_i = do_i . o_i (dO widened exactly, o fp32), in lse's (B, Hq, Sq) layout.
  Aligned<float> D(s.B * s.Hq * s.Sq, arena);
  const std::int64_t nrows = s.B * s.Sq * s.Hq;
#pragma omp parallel for schedule(static) if (nrows * s.dv > (1 << 16))
  for (std::int64_t x = 0; x < nrows; ++x) {
    const std::int64_t h = x % s.Hq, i = (x / s.Hq) % s.Sq, b = x / (s.Hq * s.Sq);
    const bf16* a = dout + x * s.dv;
    const float* c = o + x * s.dv;
    float acc = 0;
    for (std::int64_t e = 0; e < s.dv; ++e) acc += value(a[e]) * c[e];
    D[static_cast<size_t>((b * s.Hq + h) * s.Sq + i)] = acc;
  }
  if (heads == 0) return;
  const std::int64_t sets = row_sets(s, heads), units = heads * sets;
  if (backward_per_head(units, threads_here())) {
    // Unit u: head u / sets, its row blocks ib with ib % sets == u % sets.
    // Units are handed out in ascending order (next, not an OpenMP
    // schedule, whose order is unspecified), so a head's row set 1 starts
    // after its set 0 and may wait for it to store its sums: set 0's thread
    // waits for nothing, and neither does a lone thread, which ran set 0
    // first.
    std::atomic<std::int64_t> next{0};
    std::unique_ptr<std::atomic<bool>[]> stored(new std::atomic<bool>[static_cast<size_t>(heads)]);
    for (std::int64_t bh = 0; bh < heads; ++bh) stored[bh].store(false);
#pragma omp parallel if (units > 1)
    {
      // The thread's buffers: one head's K, V, packed again for each unit
      // it takes (a head's two row sets each pack its K, V: cheap against
      // its S^2 work, and no thread waits for another's packing), and one
      // row block's Q, dO, packed right before the block's tiles.
      Scratch w(s, arena);
      Aligned<float> head_dk(s.Sk * s.dqk, arena), head_dv(s.Sk * s.dv, arena);
      KeyPacks kp(s, 1, true, arena);
      RowPacks rp(s, false, arena);
      for (std::int64_t u = next++; u < units; u = next++) {
        const std::int64_t bh = u / sets, set = u % sets;
        const HeadView hv(s, bh / s.Hk, bh % s.Hk);
        kp.pack_head(s, k, v, bh);
        std::fill(head_dk.begin(), head_dk.end(), 0.0f);
        std::fill(head_dv.begin(), head_dv.end(), 0.0f);
        for (std::int64_t ib = set; ib < rp.nrb; ib += sets) {
          const RowBlock rb(hv, ib);
          rp.pack(s, q, dout, lse, D.data(), bh, ib);  // this block alone
          std::fill(w.acc.begin(), w.acc.begin() + s.dqk * kBr, 0.0f);
          for (std::int64_t kb = rb.first_key_block(); kb < rb.end_key_block(); ++kb) {
            const KeyTile kt(s, rb, kb);
            backward_scores(s, hv, rb, kt, kp, rp, w);
            backward_kv(s, hv, rb, kt, rp, w, q, dout, head_dk.data() + kt.j0 * s.dqk,
                        head_dv.data() + kt.j0 * s.dv);
            backward_q(s, hv, rb, kt, kp, w);
          }
          store_dq(s, hv, rb, w, dq);
        }
        if (set > 0)
          while (!stored[bh].load(std::memory_order_acquire)) _mm_pause();
        store_key_sums(s, hv, 0, s.Sk, head_dk.data(), head_dv.data(), set > 0, dk, dv);
        if (set == 0) stored[bh].store(true, std::memory_order_release);
      }
      // Every thread's buffers live until all are done, as in the two-pass
      // schedule's loops: what workspace_bytes counts.
#pragma omp barrier
    }
    return;
  }
  const KeyPacks kp = KeyPacks::of_every_head(s, k, v, true, arena);
  const RowPacks rp = RowPacks::of_every_head(s, q, dout, lse, D.data(), arena);
  const std::int64_t nrb = rp.nrb, nkb = kp.nkb;
#pragma omp parallel if (heads * std::max(nkb, nrb) > 1)
  {
    Scratch w(s, arena);
    // dK/dV pass: one thread per key block sums its row blocks in order,
    // each row set's into its own buffer (w.dk, w.dv; w.dk1, w.dv1).
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t u = 0; u < heads * nkb; ++u) {
      const std::int64_t bh = u % heads, kb = u / heads;
      const KeyTile blk(s, kb);  // the whole block: the buffers hold its keys
      const HeadView hv(s, bh / s.Hk, bh % s.Hk);
      float* set_dk[2] = {w.dk.data(), w.dk1.data()};
      float* set_dv[2] = {w.dv.data(), w.dv1.data()};
      for (std::int64_t set = 0; set < sets; ++set) {
        std::fill_n(set_dk[set], blk.cols * s.dqk, 0.0f);
        std::fill_n(set_dv[set], blk.cols * s.dv, 0.0f);
      }
      for (std::int64_t ib = first_row_block(s, g, blk.j0); ib < nrb; ++ib) {
        const RowBlock rb(hv, ib);
        if (rb.kbeg >= blk.j0 + blk.cols) break;
        if (rb.kend <= blk.j0) continue;
        const std::int64_t set = ib % sets;
        const KeyTile kt(s, rb, kb);
        backward_scores(s, hv, rb, kt, kp, rp, w);
        backward_kv(s, hv, rb, kt, rp, w, q, dout, set_dk[set] + (kt.j0 - blk.j0) * s.dqk,
                    set_dv[set] + (kt.j0 - blk.j0) * s.dv);
      }
      for (std::int64_t set = 0; set < sets; ++set)
        store_key_sums(s, hv, blk.j0, blk.cols, set_dk[set], set_dv[set], set > 0, dk, dv);
    }
    // dQ pass: one thread per row block sums its key blocks in order.
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t u = 0; u < heads * nrb; ++u) {
      const std::int64_t bh = u % heads, ib = nrb - 1 - u / heads;
      const HeadView hv(s, bh / s.Hk, bh % s.Hk);
      const RowBlock rb(hv, ib);
      std::fill(w.acc.begin(), w.acc.begin() + s.dqk * kBr, 0.0f);
      for (std::int64_t kb = rb.first_key_block(); kb < rb.end_key_block(); ++kb) {
        const KeyTile kt(s, rb, kb);
        backward_scores(s, hv, rb, kt, kp, rp, w);
        backward_q(s, hv, rb, kt, kp, w);
      }
      store_dq(s, hv, rb, w, dq);
    }
  }
}

}  // namespace laga::flash_bf16

#pragma GCC pop_options
