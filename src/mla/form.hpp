// What a form is made of (private to src/mla; docs/architecture.md, "Adding
// a form"). A form is one file with a forward function that returns its Tape:
// the tensors it saved for backward, typed per form, and the backward that
// consumes them. The pieces every form shares (the input projections, the
// latent all-gather, the head attention, the output projection) are here,
// each returning what it computes. The forms are listed once, in form.cpp.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "mla/block.hpp"
#include "mla/comm_model.hpp"
#include "mla/exchange.hpp"
#include "mla/memory_model.hpp"
#include "mla/ops.hpp"
#include "mla/ops_attention.hpp"

namespace laga::detail {

// Every extent of one block on one rank, built once per step.
struct Step {
  const BlockContext ctx;       // a copy: backward may be called with another context object
  std::int64_t B, L, S, N, NS;  // batch, local tokens, sequence, B L, B S
  std::int64_t D, H, Hr, h0;    // model dim, heads, this rank's heads from h0
  std::int64_t dn, dr, dqk, dv;
  std::int64_t C, rq;  // kv_lora_rank, q_lora_rank
  std::int64_t W;      // C + dr: one latent row [c | k_pe]
  std::int64_t Nq;     // the query side's rows of in_proj: H dqk (wq, rq == 0) or rq (wq_a)
  std::int64_t KV;     // dn + dv: one head's rows of wkv_b
  std::int64_t pos0;   // global index of the first local token
  // Where attention runs. Every form but laga2d attends all S tokens for its
  // SpLayout head shard (Hr heads from h0); laga2d attends its head group's
  // Hr heads from h0 for its query ranges over keys [0, Sk)
  // (HeadContextGrid). The all-to-alls move (B, L, H, d) of local tokens
  // (`tokens`) to (B, Sq, Hr, d) of the attention's rows (`attention`) and
  // back.
  std::int64_t Sq, Sk;                   // the attention's query rows and key rows on this rank
  std::vector<TokenRange> query_ranges;  // laga2d: its ranges (Sq rows); else [0, S)
  Placement tokens, attention;
  // Every rank attends every query row (every form but laga2d with Pc > 1):
  // the query latent's exchange is then an all-gather, else a redistribute
  // to the context groups' query rows.
  bool attends_all_queries = true;
  // Packed sequences, made only when kernels will read them (not in a
  // count-only run): each token's document start (B, S), each local token's
  // in-document RoPE position (B, L), and, for the query-latent exchange
  // (which rotates the queries of the attention's rows), every token's
  // (B, S). Empty: one document per row, token t at position t. A zigzag
  // shard without documents has `positions` too: its tokens' global ones.
  std::vector<std::int64_t> doc_start, positions, seq_positions;
  explicit Step(const BlockContext& ctx);
  // Causal attention over this rank's heads, full sequence, head dims;
  // within documents when packed (the explicit and laga forms).
  AttnShape head_attention() const;
  // The sequence attention of `heads` query heads over `kv_heads` key/value
  // heads (the head attention and the absorbed form's latent attention).
  AttnShape sequence_attention(std::int64_t heads, std::int64_t kv_heads, std::int64_t d_qk,
                               std::int64_t d_v) const;
  // Rotates (inverse: back) the rope part x of the local tokens' H heads,
  // head h at x.p + h * head_stride, at their positions.
  template <class T>
  void rope(ops::Mat<T> x, std::int64_t heads, std::int64_t head_stride, bool inverse) const {
    ops::rope(x, B, L, heads, head_stride, pos0, positions.empty() ? nullptr : positions.data(),
              ctx.rope, inverse);
  }
  // The same for the attention's query rows: x has B Sq rows, each batch
  // row's query ranges one after the other (the query-latent exchange's q_h
  // of this rank's heads). One call when they are the whole sequence.
  template <class T>
  void rope_queries(ops::Mat<T> x, std::int64_t heads, std::int64_t head_stride,
                    bool inverse) const {
    const std::int64_t* pos = seq_positions.empty() ? nullptr : seq_positions.data();
    if (Sq == S) return ops::rope(x, B, S, heads, head_stride, 0, pos, ctx.rope, inverse);
    ops::for_batch_rows(B, [&](std::int64_t b) {
      std::int64_t row = b * Sq;
      for (const TokenRange& q : query_ranges) {
        ops::rope(x.row_range(row, q.size()), 1, q.size(), heads, head_stride, q.begin,
                  pos ? pos + b * S + q.begin : nullptr, ctx.rope, inverse);
        row += q.size();
      }
    });
  }
};

// What a form's forward leaves for its backward.
template <class T>
struct Tape {
  virtual ~Tape() = default;
  // Writes dx (B, L, D), adds this rank's parameter gradients into grads and
  // frees what was saved as it goes.
  virtual void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                        const Tensor<T>& dout, Tensor<T>& dx, MlaParams<T>& grads) = 0;
};
template <class T>
using FormForward = std::unique_ptr<Tape<T>> (*)(const Step&, const MlaParams<T>&,
                                                 const Tensor<T>& x, Tensor<T>& out);

