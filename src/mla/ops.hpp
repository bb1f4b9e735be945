// The block's operations on tensors, written so that the same form code runs
// for real or only counts (docs/architecture.md, "One description, three
// runs"). Under a count-only pool a tensor has a shape and registered bytes
// but no storage; every op here then does nothing, so form code never asks
// whether it is computing. This is the one place that decision is made (the
// collectives make it for themselves: communicator.hpp, "Count-only").
//
// Op counts: with a CountOps scope on the thread, every op also adds what it
// does -- or, count-only, would do -- to an OpCounts: GEMM FLOPs (2 M N K),
// attention FLOPs (ops_attention.cpp) and the bytes the
// memory-bound ops read and write, and the list of GEMM and attention kernel
// calls by shape (how many of each). The planner's time model reads a form's
// compute from the count-only run this way (src/plan/time_model.hpp), and
// times each listed shape on the machine it plans for, so no form's FLOPs or
// shapes are derived by hand a second time.
//
// Precision (core/precision.hpp, --dtype): under a UsePrecision(bf16) scope
// with T = float, the ops run bf16 mixed precision: every GEMM operand is
// rounded to bf16 (into pool copies, ops_bf16.hpp) and multiplied with fp32
// sums (kernels/gemm_bf16.hpp); a product into fresh storage (gemm with
// beta 0, linear, linear_backward's dx) is rounded to bf16, since a bf16 run
// stores it, while one added into its output (beta 1: weight gradients, dx
// added to) stays an fp32 sum; RMSNorm computes in fp32 (its rstd is fp32)
// and its y is rounded, RoPE's forward rotation is computed in fp32 and
// rounded, its inverse (backward, on gradients) is not; copy and add move
// fp32. Attention (ops_attention.hpp) rounds q, k, v (and dO) and
// runs the bf16 flash kernel. The tensors stay fp32 containers: bf16
// storage emulated, so the pool, the memory model and the op counts see
// fp32 bytes. T = double refuses bf16 (it is the exact reference).
//
// A Mat is a row-major matrix view (rows, cols, row stride ld) into a tensor:
// a column slice is one head of a (B, S, H, d) tensor (ld = H d), a row slice
// is one head's rows of a weight. A view of an unbacked tensor stays null
// through slicing, so no arithmetic is ever done on a null pointer.
#pragma once

#include <atomic>
#include <compare>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "core/precision.hpp"
#include "core/tensor.hpp"
#include "kernels/attention.hpp"
#include "kernels/bf16_convert.hpp"
#include "kernels/gemm.hpp"
#include "kernels/rmsnorm.hpp"
#include "kernels/rope.hpp"
#include "mla/op_table.hpp"
#include "mla/ops_bf16.hpp"

namespace laga {
enum class AttentionKind;  // mla/block.hpp
}

namespace laga::ops {

template <class T>
struct Mat {
  T* p = nullptr;  // null: count-only (or empty)
  std::int64_t rows = 0, cols = 0, ld = 0;

