// The pieces of a DSA rank's own rows that the single-rank block
// (mla/dsa_block.hpp) and every DSA form (dsa_cp.hpp, dsa_explicit.hpp,
// dsa_laga.hpp) compute alike, each written once: the forms' input checks;
// the MLA's projections of the rows (q, the latent c, k_pe, RoPE by
// position) and their backward; the per-head K/V from the latent and the
// absorbed maps through W_UK and W_UV, each with its backward; the
// indexer's projections of the rows and their backward; k_I's gradient
// padded to the whole sequence and reduce-scattered to its owners; and the
// wire each of the forms' collectives moves its elements on (bf16 under
// --dtype bf16, or 4 bytes). All through the op layer (mla/ops_dsa.hpp).
// mla/dsa_model.cpp's dsa_memory mirrors each one's allocations once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "mla/config.hpp"
#include "mla/dsa_block.hpp"
#include "mla/layout.hpp"
#include "mla/ops.hpp"
#include "mla/ops_dsa.hpp"
#include "mla/params.hpp"

namespace laga {

// What every DSA form refuses before it runs, each message led by the
// form's function name (`fn`): a config or layout that fails validate(), a
// config without the index keys, zigzag shards, a layout for another number
// of ranks than the communicator's, and, for a head-sharded form
// (head_sharded), a layout whose ranks hold other than n_heads heads.
void check_dsa_form_inputs(const char* fn, const MlaConfig& cfg, const SpLayout& lay,
                           const Communicator& comm, bool head_sharded);

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

// The values the indexer scores with, made what a bf16 run stores
// (ops::round_as_stored; docs/forms.md, "DSA in bf16"): q_I (N, H_I, d_I)
// and k_I (N, d_I) after their RoPE, w (N, H_I) after its scale -- by the
// block and every form, right after dsa_indexer_project and the RoPE, and by
// laga_recompute on the q_I it projects for every row. So the scores read
// the same values wherever they are computed: a rank's own, or a bf16
// collective's delivery of another's (a bf16 value crosses unchanged).
// A null pointer is skipped. fp32 and float64: nothing changes.
template <class T>
void dsa_index_values_as_stored(const MlaConfig& cfg, std::int64_t N, T* qI, T* kI, T* w);

// The MLA's projections of the N = B L own rows (DeepSeek's MLA.forward):
//   qa = x wq_a^T, qr = q_norm(qa), q = rope(qr wq_b^T) (only when with_q)
//   kv = x wkv_a^T, c = kv_norm(kv[:, :C]), k_pe = rope(kv[:, C:])
// qr, the query latent, is what a bf16 run stores (ops::round_as_stored):
// the MLA's q and the indexer's q_I are projected from it, and
// laga_recompute gathers it to project every row's q_I again, so under bf16
// every form projects from the same bf16 values (fp32, float64: unchanged).
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
// The per-head keys and values of the N rows (DeepSeek's prefill, the
// block's and explicit's): [k_nope | v] = c wkv_b^T per head (kv_b, made and
// freed here), k (N, H, dqk) = [k_nope | k_pe] with k_pe (N, dr) every
// head's, v (N, H, dv); in this allocation order (dsa_memory's).
template <class T>
struct DsaHeadKv {
  Tensor<T> k, v;
};
template <class T>
DsaHeadKv<T> dsa_head_kv(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& c,
                         const Tensor<T>& k_pe, std::int64_t N);
// The absorbed attention's per-head maps through wkv_b (DeepSeek's
// "absorb" path: the block's latent attend and latent_gather attend in
// latent space, one key/value head [c | k_pe] of width W = C + dr, values
// c). wkv_b's head h is W_UK[h] (dn, C), then W_UV[h] (dv, C).
//   dsa_absorb_q:   qa (N, H, W): qa[:, h, :C] = q_nope[h] W_UK[h],
//                   qa[:, h, C:] = q_pe[h]  (q (N, H, dqk))
//   dsa_latent_out: o (N, H, dv): o[h] = o_lat[h] W_UV[h]^T  (o_lat (N, H, C))
// and their backward: do_lat[h] = dO[h] W_UV[h] and dq[h] = [dqa[h, :C]
// W_UK[h]^T | dqa[h, C:]] are overwritten; W_UV[h]'s and W_UK[h]'s
// gradients in grads.wkv_b are added to (dO[h]^T o_lat[h], q_nope[h]^T
// dqa[h, :C]). The caller allocates every tensor (dsa_memory follows it).
template <class T>
void dsa_absorb_q(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& q, Tensor<T>& qa,
                  std::int64_t N);
template <class T>
void dsa_latent_out(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& o_lat,
                    Tensor<T>& o, std::int64_t N);
template <class T>
void dsa_latent_out_backward(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& dO,
                             const Tensor<T>& o_lat, Tensor<T>& do_lat, MlaParams<T>& grads,
                             std::int64_t N);
template <class T>
void dsa_absorb_q_backward(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& q,
                           const Tensor<T>& dqa, Tensor<T>& dq, MlaParams<T>& grads,
                           std::int64_t N);
// Its backward: dk (N, H, dqk) and dv (N, H, dv) consumed (freed once
// read, so they are gone before the wkv_b backward runs): [dk_nope | dv]
// per head into grads.wkv_b (added to) and dc (N, C) (overwritten), the
// heads' k_pe gradients summed into dkv's last dr columns (k_pe is every
// head's; added to). A (N, H, dn + dv) pool tensor lives while it runs.
template <class T>
void dsa_head_kv_backward(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& c,
                          Tensor<T>& dk, Tensor<T>& dv, Tensor<T>& dkv, Tensor<T>& dc,
                          MlaParams<T>& grads, std::int64_t N);
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

// The indexer's projections of the N own rows as every scorer reads them
// (DeepSeek's Indexer.forward up to the scores): dsa_indexer_project, then
// q_I and k_I rotated by the rows' positions (the indexer's half-split
// RoPE) and q_I, k_I, w made what the run stores (dsa_index_values_as_stored).
template <class T>
DsaIndexerProjections<T> dsa_indexer_rows(const MlaConfig& cfg, const DsaIndexerParams<T>& iw,
                                          const T* x, const T* qr, const DsaRowPositions& at,
                                          const RopeTable& table, std::int64_t N);
// The indexer's weights' gradients for the N own rows, from the KL's (the
// indexer's input detached: no dx, no dqr): dq (N, HI dI) and dk (N, dI)
// rotated back by the rows' positions, then dsa_indexer_project_backward
// with ip's LayerNorm of k; frees dq, dk, dw and ip's k_pre, k_mean, k_rstd,
// in that order (dsa_memory's indexer_project_backward). The block and every
// form end their indexer this way.
template <class T>
DsaIndexerParams<T> dsa_indexer_rows_backward(const MlaConfig& cfg, const DsaIndexerParams<T>& iw,
                                              const T* x, const T* qr, DsaIndexerProjections<T>& ip,
                                              const DsaRowPositions& at, const RopeTable& table,
                                              Tensor<T>& dq, Tensor<T>& dk, Tensor<T>& dw,
                                              std::int64_t N);

// What the DSA forms' collectives move (docs/forms.md, "DSA in bf16", "On
// the wire"; dsa_predict_comm, mla/dsa_model.hpp, is its closed form).
// The activations -- the latent, the index keys k_I and weights w, q, k,
// v, the query latent, the outputs -- and their gradients move as the
// dense forms' do: in T, or as bf16 under --dtype bf16 (mla/wire.hpp), by
// exchange.hpp's collectives (dsa_index_key_grads_home below too) or, on
// the latent gather's rank-major blocks, by the two below. The top-k
// indices (int32) and the KL target (the attention's head-summed
// probabilities, an fp32 statistic, each rank's part a partial sum over
// its heads) move at 4 bytes under bf16 (dsa_gather_indices and
// dsa_reduce_scatter_seq_fp32 below), so that neither an index nor the
// target depends on P or the form.
//
// Communicator::all_gather_v / reduce_scatter_v of rank-major blocks
// (displs dense), bf16 on the wire under bf16 (wire::all_gather_v,
// wire::reduce_scatter_v), in T otherwise.
template <class T>
void dsa_all_gather_v(Communicator& comm, const T* send, std::int64_t send_count, T* recv,
                      const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                      const std::string& label);
template <class T>
void dsa_reduce_scatter_v(Communicator& comm, const T* send, const std::int64_t* counts,
                          const std::int64_t* displs, T* recv, const std::string& label);
// reduce_scatter_seq (mla/exchange.hpp) in T whatever the run's precision:
// fp32 under bf16 (and in an fp32 or float64 run what it moves anyway).
template <class T>
void dsa_reduce_scatter_seq_fp32(Communicator& comm, const SpLayout& lay, const T* src, T* dst,
                                 std::int64_t W, const std::string& label);

// The top-k of every rank's rows, own (B, L_r, K) int32, all-gathered into
// every row's (B, S, K) ("topk_ag": laga_indices and explicit): as 4-byte
// words whatever the run's precision (DType::f32 on the wire, a gather
// copies and never adds, so every bit arrives as it left: an index is
// exact at any S; dsa_predict_comm prices it at 4 bytes). Contiguous
// shards (the DSA forms refuse zigzag).
// Pool tensors: the rank-major blocks while it runs, the result.
TensorI32 dsa_gather_indices(Communicator& comm, const SpLayout& lay, const TensorI32& own,
                             std::int64_t K);

// k_I's gradient over the keys a rank read, (B, Sk, d_I) (the prefix of
// the sequence before its last row), padded with zeros to (B, S, d_I) and
// reduce-scattered to the keys' owners ("index_k_ag", the gather's label):
// the rank's own (B, L_r, d_I).
// Pool tensors: the padded (B, S, d_I) while it runs, the result.
template <class T>
Tensor<T> dsa_index_key_grads_home(Communicator& comm, const SpLayout& lay, const T* dk_prefix,
                                   std::int64_t Sk, std::int64_t dI);

}  // namespace laga
