#include "mla/ops_model.hpp"

#include <algorithm>
#include <cstring>

#include "core/rng.hpp"
#include "kernels/gemm.hpp"

namespace laga::ops {

namespace {

// A view the model's kernels take as one flat array: rows contiguous.
template <class T>
void check_dense(const Mat<T>& m, const char* op, const char* what) {
  LAGA_CHECK(m.ld == m.cols, "internal: ", op, "'s ", what, " (", m.rows, ", ", m.cols,
             ") has row stride ", m.ld, "; it needs dense rows");
}

template <class A, class B>
void check_same(const A& a, const B& b, const char* op) {
  LAGA_CHECK(a.rows == b.rows && a.cols == b.cols, "internal: ", op, " of a (", b.rows, ", ",
             b.cols, ") operand into (", a.rows, ", ", a.cols, ")");
}

}  // namespace

template <class T>
void embedding(Mat<T> out, const std::int32_t* ids, const Tensor<T>& table) {
  check_dense(out, "embedding", "output");
  LAGA_CHECK(table.rank() == 2 && table.dim(1) == out.cols, "internal: embedding of a ",
             to_string(table.shape()), " table into rows of ", out.cols);
  const std::int64_t N = out.rows, V = table.dim(0), D = out.cols;
  count_elementwise<T>(N * D, 2);
  if (!runs(N * D, {out.p, ids, table.data()})) return;
  OpCall c;
  c.op = Op::embedding_forward, c.dtype = op_dtype<T>();
  c.shape.rows = N, c.shape.n = V, c.shape.cols = D;
  c.in[0] = ids, c.in[1] = table.data(), c.out[0] = out.p;
  run_kernel(c);
}

template <class T>
void embedding_backward(Tensor<T>& dtable, In<T> dout, const std::int32_t* ids) {
  check_dense(dout, "embedding_backward", "dout");
  LAGA_CHECK(dtable.rank() == 2 && dtable.dim(1) == dout.cols, "internal: embedding_backward of ",
             "rows of ", dout.cols, " into a ", to_string(dtable.shape()), " table");
  const std::int64_t N = dout.rows, V = dtable.dim(0), D = dout.cols;
  count_elementwise<T>(N * D, 3);
  if (!runs(N * D, {dtable.data(), dout.p, ids})) return;
  OpCall c;
  c.op = Op::embedding_backward, c.dtype = op_dtype<T>();
  c.shape.rows = N, c.shape.n = V, c.shape.cols = D;
  c.in[0] = dout.p, c.in[1] = ids, c.out[0] = dtable.data();
  run_kernel(c);
}

namespace {

// The two-input elementwise ops (SwiGLU's silu(a) * b, the output gate's
// o * sigmoid(g)) share one shape of call: forward out = f(a, b) over three
// dense operands of one shape (3 element reads and writes each), backward
// (da, db) from (dout, a, b) over five (5). `names`: the operands as the op's
// documentation calls them, for the refusals.
template <class T>
void binary_elementwise(Op op, const char* what, const char* const (&names)[3], Mat<T> out, In<T> a,
                        In<T> b) {
  check_same(out, a, what), check_same(out, b, what);
  check_dense(out, what, names[0]), check_dense(a, what, names[1]);
  check_dense(b, what, names[2]);
  const std::int64_t n = out.rows * out.cols;
  count_elementwise<T>(n, 3);
  if (!runs(n, {out.p, a.p, b.p})) return;
  OpCall c;
  c.op = op, c.dtype = op_dtype<T>(), c.shape.rows = n;
  c.in[0] = a.p, c.in[1] = b.p, c.out[0] = out.p;
  run_kernel(c);
}

template <class T>
void binary_elementwise_backward(Op op, const char* what, Mat<T> da, Mat<T> db, In<T> dout, In<T> a,
                                 In<T> b) {
  for (const Mat<const T>& m : {Mat<const T>(da), Mat<const T>(db), dout, a, b}) {
    check_same(m, Mat<const T>(da), what);
    check_dense(m, what, "an operand");
  }
  const std::int64_t n = da.rows * da.cols;
  count_elementwise<T>(n, 5);
  if (!runs(n, {da.p, db.p, dout.p, a.p, b.p})) return;
  OpCall c;
  c.op = op, c.dtype = op_dtype<T>(), c.shape.rows = n;
  c.in[0] = dout.p, c.in[1] = a.p, c.in[2] = b.p, c.out[0] = da.p, c.out[1] = db.p;
  run_kernel(c);
}

}  // namespace

template <class T>
void swiglu(Mat<T> h, In<T> a, In<T> b) {
  binary_elementwise(Op::swiglu_forward, "swiglu", {"h", "a", "b"}, h, a, b);
}

template <class T>
void swiglu_backward(Mat<T> da, Mat<T> db, In<T> dh, In<T> a, In<T> b) {
  binary_elementwise_backward(Op::swiglu_backward, "swiglu_backward", da, db, dh, a, b);
}

template <class T>
void output_gate(Mat<T> y, In<T> o, In<T> g) {
  binary_elementwise(Op::output_gate_forward, "output_gate", {"y", "o", "g"}, y, o, g);
}

template <class T>
void output_gate_backward(Mat<T> d_o, Mat<T> dg, In<T> dy, In<T> o, In<T> g) {
  binary_elementwise_backward(Op::output_gate_backward, "output_gate_backward", d_o, dg, dy, o, g);
}

template <class T>
double cross_entropy(Tensor<T>& loss, Tensor<double>& lse, In<T> logits,
                     const std::int32_t* targets) {
  check_dense(logits, "cross_entropy", "logits");
  const std::int64_t N = logits.rows, V = logits.cols;
  LAGA_CHECK(loss.numel() == N && lse.numel() == N, "internal: cross_entropy of ", N, " rows into ",
             loss.numel(), " losses and ", lse.numel(), " lse");
  count_elementwise<T>(N * V, 1);
  count_elementwise<T>(N, 1);
  count_elementwise<double>(N, 1);
  double sum = 0.0;  // sequential: the same bits on every backend
  if (!runs(N, {loss.data(), lse.data(), logits.p, targets})) return sum;
  OpCall c;
  c.op = Op::cross_entropy, c.dtype = op_dtype<T>(), c.shape.rows = N, c.shape.cols = V;
  c.in[0] = logits.p, c.in[1] = targets, c.out[0] = loss.data(), c.out[1] = lse.data();
  run_kernel(c);
  for (std::int64_t i = 0; i < N; ++i) sum += loss[i];
  return sum;
}

template <class T>
void cross_entropy_backward(Mat<T> dlogits, In<T> logits, const Tensor<double>& lse,
                            const std::int32_t* targets, double scale) {
  check_same(dlogits, logits, "cross_entropy_backward");
  check_dense(dlogits, "cross_entropy_backward", "dlogits");
  check_dense(logits, "cross_entropy_backward", "logits");
  const std::int64_t N = logits.rows, V = logits.cols;
  LAGA_CHECK(lse.numel() == N, "internal: cross_entropy_backward of ", N, " rows with ",
             lse.numel(), " lse");
  count_elementwise<T>(N * V, 2);
  if (!runs(N * V, {dlogits.p, logits.p, lse.data(), targets})) return;
  OpCall c;
  c.op = Op::cross_entropy_backward, c.dtype = op_dtype<T>(), c.shape.rows = N, c.shape.cols = V;
  c.in[0] = logits.p, c.in[1] = lse.data(), c.in[2] = targets, c.out[0] = dlogits.p;
  c.alpha = scale;
  run_kernel(c);
}

template <class T>
void adamw(Tensor<T>& p, Tensor<T>& m, Tensor<T>& v, const Tensor<T>& g, std::int64_t step,
           const AdamWHyper& h) {
  const std::int64_t n = p.numel();
  LAGA_CHECK(m.numel() == n && v.numel() == n && g.numel() == n, "internal: adamw of ", n,
             " parameters with moments of ", m.numel(), " and ", v.numel(), " and ", g.numel(),
             " gradients");
  count_elementwise<T>(n, 7);
  if (!runs(n, {p.data(), m.data(), v.data(), g.data()})) return;
  OpCall c;
  c.op = Op::adamw, c.dtype = op_dtype<T>(), c.shape.rows = n, c.shape.k = step;
  c.in[0] = g.data(), c.out[0] = p.data(), c.out[1] = m.data(), c.out[2] = v.data();
  c.context = &h;
  run_kernel(c);
}

template <class T>
double sum_squares(const Tensor<T>& t) {
  count_elementwise<T>(t.numel(), 1);
  if (!runs(t.numel(), {t.data()})) return 0.0;
  return laga::sum_squares(t.data(), t.numel());
}

template <class T>
void scale(Tensor<T>& t, T factor) {
  count_elementwise<T>(t.numel(), 2);
  if (!runs(t.numel(), {t.data()})) return;
  T* x = t.data();
  for (std::int64_t i = 0; i < t.numel(); ++i) x[i] *= factor;
}

template <class T>
NonFinite count_nonfinite(const Tensor<T>& t) {
  count_elementwise<T>(t.numel(), 1);
  if (!runs(t.numel(), {t.data()})) return {};
  return laga::count_nonfinite(t.data(), t.numel());
}

template <class T>
void fill_normal(Tensor<T>& t, std::uint64_t seed, std::uint64_t stream, std::uint64_t first,
                 double stddev) {
  count_elementwise<T>(t.numel(), 1);
  if (!runs(t.numel(), {t.data()})) return;
  laga::fill_normal(t.data(), t.numel(), seed, stream, first, stddev);
}

template <class T>
void update_on_host(Tensor<T>& t, const std::function<std::vector<T>(std::vector<T>)>& f) {
  count_elementwise<T>(t.numel(), 2);
  if (!runs(t.numel(), {t.data()})) return;
  const std::vector<T> updated = f(std::vector<T>(t.data(), t.data() + t.numel()));
  LAGA_CHECK(std::int64_t(updated.size()) == t.numel(), "internal: a host update of ", t.numel(),
             " values returned ", updated.size());
  std::copy(updated.begin(), updated.end(), t.data());
}

template <class T>
void gather_rows(Mat<T> dst, In<T> src, const std::int32_t* index) {
  check_dense(dst, "gather_rows", "dst"), check_dense(src, "gather_rows", "src");
  LAGA_CHECK(dst.cols == src.cols, "internal: gather_rows of rows of ", src.cols, " into rows of ",
             dst.cols);
  const std::int64_t R = dst.rows, D = dst.cols;
  count_elementwise<T>(R * D, 2);
  if (!runs(R * D, {dst.p, src.p, index})) return;
#pragma omp parallel for schedule(static)
  for (std::int64_t p = 0; p < R; ++p) {
    const T* s = src.p + std::int64_t(index[p]) * D;
    std::copy(s, s + D, dst.p + p * D);
  }
}

template <class T>
void combine_rows(Mat<T> out, In<T> src, const std::int64_t* row, const T* weight, std::int64_t k) {
  check_dense(out, "combine_rows", "out"), check_dense(src, "combine_rows", "src");
  LAGA_CHECK(out.cols == src.cols && k >= 1, "internal: combine_rows of ", k, " rows of ", src.cols,
             " into rows of ", out.cols);
  const std::int64_t N = out.rows, D = out.cols;
  count_elementwise<T>(N * k * D, 3);
  if (!runs(N * D, {out.p, src.p, row})) return;
  T* o = out.p;
  if (weight) {
#pragma omp parallel for schedule(static)
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t j = 0; j < k; ++j) {
        const T wt = weight[t * k + j];
        const T* y = src.p + row[t * k + j] * D;
        for (std::int64_t i = 0; i < D; ++i) o[t * D + i] += wt * y[i];
      }
  } else {
#pragma omp parallel for schedule(static)
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t j = 0; j < k; ++j) {
        const T* y = src.p + row[t * k + j] * D;
        for (std::int64_t i = 0; i < D; ++i) o[t * D + i] += y[i];
      }
  }
}