// One row of the form registry: the form's description (FormSpec, what the
// rest of laga reads) and its forward for each element type. Each form's
// file defines its row's function, NAME_entry(), listed in mla/forms.def.
struct FormEntry {
  FormSpec spec;
  FormForward<float> f32;
  FormForward<double> f64;
};
const FormEntry& form_entry(Form f);  // form.cpp

// What the head-parallel rows share: every rank attends all S query rows
// for its SpLayout head shard, and the head attention multiplies dqk + dv
// per pair and head.
inline Placement head_shards(const SpLayout& layout, FormVariant) {
  return Placement::head_shards(layout);
}
inline std::int64_t head_pair_width(const MlaConfig& cfg) {
  return cfg.qk_head_dim() + cfg.v_head_dim;
}
#define LAGA_FORM(enumerator, entry) FormEntry entry();
#include "mla/forms.def"
#undef LAGA_FORM

// --- the shared pieces -----------------------------------------------------

// p + off; null stays null (count-only tensors have no storage).
template <class T>
T* at(T* p, std::int64_t off) {
  return p ? p + off : nullptr;
}

// Each rank attends its own seq shard with all heads (allgather_kv,
// ring_kv); a rank without tokens attends no range.
inline Placement own_tokens_all_heads(const SpLayout& layout, FormVariant) {
  Placement p = Placement::seq_shards(layout);
  for (std::size_t r = 0; r < p.tokens.size(); ++r)
    if (layout.seq_count[r] == 0) p.tokens[r].clear();
  return p;
}

// Saved by the input projections, consumed by project_in_backward.
template <class T>
struct InputSaved {
  // proj (B, L, Nq + C + dr) = x in_proj^T: [q | kv_a] (rq == 0) or
  // [qa | kv_a] (rq > 0), q_pe and k_pe rotated. rq > 0: kept whole, as qa
  // and kv_a are what backward reads. rq == 0: freed once q is exchanged,
  // after kv_a, all that backward reads of it, is copied out.
  Tensor<T> proj;
  Tensor<T> kv_a;        // rq == 0: (B, L, C+dr): [c | k_pe], k_pe rotated
  Tensor<T> q_rstd, qn;  // rq > 0: q_norm's rstd (B, L) and output (B, L, rq)
  Tensor<T> kv_rstd;     // (B, L)
  // mla_use_output_gate (Kimi K3): the gate's logits g = x wg^T (B, L, H dv),
  // kept to the output projection's backward; its gradient dg there, which
  // project_in_backward takes to dx and wg's gradient.
  Tensor<T> gate, dgate;
  // kv_a (B L, C+dr) wherever it is (proj's columns, or its copy).
  ops::Mat<const T> kv_a_rows(const Step& st) const {
    return kv_a.defined() ? ops::mat(kv_a) : ops::mat(proj).col_range(st.Nq, st.W);
  }
};

