#include "mla/ops_sparse.hpp"

#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "mla/form_spec.hpp"
#include "mla/op_table.hpp"
#include "mla/ops_bf16.hpp"

namespace laga::ops {

namespace {

// As ops_attention.cpp's count_call for flash (backward recomputes q.k),
// over K keys a row.
void count_sparse(const SparseAttnShape& s, AttentionPass pass) {
  AttnShape dense = s.attn;
  dense.Sk = s.K, dense.causal = false, dense.doc_start = nullptr;
  const double per_pair = pass == AttentionPass::forward ? double(dense.dqk + dense.dv)
                                                         : 3.0 * dense.dqk + 2.0 * dense.dv;
  count_attention(dense, AttentionKind::flash, pass, [&] {
    return 2.0 * double(dense.B) * double(dense.Sq) * double(dense.Hq) * double(s.K) * per_pair;
  });
}

OpShape op_shape(const SparseAttnShape& s) {
  OpShape shape;
  shape.attn = s.attn, shape.k = s.K;
  return shape;
}

// A bf16 call's operands rounded to bf16 (ops_sparse.hpp, "bf16"): n[i]
// values of copy i, ops_bf16.hpp's Copies packed end to end under their own
// label, made before runs() asks whether the call computes, so that a
// count-only run registers the same bytes.
struct Bf16Copies : bf16_path::Copies<bf16> {
  explicit Bf16Copies(const std::vector<std::int64_t>& n)
      : Copies(n, "bf16 sparse attention operands", /*align=*/1) {}
};

const KernelRow& bf16_row(Op op, const SparseAttnShape& s) {
  const KernelRow& row = pick(op_device, op, RunDtype::bf16, op_shape(s));
  LAGA_CHECK(row.operands == Bf16Operands::bf16, "internal: ", to_string(op), "'s bf16 row ",
             row.name, " takes fp32 values; ops_sparse.cpp hands its rows bf16 operands");
  return row;
}

}  // namespace

template <class T>
void sparse_attention_forward(const SparseAttnShape& s, T* o, T* lse, Src<T> q, Src<T> k, Src<T> v,
                              const std::int32_t* idx) {
  s.validate();
  count_sparse(s, AttentionPass::forward);
  if (in_bf16<T>()) {
    if constexpr (std::is_same_v<T, float>) {
      const AttnShape& a = s.attn;
      if (a.B * a.Sq * a.Hq == 0) return;
      const KernelRow& row = bf16_row(Op::sparse_attention_forward, s);
      const std::int64_t nq = a.B * a.Sq * a.Hq * a.dqk, nk = a.B * a.Sk * a.Hk * a.dqk,
                         nv = a.B * a.Sk * a.Hk * a.dv;
      Bf16Copies copies({nq, nk, nv});
      OpCall c;
      c.op = Op::sparse_attention_forward, c.dtype = RunDtype::bf16, c.shape = op_shape(s);
      const Tensor<bf16> scratch = row_workspace(row, c, "sparse attention scratch");
      if (!runs(a.B * a.Sq * a.Hq, {o, lse, q, k, v, idx})) return;
      sparse_attention_check_indices(s, idx);
      c.in[0] = copies.round(0, q, nq), c.in[1] = copies.round(1, k, nk);
      c.in[2] = copies.round(2, v, nv), c.in[3] = idx;
      c.out[0] = o, c.out[1] = lse;
      run_row(row, c);
    }
    return;
  }
  OpCall c;
  c.op = Op::sparse_attention_forward, c.dtype = op_dtype<T>(), c.shape = op_shape(s);
  const KernelRow& row = pick(op_device, c.op, c.dtype, c.shape);
  const Tensor<bf16> scratch = row_workspace(row, c, "sparse attention scratch");
  if (!runs(s.attn.B * s.attn.Sq * s.attn.Hq, {o, lse, q, k, v, idx})) return;
  sparse_attention_check_indices(s, idx);
  c.in[0] = q, c.in[1] = k, c.in[2] = v, c.in[3] = idx;
  c.out[0] = o, c.out[1] = lse;
  run_row(row, c);
}

template <class T>
void sparse_attention_backward(const SparseAttnShape& s, T* dq, T* dk, T* dv, Src<T> dout, Src<T> q,
                               Src<T> k, Src<T> v, Src<T> o, Src<T> lse, const std::int32_t* idx) {
  s.validate();
  count_sparse(s, AttentionPass::backward);
  if (in_bf16<T>()) {
    if constexpr (std::is_same_v<T, float>) {
      const AttnShape& a = s.attn;
      if (a.B * a.Sq * a.Hq == 0) return;
      const KernelRow& row = bf16_row(Op::sparse_attention_backward, s);
      const std::int64_t nq = a.B * a.Sq * a.Hq * a.dqk, nk = a.B * a.Sk * a.Hk * a.dqk,
                         nv = a.B * a.Sk * a.Hk * a.dv, no = a.B * a.Sq * a.Hq * a.dv;
      Bf16Copies copies({no, nq, nk, nv});
      OpCall c;
      c.op = Op::sparse_attention_backward, c.dtype = RunDtype::bf16, c.shape = op_shape(s);
      const Tensor<bf16> scratch = row_workspace(row, c, "sparse attention scratch");
      if (!runs(a.B * a.Sq * a.Hq, {dq, dk, dv, dout, q, k, v, o, lse, idx})) return;
      sparse_attention_check_indices(s, idx);
      c.in[0] = copies.round(0, dout, no), c.in[1] = copies.round(1, q, nq);
      c.in[2] = copies.round(2, k, nk), c.in[3] = copies.round(3, v, nv);
      c.in[4] = o, c.in[5] = lse, c.in[6] = idx;
      c.out[0] = dq, c.out[1] = dk, c.out[2] = dv;
      run_row(row, c);
    }
    return;
  }
  OpCall c;
  c.op = Op::sparse_attention_backward, c.dtype = op_dtype<T>(), c.shape = op_shape(s);
  const KernelRow& row = pick(op_device, c.op, c.dtype, c.shape);
  const Tensor<bf16> scratch = row_workspace(row, c, "sparse attention scratch");
  if (!runs(s.attn.B * s.attn.Sq * s.attn.Hq, {dq, dk, dv, dout, q, k, v, o, lse, idx})) return;
  sparse_attention_check_indices(s, idx);
  c.in[0] = dout, c.in[1] = q, c.in[2] = k, c.in[3] = v, c.in[4] = o, c.in[5] = lse;
  c.in[6] = idx;
  c.out[0] = dq, c.out[1] = dk, c.out[2] = dv;
  run_row(row, c);
}

template <class T>
void sparse_attention_head_summed_probs(const SparseAttnShape& s, T* p, Src<T> q, Src<T> k,
                                        Src<T> lse, const std::int32_t* idx) {
  s.validate();
  const AttnShape& a = s.attn;
  if (in_bf16<T>()) {
    if constexpr (std::is_same_v<T, float>) {
      if (a.B * a.Sq * a.Hq == 0) return;
      const std::int64_t nq = a.B * a.Sq * a.Hq * a.dqk, nk = a.B * a.Sk * a.Hk * a.dqk;
      Bf16Copies copies({nq, nk});
      if (!runs(a.B * a.Sq * a.Hq, {p, q, k, lse, idx})) return;
      laga::sparse_attention_head_summed_probs_bf16(s, p, copies.round(0, q, nq),
                                                    copies.round(1, k, nk), lse, idx);
    }
    return;
  }
  if (!runs(a.B * a.Sq * a.Hq, {p, q, k, lse, idx})) return;
  laga::sparse_attention_head_summed_probs(s, p, q, k, lse, idx);
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template void sparse_attention_forward<T>(const SparseAttnShape&, T*, T*, Src<T>, Src<T>,        \
                                            Src<T>, const std::int32_t*);                          \
  template void sparse_attention_backward<T>(const SparseAttnShape&, T*, T*, T*, Src<T>, Src<T>,   \
                                             Src<T>, Src<T>, Src<T>, Src<T>, const std::int32_t*); \
  template void sparse_attention_head_summed_probs<T>(const SparseAttnShape&, T*, Src<T>, Src<T>,  \
                                                      Src<T>, const std::int32_t*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::ops
