#include "mla/ops_sparse.hpp"

#include "mla/form_spec.hpp"
#include "mla/op_table.hpp"

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

}  // namespace

template <class T>
void sparse_attention_forward(const SparseAttnShape& s, T* o, T* lse, Src<T> q, Src<T> k, Src<T> v,
                              const std::int32_t* idx) {
  s.validate();
  count_sparse(s, AttentionPass::forward);
  if (!runs(s.attn.B * s.attn.Sq * s.attn.Hq, {o, lse, q, k, v, idx})) return;
  sparse_attention_check_indices(s, idx);
  OpCall c;
  c.op = Op::sparse_attention_forward, c.dtype = op_dtype<T>(), c.shape = op_shape(s);
  c.in[0] = q, c.in[1] = k, c.in[2] = v, c.in[3] = idx;
  c.out[0] = o, c.out[1] = lse;
  run_row(pick(op_device, c.op, c.dtype, c.shape), c);
}

template <class T>
void sparse_attention_backward(const SparseAttnShape& s, T* dq, T* dk, T* dv, Src<T> dout, Src<T> q,
                               Src<T> k, Src<T> v, Src<T> o, Src<T> lse, const std::int32_t* idx) {
  s.validate();
  count_sparse(s, AttentionPass::backward);
  if (!runs(s.attn.B * s.attn.Sq * s.attn.Hq, {dq, dk, dv, dout, q, k, v, o, lse, idx})) return;
  sparse_attention_check_indices(s, idx);
  OpCall c;
  c.op = Op::sparse_attention_backward, c.dtype = op_dtype<T>(), c.shape = op_shape(s);
  c.in[0] = dout, c.in[1] = q, c.in[2] = k, c.in[3] = v, c.in[4] = o, c.in[5] = lse;
  c.in[6] = idx;
  c.out[0] = dq, c.out[1] = dk, c.out[2] = dv;
  run_row(pick(op_device, c.op, c.dtype, c.shape), c);
}

#define LAGA_INSTANTIATE(T)                                                                      \
  template void sparse_attention_forward<T>(const SparseAttnShape&, T*, T*, Src<T>, Src<T>,      \
                                            Src<T>, const std::int32_t*);                        \
  template void sparse_attention_backward<T>(const SparseAttnShape&, T*, T*, T*, Src<T>, Src<T>, \
                                             Src<T>, Src<T>, Src<T>, Src<T>, const std::int32_t*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::ops