template <class T>
void combine_rows_backward(Mat<T> dsrc, T* dweight, In<T> dout, In<T> src, const std::int64_t* row,
                           const T* weight, std::int64_t k) {
  check_dense(dsrc, "combine_rows_backward", "dsrc");
  check_dense(dout, "combine_rows_backward", "dout");
  check_dense(src, "combine_rows_backward", "src");
  check_same(dsrc, src, "combine_rows_backward");
  LAGA_CHECK(dout.cols == src.cols && k >= 1, "internal: combine_rows_backward of ", k, " rows of ",
             src.cols, " from rows of ", dout.cols);
  const std::int64_t N = dout.rows, D = dout.cols;
  count_elementwise<T>(N * k * D, 3);
  if (!runs(N * D, {dsrc.p, dweight, dout.p, src.p, row, weight})) return;
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t p = row[t * k + j];
      const T wt = weight[t * k + j];
      const T* y = src.p + p * D;
      const T* go = dout.p + t * D;
      T* gy = dsrc.p + p * D;
      double dot = 0.0;
      for (std::int64_t i = 0; i < D; ++i) {
        dot += double(go[i]) * double(y[i]);
        gy[i] = wt * go[i];
      }
      dweight[t * k + j] = static_cast<T>(dot);
    }
}

template <class T>
RoutedLinears<T>::RoutedLinears(std::int64_t slice, std::int64_t max_rows,
                                std::initializer_list<bf16_path::RowSlicedLinears::InOut> shapes,
                                bool backward) {
  if (in_bf16<T>())
    bf16_.emplace(std::max<std::int64_t>(1, std::min(slice, max_rows)), shapes, backward);
}