// The pieces, as static members of one class template so that one explicit
// instantiation per type (pieces.cpp) covers them all.
template <class T>
struct Pieces {
  // Both input projections of x in one GEMM (docs/forms.md, "The input
  // projections"): in.proj = x in_proj^T, q_pe (rq == 0) and k_pe rotated.
  // Every form calls it first; what follows reads in.proj.
  static void project_in(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                         InputSaved<T>& in);
  // rq > 0: the query latent of local tokens, qn = q_norm(qa) (B, L, rq),
  // into in.qn (with in.q_rstd for its backward).
  static void project_q_latent(const Step& st, const MlaParams<T>& w, InputSaved<T>& in);
  // c_hat (B, L, C), the normalised latent; in.kv_rstd saved (rq == 0: and
  // in.kv_a copied out of in.proj).
  static Tensor<T> project_latent(const Step& st, const MlaParams<T>& w, InputSaved<T>& in,
                                  const char* c_hat_name);
  // The per-head queries q (B, L, H dqk) of local tokens moved to the
  // attention's rows: q_a2a -> (B, Sq, H_r, dqk). rq == 0: q is in.proj's
  // first columns, sent from there, and in.proj is then freed
  // (project_latent must have run); rq > 0: q = wq_b qn, rotated, here.
  static Tensor<T> queries_to_heads(const Step& st, const MlaParams<T>& w, InputSaved<T>& in);
  // Its adjoint, dq_h (B, Sq, H_r, dqk) to local tokens (frees dq_h). rq == 0:
  // into the first Nq columns of d proj (B, L, Nq + C + dr), allocated here
  // as dproj, returning nothing; rq > 0: returned as dq_loc (B, L, H dqk),
  // which wq_b's backward reads.
  static Tensor<T> queries_to_tokens(const Step& st, Tensor<T>& dq_h, Tensor<T>& dproj);
  // The same for a form whose ranks attend their own tokens with all heads
  // (the query rows stay home): q (B, L, H, dqk) of local tokens, from
  // in.proj's first columns (then freed; project_latent must have run) or,
  // rq > 0, wq_b qn, rotated; and its adjoint, with queries_to_tokens'
  // contract (dq lands in dproj, or is returned as dq_loc). Frees dq.
  static Tensor<T> local_queries(const Step& st, const MlaParams<T>& w, InputSaved<T>& in);
  static Tensor<T> local_queries_backward(const Step& st, Tensor<T>& dq, Tensor<T>& dproj);

  // The all-to-alls as the forms use them, each freeing its input:
  // (B, L, H*d) of local tokens -> (B, Sq, H_r, d) of the attention's rows
  // (Sq = S but in laga2d),
  static Tensor<T> to_heads(const Step& st, Tensor<T>& loc, std::int64_t d, const char* label,
                            const char* name);
  // (the same from a view whose rows may be strided: columns of a wider row)
  static Tensor<T> to_heads(const Step& st, ops::In<T> loc, std::int64_t d, const char* label,
                            const char* name);
  // and back: (B, Sq, H_r, d) -> (B, L, H*d).
  static Tensor<T> to_tokens(const Step& st, Tensor<T>& h, std::int64_t d, const char* label,
                             const char* name);
  // d latent (B, S, C+dr) of every token from this rank's heads, summed over
  // the group for this rank's tokens (B, L, C+dr): the all-gather's adjoint.
  // Frees dlat. With `started` (Overlap::on), the reduce-scatter is started
  // and put there, holding dlat (or its packed copy) until its wait: the
  // result is to be read after started->wait().
  static Tensor<T> reduce_latent(const Step& st, Tensor<T>& dlat, StartedSeq<T>* started = nullptr);

  // [c_hat | k_pe] of local tokens gathered over the group: (B, S, C+dr).
  // `started` as for reduce_latent; it holds the send buffer of local rows.
  // kv_a: (B L, C+dr) rows, whose k_pe columns are sent.
  static Tensor<T> gather_latent(const Step& st, const Tensor<T>& c_hat, ops::In<T> kv_a,
                                 StartedSeq<T>* started = nullptr);