  Mat block(std::int64_t r0, std::int64_t nr, std::int64_t c0, std::int64_t nc) const {
    LAGA_CHECK(r0 >= 0 && c0 >= 0 && r0 + nr <= rows && c0 + nc <= cols, "internal: view rows [",
               r0, ", ", r0 + nr, ") cols [", c0, ", ", c0 + nc, ") outside a (", rows, ", ", cols,
               ") matrix");
    return {p ? p + r0 * ld + c0 : nullptr, nr, nc, ld};
  }
  Mat col_range(std::int64_t c0, std::int64_t nc) const { return block(0, rows, c0, nc); }
  Mat row_range(std::int64_t r0, std::int64_t nr) const { return block(r0, nr, 0, cols); }
  operator Mat<const T>() const { return {p, rows, cols, ld}; }  // NOLINT: views convert to const
};

// t viewed as (rows, cols); rows * cols must be its size.
template <class T>
Mat<T> mat(Tensor<T>& t, std::int64_t rows, std::int64_t cols) {
  LAGA_CHECK(rows >= 0 && cols >= 0 && rows * cols == t.numel(), "internal: a tensor of ",
             to_string(t.shape()), " is not a (", rows, ", ", cols, ") matrix");
  return {t.data(), rows, cols, cols};
}
template <class T>
Mat<const T> mat(const Tensor<T>& t, std::int64_t rows, std::int64_t cols) {
  return mat(const_cast<Tensor<T>&>(t), rows, cols);
}
// Its last dimension as columns, all others as rows (so a tensor with an
// empty last dimension still has its rows).
template <class T>
Mat<T> mat(Tensor<T>& t) {
  const Shape& s = t.shape();
  std::int64_t rows = 1;
  for (std::size_t i = 0; i + 1 < s.size(); ++i) rows *= s[i];
  return mat(t, rows, s.back());
}
template <class T>
Mat<const T> mat(const Tensor<T>& t) {
  return mat(const_cast<Tensor<T>&>(t));
}

// t as one row of all its elements.
template <class T>
Mat<T> flat(Tensor<T>& t) {
  return {t.data(), 1, t.numel(), t.numel()};
}
template <class T>
Mat<const T> flat(const Tensor<T>& t) {
  return {t.data(), 1, t.numel(), t.numel()};
}

// One laga::gemm call as issued: C (m, n) = op(A) op(B) (+ C when
// accumulating), op(A) (m, k), with the row strides of A, B and C (a view of
// one head of a (S, H, d) tensor has ld = H d, and the stride changes how the
// kernel walks memory).
struct GemmCall {
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  bool accumulate = false;  // beta 1: C is read as well as written
  auto operator<=>(const GemmCall&) const = default;
};

enum class AttentionPass { forward, backward };
// One attention kernel call as issued: its extents (AttnShape's), kernel and
// pass. `documents`: the call had packed-sequence document starts, so its
// work depends on their positions and not on the extents alone.
struct AttentionCall {
  std::int64_t B = 0, Sq = 0, Sk = 0, Hq = 0, Hk = 0, dqk = 0, dv = 0;
  bool causal = true, documents = false;
  AttentionKind kernel{};
  AttentionPass pass = AttentionPass::forward;
  auto operator<=>(const AttentionCall&) const = default;
  // Whether the call's extents alone say what it costs, so that timing the
  // shape times the call: not an empty call (a rank without heads, P > H,
  // records one; the kernels refuse zero heads, and it costs nothing), and
  // no document starts (their positions set the work).
  bool costed_by_extents() const {
    return B > 0 && Sq > 0 && Sk > 0 && Hq > 0 && Hk > 0 && !documents;
  }
};

// How often one shape was called and the FLOPs those calls counted.
struct CallTally {
  std::int64_t calls = 0;
  double flops = 0;
  bool operator==(const CallTally&) const = default;
};

struct OpCounts {
  double gemm_flops = 0;
  double attention_flops = 0;
  double elementwise_bytes = 0;                        // read + written by the memory-bound ops
  std::map<GemmCall, CallTally> gemm_calls;            // sums to gemm_flops
  std::map<AttentionCall, CallTally> attention_calls;  // sums to attention_flops
  // DeepSeek Sparse Attention's indexer: its scores' FLOPs (the top-k's and
  // the KL's, mla/ops_dsa.hpp), as dsa_work counts them (mla/dsa_model.hpp).
  double indexer_flops = 0;

  // `calls` calls of g: their 2 m n k FLOPs each, and its tally; an empty
  // product counts no call (ops::gemm runs no kernel for it).
  void add_gemm(const GemmCall& g, std::int64_t calls = 1) {
    const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k) * double(calls);
    gemm_flops += flops;
    if (g.m == 0 || g.n == 0 || g.k == 0) return;
    CallTally& t = gemm_calls[g];
    t.calls += calls, t.flops += flops;
  }
  // Every figure and tally of `o` added to these (sums over ranks, cases, layers).
  void add(const OpCounts& o) {
    gemm_flops += o.gemm_flops;
    attention_flops += o.attention_flops;
    elementwise_bytes += o.elementwise_bytes;
    indexer_flops += o.indexer_flops;
    for (const auto& [call, t] : o.gemm_calls) {
      CallTally& sum = gemm_calls[call];
      sum.calls += t.calls, sum.flops += t.flops;
    }
    for (const auto& [call, t] : o.attention_calls) {
      CallTally& sum = attention_calls[call];
      sum.calls += t.calls, sum.flops += t.flops;
    }
  }
};

