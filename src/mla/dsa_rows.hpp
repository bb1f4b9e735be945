// The pieces of a DSA rank's own rows that the single-rank block
// (mla/dsa_block.hpp) and every DSA form (dsa_cp.hpp, dsa_explicit.hpp,
// dsa_laga.hpp) compute alike, each written once: the MLA's projections of
// the rows (q, the latent c, k_pe, RoPE by position) and their backward,
// the indexer's RoPE of the rows, and k_I's gradient padded to the whole
// sequence and reduce-scattered to its owners. All through the op layer
// (mla/ops_dsa.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "mla/config.hpp"
#include "mla/layout.hpp"
#include "mla/ops.hpp"
#include "mla/ops_dsa.hpp"
#include "mla/params.hpp"

namespace laga {

// Where a caller's own rows sit: B batch rows of L tokens, token l of a row
// at position pos0 + l, or at positions[b L + l] when positions is set
// (packed documents: each token's position in its document).
struct DsaRowPositions {
  std::int64_t B = 0, L = 0, pos0 = 0;
  const std::int64_t* positions = nullptr;
};

// The MLA's interleaved RoPE of the rows in place: `heads` heads at
// ld_head, tokens at ld_token.
template <class T>
void dsa_rope_rows(T* p, const DsaRowPositions& at, std::int64_t heads, std::int64_t ld_token,
                   std::int64_t ld_head, const RopeTable& table, bool inverse);
// The indexer's half-split RoPE of the rows in place (the first dr of each
// head of width head_dim).
template <class T>
void dsa_rope_index_rows(T* p, const DsaRowPositions& at, std::int64_t heads, std::int64_t ld_token,
                         std::int64_t head_dim, const RopeTable& table, bool inverse);

// How the indexer scores (cfg.index_fp8: DeepSeek's fp8 path, else the
// run's dtype): every form sets its IndexerShape's scores from this.
inline IndexScores index_scores_of(const MlaConfig& cfg) {
  return cfg.index_fp8 ? IndexScores::fp8 : IndexScores::run_dtype;
}

// The MLA's projections of the N = B L own rows (DeepSeek's MLA.forward):
//   qa = x wq_a^T, qr = q_norm(qa), q = rope(qr wq_b^T) (only when with_q)
//   kv = x wkv_a^T, c = kv_norm(kv[:, :C]), k_pe = rope(kv[:, C:])
// With cfg.kv_fp8_round_trip, c is DeepSeek's fp8 kv-cache simulation of
// itself right after kv_norm (ops::kv_fp8_round_trip; docs/forms.md, "The
// fp8 indexer"), here for every form. Inference only: with
// backward_to_come (the caller has a dout) it throws, the same on every rank.
// Pool tensors (activations), made in the order below; the caller frees
// (reset()) each once nothing reads it again: backward reads qa, qr,
// rstd_q, kv and rstd_kv (mla/dsa_model.cpp's dsa_memory follows them).
template <class T>
struct DsaOwnRows {
  Tensor<T> qa, qr, rstd_q;  // (N, rq), (N, rq), (N)
  Tensor<T> q;               // (N, H, dqk), its rope part rotated; undefined without with_q
  Tensor<T> kv, c, rstd_kv;  // (N, C + dr), (N, C), (N)
  Tensor<T> k_pe;            // (N, dr), rotated
};
template <class T>
DsaOwnRows<T> dsa_own_rows(const MlaConfig& cfg, const MlaParams<T>& w, const T* x,
                           const DsaRowPositions& at, const RopeTable& table, bool with_q,
                           bool backward_to_come);
// Their backward into x: dkv (N, C + dr) holds k_pe's gradient in its last
// dr columns (rotated back here; its first C are overwritten); dc (N, C) is
// c's gradient; dq (N, H, dqk) q's gradient, its rope part rotated back
// here, or null when the caller made the query latent's gradient itself
// (then dqr holds it; otherwise dqr is made here, (N, rq), and a (N, rq)
// transient beside it). grads' kv_norm, wkv_a,
// q_norm, wq_a (and wq_b with dq) are added to; dx (N, D) is overwritten.
template <class T>
void dsa_own_rows_backward(const MlaConfig& cfg, const MlaParams<T>& w, const T* x,
                           const DsaOwnRows<T>& f, const DsaRowPositions& at,
                           const RopeTable& table, T* dkv, const T* dc, T* dq, Tensor<T>& dqr,
                           MlaParams<T>& grads, T* dx);

// k_I's gradient over the keys a rank read, (B, Sk, d_I) (the prefix of
// the sequence before its last row), padded with zeros to (B, S, d_I) and
// reduce-scattered to the keys' owners ("index_k_ag", the gather's label):
// the rank's own (B, L_r, d_I).
// Pool tensors: the padded (B, S, d_I) while it runs, the result.
template <class T>
Tensor<T> dsa_index_key_grads_home(Communicator& comm, const SpLayout& lay, const T* dk_prefix,
                                   std::int64_t Sk, std::int64_t dI);

}  // namespace laga