  // laga's up-projection for this rank's H_r heads over the first `keys`
  // tokens of every row of the gathered latent lat (B, S, C+dr):
  // kv = c_hat wkv_b[h0 .. h0+H_r heads' rows]^T, split into k (B, keys, H_r,
  // dqk) and v (B, keys, H_r, dv), allocated here.
  static void up_project_kv(const Step& st, const MlaParams<T>& w, const Tensor<T>& lat,
                            std::int64_t keys, Tensor<T>& k, Tensor<T>& v);
  // Its backward: d lat (B, S, C+dr), zero past `keys` in each row, returned;
  // wkv_b's gradient of the H_r heads' rows added. Frees dk and dv.
  static Tensor<T> up_project_kv_backward(const Step& st, const MlaParams<T>& w,
                                          const Tensor<T>& lat, std::int64_t keys, Tensor<T>& dk,
                                          Tensor<T>& dv, MlaParams<T>& grads);

  // The attention kernel calls themselves (one call on raw pointers, its
  // backward, a bf16 run's scratch) are the op layer's: ops_attention.hpp.
  // The eager kernel's probabilities (B, Hq, S, S) or the flash kernel's lse
  // (B, Hq, S): what attention backward reads.
  static Tensor<T> attention_forward(const Step& st, const AttnShape& s, Tensor<T>& o,
                                     const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v);
  // Frees stats.
  static void attention_backward(const Step& st, const AttnShape& s, Tensor<T>& dq, Tensor<T>& dk,
                                 Tensor<T>& dv, const Tensor<T>& dout, const Tensor<T>& q,
                                 const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>& o,
                                 Tensor<T>& stats);

  // o_h (B, S, H_r, dv) to heads of local tokens, o_loc (B, L, H*dv), returned
  // (saved for wo's gradient); out (B, L, D) = output_projection(o_loc).
  static Tensor<T> project_out(const Step& st, const MlaParams<T>& w, const InputSaved<T>& in,
                               const Tensor<T>& o_h, Tensor<T>& out);
  // dout -> wo's gradient (frees o_loc); returns do_h (B, S, H_r, dv).
  static Tensor<T> project_out_backward(const Step& st, const MlaParams<T>& w, InputSaved<T>& in,
                                        const Tensor<T>& dout, Tensor<T>& o_loc,
                                        MlaParams<T>& grads);
  // The output projection of the local tokens' heads o_loc (B, L, H dv),
  // every form's last step: out (B, L, D) = o_loc wo^T, or with Kimi K3's
  // output gate (o_loc * sigmoid(in.gate)) wo^T (docs/mla-math.md, "Gated
  // NoPE MLA"). o_loc itself stays ungated (the attention's backward reads it).
  static void output_projection(const Step& st, const MlaParams<T>& w, const InputSaved<T>& in,
                                const Tensor<T>& o_loc, Tensor<T>& out);
  // Its backward: do_loc (B, L, H dv, allocated here) = d o_loc, wo's
  // gradient added, and with the gate in.dgate = d g (in.gate freed).
  static Tensor<T> output_projection_backward(const Step& st, const MlaParams<T>& w,
                                              InputSaved<T>& in, const Tensor<T>& dout,
                                              const Tensor<T>& o_loc, MlaParams<T>& grads,
                                              const char* name);