// The counter this thread's ops add to: null (the default) counts nothing.
inline thread_local OpCounts* op_counter = nullptr;

// Counts this thread's ops into `counts` while it lives.
class CountOps {
 public:
  explicit CountOps(OpCounts& counts) : previous_(std::exchange(op_counter, &counts)) {}
  ~CountOps() { op_counter = previous_; }
  CountOps(const CountOps&) = delete;
  CountOps& operator=(const CountOps&) = delete;

 private:
  OpCounts* previous_;
};

// How many identical copies of what this thread runs now each op stands
// for: a count-only run issues a per-batch-row call once, for all B rows
// alike (they differ only in their offsets, and count-only has no
// documents), under a RepeatCounts(B) scope, so that its cost does not grow
// with --batch while its counts are the B calls' (calls, FLOPs and bytes B
// times one's). 1 outside any scope. Pool tensors a repeated call makes are
// made once: each of the B calls frees its own before the next, so the
// pool's peak is one call's either way.
inline thread_local std::int64_t op_repeat = 1;

class RepeatCounts {
 public:
  explicit RepeatCounts(std::int64_t times)
      : previous_(std::exchange(op_repeat, op_repeat * times)) {}
  ~RepeatCounts() { op_repeat = previous_; }
  RepeatCounts(const RepeatCounts&) = delete;
  RepeatCounts& operator=(const RepeatCounts&) = delete;

 private:
  std::int64_t previous_;
};

// Per-batch-row work: f(b) for every row of B, or, in a count-only run
// (every row alike), f(0) once standing for all B (RepeatCounts).
template <class F>
void for_batch_rows(std::int64_t B, F&& f) {
  if (current_pool().count_only()) {
    if (B <= 0) return;
    const RepeatCounts all_rows(B);
    f(std::int64_t(0));
    return;
  }
  for (std::int64_t b = 0; b < B; ++b) f(b);
}

inline void count_gemm(const GemmCall& g) {
  if (op_counter) op_counter->add_gemm(g, op_repeat);
}
// `flops()` is called only while counting: an attention shape's count walks
// its rows, which a count-only run at S = 10^14 must not do for nothing.
template <class Flops>
void count_attention(const AttnShape& s, AttentionKind kernel, AttentionPass pass, Flops&& flops) {
  if (!op_counter) return;
  const double f = flops() * double(op_repeat);
  op_counter->attention_flops += f;
  const AttentionCall call{
      s.B, s.Sq, s.Sk, s.Hq, s.Hk, s.dqk, s.dv, s.causal, s.doc_start != nullptr, kernel, pass};
  CallTally& t = op_counter->attention_calls[call];
  t.calls += op_repeat, t.flops += f;
}
// The indexer's score FLOPs (mla/ops_dsa.hpp).
inline void count_indexer(double flops) {
  if (op_counter) op_counter->indexer_flops += flops * double(op_repeat);
}
// `elements` elements of T moved `passes` times (each read or write is one).
template <class T>
void count_elementwise(std::int64_t elements, int passes) {
  if (op_counter)
    op_counter->elementwise_bytes += double(elements) * passes * sizeof(T) * double(op_repeat);
}

// True when the op has work to do on real storage; false when there is
// nothing to do (an empty extent) or nothing to do it on (count-only). A null
// view under a computing pool is a bug in the caller, named here.
inline bool runs(std::int64_t elements, std::initializer_list<const void*> ptrs) {
  if (elements == 0) return false;
  bool all = true;
  for (const void* p : ptrs) all = all && p != nullptr;
  if (all) return true;
  LAGA_CHECK(current_pool().count_only(),
             "internal: an op on a tensor without storage under a computing pool");
  return false;
}

