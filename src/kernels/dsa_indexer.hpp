// DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2-Exp,
// inference/model.py, class Indexer, after the 2025-11-17 commit "fix
// indexer rope"; docs/forms.md, "DeepSeek Sparse Attention (DSA)"): its
// pieces that are not GEMMs, forward and backward, on raw pointers.
//
// What the indexer computes for query token i and key token j <= i (the
// block, mla/dsa_block.cpp, makes q, k and w with linears):
//   q_i,h = rope_halves(wq_b qr_i)[h]            (H_I heads of width d_I)
//   k_j   = rope_halves(LayerNorm(wk x_j))        (one head of width d_I)
//   w_i,h = (weights_proj x_i)_h  H_I^-1/2  d_I^-1/2
//   I_ij  = sum_h w_i,h ReLU(q_i,h . k_j)
// and query i attends the index_topk keys of highest I_ij among its causal
// keys (all of them while it has no more than index_topk).
//
// DeepSeek's code also applies rotate_activation (a Hadamard transform
// scaled by d_I^-1/2) to q and k and quantizes both to fp8 in blocks of
// 128 (act_quant) before fp8_index. The Hadamard matrix scaled so is
// orthogonal, so q.k is unchanged by it in exact arithmetic: in the run's
// dtype, without fp8, it is the identity and laga leaves it out. The fp8
// path (IndexScores::fp8, the config's index_fp8; where the rotation spreads
// outliers before quantization and so does change the result) is in
// kernels/dsa_indexer_fp8.hpp: it decides the selection only. The KL loss
// (dsa_indexer_kl) always reads the run-dtype scores, fp8 on or off: the
// rounding of the fp8 path is piecewise constant (zero gradient almost
// everywhere), so the KL and its gradient are those of the unquantized
// scores over the fp8 selection (straight-through; docs/forms.md, "The fp8
// indexer").
//
// rope_halves is the indexer's RoPE, NOT the MLA's interleaved one
// (kernels/rope.hpp): DeepSeek's apply_rotary_emb(x, freqs_cis, False)
// pairs dim e with dim e + dr/2 of the first dr = qk_rope_head_dim dims,
//   y_e = x_e cos(pos f_e) - x_{e+dr/2} sin(pos f_e)
//   y_{e+dr/2} = x_e sin(pos f_e) + x_{e+dr/2} cos(pos f_e),  e < dr/2,
// with the MLA's frequencies f_e (YaRN included: the same freqs_cis).
//
// The tie rule of the top-k (the same on every rank and form, since it reads
// only the scores and the key positions): a higher score wins; of equal
// scores the lower key position wins. torch.topk leaves ties unspecified.
// The selection is written sorted by key position, -1 in the unused slots.
#pragma once

#include <cstdint>

#include "kernels/attention.hpp"
#include "kernels/rope.hpp"

namespace laga {

// The indexer's extents over AttnShape's masks: attn.B, Sq, Sk (query row i
// is token i + Sk - Sq, as in kernels/attention.hpp), attn.Hq = H_I (index
// heads), attn.dqk = d_I, attn.causal (true) and attn.doc_start (packed
// documents: a query selects only within its document); topk = index_topk.
// How dsa_index_topk and dsa_index_scores score a pair: in the run's dtype
// (the default), or DeepSeek's fp8 path (index_fp8: Hadamard rotation,
// act_quant e4m3 with ue8m0 block scales, fp8_index; d_I must be 128).
enum class IndexScores { run_dtype, fp8 };
const char* to_string(IndexScores s);

struct IndexerShape {
  AttnShape attn{};
  std::int64_t topk = 1;
  IndexScores scores = IndexScores::run_dtype;
  void validate() const;  // throws laga::Error naming the bad extent
};

// The indexer's RoPE on the first table.dim() dims of each head, in place:
// L tokens of H heads, element e of (token l, head h) at
// x + l * ld_token + h * ld_head + e, token l at positions[l] (or pos0 + l
// when positions is null). inverse: the backward (the transposed rotation).
template <class T>
void rope_halves_apply(T* x, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                       std::int64_t ld_head, std::int64_t pos0, const std::int64_t* positions,
                       const RopeTable& table, bool inverse);

// LayerNorm with weight and bias over rows of n (DeepSeek's k_norm, eps 1e-6
// there): y = (x - mean) rstd w + b. mean, rstd (rows) saved for backward.
template <class T>
void layernorm_forward(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b,
                       std::int64_t rows, std::int64_t n, double eps);
// dx overwritten; dw, db added to.
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, std::int64_t rows, std::int64_t n);

// idx (B, Sq, topk) int32: each query row's selection (rule above), from
// q (B, Sq, H_I, d_I), k (B, Sk, d_I), w (B, Sq, H_I).
template <class T>
void dsa_index_topk(const IndexerShape& s, std::int32_t* idx, const T* q, const T* k, const T* w);

// The indexer's scores I_ij (as s.scores says) of every causal pair (B, Sq, Sk), -inf
// elsewhere: for tests and the DeepSeek harness (it is an Sq x Sk array;
// the top-k above never forms it).
template <class T>
void dsa_index_scores(const IndexerShape& s, T* scores, const T* q, const T* k, const T* w);

// The indexer's KL loss over a set of K slots per query row, on the run-dtype
// scores whatever s.scores says (see the fp8 note above) (DeepSeek-V3.2's
// report §2.1: the dense warm-up passes every causal key, the sparse stage
// the selected ones) and its gradient:
//   L = sum_i sum_r p_ir (log p_ir - log softmax_r(I_i,idx[i,r]))
// with p (B, Sq, K) the target (the main attention's head-summed,
// L1-normalised distribution over the same slots, held constant), empty
// slots (-1) left out. loss (B Sq): each row's term, in double.
// dq (B, Sq, H_I, d_I), dk (B, Sk, d_I), dw (B, Sq, H_I) overwritten with
// dL/d of each (ReLU's derivative at 0 taken as 0, as torch's).
template <class T>
void dsa_indexer_kl(const IndexerShape& s, std::int64_t K, const std::int32_t* idx, const T* p,
                    const T* q, const T* k, const T* w, double* loss, T* dq, T* dk, T* dw);

// Every causal key of each query row as a selection of K = Sk slots
// (ascending, -1 after): the dense warm-up's key set for dsa_indexer_kl and
// the main attention's dense mask in sparse form.
void dsa_all_causal(const IndexerShape& s, std::int32_t* idx);

}  // namespace laga