  // From the queries' gradient and dlat_loc (B, L, C+dr) = d[c_hat | k_pe]
  // (before the inverse rotation) to dx and the wq*, q_norm, wkv_a, kv_norm
  // gradients. The queries' gradient is, with per-head queries
  // (QueryExchange::heads) and rq == 0, already in dproj's first Nq columns
  // (queries_to_tokens; dq undefined); with rq > 0, dq_loc (B, L, H*dqk)
  // (dproj undefined, allocated here); both before the inverse rotation;
  // with the latent exchange, dq is d qn (B, L, rq), already taken back
  // through the rotation and wq_b (whose gradient the form added). Both
  // halves are written into dproj = d[q or qa | kv_a] (B, L, Nq + C + dr),
  // then ONE GEMM gives dx = dproj in_proj and one in_proj's gradient
  // (wq's or wq_a's and wkv_a's rows) += dproj^T x. Consumes dq, dlat_loc,
  // dproj and everything in `in`. With `dlat_pending` (Overlap::on:
  // dlat_loc's reduce-scatter started by reduce_latent), the query half
  // runs first, then the wait, then the latent's: the same arithmetic
  // either way, so the same bits.
  static void project_in_backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                  Tensor<T>& dq, Tensor<T>& dlat_loc, Tensor<T>& dproj,
                                  InputSaved<T>& in, Tensor<T>& dx, MlaParams<T>& grads,
                                  StartedSeq<T>* dlat_pending = nullptr);
  // Its two halves, each writing its columns of dproj: the queries' (q_pe
  // rotated back; rq > 0 through wq_b (heads) and q_norm) and the latent
  // norm's (dlat_loc rotated back and taken through kv_norm; frees
  // dlat_loc).
  static void query_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq,
                             InputSaved<T>& in, Tensor<T>& dproj, MlaParams<T>& grads);
  static void latent_norm_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dlat_loc,
                                   InputSaved<T>& in, Tensor<T>& dproj, MlaParams<T>& grads);
  // K = [k_nope | k_pe] (rows, heads, dqk) and V (rows, heads, dv) from kv
  // (rows, heads*(dn+dv)) and each row's rotated k_pe (rows, dr), which every
  // head shares (Megatron-Core expands it the same way).
  static void split_kv(const Step& st, std::int64_t heads, ops::In<T> kv, ops::In<T> k_pe,
                       ops::Mat<T> k, ops::Mat<T> v);
  // The adjoint of split_kv: dkv (rows, heads*(dn+dv)) from dk's nope part and
  // dv; dk's rope parts are summed over heads, in head order, into dk_pe
  // (rows, dr) (added to what is there).
  // The invariant mode's up_project_kv_backward (docs/invariance.md): the
  // gradient of this rank's tokens' latent, (B, L, C + dr), summed over
  // every rank's heads canonically.
  static Tensor<T> up_project_kv_backward_invariant(const Step& st, const MlaParams<T>& w,
                                                    const Tensor<T>& lat, std::int64_t keys,
                                                    Tensor<T>& dk, Tensor<T>& dv,
                                                    MlaParams<T>& grads);
  // The invariant mode's latent gradient from per-head parts (absorbed,
  // laga_fused; docs/invariance.md): dlat_heads (H_r, B, S, C + dr), each
  // head's d[c_hat | k_pe] of every token, summed over every rank's heads
  // in the one tree over the global head index
  // (ops::canonical_parts_reduce_scatter) and scattered to the tokens'
  // owners: (B, L, C + dr) returned (frees dlat_heads). Every rank joins,
  // one without heads too.
  static Tensor<T> latent_head_sum_invariant(const Step& st, Tensor<T>& dlat_heads);
  // Head h's columns (B S, d) of a (B, S, H_r, d) tensor, and its rows (B, S)
  // of attention's statistics (B, H_r, S): the invariant mode's calls of one
  // head each (absorbed, laga_fused).
  static ops::Mat<T> head_columns(const Step& st, Tensor<T>& t, std::int64_t d, std::int64_t h) {
    return ops::mat(t, st.NS, st.Hr * d).col_range(h * d, d);
  }
  static ops::Mat<T> head_stats(const Step& st, Tensor<T>& stats, std::int64_t h) {
    return ops::mat(stats, st.B, st.Hr * st.S).col_range(h * st.S, st.S);
  }
  // Head h's (B S, C + dr) of latent_head_sum_invariant's dlat_heads.
  static ops::Mat<T> head_part(const Step& st, Tensor<T>& dlat_heads, std::int64_t h) {
    return ops::mat(dlat_heads, st.Hr * st.NS, st.W).row_range(h * st.NS, st.NS);
  }
  static void merge_dkv(const Step& st, std::int64_t heads, ops::In<T> dk, ops::In<T> dv,
                        ops::Mat<T> dkv, ops::Mat<T> dk_pe);
  // explicit's per-head K and V of local tokens and all H heads (explicit,
  // a2a_p2p): kv (B, L, H (dn+dv)) = c_hat wkv_b^T, split into k (B, L, H
  // dqk), k_pe from in's kv_a broadcast over heads, and v (B, L, H dv).
  struct LocalKv {
    Tensor<T> k, v;
  };
  static LocalKv local_kv(const Step& st, const MlaParams<T>& w, const Tensor<T>& c_hat,
                          const InputSaved<T>& in);
  // Its backward from dk (B L, H dqk) and dv (B L, H dv): d[c_hat | k_pe]
  // (B, L, C + dr) returned (d kv from [dk_nope | dv] per head, d k_pe the
  // sum over heads of dk's rope part, d c_hat = dkv wkv_b); wkv_b += dkv^T
  // c_hat (explicit, ring_kv, a2a_p2p).
  static Tensor<T> local_kv_backward(const Step& st, const MlaParams<T>& w, ops::In<T> dk,
                                     ops::In<T> dv, const Tensor<T>& c_hat, MlaParams<T>& grads);
};

