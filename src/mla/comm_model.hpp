// Closed-form communication of one MLA block: the bytes rank r sends and
// receives, per (phase, label), computed from the config and the layout
// alone. Written apart from the ledger code on purpose: tests require the two
// to agree byte for byte (docs/accounting.md derives every term).
//
// With e the element size, L_j / H_j rank j's tokens / heads, W = C + dr:
//   forward   q_a2a      sum_{j!=r} B L_r H_j dqk e       (seq -> head)
//             q_latent_ag (P-1) B L_r rq e                laga --q-latent, in
//                                                         place of q_a2a
//             k_a2a      sum_{j!=r} B L_r H_j dqk e       explicit
//             v_a2a      sum_{j!=r} B L_r H_j dv e        explicit
//             latent_ag  (P-1) B L_r W e                  laga, absorbed
//             out_a2a    sum_{j!=r} B L_j H_r dv e        (head -> seq)
//             k_ag, v_ag (P-1) B L_r H dqk e, (P-1) B L_r H dv e   allgather_kv
//             kv_ring    (sum_j B L_j - B L_{r+1}) H (dqk+dv) e    ring_kv, P-1 calls
//             latent_ring (sum_j B L_j - B L_{r+1}) W e           ring_latent, P-1 calls
//   backward  the same labels, each collective's adjoint: an all-to-all's is
//             the inverse all-to-all (send and receive swap), the
//             all-gather's a reduce-scatter, sum_{j!=r} B L_j W e; a ring
//             form's pass again (recomputation) and its gradients' pass
//             home, dkv_ring / dlatent_ring, sum_j B L_j width e in P calls
//   grad_sync grad_allreduce ((n - c_r) + (P-1) c_r) e, n = parameter count
//             (from DeepSeek's shapes, written out in comm_model.cpp),
//             c_r = all_reduce_chunk(n, P, r) (reduce-scatter + all-gather);
//             no call at P 1 (one rank's gradients are already the sum)
// laga2d (HeadContextGrid): q_a2a and out_a2a move each (token, head)
// element to the rank that attends it, sum_{j!=r} B |shard_r ∩ queries_j|
// H_g(j) d e sent (received: the same with r and j swapped); latent_ag as laga.
// laga2d --q-latent with Pc > 1: q_latent_a2a sends each peer the query
// latent of its tokens that the peer attends, sum_{j!=r} B |shard_r ∩
// queries_j| rq e (every head group of a context group gets a copy);
// backward the reverse, the copies' gradients summed by the tokens' owner.
// At Pc = 1 it is laga's q_latent_ag.
// The invariant mode (docs/invariance.md; `invariant` below) adds, backward,
// the canonical sums' collectives (mla/canonical_sum.hpp, their closed
// forms there), in the tensors' own element size t (they do not narrow):
//   every form   wo_grad, in_proj_grad, kv_norm_grad (q_norm_grad and, with
//                per-head queries, wq_b_grad when rq > 0; wg_grad with Kimi's
//                gate): each weight's gradient a canonical token sum,
//                (P-1) p_r n t sent, (p - p_r) n t received (p_r: rank r's
//                pieces of the sequence, p every rank's; n: the weight's size)
//   explicit     wkv_b_grad, the same for wkv_b (its up-projection is token-sharded)
//   allgather_kv wkv_b_grad as explicit; in place of k_ag's and v_ag's
//                reduce-scatters, q_chunk_ag and do_chunk_ag (every token's q
//                and dO all-gathered, H dqk and H dv wide) and kv_chunk_sum,
//                the canonical sum over the query chunks of every token's
//                [dK | dV] (H (dqk + dv) wide), p_r (B S - B L_r) n t sent,
//                (p - p_r) B L_r n t received (p_r: rank r's pieces of the
//                chunk index)
//   latent_ag    backward, in place of the reduce-scatter: the canonical one
//                over the heads' columns (k_h a head: laga dn + dv + dr),
//                p_r (B S - B L_r) W t sent, (p - p_r) B L_r W t received
//                (p_r: rank r's pieces of the heads' columns)
// A form declares its own in its `collectives` (CommTerms::token_sum,
// latent_gather's head_columns); the shared ones are added here.
// Each (phase, label) is one collective call per block step (calls = 1),
// but a ring pass: one call per shift (ring_pass_bytes).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/precision.hpp"
#include "mla/block.hpp"
#include "mla/exchange.hpp"

