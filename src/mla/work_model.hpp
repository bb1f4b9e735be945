// The attention work of one rank, in closed form (docs/compare.md,
// "Attention work"): what a kernel that skips masked blocks must do at least.
//
// Every form attends over the whole sequence for the rank's H_r heads (after
// the seq->head all-to-all), so a rank's work is H_r times the (query, key)
// pairs of the causal mask, summed over the batch:
//   pairs = sum_rows sum_docs len (len + 1) / 2   (one document per row: S (S + 1) / 2)
//   FLOPs = 2 pairs H_r (d_qk + d_v)              (q.k and p.v, forward)
// with (d_qk, d_v) = (dn + dr, dv) for explicit, laga and laga2d and
// (C + dr, C) for absorbed (attention in latent space). Packing therefore
// scales every rank's work by the same factor; the imbalance between ranks
// comes from uneven head shards alone.
//
// laga2d attends its head group's H_g heads for its query ranges only
// (HeadContextGrid): pairs = sum over its query tokens t of the keys t sees,
// t - start(t) + 1, where start(t) is t's document's first token (0 unpacked).
// Its mirrored chunks balance this unpacked; packed, the balance depends on
// where the documents fall.
#pragma once

#include "mla/block.hpp"

namespace laga {

struct AttentionWork {
  double pairs = 0;  // (query, key) pairs per head, summed over the batch
  double flops = 0;  // forward FLOPs of q.k and p.v over the rank's heads
};

// `docs` may be null (one document per row).
AttentionWork attention_work(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                             int rank, const Documents* docs);

// max / min over ranks of the attention FLOPs (1 when every rank does the
// same; +inf when some rank does none while another does some).
double attention_balance(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                         const Documents* docs);

}  // namespace laga
