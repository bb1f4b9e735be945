// The language model's ops (model/model.cpp, model/moe.cpp, model/train.cpp):
// embedding, SwiGLU, cross-entropy, AdamW and the optimiser step's
// reductions, the MoE's row permutations (gather, combine) and its routed
// experts' linears, and the model's host-side steps. They are ops.hpp's ops
// (its header: count-only, op counting and precision), for the model's
// tensors: each op counts what it does (or, count-only, would do), decides
// there whether it computes, and handles its precision, so that the model
// never asks whether it is counting (docs/architecture.md, "One
// description, three runs") and includes no kernel header.
//
// Each op is one function (or, for the routed experts, one class) over Mat
// views and tensors, its shapes beside its operands, with its traits in the
// comment above it: what it counts (OpCounts: GEMM FLOPs, or the bytes an
// elementwise op reads and writes, passes x elements x sizeof) and what it
// does under bf16 mixed precision. The kernels are kernels/*.hpp's; every
// one has a naive double reference (mla_test_ops_model holds these ops to
// theirs, and their count-only runs to the real runs' counts).
//
// Rows of the kernel table (mla/op_table.hpp, issue 52: its Op lists the
// four below and leaves their slots to this header): each op
// here computes with one kernel call after its runs(), the call a row's run
// makes from an OpCall with these slots and shape fields (rows, cols; n the
// vocabulary; RunDtype the thread's, fp32 values under bf16):
//   embedding_forward   rows N, cols D, n V; in: ids, table; out: out
//   embedding_backward  rows N, cols D, n V; in: dout, ids; out: dtable (added to)
//   swiglu_forward      rows x cols elements; in: a, b; out: h
//   swiglu_backward     rows x cols elements; in: dh, a, b; out: da, db
//   output_gate_forward  rows x cols elements; in: o, g; out: y
//   output_gate_backward rows x cols elements; in: dy, o, g; out: do, dg
//   cross_entropy       rows N, cols V; in: logits, targets; out: loss, lse (double);
//                       backward (no Op yet): in: logits, lse, targets; out: dlogits;
//                       alpha = scale
//   adamw               rows n; in: g; out: p, m, v; context: AdamWHyper, k = step
//
// What a count-only run cannot have is data: a routing, which the MoE's
// sizes depend on, exists only where tensors hold values. data_dependent
// (below) is where the model states what a count-only run takes in its
// place; the op layer decides which of the two runs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "core/nonfinite.hpp"
#include "kernels/adamw.hpp"          // AdamWHyper, clip_factor, LrSchedule (train.hpp's options)
#include "kernels/cross_entropy.hpp"  // kIgnoreTarget (data.cpp's packed targets)
#include "mla/ops.hpp"