namespace laga {

struct PredictedBytes {
  std::int64_t sent = 0, received = 0;
  std::int64_t calls = 0;  // collective calls under the label, one per add() below
  CollectiveKind kind = CollectiveKind::all_to_all;  // which collective the label is
};
using CommPrediction = std::map<std::pair<Phase, std::string>, PredictedBytes>;

// Throws laga::Error for a variant the block refuses (check_variant). The
// form's own collectives are its registry row's closed form
// (FormSpec::collectives, in its file); the gradient all-reduce, the same
// for every form, is here.
// invariant: the run's RunSpec::invariant (docs/invariance.md); laga::Error
// for a form whose row does not offer the mode.
CommPrediction predict_comm(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                            int rank, std::int64_t elem_bytes, bool backward, bool grad_sync,
                            bool invariant = false);

// An element's bytes on the wire: the form's collectives' (activations and
// their gradients) and the gradient all-reduce's.
struct WireElementBytes {
  std::int64_t activations = 4, gradients = 4;
  // The tensors' own: what a collective that does not narrow moves (the
  // invariant mode's canonical sums: mla/canonical_sum.hpp).
  std::int64_t tensors = 4;
};
// What a run at `p` moves, its tensors being of tensor_bytes elements
// (mla/wire.hpp): under bf16 the activations at 2 and the gradient
// all-reduce at fp32's 4, or at 2 with --grad-reduce bf16; otherwise both
// at tensor_bytes.
WireElementBytes wire_element_bytes(Precision p, GradReduce g, std::int64_t tensor_bytes);
// predict_comm with the two sizes apart.
CommPrediction predict_comm(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                            int rank, WireElementBytes e, bool backward, bool grad_sync,
                            bool invariant = false);

// The block's parameters' elements, from DeepSeek-V3's shapes written out
// here rather than taken from mla_param_shapes (which also allocates and
// reduces the gradients), so that the terms read from it check that code.
struct WeightElements {
  explicit WeightElements(const MlaConfig& cfg);
  std::int64_t in_proj = 0;  // [wq (H dqk, D) | wq_a (rq, D)] over wkv_a (C + dr, D)
  std::int64_t q_norm = 0;   // (rq); 0 when rq = 0
  std::int64_t wq_b = 0;     // (H dqk, rq); 0 when rq = 0
  std::int64_t kv_norm = 0;  // (C)
  std::int64_t wkv_b = 0;    // (H (dn + dv), C)
  std::int64_t wo = 0;       // (D, H dv)
  std::int64_t wg = 0;       // Kimi K3's output gate (H dv, D); 0 without it
  std::int64_t total() const { return in_proj + q_norm + wq_b + kv_norm + wkv_b + wo + wg; }
};

// The terms a form's closed form is written in, for rank r of the layout,
// with the attention placed where the form places it (FormSpec::attention):
// each returns the bytes r sends and receives in one collective of that
// shape, and add() files them under a label. A form's `collectives` adds
// its forward's calls and, when `backward`, its backward's.
struct CommTerms {
  CommTerms(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant, int rank,
            std::int64_t elem_bytes, bool backward, bool invariant = false,
            std::int64_t tensor_bytes = 4);
  const MlaConfig& cfg;
  const SpLayout& layout;
  const FormVariant variant;
  const int rank;
  const std::int64_t elem_bytes;
  const bool backward;
  // The invariant mode (RunSpec::invariant): its canonical sums move
  // tensor_bytes an element (the tensors' own type; they do not narrow).
  const bool invariant;
  const std::int64_t tensor_bytes;
  const Placement attention;  // where each rank attends
  const WeightElements weights;
  CommPrediction result;

  // seq->head of width d: every (token, head) element of r's seq shard goes
  // to each rank that attends it (per_head: for that rank's heads; else the
  // one row of width d per token, a tensor without heads), and r receives
  // its heads of the tokens it attends from their owners.
  PredictedBytes seq_to_head(std::int64_t d, bool per_head = true) const;
  PredictedBytes head_to_seq(std::int64_t d, bool per_head = true) const;  // its adjoint
  PredictedBytes all_gather(std::int64_t width) const;                     // r's rows to every peer
  PredictedBytes reduce_scatter(std::int64_t width) const;                 // its adjoint
  // Files one call under (phase, label); at P 1 with no bytes (a single
  // rank sends nothing, but the call is still made).
  void add(Phase phase, const char* label, PredictedBytes bytes, CollectiveKind kind);

  // The head-parallel forms' frame: the queries to the attention (q_a2a,
  // or with the query latent q_latent_ag, or q_latent_a2a where the ranks
  // attend part of the rows), then `kv(Phase::forward)`, the keys' and
  // values' way there, then out_a2a back; backward each one's adjoint in
  // reverse, `kv(Phase::backward)` last.
  template <class KeysValues>
  void head_parallel(KeysValues&& kv) {
    queries(Phase::forward);
    kv(Phase::forward);
    add(Phase::forward, "out_a2a", head_to_seq(cfg.v_head_dim), CollectiveKind::all_to_all);
    if (!backward) return;
    add(Phase::backward, "out_a2a", seq_to_head(cfg.v_head_dim), CollectiveKind::all_to_all);
    queries(Phase::backward);
    kv(Phase::backward);
  }
  // An all-to-all of width d to the attention's heads forward (seq_to_head),
  // back backward (head_to_seq), under `label`.
  void to_heads(Phase phase, const char* label, std::int64_t d);
  // The queries' exchange of the variant in `phase` (backward: its adjoint).
  void queries(Phase phase);
  // The latent [c_hat | k_pe] all-gathered forward, its gradient
  // reduce-scattered backward (label latent_ag). In the invariant mode the
  // backward is the canonical sum over every rank's heads' columns instead
  // (head_sum_reduce_scatter, C + dr wide): head_columns a head -- laga's
  // dn + dv + dr (its up-projection's gradient folded into the sum:
  // ops::canonical_latent_reduce_scatter), the one-argument call's; a form
  // that keeps each head's d[c_hat | k_pe] apart, C + dr.
  void latent_gather(Phase phase);
  void latent_gather(Phase phase, std::int64_t head_columns);