// The kernel table's row for c on this thread's device (op_table.hpp), run.
inline void run_kernel(const OpCall& c) {
  run_row(pick(op_device, c.op, c.dtype, c.shape), c);
}
// The scratch a row asks for besides its operands (KernelRow::workspace_bytes;
// the CUDA sparse attention rows': cuda/sparse_attention.hpp), one pool
// tensor for c, made before runs() asks whether the call computes, so that
// a count-only run and the memory model count the bytes the kernel carves.
// Sets c.workspace and c.workspace_bytes (none under count-only).
inline Tensor<bf16> row_workspace(const KernelRow& row, OpCall& c, const char* name) {
  if (!row.workspace_bytes) return {};
  const std::int64_t bytes = row.workspace_bytes(c.dtype, c.shape);
  if (bytes <= 0) return {};
  Tensor<bf16> t({(bytes + 1) / 2}, name);
  c.workspace = t.data(), c.workspace_bytes = t.data() ? bytes : 0;
  return t;
}
// C (m, n) = alpha op(A) op(B) + beta C through the table (T's dtype: fp32
// or fp64; bf16's products are bf16_path's).
template <class T>
void run_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
              const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
              std::int64_t ldc) {
  OpCall c;
  c.op = Op::gemm, c.dtype = std::is_same_v<T, double> ? RunDtype::fp64 : RunDtype::fp32;
  c.shape.m = m, c.shape.n = n, c.shape.k = k, c.shape.lda = lda, c.shape.ldb = ldb;
  c.shape.ldc = ldc, c.shape.trans_a = trans_a, c.shape.trans_b = trans_b;
  c.shape.invariant = op_invariant;
  c.in[0] = A, c.in[1] = B, c.out[0] = C, c.alpha = double(alpha), c.beta = double(beta);
  run_kernel(c);
}

// The data-movement ops' calls (Op::copy_rows, Op::fill; mla/op_table.hpp),
// through the table: on a device they run there, never as host loops over
// its memory. Raw pointers with their row strides; counting and the
// count-only decision are the callers' (copy, add, widen, fill below;
// mla/exchange.cpp's packing).
// dst (rows, cols; row stride ldd) = src (stride lds), converted from S to
// D where they differ (bf16 <-> fp32), or added to dst when accumulate.
template <class S, class D>
void move_rows(D* dst, std::int64_t ldd, const S* src, std::int64_t lds, std::int64_t rows,
               std::int64_t cols, bool accumulate = false) {
  if (rows == 0 || cols == 0) return;
  OpCall c;
  c.op = Op::copy_rows, c.dtype = move_dtype<D>();
  c.shape.rows = rows, c.shape.cols = cols, c.shape.lda = lds, c.shape.ldc = ldd;
  c.shape.src_bf16 = std::is_same_v<S, bf16>, c.shape.accumulate = accumulate;
  c.in[0] = src, c.out[0] = dst;
  run_kernel(c);
}
// dst (rows, cols; row stride ldd) = value.
template <class T>
void fill_rows(T* dst, std::int64_t ldd, std::int64_t rows, std::int64_t cols, T value) {
  if (rows == 0 || cols == 0) return;
  OpCall c;
  c.op = Op::fill, c.dtype = move_dtype<T>();
  c.shape.rows = rows, c.shape.cols = cols, c.shape.ldc = ldd;
  c.out[0] = dst, c.alpha = double(value);
  run_kernel(c);
}

// Whether this thread's ops on T run bf16 mixed precision: T = float under
// Precision::bf16. T = double under bf16 is refused, not quietly run in
// double, so a bf16 request can never produce an fp64 result.
template <class T>
bool in_bf16() {
  if (op_precision != Precision::bf16) return false;
  LAGA_CHECK((std::is_same_v<T, float>),
             "bf16 mixed precision runs the float path: it needs T = float, not double");
  return true;
}

