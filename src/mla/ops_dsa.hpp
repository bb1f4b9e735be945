// The op layer's DeepSeek Sparse Attention ops (mla/ops.hpp's contract:
// each op counts what it does, decides count-only for itself -- runs() --
// and runs its kernel through the kernel table, mla/op_table.hpp): what
// the DSA block and its forms (mla/dsa_block.hpp, dsa_cp.hpp,
// dsa_explicit.hpp, dsa_laga.hpp) ask for besides the sparse attention
// (mla/ops_sparse.hpp), so that none of them includes a kernel header
// (docs/architecture.md, "The op layer and the kernel table").
//
// Two kinds:
//  - the dense block's ops on rows given as pointers and strides (the DSA
//    code keeps its operands in row buffers and its indexer's weights as
//    plain vectors): linear_rows, gemm_strided, rmsnorm_rows, rope_rows --
//    each a view of ops::gemm / ops::rmsnorm / ops::rope's table row, the
//    same kernel and operand order as kernels/gemm.hpp's linear_forward,
//    linear_backward and gemm, kernels/rmsnorm.hpp and kernels/rope.hpp, so
//    the bits are those of a direct call;
//  - the indexer's own (kernels/dsa_indexer.hpp, sparse_attention's head
//    sum): LayerNorm, the half-split RoPE, the scores' causal top-k, every
//    causal key as a selection, the KL loss and its gradient. fp64 and
//    fp32: the rows refuse bf16, naming it; under a bf16 scope these ops
//    (and the dense ones above) run fp32 (docs/forms.md, "DSA in bf16":
//    only the sparse attention and its KL target run bf16; the values the
//    indexer scores with are rounded after, by round_as_stored below).
//
// Counting (OpCounts): the GEMMs as ops::gemm counts them; LayerNorm, both
// RoPEs and the selections as elementwise bytes; the indexer's scores as
// indexer_flops, as dsa_work counts them (mla/dsa_model.hpp): the top-k
// H_I (2 d_I + 2) a causal (query, key) pair, the KL 3 H_I 2 d_I a filled
// slot (its scores again, then dq and dk). The KL's target is
// ops_sparse.hpp's sparse_attention_head_summed_probs.
#pragma once

#include <cstdint>

#include "kernels/dsa_indexer.hpp"
#include "mla/ops.hpp"
#include "mla/ops_sparse.hpp"

namespace laga::ops {

// y (N, out) = x (N, in) w^T, all dense (kernels/gemm.hpp's linear_forward).
template <class T>
void linear_rows(T* y, const T* x, const T* w, std::int64_t N, std::int64_t in, std::int64_t out);
// dx (N, in) = dy w (added to when accumulate_dx; skipped when dx is null),
// dw (out, in) += dy^T x (kernels/gemm.hpp's linear_backward, its order).
template <class T>
void linear_rows_backward(T* dx, bool accumulate_dx, T* dw, const T* dy, const T* x, const T* w,
                          std::int64_t N, std::int64_t in, std::int64_t out);
// C (m, n) = alpha op(A) op(B) + beta C at the given row strides
// (kernels/gemm.hpp's gemm).
template <class T>
void gemm_strided(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                  T alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C,
                  std::int64_t ldc);
// y (rows, n) dense = RMSNorm of x's first n columns (x at row stride ldx);
// rstd (rows) kept (kernels/rmsnorm.hpp's rmsnorm_forward).
template <class T>
void rmsnorm_rows(T* y, T* rstd, const T* x, std::int64_t ldx, const T* w, std::int64_t rows,
                  std::int64_t n, double eps);
// dx overwritten, dw added to, each at its row stride.
template <class T>
void rmsnorm_rows_backward(T* dx, std::int64_t ldx, T* dw, const T* dy, std::int64_t ldy,
                           const T* x, std::int64_t ldxx, const T* w, const T* rstd,
                           std::int64_t rows, std::int64_t n);
// The MLA's interleaved RoPE in place (kernels/rope.hpp's rope_apply and
// rope_apply_at): B L tokens of H heads at positions pos0 .. or positions.
template <class T>
void rope_rows(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
               std::int64_t ld_head, std::int64_t pos0, const RopeTable& table, bool inverse);
template <class T>
void rope_rows_at(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                  std::int64_t ld_head, const std::int64_t* positions, const RopeTable& table,
                  bool inverse);

// The indexer's half-split RoPE (kernels/dsa_indexer.hpp's
// rope_halves_apply): L tokens of H heads, in place.
template <class T>
void rope_halves(T* x, std::int64_t L, std::int64_t H, std::int64_t ld_token, std::int64_t ld_head,
                 std::int64_t pos0, const std::int64_t* positions, const RopeTable& table,
                 bool inverse);
// LayerNorm with weight and bias (k_norm): y, mean, rstd (rows) written.
template <class T>
void layernorm(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b, std::int64_t rows,
               std::int64_t n, double eps);
// dx overwritten; dw, db added to.
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, std::int64_t rows, std::int64_t n);
// idx (B, Sq, topk): each query row's selection (dsa_index_topk's rule).
template <class T>
void index_topk(const IndexerShape& s, std::int32_t* idx, const T* q, const T* k, const T* w);
// idx (B, Sq, Sk): every causal key of each row (dsa_all_causal).
void index_all_causal(const IndexerShape& s, std::int32_t* idx);
// The indexer's KL over K slots a row and its gradient (dsa_indexer_kl).
template <class T>
void indexer_kl(const IndexerShape& s, std::int64_t K, const std::int32_t* idx, const T* p,
                const T* q, const T* k, const T* w, double* loss, T* dq, T* dk, T* dw);
// What a bf16 run stores of a value it has just made (mla/ops.hpp's rule:
// a fresh product, RMSNorm's y and RoPE's rotation are rounded to bf16):
// under a bf16 scope (T = float) every element of the (rows, cols) dense
// block at p is replaced by its bf16 value, in place; in fp32 and float64
// nothing changes. The DSA rows run their ops at fp32 (above), so the values
// a form scores with or sends are rounded by this, once, where they are made
// (mla/dsa_rows.hpp, dsa_own_rows and dsa_index_values_as_stored): a bf16
// value crosses the bf16 wire unchanged, so every rank and form then reads
// the same bits. Not counted (the dense ops' roundings are not either).
template <class T>
void round_as_stored(T* p, std::int64_t rows, std::int64_t cols);
// DeepSeek's fp8 kv-cache simulation on the latent c (rows, n), in place:
// each act_quant block of kActQuantBlock values rounded through fp8 e4m3
// with V3.2's ue8m0 (power-of-two) scales (kernels/fp8_e4m3.hpp's
// fp8_round_trip), through the kernel table's kv_fp8_round_trip row,
// counted as elementwise bytes (c read and written); dsa_work has no term
// for it (an inference-only simulation, mla/dsa_rows.hpp's dsa_own_rows).
template <class T>
void kv_fp8_round_trip(T* c, std::int64_t rows, std::int64_t n);
// The filled slots of the rows of s when each row keeps at most K of its
// causal keys (within its document when s.doc_start is set): what the
// top-k's (K >= Sk: every causal pair) and the KL's counts are per slot of.
double indexer_slots(const AttnShape& s, std::int64_t K);

}  // namespace laga::ops