namespace laga::ops {

// ------------------------------------------------------------ operands

// Whether t can be an op's operand here: it has storage, or the run only
// counts (then no tensor has any). The model's parameter checks ask this to
// name an unbacked weight before any op meets it.
template <class T>
bool usable(const Tensor<T>& t) {
  return t.backed() || current_pool().count_only();
}
// The same for a caller's pointer to `elements` values.
inline bool usable(const void* p, std::int64_t elements) {
  return p != nullptr || elements == 0 || current_pool().count_only();
}

// A value that depends on what tensors hold (the MoE's routing: which
// experts each token picked, and so how many rows each expert runs):
// `compute()` where ops compute, `stand_in()` in a count-only run, which has
// no values. The stand-in is the caller's statement of what a count-only
// run sizes its tensors by (model/moe.cpp: a routing that selects nothing,
// the uniform expectation of an owner's rows); which of the two runs is
// decided here.
template <class Compute, class StandIn>
auto data_dependent(Compute&& compute, StandIn&& stand_in) {
  return current_pool().count_only() ? stand_in() : compute();
}

// ------------------------------------------------------------ the model's ops

// out (N, D) = rows ids (N) of table (V, D): the token embedding.
// Counts: 2 passes of N D (table rows read, out written). bf16: a lookup,
// no rounding (the table's values are the run's).
template <class T>
void embedding(Mat<T> out, const std::int32_t* ids, const Tensor<T>& table);
// dtable (V, D) += dout (N, D) scattered to rows ids (N), in row order.
// Counts: 3 passes of N D.
template <class T>
void embedding_backward(Tensor<T>& dtable, In<T> dout, const std::int32_t* ids);

// h = silu(a) * b, elementwise over (N, F) views (kernels/swiglu.hpp).
// Counts: 3 passes of N F (a, b in; h out). bf16: computed in fp32 from the
// GEMMs' bf16 outputs; h stays fp32 (the next GEMM rounds its operand).
template <class T>
void swiglu(Mat<T> h, In<T> a, In<T> b);
// da, db overwritten from dh and the forward's a, b. Counts: 5 passes.
template <class T>
void swiglu_backward(Mat<T> da, Mat<T> db, In<T> dh, In<T> a, In<T> b);

// y = o * sigmoid(g), elementwise over (N, H dv) views: Kimi K3's MLA
// output gate (kernels/output_gate.hpp). Counts: 3 passes. bf16: computed in
// fp32 from the GEMM's output; y stays fp32 (wo's GEMM rounds its operand).
template <class T>
void output_gate(Mat<T> y, In<T> o, In<T> g);
// d_o, dg overwritten from dy and the forward's o, g. Counts: 5 passes.
template <class T>
void output_gate_backward(Mat<T> d_o, Mat<T> dg, In<T> dy, In<T> o, In<T> g);

// loss (N) and lse (N) of logits (N, V) against targets (N)
// (kernels/cross_entropy.hpp, fused with the log-softmax); returns the sum of
// loss, added in row order (the same bits on every backend), 0 count-only.
// Counts: N V read, 2 N written. bf16: fp32 logits (the head's bf16
// output), sums in double.
template <class T>
double cross_entropy(Tensor<T>& loss, Tensor<double>& lse, In<T> logits,
                     const std::int32_t* targets);
// dlogits (N, V) = scale (softmax(logits) - onehot(targets)); may alias
// logits. Counts: 2 passes of N V.
template <class T>
void cross_entropy_backward(Mat<T> dlogits, In<T> logits, const Tensor<double>& lse,
                            const std::int32_t* targets, double scale);

// One AdamW step (kernels/adamw.hpp) on p, m, v from g, all of one size;
// step >= 1. Counts: 7 passes (p, m, v read and written, g read). Always
// fp32 or double: the weights and moments are the run's type under bf16 too.
template <class T>
void adamw(Tensor<T>& p, Tensor<T>& m, Tensor<T>& v, const Tensor<T>& g, std::int64_t step,
           const AdamWHyper& h);
// sum t^2 in double, sequentially; 0 count-only. Counts: 1 pass.
template <class T>
double sum_squares(const Tensor<T>& t);
// t *= factor, elementwise. Counts: 2 passes.
template <class T>
void scale(Tensor<T>& t, T factor);
// t's non-finite values (core/nonfinite.hpp); none count-only. Counts: 1 pass.
template <class T>
NonFinite count_nonfinite(const Tensor<T>& t);
// t[i] = stddev * normal(seed, stream, first + i) by the counter-based RNG
// (core/rng.hpp). Counts: 1 pass.
template <class T>
void fill_normal(Tensor<T>& t, std::uint64_t seed, std::uint64_t stream, std::uint64_t first,
                 double stddev);
// t's values replaced by f(its values), on the host (the MoE's bias
// balancing, a few values a step); nothing count-only, f is not called.
// Counts: 2 passes.
template <class T>
void update_on_host(Tensor<T>& t, const std::function<std::vector<T>(std::vector<T>)>& f);

// ------------------------------------------------- the MoE's permutations

// dst (R, D): row p = src's row index[p] (the dispatch's gather: each routed
// copy's input). Counts: 2 passes of R D.
template <class T>
void gather_rows(Mat<T> dst, In<T> src, const std::int32_t* index);
// out (N, D) += sum_j weight[t k + j] src[row[t k + j]] for each token t,
// slots j in order (the combine); weight null adds the rows unweighted (the
// un-permute of dx). src (R, D). Counts: 3 passes of N k D.
template <class T>
void combine_rows(Mat<T> out, In<T> src, const std::int64_t* row, const T* weight, std::int64_t k);
// The combine's backward: dsrc's row row[t k + j] = weight[t k + j] dout_t,
// dweight[t k + j] = <dout_t, src[row[t k + j]]> (summed in double).
// dsrc (R, D) has one row per copy, each written once. Counts: 3 passes of
// N k D.
template <class T>
void combine_rows_backward(Mat<T> dsrc, T* dweight, In<T> dout, In<T> src, const std::int64_t* row,
                           const T* weight, std::int64_t k);

// The MoE's routed experts' linears, whose row counts follow the routing
// (ops.hpp's linear and linear_backward otherwise): under bf16, every call's
// operand copies come from one scratch made when this is made, in a
// count-only run too (ops_bf16.hpp, RowSlicedLinears), for slices of
// min(slice, max_rows) rows at the widest of `shapes`, so the pool's peak
// does not depend on the routing. Counts: linear's GEMMs.
template <class T>
class RoutedLinears {
 public:
  // backward: the run calls backward(), else forward().
  RoutedLinears(std::int64_t slice, std::int64_t max_rows,
                std::initializer_list<bf16_path::RowSlicedLinears::InOut> shapes, bool backward);
  // y (N, out) = x (N, in) w^T, w (out, in); y and x dense.
  void forward(Mat<T> y, In<T> x, const Tensor<T>& w);
  // dx (N, in) = dy w (added when accumulate), dw += dy^T x.
  void backward(Mat<T> dx, bool accumulate, Tensor<T>& dw, In<T> dy, In<T> x, const Tensor<T>& w);

 private:
  std::optional<bf16_path::RowSlicedLinears> bf16_;
};

}  // namespace laga::ops