// bf16 mixed precision keeps a tensor for backward at 2 bytes an element
// (Tensor::narrow_to_bf16) where doing so changes no bit of the step: the
// tensor holds bf16 values already (a GEMM's fresh output, RMSNorm's y, what
// a bf16 collective delivered), or backward reads it only as an operand the
// op layer rounds to bf16 anyway (a GEMM's, attention's q, k, v). Each
// caller names which (docs/accounting.md, "Held at 2 bytes"); widen_kept
// gives the fp32 tensor back before backward reads it elsewhere. fp32 and
// double runs keep every tensor as it is.
inline std::atomic<bool> narrow_kept_tensors{true};  // tests switch it off to compare bits
template <class T>
void keep_narrowed(Tensor<T>& t) {
  if (t.defined() && !t.narrowed() && in_bf16<T>() && narrow_kept_tensors)
    t.narrow_to_bf16(&bf16_path::to_bf16_threaded);
}
template <class T>
void widen_kept(Tensor<T>& t) {
  if (t.narrowed()) t.widen_from_bf16(&bf16_path::to_float_threaded);
}

// A read-only operand: a Mat<const T> that a Mat<T> converts to (outside
// template deduction, so T comes from the written operand).
template <class T>
using In = std::type_identity_t<Mat<const T>>;

// C = alpha op(A) op(B) + beta C.
template <class T>
void gemm(Mat<T> C, T beta, In<T> A, bool trans_a, In<T> B, bool trans_b, T alpha = T(1)) {
  const std::int64_t K = trans_a ? A.rows : A.cols;
  LAGA_CHECK((trans_a ? A.cols : A.rows) == C.rows && (trans_b ? B.rows : B.cols) == C.cols &&
                 (trans_b ? B.cols : B.rows) == K,
             "internal: gemm of (", A.rows, ", ", A.cols, ")", trans_a ? "^T" : "", " and (",
             B.rows, ", ", B.cols, ")", trans_b ? "^T" : "", " into (", C.rows, ", ", C.cols, ")");
  count_gemm({trans_a, trans_b, C.rows, C.cols, K, A.ld, B.ld, C.ld, beta != T(0)});
  if (K == 0) {  // an empty sum: C = beta C, 0 (beta 0) or C as it is (beta 1)
    count_elementwise<T>(C.rows * C.cols, 2);
    LAGA_CHECK(beta == T(0) || beta == T(1), "internal: an empty product scaled by beta ",
               double(beta), " (the op layer's callers accumulate or overwrite: beta 1 or 0)");
    if (beta == T(0) && runs(C.rows * C.cols, {C.p})) fill_rows(C.p, C.ld, C.rows, C.cols, T(0));
    return;
  }
  // bf16 before runs(): its operand copies are pool tensors, which a
  // count-only run registers too (bf16_path asks runs() after making them).
  if (in_bf16<T>()) {  // T = float: in_bf16<double> throws
    if constexpr (std::is_same_v<T, float>)
      return bf16_path::gemm(C, beta, A, trans_a, B, trans_b, alpha);
  }
  if (!runs(C.rows * C.cols, {C.p, A.p, B.p})) return;
  run_gemm<T>(trans_a, trans_b, C.rows, C.cols, K, alpha, A.p, A.ld, B.p, B.ld, beta, C.p, C.ld);
}