  // The invariant mode's canonical sums (mla/canonical_sum.hpp), filed under
  // (backward, label) in the mode when `backward`, nothing otherwise: a
  // gradient of `width` elements summed over the sequence's tokens
  // (ops::canonical_token_sum; kind all_gather) ...
  void token_sum(const char* label, std::int64_t width);
  // ... and a sum over the heads' columns (head_columns a head) of n-wide
  // rows of every token, scattered to the tokens' owners
  // (ops::canonical_reduce_scatter; kind all_to_all).
  void head_sum_reduce_scatter(const char* label, std::int64_t head_columns, std::int64_t n);
  // ... and a sum over allgather_kv's query chunks (ops::query_chunk_shards)
  // of n-wide rows of every token, scattered to the tokens' owners
  // (ops::canonical_parts_reduce_scatter; kind all_to_all).
  void query_chunk_sum(const char* label, std::int64_t n);
  // The token sums every form makes, of the weights it applies to its own
  // tokens (mla/pieces.cpp): wo_grad, in_proj_grad, kv_norm_grad, with rq >
  // 0 q_norm_grad and (per-head queries) wq_b_grad, with the gate wg_grad.
  // predict_comm adds them for every form.
  void projection_sums();
  // A ring pass (ring_pass_bytes) of the blocks (elements) of a ring's
  // members, in ring order, this rank at `place`, under `label`; `home`:
  // the pass that brings each block back to its owner. Nothing in a ring of
  // one: a ring form makes no shift there.
  void add_ring(Phase phase, const char* label, const std::vector<std::int64_t>& blocks, int place,
                bool home);
  // A ring form's whole frame (mla/ring.hpp): its blocks' pass forward
  // under `pass`; backward the pass again (recomputation) and the
  // gradients' pass home under `grad_pass`. Over every rank (width per
  // token), or over a ring of its own (its members' blocks, this rank's place).
  void ring_form(const char* pass, const char* grad_pass, std::int64_t width);
  void ring_form(const char* pass, const char* grad_pass, const std::vector<std::int64_t>& blocks,
                 int place);
};

// The crossover of the query exchange. Per local token of rank r, forward
// (backward moves the same, reversed), the per-head all-to-all sends
// (H - H_r) dqk elements and the query-latent all-gather (P - 1) rq; both
// scale with B L_r e alike, so which is smaller depends on the config, P and
// H_r only. With H_r = H / P the latent gather sends less iff
// (P - 1) rq < (P - 1) H dqk / P, i.e. P rq < H dqk.
struct QueryExchangeCost {
  std::int64_t heads_per_token = 0;   // (H - H_r) dqk
  std::int64_t latent_per_token = 0;  // (P - 1) rq
  bool latent_sends_less() const { return latent_per_token < heads_per_token; }
};
QueryExchangeCost query_exchange_cost(const MlaConfig& cfg, const SpLayout& layout, int rank);

// The smallest P at which the latent gather sends at least as many bytes as
// the per-head all-to-all when the heads split evenly: ceil(H dqk / rq)
// (DeepSeek-V3: 128 * 192 / 1536 = 16, where the two are equal). 0 when
// rq == 0 (there is no query latent).
std::int64_t query_latent_crossover(const MlaConfig& cfg);

// Sum over labels of one phase (Phase::count: all phases).
std::int64_t predicted_sent(const CommPrediction& p, Phase phase = Phase::count);

// One ring pass of a ring context-parallel form: block_elems[j] elements
// start on rank j and each of P - 1 ring_shift steps passes every rank's
// current block on (comm/communicator.hpp), so every rank sees every block.
// Rank r sends every block but the one it receives in the last step
// (forward: rank r + 1's, which would only go on to its home) and receives
// every block but its own:
//   sent     (sum_j b_j - b_{r+1}) e      forward (backward: b_{r-1})
//   received (sum_j b_j - b_r) e
// with calls = P - 1 (zero on one rank) and kind ring_shift. A closed form of
// its own, for the ledger of a ring form to be checked against. `home`: one
// shift more, which brings every block back to the rank it started on (a
// ring form's gradient accumulators): P calls, and every rank sends and
// receives every block once, sum_j b_j e each way.
PredictedBytes ring_pass_bytes(const std::vector<std::int64_t>& block_elems, int rank,
                               std::int64_t elem_bytes,
                               RingDirection direction = RingDirection::forward, bool home = false);

}  // namespace laga
