#include "mla/ops_dsa.hpp"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "kernels/fp8_e4m3.hpp"
#include "mla/ops_bf16.hpp"

namespace laga::ops {

namespace {

// Under a bf16 scope these ops run fp32, as the DSA code's direct kernel
// calls did: only the sparse attention and its KL target (ops_sparse.hpp)
// run bf16, and the indexer's values are rounded after (round_as_stored;
// docs/forms.md, "DSA in bf16").
struct Fp32Ops {
  Precision previous = std::exchange(op_precision, Precision::fp32);
  ~Fp32Ops() { op_precision = previous; }
  Fp32Ops() = default;
  Fp32Ops(const Fp32Ops&) = delete;
  Fp32Ops& operator=(const Fp32Ops&) = delete;
};

// A (rows, cols) view at row stride ld of a pointer (null stays null: the
// count-only decision is the op's).
template <class T>
Mat<T> view(T* p, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  return {p, rows, cols, ld};
}

// Score FLOPs of one (query, key) pair: the H_I dot products of width d_I,
// and each head's relu(.) times w_h added (dsa_work's idx_pair).
double pair_flops(const AttnShape& a) {
  return double(a.Hq) * (2.0 * double(a.dqk) + 2.0);
}

OpShape indexer_shape(const IndexerShape& s) {
  OpShape shape;
  shape.attn = s.attn, shape.k = s.topk;
  return shape;
}

}  // namespace

double indexer_slots(const AttnShape& s, std::int64_t K) {
  const double k = double(K);
  if (!s.doc_start) {
    // sum over token t in [t0, t1) of min(K, t + 1), in closed form.
    const auto upto = [k](double n) {  // sum_{t < n} min(K, t + 1)
      return n <= k ? n * (n + 1) / 2 : k * (k + 1) / 2 + (n - k) * k;
    };
    return double(s.B) * (upto(double(s.Sk)) - upto(double(s.Sk - s.Sq)));
  }
  double slots = 0;  // packed documents: a row's keys are its document's (real runs only)
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t i = 0; i < s.Sq; ++i) {
      const std::int64_t t = i + s.Sk - s.Sq;
      slots += double(std::min<std::int64_t>(K, t + 1 - s.doc_start[b * s.Sk + t]));
    }
  return slots;
}

template <class T>
void linear_rows(T* y, const T* x, const T* w, std::int64_t N, std::int64_t in, std::int64_t out) {
  const Fp32Ops fp32;
  gemm<T>(view(y, N, out, out), T(0), view(x, N, in, in), false, view(w, out, in, in), true);
}

template <class T>
void linear_rows_backward(T* dx, bool accumulate_dx, T* dw, const T* dy, const T* x, const T* w,
                          std::int64_t N, std::int64_t in, std::int64_t out) {
  const Fp32Ops fp32;
  if (dx)
    gemm<T>(view(dx, N, in, in), accumulate_dx ? T(1) : T(0), view(dy, N, out, out), false,
            view(w, out, in, in), false);
  if (dw)
    gemm<T>(view(dw, out, in, in), T(1), view(dy, N, out, out), true, view(x, N, in, in), false);
}

template <class T>
void gemm_strided(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                  T alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
                  std::int64_t ldc) {
  const Fp32Ops fp32;
  gemm<T>(view(C, m, n, ldc), beta, trans_a ? view(A, k, m, lda) : view(A, m, k, lda), trans_a,
          trans_b ? view(B, n, k, ldb) : view(B, k, n, ldb), trans_b, alpha);
}

template <class T>
void rmsnorm_rows(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w, std::int64_t rows,
                  std::int64_t n, double eps) {
  const Fp32Ops fp32;
  // ops::rmsnorm's count and call, on pointers (its rstd and w are tensors).
  count_elementwise<T>(rows * n, 2);
  if (!runs(rows * n, {y, rstd, x, w})) return;
  OpCall c;
  c.op = Op::rmsnorm_forward, c.dtype = op_dtype<T>();
  c.shape.rows = rows, c.shape.cols = n, c.shape.lda = ldx;
  c.in[0] = x, c.in[1] = w, c.out[0] = y, c.out[1] = rstd, c.alpha = eps;
  run_kernel(c);
}