// y (N, out) = x (N, in) w^T. x_held: x's bf16 values, x.p then null, as
// linear_backward's below.
template <class T>
void linear(Mat<T> y, In<T> x, const Tensor<T>& w,
            std::optional<const bf16*> x_held = std::nullopt) {
  LAGA_CHECK(x.ld == x.cols && y.ld == y.cols && x.rows == y.rows && w.dim(0) == y.cols &&
                 w.dim(1) == x.cols,
             "internal: linear of (", x.rows, ", ", x.cols, ") by ", to_string(w.shape()));
  // linear_forward's gemm: x (N, in) by w (out, in) transposed.
  count_gemm({false, true, y.rows, y.cols, x.cols, x.cols, x.cols, y.cols, false});
  if (in_bf16<T>()) {  // as gemm: before runs()
    if constexpr (std::is_same_v<T, float>)
      return bf16_path::linear(y.p, x.p, w.data(), y.rows, x.cols, y.cols, x_held);
  }
  LAGA_CHECK(!x_held, "internal: an operand held narrowed outside a bf16 run");
  if (!runs(y.rows * y.cols, {y.p, x.p, w.data()})) return;
  // laga::linear_forward's one gemm.
  run_gemm<T>(false, true, y.rows, y.cols, x.cols, T(1), x.p, x.cols, w.data(), x.cols, T(0), y.p,
              y.cols);
}
// dx = dy w (added when accumulate; skipped when dx.p is null and not
// needed), dw += dy^T x.
// x_held (the overload below): x's bf16 values, x.p then null; only in a
// bf16 run, the only one keep_narrowed narrows in.
template <class T>
void linear_backward(std::type_identity_t<Mat<T>>* dx, bool accumulate, Tensor<T>& dw, In<T> dy,
                     In<T> x, const Tensor<T>& w,
                     std::optional<const bf16*> x_held = std::nullopt) {
  // laga::linear_backward's gemms: dw (out, in) += dy^T x; dx (N, in) = dy w.
  const std::int64_t N = dy.rows, in = x.cols, out = dy.cols;
  count_gemm({true, false, out, in, N, out, in, in, true});
  if (dx) count_gemm({false, false, N, in, out, out, in, in, accumulate});
  if (in_bf16<T>()) {  // as gemm: before runs()
    if constexpr (std::is_same_v<T, float>)
      return bf16_path::linear_backward(dx ? dx->p : nullptr, accumulate, dw.data(), dy.p, x.p,
                                        w.data(), dy.rows, x.cols, dy.cols, x_held);
  }
  LAGA_CHECK(!x_held, "internal: an operand held narrowed outside a bf16 run");
  if (!runs(dy.rows * dy.cols, {dy.p, x.p, w.data(), dw.data(), dx ? dx->p : w.data()})) return;
  // laga::linear_backward's two gemms, in its order.
  if (dx)
    run_gemm<T>(false, false, N, in, out, T(1), dy.p, out, w.data(), in, accumulate ? T(1) : T(0),
                dx->p, in);
  run_gemm<T>(true, false, out, in, N, T(1), dy.p, out, x.p, in, T(1), dw.data(), in);
}

// As above, x a whole tensor (mat(x)), which may be held narrowed
// (keep_narrowed: bf16 runs): its bf16 values are then the product's operand
// as they are, with no widening and no copy (the same bits: the op rounds x
// to exactly those values).
template <class T>
void linear_backward(std::type_identity_t<Mat<T>>* dx, bool accumulate, Tensor<T>& dw, In<T> dy,
                     const Tensor<T>& x, const Tensor<T>& w) {
  if (!x.narrowed()) return linear_backward(dx, accumulate, dw, dy, mat(x), w);
  const Shape& s = x.shape();
  const std::int64_t in = s.back(), N = x.numel() / std::max<std::int64_t>(in, 1), out = dy.cols;
  LAGA_CHECK(dy.rows == N && dy.ld == dy.cols && w.dim(0) == out && w.dim(1) == in,
             "internal: linear_backward of a held (", N, ", ", in, ") by ", to_string(w.shape()));
  linear_backward(dx, accumulate, dw, dy, In<T>{nullptr, N, in, in}, w,
                  std::optional(x.narrowed_data()));
}