// The input side laga and laga2d share (docs/forms.md, "laga", "laga2d"):
// the queries of local tokens moved to the attention's rows and this rank's
// heads, and the latent [c_hat | k_pe] all-gathered and up-projected to
// this rank's heads over keys [0, Sk).
//   queries, per head (QueryExchange::heads): q (B, L, H dqk) -> q_a2a ->
//     q_h (B, Sq, H_r, dqk);
//   or the query latent (QueryExchange::latent): qn (B, L, rq) -> qn_q
//     (B, Sq, rq) of the attention's rows (all-gathered, q_latent_ag, when
//     they are every row; else redistributed to the context groups,
//     q_latent_a2a), then q_h = qn_q wq_b[own heads' rows]^T, rotated at
//     those rows' positions: the same FLOPs as wq_b of all heads on local
//     tokens when Sq H_r = L H;
//   latent: [c_hat | k_pe] (B, L, C+dr) -> latent_ag -> lat (B, S, C+dr).
// With Overlap::on the latent goes first and its all-gather is started
// before the queries' projection and exchange, and waited for at the
// up-projection; backward starts its reduce-scatter before the query
// path's backward. The same collectives and arithmetic either way.
// Where the up-projection of the gathered latent to this rank's heads runs:
// stored (laga, laga2d: K, V (B, Sk, H_r, .) made here for the attention) or
// in_kernel (laga_fused: the fused kernel makes them a key chunk at a time
// from lat, kernels/attention_flash_latent.hpp; forward returns no k_h, v_h).
enum class UpProjection { stored, in_kernel };

template <class T>
struct LagaInputs {
  InputSaved<T> in;
  Tensor<T> qn_q;  // latent exchange: (B, Sq, rq), what wq_b's gradient reads
  Tensor<T> lat;   // (B, S, C+dr): [c_hat | k_pe] of every token
  struct Qkv {
    Tensor<T> q_h, k_h, v_h;  // (B, Sq, H_r, dqk), (B, Sk, H_r, dqk), (B, Sk, H_r, dv)
  };
  Qkv forward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
              UpProjection up = UpProjection::stored);
  // From the attention's gradients (freed) to dx and this side's parameter
  // gradients; frees everything saved.
  void backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, Tensor<T>& dq_h,
                Tensor<T>& dk_h, Tensor<T>& dv_h, Tensor<T>& dx, MlaParams<T>& grads);
  // The same after UpProjection::in_kernel: the kernel gave dlat (B, S,
  // C+dr), d[c_hat | k_pe] of every token from this rank's heads, and added
  // wkv_b's gradient itself. Frees dq_h, dlat and everything saved.
  void backward_from_latent(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                            Tensor<T>& dq_h, Tensor<T>& dlat, Tensor<T>& dx, MlaParams<T>& grads);

 private:
  // The queries' exchange backward: d qn (latent exchange) returned, or
  // (per-head queries) dq in dproj's first columns.
  Tensor<T> queries_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq_h,
                             Tensor<T>& dproj, MlaParams<T>& grads);
  // From dlat to dx: the reduce-scatter and the input projections' backward.
  void latent_backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x, Tensor<T>& dq,
                       Tensor<T>& dproj, Tensor<T>& dlat, Tensor<T>& dx, MlaParams<T>& grads);
  // The latent exchange's forward: returns q_h; keeps qn_q.
  Tensor<T> exchange_query_latent(const Step& st, const MlaParams<T>& w);
  // Its backward: returns d qn (B, L, rq) of local tokens, summed over the
  // ranks that attended them; wq_b's gradient of this rank's heads' rows
  // added. Frees dq_h and qn_q.
  Tensor<T> query_latent_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq_h,
                                  MlaParams<T>& grads);
};