template <class T>
void rmsnorm_rows_backward(T* dx, std::int64_t ldx, T* dw, const T* dy, std::int64_t ldy,
                           const T* x, std::int64_t ldxx, const T* w, const T* rstd,
                           std::int64_t rows, std::int64_t n) {
  const Fp32Ops fp32;
  // ops::rmsnorm_backward's count and call, on pointers.
  count_elementwise<T>(rows * n, 3);
  if (!runs(rows * n, {dx, dw, dy, x, w, rstd})) return;
  OpCall c;
  c.op = Op::rmsnorm_backward, c.dtype = op_dtype<T>();
  c.shape.rows = rows, c.shape.cols = n, c.shape.lda = ldxx, c.shape.ldb = ldy, c.shape.ldc = ldx;
  c.in[0] = dy, c.in[1] = x, c.in[2] = w, c.in[3] = rstd, c.out[0] = dx, c.out[1] = dw;
  run_kernel(c);
}

template <class T>
void rope_rows(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
               std::int64_t ld_head, std::int64_t pos0, const RopeTable& table, bool inverse) {
  const Fp32Ops fp32;
  rope<T>(view(x, B * L, table.dim(), ld_token), B, L, H, ld_head, pos0, nullptr, table, inverse);
}
template <class T>
void rope_rows_at(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                  std::int64_t ld_head, const std::int64_t* positions, const RopeTable& table,
                  bool inverse) {
  const Fp32Ops fp32;
  rope<T>(view(x, B * L, table.dim(), ld_token), B, L, H, ld_head, 0, positions, table, inverse);
}

template <class T>
void rope_halves(T* x, std::int64_t L, std::int64_t H, std::int64_t ld_token, std::int64_t ld_head,
                 std::int64_t pos0, const std::int64_t* positions, const RopeTable& table,
                 bool inverse) {
  const Fp32Ops fp32;
  if (table.dim() == 0) return;                  // NoPE: nothing rotates (as ops::rope)
  count_elementwise<T>(L * H * table.dim(), 2);  // rotated in place
  if (!runs(L * H, {x})) return;
  OpCall c;
  c.op = inverse ? Op::rope_halves_backward : Op::rope_halves_forward, c.dtype = op_dtype<T>();
  c.shape.batch = 1, c.shape.tokens = L, c.shape.heads = H, c.shape.ld_token = ld_token;
  c.shape.ld_head = ld_head, c.shape.pos0 = pos0;
  c.in[0] = positions, c.out[0] = x, c.context = &table;
  run_kernel(c);
}

template <class T>
void layernorm(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b, std::int64_t rows,
               std::int64_t n, double eps) {
  const Fp32Ops fp32;
  count_elementwise<T>(rows * n, 2);  // x in, y out
  if (!runs(rows * n, {y, mean, rstd, x, w, b})) return;
  OpCall c;
  c.op = Op::layernorm_forward, c.dtype = op_dtype<T>();
  c.shape.rows = rows, c.shape.cols = n;
  c.in[0] = x, c.in[1] = w, c.in[2] = b, c.out[0] = y, c.out[1] = mean, c.out[2] = rstd;
  c.alpha = eps;
  run_kernel(c);
}

template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, std::int64_t rows, std::int64_t n) {
  const Fp32Ops fp32;
  count_elementwise<T>(rows * n, 3);  // dy and x in, dx out
  if (!runs(rows * n, {dx, dw, db, dy, x, w, mean, rstd})) return;
  OpCall c;
  c.op = Op::layernorm_backward, c.dtype = op_dtype<T>();
  c.shape.rows = rows, c.shape.cols = n;
  c.in[0] = dy, c.in[1] = x, c.in[2] = w, c.in[3] = mean, c.in[4] = rstd;
  c.out[0] = dx, c.out[1] = dw, c.out[2] = db;
  run_kernel(c);
}

template <class T>
void index_topk(const IndexerShape& s, std::int32_t* idx, const T* q, const T* k, const T* w) {
  const Fp32Ops fp32;
  s.validate();
  if (op_counter) count_indexer(indexer_slots(s.attn, s.attn.Sk) * pair_flops(s.attn));
  count_elementwise<std::int32_t>(s.attn.B * s.attn.Sq * s.topk, 1);
  if (!runs(s.attn.B * s.attn.Sq, {idx, q, k, w})) return;
  OpCall c;
  c.op = Op::index_topk, c.dtype = op_dtype<T>(), c.shape = indexer_shape(s);
  c.in[0] = q, c.in[1] = k, c.in[2] = w, c.out[0] = idx, c.context = &s;
  run_kernel(c);
}