// y (N, C) contiguous = rmsnorm of x's first C columns (x may be wider).
template <class T>
void rmsnorm(Mat<T> y, Tensor<T>& rstd, In<T> x, const Tensor<T>& w, double eps) {
  count_elementwise<T>(y.rows * y.cols, 2);  // x in, y out
  if (!runs(y.rows * y.cols, {y.p, rstd.data(), x.p, w.data()})) return;
  OpCall c;
  c.op = Op::rmsnorm_forward, c.dtype = op_dtype<T>();
  c.shape.rows = y.rows, c.shape.cols = y.cols, c.shape.lda = x.ld;
  c.in[0] = x.p, c.in[1] = w.data(), c.out[0] = y.p, c.out[1] = rstd.data(), c.alpha = eps;
  run_kernel(c);
  if (in_bf16<T>()) {
    if constexpr (std::is_same_v<T, float>) bf16_path::round_in_place(y);
  }
}
// dx (N, C) overwritten, dw accumulated; dx, dy and x each at its own row
// stride.
template <class T>
void rmsnorm_backward(Mat<T> dx, Tensor<T>& dw, In<T> dy, In<T> x, const Tensor<T>& w,
                      const Tensor<T>& rstd) {
  count_elementwise<T>(dx.rows * dx.cols, 3);  // dy and x in, dx out
  if (!runs(dx.rows * dx.cols, {dx.p, dw.data(), dy.p, x.p, w.data(), rstd.data()})) return;
  OpCall c;
  c.op = Op::rmsnorm_backward, c.dtype = op_dtype<T>();
  c.shape.rows = dx.rows, c.shape.cols = dx.cols;
  c.shape.lda = x.ld, c.shape.ldb = dy.ld, c.shape.ldc = dx.ld;
  c.in[0] = dy.p, c.in[1] = x.p, c.in[2] = w.data(), c.in[3] = rstd.data();
  c.out[0] = dx.p, c.out[1] = dw.data();
  run_kernel(c);
}

// Rotates the rope part x of B * L tokens (rows) of H heads: head h of a row
// at x.p + h * head_stride, at positions (B, L) when given (packed
// sequences), else at global positions pos0 .. pos0 + L - 1.
template <class T>
void rope(Mat<T> x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t head_stride,
          std::int64_t pos0, const std::int64_t* positions, const RopeTable& table, bool inverse) {
  // NoPE (MlaConfig::rotates): the table is empty and nothing rotates; no
  // kernel is asked, on any backend (docs/mla-math.md, "Gated NoPE MLA").
  if (table.dim() == 0) return;
  count_elementwise<T>(x.rows * H * table.dim(), 2);  // rotated in place
  if (!runs(x.rows * H, {x.p})) return;
  OpCall c;
  c.op = inverse ? Op::rope_backward : Op::rope_forward, c.dtype = op_dtype<T>();
  c.shape.batch = B, c.shape.tokens = L, c.shape.heads = H, c.shape.ld_token = x.ld;
  c.shape.ld_head = head_stride, c.shape.pos0 = pos0;
  c.in[0] = positions, c.out[0] = x.p, c.context = &table;
  run_kernel(c);
  // Forward rotates a GEMM's (bf16) output in place: the rotated values are
  // rounded again, and the view's unrotated columns (the heads' nope parts,
  // that GEMM's output too) are bf16 already, so rounding all of x changes
  // only what was rotated.
  if (!inverse && in_bf16<T>()) {
    if constexpr (std::is_same_v<T, float>) bf16_path::round_in_place(x);
  }
}

