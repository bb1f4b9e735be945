// The MLA block with DeepSeek Sparse Attention, single rank, explicit
// (per-head keys and values, DeepSeek's prefill): forward, the LM backward
// through the selected keys, and the lightning indexer's KL loss and its
// gradient (docs/forms.md, "DeepSeek Sparse Attention (DSA)").
//
// Per batch row of S tokens (token s at position s):
//   qr = q_norm(x wq_a^T), q = rope(qr wq_b^T)           (MLA, interleaved RoPE)
//   c = kv_norm((x wkv_a^T)[:C]), k_pe = rope((x wkv_a^T)[C:])
//   [k_nope | v] = c wkv_b^T, k = [k_nope | k_pe]
//   the indexer (kernels/dsa_indexer.hpp) on (x, qr): its q, k, w and the
//   causal top-k idx
//   o = attention of q over the keys idx selects (sparse stage) or over
//       every causal key (dense warm-up), out = o wo^T
// Training semantics (DeepSeek-V3.2's report, §2.1):
//   - the LM gradient (dout) flows through the attended keys into x and
//     the MLA weights; none reaches the indexer (the top-k has no gradient);
//   - the indexer is trained by its KL loss only: the target is the main
//     attention's distribution summed over heads and L1-normalised, held
//     constant; the loss is over every causal key in the dense warm-up
//     (DsaStage::dense_warmup) and over the selected keys in the sparse
//     stage (DsaStage::sparse); the indexer's input (x, qr) is detached, so
//     the KL gradient reaches the indexer's weights and nothing else.
// Precision: T throughout (fp32 or fp64); under bf16 (T = float) the sparse
// attention and its KL target run bf16 mixed precision, the other ops fp32
// (docs/forms.md, "DSA in bf16"); DeepSeek's fp8 indexer and kv round trip
// by the config's index_fp8 / kv_fp8_round_trip (docs/forms.md, "The fp8
// indexer"; mla/dsa_rows.hpp).
//
// The block asks the op layer for every computation (mla/ops_dsa.hpp,
// mla/ops_sparse.hpp; it includes no kernel header), so its ops are counted
// (OpCounts); its operands are pool tensors (activations; the selection an
// int32 tensor), so it has a count-only run (MemoryPool::set_count_only:
// x is not read, dout only says whether backward runs; the result's
// vectors come back empty). The forms do not run it (a DSA config is
// refused by the tool's ModelOptions::load); mla/dsa_cp.hpp runs it
// query-local over P ranks, mla/dsa_explicit.hpp and dsa_laga.hpp
// head-sharded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "mla/config.hpp"
#include "mla/params.hpp"

namespace laga {

enum class DsaStage { dense_warmup, sparse };
const char* to_string(DsaStage s);  // "dense_warmup", "sparse"
// Where the main attention runs: per head (DeepSeek's prefill, keys
// [k_nope | k_pe] and values up-projected per head) or in latent space (the
// absorbed form: q_nope W_UK against [c | k_pe], values c, o_lat W_UV^T --
// what a rank runs after all-gathering the latent, the field's context-
// parallel choice). The same numbers in exact arithmetic.
enum class DsaAttend { per_head, latent };
const char* to_string(DsaAttend a);  // "per_head", "latent"

// The indexer's weights under DeepSeek's names (model.py, class Indexer):
//   indexer.wq_b.weight          (index_n_heads * index_head_dim, q_lora_rank)
//   indexer.wk.weight            (index_head_dim, dim)
//   indexer.k_norm.weight/.bias  (index_head_dim)
//   indexer.weights_proj.weight  (index_n_heads, dim)
template <class T>
struct DsaIndexerParams {
  std::vector<T> wq_b, wk, k_norm_weight, k_norm_bias, weights_proj;
  static DsaIndexerParams zeros(const MlaConfig& cfg);
  // (name, tensor) in the order above.
  std::vector<std::pair<std::string, std::vector<T>*>> named();
};

// The indexer's projections of N tokens (DeepSeek's Indexer.forward up to
// its fp8), before RoPE, which the caller applies from its tokens' positions:
// q (N, HI dI) = qr wq_b^T; k (N, dI) = LayerNorm(k_pre), k_pre = x wk^T,
// with its mean and rstd kept for backward; w (N, HI) = x weights_proj^T
// HI^-1/2 dI^-1/2 (the q_scale of fp8 is 1 without quantization). The
// single-rank block and the latent gather both call it.
// Pool tensors (activations), made in this order.
template <class T>
struct DsaIndexerProjections {
  Tensor<T> q, k_pre, k, k_mean, k_rstd, w;
  double w_scale = 0;  // HI^-1/2 dI^-1/2: w's backward scales by it too
};
template <class T>
DsaIndexerProjections<T> dsa_indexer_project(const MlaConfig& cfg, const DsaIndexerParams<T>& iw,
                                             const T* x, const T* qr, std::int64_t N);
// Its backward, the one place the indexer's weights' gradients are made
// from the KL's (the indexer's input detached: no dx, no dqr): dw (N, HI)
// the gradient of the scaled weights (scaled here by w_scale, as forward
// did; dw is scaled in place), dq (N, HI dI) and dk (N, dI) already rotated
// back (each caller from its own tokens' positions), k_pre, k_mean, k_rstd
// forward's LayerNorm of k (DsaIndexerProjections' fields). One (N, dI)
// pool tensor lives while it runs (k_pre's gradient).
template <class T>
DsaIndexerParams<T> dsa_indexer_project_backward(const MlaConfig& cfg,
                                                 const DsaIndexerParams<T>& iw, const T* x,
                                                 const T* qr, double w_scale, const T* k_pre,
                                                 const T* k_mean, const T* k_rstd, T* dw,
                                                 const T* dq, const T* dk, std::int64_t N);

template <class T>
struct DsaBlockResult {
  std::vector<T> out;                 // (B, S, D)
  std::vector<std::int32_t> idx;      // (B, S, index_topk): the selection, ascending, -1 unused
  std::vector<T> dx;                  // (B, S, D): the LM gradient (empty without dout)
  MlaParams<T> grads;                 // the LM gradient of the MLA weights
  DsaIndexerParams<T> indexer_grads;  // the KL loss's gradient of the indexer's weights
  double kl_loss = 0;                 // the indexer's KL, summed over every query row
};

// x, dout (B, S, D); dout null: forward, the selection and the KL loss only
// (no gradients). Throws laga::Error when cfg has no DSA keys.
template <class T>
DsaBlockResult<T> dsa_block(const MlaConfig& cfg, const MlaParams<T>& w,
                            const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                            std::int64_t B, std::int64_t S, DsaStage stage,
                            DsaAttend attend = DsaAttend::per_head);

}  // namespace laga