template <class T>
void RoutedLinears<T>::forward(Mat<T> y, In<T> x, const Tensor<T>& w) {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) {
      LAGA_CHECK(x.ld == x.cols && y.ld == y.cols && x.rows == y.rows && w.dim(0) == y.cols &&
                     w.dim(1) == x.cols,
                 "internal: linear of (", x.rows, ", ", x.cols, ") by ", to_string(w.shape()));
      count_gemm({false, true, y.rows, y.cols, x.cols, x.cols, x.cols, y.cols, false});
      return bf16_->forward(y.p, x.p, w.data(), y.rows, x.cols, y.cols);
    }
  }
  linear(y, x, w);
}

template <class T>
void RoutedLinears<T>::backward(Mat<T> dx, bool accumulate, Tensor<T>& dw, In<T> dy, In<T> x,
                                const Tensor<T>& w) {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_) {
      const std::int64_t N = dy.rows, in = x.cols, out = dy.cols;
      LAGA_CHECK(dx.ld == dx.cols && dy.ld == dy.cols && x.ld == x.cols && x.rows == N &&
                     dx.rows == N && dx.cols == in && w.dim(0) == out && w.dim(1) == in,
                 "internal: linear_backward of (", N, ", ", out, ") by ", to_string(w.shape()));
      count_gemm({true, false, out, in, N, out, in, in, true});
      count_gemm({false, false, N, in, out, out, in, in, accumulate});
      return bf16_->backward(dx.p, accumulate, dw.data(), dy.p, x.p, w.data(), N, in, out);
    }
  }
  linear_backward(&dx, accumulate, dw, dy, x, w);
}