// dst = src, row by row.
template <class T>
void copy(Mat<T> dst, In<T> src) {
  LAGA_CHECK(dst.rows == src.rows && dst.cols == src.cols, "internal: copy of (", src.rows, ", ",
             src.cols, ") into (", dst.rows, ", ", dst.cols, ")");
  count_elementwise<T>(dst.rows * dst.cols, 2);
  if (!runs(dst.rows * dst.cols, {dst.p, src.p})) return;
  move_rows(dst.p, dst.ld, src.p, src.ld, dst.rows, dst.cols);
}
// dst = src's bf16 values widened (exactly), row by row: a tensor held
// narrowed read where an fp32 operand is needed.
// Only bf16 runs hold tensors narrowed, so T is float (a double run never
// calls it; it compiles for the ring engine's double instantiation).
template <class T>
void widen(Mat<T> dst, Mat<const bf16> src) {
  LAGA_CHECK(dst.rows == src.rows && dst.cols == src.cols, "internal: widen of (", src.rows, ", ",
             src.cols, ") into (", dst.rows, ", ", dst.cols, ")");
  LAGA_CHECK(in_bf16<T>(), "internal: a tensor held narrowed outside a bf16 run");
  count_elementwise<T>(dst.rows * dst.cols, 1);
  count_elementwise<bf16>(dst.rows * dst.cols, 1);
  if (!runs(dst.rows * dst.cols, {dst.p, src.p})) return;
  if constexpr (std::is_same_v<T, float>)
    move_rows(dst.p, dst.ld, src.p, src.ld, dst.rows, dst.cols);
}
// dst += src.
template <class T>
void add(Mat<T> dst, In<T> src) {
  LAGA_CHECK(dst.rows == src.rows && dst.cols == src.cols, "internal: add of (", src.rows, ", ",
             src.cols, ") into (", dst.rows, ", ", dst.cols, ")");
  count_elementwise<T>(dst.rows * dst.cols, 3);
  if (!runs(dst.rows * dst.cols, {dst.p, src.p})) return;
  move_rows(dst.p, dst.ld, src.p, src.ld, dst.rows, dst.cols, true);
}
// dst = value (a tensor's storage zeroed for a sum, or poisoned by a test).
template <class T>
void fill(Mat<T> dst, T value) {
  count_elementwise<T>(dst.rows * dst.cols, 1);
  if (!runs(dst.rows * dst.cols, {dst.p})) return;
  fill_rows(dst.p, dst.ld, dst.rows, dst.cols, value);
}

// p + k, a view's first element given by a pointer: null stays null (an
// unbacked tensor's view, count-only), as Mat::block keeps it.
template <class T>
T* at(T* p, std::int64_t k) {
  return p ? p + k : nullptr;
}
// x *= s in place, each element as T(double(x) * s): the DSA indexer's
// weights' scale (mla/dsa_block.cpp). A host loop: the DSA code runs on the
// host only (docs/forms.md, "DSA").
template <class T>
void scale(Mat<T> x, double s) {
  count_elementwise<T>(x.rows * x.cols, 2);
  if (!runs(x.rows * x.cols, {x.p})) return;
  for (std::int64_t i = 0; i < x.rows; ++i)
    for (std::int64_t j = 0; j < x.cols; ++j) x.p[i * x.ld + j] = T(double(x.p[i * x.ld + j]) * s);
}
// x *= num / den in place, each element as T(double(x) * num / den) (the
// explicit DSA form's share of the KL target, mla/dsa_explicit.cpp).
template <class T>
void scale_ratio(Mat<T> x, double num, double den) {
  count_elementwise<T>(x.rows * x.cols, 2);
  if (!runs(x.rows * x.cols, {x.p})) return;
  for (std::int64_t i = 0; i < x.rows; ++i)
    for (std::int64_t j = 0; j < x.cols; ++j)
      x.p[i * x.ld + j] = T(double(x.p[i * x.ld + j]) * num / den);
}
// dst[i] = D(src[i]), n values (the DSA selection moved as fp32 values and
// back, mla/dsa_explicit.cpp). A host loop, as scale's.
template <class D, class S>
void cast(D* dst, const S* src, std::int64_t n) {
  count_elementwise<S>(n, 1);
  count_elementwise<D>(n, 1);
  if (!runs(n, {dst, src})) return;
  for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(src[i]);
}
// The dout pointer of a call whose dout only says that backward runs (the
// DSA block and forms: null = forward only): the tensor's storage, or under
// a count-only pool, where it has none, a stand-in the op never reads.
template <class T>
const T* backward_input(const Tensor<T>& dout) {
  static const T unread{};
  if (runs(dout.numel(), {dout.data()})) return dout.data();
  return &unread;
}
// A tensor's values as a vector (a result handed back as plain rows, as the
// DSA forms' DsaBlockResult does): empty when the tensor has no storage
// (count-only), so no caller decides that itself.
template <class T>
std::vector<T> to_vector(const Tensor<T>& t) {
  if (!runs(t.numel(), {t.data()})) return {};
  return std::vector<T>(t.data(), t.data() + t.numel());
}

}  // namespace laga::ops