// The head attention explicit and laga share: attention over q_h, k_h, v_h
// (B, S, H_r, .) and its saved output and statistics.
template <class T>
struct HeadAttention {
  Tensor<T> q_h, k_h, v_h;  // (B, S, H_r, dqk / dqk / dv)
  Tensor<T> o_att;          // (B, S, H_r, dv): flash's backward reads it; eager's does not
  Tensor<T> stats;
  // Runs it and returns out (B, L, D); keeps o_loc for wo's gradient.
  void forward(const Step& st, const MlaParams<T>& w, const InputSaved<T>& in, Tensor<T>& out,
               Tensor<T>& o_loc);
  // do_h in; dq_h, dk_h, dv_h (B, S, H_r, .) out; frees what it saved.
  struct Grads {
    Tensor<T> dq_h, dk_h, dv_h;
  };
  Grads backward(const Step& st, Tensor<T>& do_h);
};

// The attention of this rank's query ranges (Step::query_ranges, Sq rows,
// one range after another) for its H_r heads, each range of n queries
// ending at token e over keys [0, e): laga2d's mirrored chunks, allgather_kv's
// local tokens. The key and value tensors hold kv_rows rows per batch row,
// of which the first Sk are read (laga2d: kv_rows = Sk; allgather_kv: the
// whole gathered sequence, kv_rows = S).
//
// One kernel call per range and batch row (AttnCall), or one over the whole
// batch when the rank has one range and the batch rows are uniform slices;
// the call that reaches Sk writes its keys' gradients in place, the others
// through scratch, added after.
struct AttnCall {
  AttnShape shape;
  std::int64_t q_row = 0, kv_row = 0,
               stats = 0;  // first (B Sq) row, (B kv_rows) row, stats element
  bool all_keys = false;   // reads keys [0, Sk): writes their gradients in place
  // How many batch rows' identical calls this one stands for: 1, or in a
  // count-only run B (batch row 0's, ops::RepeatCounts).
  std::int64_t repeat = 1;
};
template <class T>
struct RangeAttention {
  Tensor<T> q_h;             // (B, Sq, H_r, dqk)
  Tensor<T> k_h, v_h;        // (B, kv_rows, H_r, dqk / dv)
  std::int64_t kv_rows = 0;  // >= Sk
  Tensor<T> o_att;           // (B, Sq, H_r, dv), from forward
  Tensor<T> stats;           // every call's eager probabilities or flash lse
  std::vector<AttnCall> calls;
  // o_att and stats from q_h, k_h, v_h.
  void forward(const Step& st);
  // do_h (B, Sq, H_r, dv) in (freed); dq_h (B, Sq, H_r, dqk), dk_h and dv_h
  // (B, kv_rows, H_r, .), zero past Sk in each batch row, out; frees what it
  // saved.
  struct Grads {
    Tensor<T> dq_h, dk_h, dv_h;
  };
  Grads backward(const Step& st, Tensor<T>& do_h);
};

}  // namespace laga::detail