#define LAGA_INSTANTIATE(T)                                                                       \
  template void embedding<T>(Mat<T>, const std::int32_t*, const Tensor<T>&);                      \
  template void embedding_backward<T>(Tensor<T>&, In<T>, const std::int32_t*);                    \
  template void swiglu<T>(Mat<T>, In<T>, In<T>);                                                  \
  template void swiglu_backward<T>(Mat<T>, Mat<T>, In<T>, In<T>, In<T>);                          \
  template void output_gate<T>(Mat<T>, In<T>, In<T>);                                             \
  template void output_gate_backward<T>(Mat<T>, Mat<T>, In<T>, In<T>, In<T>);                     \
  template double cross_entropy<T>(Tensor<T>&, Tensor<double>&, In<T>, const std::int32_t*);      \
  template void cross_entropy_backward<T>(Mat<T>, In<T>, const Tensor<double>&,                   \
                                          const std::int32_t*, double);                           \
  template void adamw<T>(Tensor<T>&, Tensor<T>&, Tensor<T>&, const Tensor<T>&, std::int64_t,      \
                         const AdamWHyper&);                                                      \
  template double sum_squares<T>(const Tensor<T>&);                                               \
  template void scale<T>(Tensor<T>&, T);                                                          \
  template NonFinite count_nonfinite<T>(const Tensor<T>&);                                        \
  template void fill_normal<T>(Tensor<T>&, std::uint64_t, std::uint64_t, std::uint64_t, double);  \
  template void update_on_host<T>(Tensor<T>&,                                                     \
                                  const std::function<std::vector<T>(std::vector<T>)>&);          \
  template void gather_rows<T>(Mat<T>, In<T>, const std::int32_t*);                               \
  template void combine_rows<T>(Mat<T>, In<T>, const std::int64_t*, const T*, std::int64_t);      \
  template void combine_rows_backward<T>(Mat<T>, T*, In<T>, In<T>, const std::int64_t*, const T*, \
                                         std::int64_t);                                           \
  template class RoutedLinears<T>;
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::ops