void index_all_causal(const IndexerShape& s, std::int32_t* idx) {
  s.validate();
  count_elementwise<std::int32_t>(s.attn.B * s.attn.Sq * s.attn.Sk, 1);
  if (!runs(s.attn.B * s.attn.Sq * s.attn.Sk, {idx})) return;
  OpCall c;
  c.op = Op::index_all_causal, c.dtype = RunDtype::fp64, c.shape = indexer_shape(s);
  c.shape.k = s.attn.Sk, c.out[0] = idx, c.context = &s;
  run_kernel(c);
}

template <class T>
void indexer_kl(const IndexerShape& s, std::int64_t K, const std::int32_t* idx, const T* p,
                const T* q, const T* k, const T* w, double* loss, T* dq, T* dk, T* dw) {
  const Fp32Ops fp32;
  s.validate();
  // dsa_work's KL term: its scores again, then dq and dk, 3 H_I 2 d_I a slot.
  if (op_counter)
    count_indexer(3.0 * indexer_slots(s.attn, K) * double(s.attn.Hq) * 2.0 * double(s.attn.dqk));
  if (!runs(s.attn.B * s.attn.Sq, {idx, p, q, k, w, loss, dq, dk, dw})) return;
  OpCall c;
  c.op = Op::indexer_kl, c.dtype = op_dtype<T>(), c.shape = indexer_shape(s);
  c.shape.n = K, c.context = &s;
  c.in[0] = idx, c.in[1] = p, c.in[2] = q, c.in[3] = k, c.in[4] = w;
  c.out[0] = loss, c.out[1] = dq, c.out[2] = dk, c.out[3] = dw;
  run_kernel(c);
}

template <class T>
void kv_fp8_round_trip(T* c, std::int64_t rows, std::int64_t n) {
  count_elementwise<T>(rows * n, 2);  // c read and written in place
  if (!runs(rows * n, {c})) return;
  OpCall call;
  call.op = Op::kv_fp8_round_trip, call.dtype = op_dtype<T>();
  call.shape.rows = rows, call.shape.cols = n, call.out[0] = c;
  run_kernel(call);
}

template <class T>
void round_as_stored(T* p, std::int64_t rows, std::int64_t cols) {
  if constexpr (std::is_same_v<T, float>) {
    if (!in_bf16<T>() || !runs(rows * cols, {p})) return;
    bf16_path::round_in_place(view(p, rows, cols, cols));
  }
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template void linear_rows<T>(T*, const T*, const T*, std::int64_t, std::int64_t, std::int64_t);  \
  template void linear_rows_backward<T>(T*, bool, T*, const T*, const T*, const T*, std::int64_t,  \
                                        std::int64_t, std::int64_t);                               \
  template void gemm_strided<T>(bool, bool, std::int64_t, std::int64_t, std::int64_t, T, const T*, \
                                std::int64_t, const T*, std::int64_t, T, T*, std::int64_t);        \
  template void rmsnorm_rows<T>(T*, T*, const T*, std::int64_t, const T*, std::int64_t,            \
                                std::int64_t, double);                                             \
  template void rmsnorm_rows_backward<T>(T*, std::int64_t, T*, const T*, std::int64_t, const T*,   \
                                         std::int64_t, const T*, const T*, std::int64_t,           \
                                         std::int64_t);                                            \
  template void rope_rows<T>(T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,           \
                             std::int64_t, std::int64_t, const RopeTable&, bool);                  \
  template void rope_rows_at<T>(T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,        \
                                std::int64_t, const std::int64_t*, const RopeTable&, bool);        \
  template void rope_halves<T>(T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,         \
                               std::int64_t, const std::int64_t*, const RopeTable&, bool);         \
  template void layernorm<T>(T*, T*, T*, const T*, const T*, const T*, std::int64_t, std::int64_t, \
                             double);                                                              \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,          \
                                      const T*, std::int64_t, std::int64_t);                       \
  template void index_topk<T>(const IndexerShape&, std::int32_t*, const T*, const T*, const T*);   \
  template void indexer_kl<T>(const IndexerShape&, std::int64_t, const std::int32_t*, const T*,    \
                              const T*, const T*, const T*, double*, T*, T*, T*);                  \
  template void kv_fp8_round_trip<T>(T*, std::int64_t, std::int64_t);                              \
  template void round_as_stored<T>(T*, std::int64_t, std::int64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::ops
