// The public block API and the pieces every form shares (form.hpp).
#include "mla/block.hpp"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "mla/exchange.hpp"
#include "mla/form.hpp"
#include "mla/wire.hpp"

namespace laga {

namespace detail {

using ops::mat;

Step::Step(const BlockContext& c) : ctx(c) {
  const MlaConfig& m = c.cfg;
  const SpLayout& lay = c.layout;
  const auto r = static_cast<std::size_t>(c.comm.rank());
  LAGA_CHECK(c.comm.size() == lay.ranks, "block: the communicator has ", c.comm.size(),
             " ranks but the layout was made for ", lay.ranks);
  LAGA_CHECK(lay.heads == m.n_heads, "block: the layout splits ", lay.heads,
             " heads but the config has n_heads = ", m.n_heads);
  LAGA_CHECK(c.rope.positions() >= lay.seq, "block: the RoPE table covers ", c.rope.positions(),
             " positions but the sequence has ", lay.seq);
  B = lay.batch, L = lay.seq_count[r], S = lay.seq, N = B * L, NS = B * S;
  D = m.dim, H = m.n_heads;
  dn = m.qk_nope_head_dim, dr = m.qk_rope_head_dim, dqk = dn + dr, dv = m.v_head_dim;
  C = m.kv_lora_rank, rq = m.q_lora_rank, W = C + dr, KV = dn + dv;
  Nq = rq == 0 ? H * dqk : rq;
  pos0 = lay.seq_ranges[r].front().begin;
  check_variant(m, lay, c.variant);
  tokens = Placement::seq_shards(lay);
  attention = attention_placement(lay, c.variant);
  Hr = attention.head_count[r], h0 = attention.head_offset[r];
  query_ranges = attention.tokens[r];
  Sq = attention.rows(c.comm.rank());
  Sk = query_ranges.empty() ? 0 : query_ranges.back().end;
  for (const std::vector<TokenRange>& q : attention.tokens)
    attends_all_queries = attends_all_queries && q == std::vector<TokenRange>{{0, S}};
  // The local tokens: one range, or a zigzag shard's two.
  const std::vector<TokenRange>& own_ranges = lay.seq_ranges[r];
  if (const Documents* docs = c.documents) {
    LAGA_CHECK(docs->batch() == B && docs->seq() == S, "block: the documents are for (B ",
               docs->batch(), ", S ", docs->seq(), ") but the batch is (B ", B, ", S ", S, ")");
    if (!current_pool().count_only()) {
      doc_start = docs->doc_starts();
      positions = docs->positions(own_ranges);
      if (c.variant.queries == QueryExchange::latent) seq_positions = docs->positions({{0, S}});
    }
  } else if (own_ranges.size() > 1 && !current_pool().count_only()) {
    // A zigzag shard: its tokens' global positions, the same for every row.
    const std::vector<std::int64_t> own = lay.positions(c.comm.rank());
    for (std::int64_t b = 0; b < B; ++b) positions.insert(positions.end(), own.begin(), own.end());
  }
}

AttnShape Step::sequence_attention(std::int64_t heads, std::int64_t kv_heads, std::int64_t d_qk,
                                   std::int64_t d_v) const {
  AttnShape s{B, S, S, heads, kv_heads, d_qk, d_v, ctx.cfg.softmax_scale(), true};
  s.doc_start = doc_start.empty() ? nullptr : doc_start.data();
  return s;
}

AttnShape Step::head_attention() const {
  return sequence_attention(Hr, Hr, dqk, dv);
}

namespace {
// The first `keys` tokens of every row of a (B, S, .) tensor and of a
// (B, keys, .) one, as blocks of rows both hold contiguously: f(row in the
// (B S) rows, row in the (B keys) rows, rows). One block of all B S rows when
// keys = S (so laga's GEMMs are one call, as before laga2d shared them), else
// one per batch row.
template <class F>
void for_key_blocks(const Step& st, std::int64_t keys, F&& f) {
  if (keys == st.S) return f(std::int64_t(0), std::int64_t(0), st.NS);
  ops::for_batch_rows(st.B, [&](std::int64_t b) { f(b * st.S, b * keys, keys); });
}
// One bf16 attention call's scratch (Pieces::attend, attend_backward): the
// copies of its operands the kernel reads -- bf16 for the VDPBF16PS kernels,
// fp32 holding bf16 values where they widen (flash_bf16_isa) -- and the
// bf16 kernel's workspace (FlashWorkspace), carved from one pool tensor, so
// that the pool and the memory model count them (they were malloc'd and
// thread scratch outside both, 147 MB beside a 160 MB pool peak at D 2048,
// S 2048: docs/accounting.md, "bf16 operand copies and attention
// scratch"). Each part's bytes are a multiple of 64 (the workspace must be
// 64-byte aligned). The workspace follows this thread's OpenMP thread
// count, which a count-only run sets to the rank's (memory_model.hpp).
struct Bf16AttentionParts {
  std::int64_t q = 0, k = 0, v = 0, dout = 0, workspace = 0;
  std::int64_t bytes() const { return q + k + v + dout + workspace; }
};

std::int64_t whole_lines(std::int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}

// kept: q, k, v, dout held narrowed (their bf16 values are the bf16
// kernel's operands as they are). bound: the workspace of every call with extents no
// larger than s's (a caller sizing one scratch for several such calls).
Bf16AttentionParts bf16_attention_parts(const AttnShape& s, ops::AttentionPass pass,
                                        const std::array<bool, 4>& kept, bool bound) {
  const bool backward = pass == ops::AttentionPass::backward;
  const bool widens = flash_bf16_isa() == FlashBf16Isa::fp32;
  const std::int64_t e = widens ? 4 : 2;
  const auto copy = [&](std::int64_t n, bool is_kept) {
    return is_kept && !widens ? 0 : whole_lines(e * n);
  };
  Bf16AttentionParts p;
  p.q = copy(s.B * s.Sq * s.Hq * s.dqk, kept[0]);
  p.k = copy(s.B * s.Sk * s.Hk * s.dqk, kept[1]);
  p.v = copy(s.B * s.Sk * s.Hk * s.dv, kept[2]);
  p.dout = backward ? copy(s.B * s.Sq * s.Hq * s.dv, kept[3]) : 0;
  if (!widens)
    p.workspace = whole_lines(bound ? attention_flash_bf16_workspace_bound(s, backward)
                                    : attention_flash_bf16_workspace_bytes(s, backward));
  return p;
}

Tensor<bf16> bf16_attention_scratch(const Bf16AttentionParts& p) {
  return Tensor<bf16>({p.bytes() / 2}, "bf16 attention scratch");
}

// The operands a call was given held narrowed (none: null), refused
// outside a bf16 run; and what the call reads of one operand, as runs()
// checks it: the held bf16 values, else x.
template <class T>
typename Pieces<T>::NarrowedOperands held_operands(
    const typename Pieces<T>::NarrowedOperands* narrowed) {
  LAGA_CHECK(!narrowed || ops::in_bf16<T>(),
             "internal: narrowed attention operands outside a bf16 run");
  return narrowed ? *narrowed : typename Pieces<T>::NarrowedOperands{};
}
template <class T>
const void* read_ptr(bool held, const bf16* values, const T* x) {
  return held ? static_cast<const void*>(values) : static_cast<const void*>(x);
}

// One attention operand of n values for the bf16 kernels: a tensor held
// narrowed gives its bf16 values as they are; another's are rounded into
// `dst`, its place in the call's scratch.
const bf16* bf16_operand(void* dst, const float* x, bool held, const bf16* values, std::int64_t n) {
  if (held) return values;
  ops::bf16_path::to_bf16_threaded(x, static_cast<bf16*>(dst), n);
  return static_cast<const bf16*>(dst);
}
// The same for the fp32 kernels where the bf16 ones widen (flash_bf16_isa):
// the bf16 values as fp32 in `dst`, widened (exactly) or rounded.
const float* widened_operand(void* dst, const float* x, bool held, const bf16* values,
                             std::int64_t n) {
  if (held)
    ops::bf16_path::to_float_threaded(values, static_cast<float*>(dst), n);
  else
    ops::bf16_path::round_threaded(x, static_cast<float*>(dst), n);
  return static_cast<const float*>(dst);
}

}  // namespace

template <class T>
void Pieces<T>::project_in(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                           InputSaved<T>& in) {
  // One GEMM, N = Nq + C + dr wide, where the latent's alone (N = C + dr)
  // would be a skinny GEMM well below the machine's rate.
  in.proj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "proj");
  const ops::Mat<T> proj = mat(in.proj);
  ops::linear(proj, mat(x), w.in_proj);
  st.rope(proj.col_range(st.Nq + st.C, st.dr), 1, 0, false);
  if (st.rq == 0) st.rope(proj.col_range(st.dn, st.Nq - st.dn), st.H, st.dqk, false);
}

template <class T>
void Pieces<T>::project_q_latent(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
  in.q_rstd = Tensor<T>({st.B, st.L}, "q_rstd");
  in.qn = Tensor<T>({st.B, st.L, st.rq}, "qn");
  ops::rmsnorm(mat(in.qn), in.q_rstd, mat(in.proj).col_range(0, st.rq), w.q_norm,
               st.ctx.cfg.norm_eps);
}

template <class T>
Tensor<T> Pieces<T>::project_latent(const Step& st, const MlaParams<T>& w, InputSaved<T>& in,
                                    const char* c_hat_name) {
  const ops::Mat<const T> kv_a = mat(in.proj).col_range(st.Nq, st.W);
  in.kv_rstd = Tensor<T>({st.B, st.L}, "kv_rstd");
  Tensor<T> c_hat({st.B, st.L, st.C}, c_hat_name);
  ops::rmsnorm(mat(c_hat), in.kv_rstd, kv_a.col_range(0, st.C), w.kv_norm, st.ctx.cfg.norm_eps);
  if (st.rq == 0) {
    in.kv_a = Tensor<T>({st.B, st.L, st.W}, "kv_a");
    ops::copy(mat(in.kv_a), kv_a);
  }
  return c_hat;
}

template <class T>
Tensor<T> Pieces<T>::queries_to_heads(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
  if (st.rq == 0) {
    LAGA_CHECK(in.kv_a.defined(),
               "internal: queries_to_heads before project_latent would free proj before kv_a is "
               "copied out of it");
    Tensor<T> q_h =
        to_heads(st, mat(std::as_const(in.proj)).col_range(0, st.Nq), st.dqk, "q_a2a", "q_h");
    in.proj.reset();
    return q_h;
  }
  project_q_latent(st, w, in);
  Tensor<T> q({st.B, st.L, st.H * st.dqk}, "q");
  ops::linear(mat(q), mat(in.qn), w.wq_b);
  st.rope(mat(q).col_range(st.dn, st.H * st.dqk - st.dn), st.H, st.dqk, false);
  return to_heads(st, q, st.dqk, "q_a2a", "q_h");
}

template <class T>
Tensor<T> Pieces<T>::local_queries(const Step& st, const MlaParams<T>& w, InputSaved<T>& in) {
  Tensor<T> q({st.B, st.L, st.H * st.dqk}, "q_h");
  if (st.rq == 0) {
    LAGA_CHECK(in.kv_a.defined(),
               "internal: local_queries before project_latent would free proj before kv_a is "
               "copied out of it");
    ops::copy(mat(q), mat(std::as_const(in.proj)).col_range(0, st.Nq));
    in.proj.reset();
    return q;
  }
  project_q_latent(st, w, in);
  ops::linear(mat(q), mat(in.qn), w.wq_b);
  st.rope(mat(q).col_range(st.dn, st.H * st.dqk - st.dn), st.H, st.dqk, false);
  return q;
}

template <class T>
Tensor<T> Pieces<T>::local_queries_backward(const Step& st, Tensor<T>& dq, Tensor<T>& dproj) {
  if (st.rq > 0) return std::move(dq);
  dproj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "dproj");
  ops::copy(mat(dproj).col_range(0, st.Nq), mat(std::as_const(dq)));
  dq.reset();
  return {};
}

template <class T>
Tensor<T> Pieces<T>::queries_to_tokens(const Step& st, Tensor<T>& dq_h, Tensor<T>& dproj) {
  if (st.rq > 0) return to_tokens(st, dq_h, st.dqk, "q_a2a", "dq_loc");
  dproj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "dproj");
  redistribute(st.ctx.comm, st.B, st.attention, st.tokens, dq_h.data(), dproj.data(), st.dqk,
               "q_a2a", 0, st.Nq + st.W);
  dq_h.reset();
  return {};
}

template <class T>
Tensor<T> Pieces<T>::gather_latent(const Step& st, const Tensor<T>& c_hat, ops::In<T> kv_a,
                                   StartedSeq<T>* started) {
  // The all-gather's send buffer: [c_hat | k_pe] per local token.
  Tensor<T> lat_loc({st.B, st.L, st.W}, "lat_loc", MemCategory::comm_buffers);
  ops::copy(mat(lat_loc).col_range(0, st.C), mat(c_hat));
  ops::copy(mat(lat_loc).col_range(st.C, st.dr), kv_a.col_range(st.C, st.dr));
  Tensor<T> lat({st.B, st.S, st.W}, "lat");
  if (started)  // lat_loc goes with it: the collective reads it until the wait
    *started = start_gather_seq(st.ctx.comm, st.ctx.layout, std::move(lat_loc), lat.data(), st.W,
                                "latent_ag");
  else
    gather_seq(st.ctx.comm, st.ctx.layout, lat_loc.data(), lat.data(), st.W, "latent_ag");
  return lat;
}

template <class T>
void Pieces<T>::up_project_kv(const Step& st, const MlaParams<T>& w, const Tensor<T>& lat,
                              std::int64_t keys, Tensor<T>& k, Tensor<T>& v) {
  k = Tensor<T>({st.B, keys, st.Hr, st.dqk}, "k_h");
  v = Tensor<T>({st.B, keys, st.Hr, st.dv}, "v_h");
  // kv_h (B keys, H_r (dn+dv)) = c_hat wkv_b[H_r heads' rows]^T: the H_r slice
  // of explicit's up-projection, over the keys.
  Tensor<T> kv_h({st.B, keys, st.Hr * st.KV}, "kv_h");
  const ops::Mat<const T> wkv_b_r = mat(w.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<const T> lat_m = mat(lat);
  ops::Mat<T> kv_m = mat(kv_h), k_m = mat(k, st.B * keys, st.Hr * st.dqk),
              v_m = mat(v, st.B * keys, st.Hr * st.dv);
  for_key_blocks(st, keys, [&](std::int64_t lat_row, std::int64_t key_row, std::int64_t rows) {
    const ops::Mat<const T> lat_b = lat_m.row_range(lat_row, rows);
    const ops::Mat<T> kv_b = kv_m.row_range(key_row, rows);
    ops::gemm(kv_b, T(0), lat_b.col_range(0, st.C), false, wkv_b_r, true);
    split_kv(st, st.Hr, kv_b, lat_b.col_range(st.C, st.dr), k_m.row_range(key_row, rows),
             v_m.row_range(key_row, rows));
  });
}

template <class T>
Tensor<T> Pieces<T>::up_project_kv_backward(const Step& st, const MlaParams<T>& w,
                                            const Tensor<T>& lat, std::int64_t keys, Tensor<T>& dk,
                                            Tensor<T>& dv, MlaParams<T>& grads) {
  // d[c_hat | k_pe] of every token from this rank's heads (zero past the keys).
  Tensor<T> dlat = Tensor<T>::zeros({st.B, st.S, st.W}, "dlat");
  Tensor<T> dkv_h({st.B, keys, st.Hr * st.KV}, "dkv_h");
  const ops::Mat<const T> wkv_b_r = mat(w.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<T> dwkv_b_r = mat(grads.wkv_b).row_range(st.h0 * st.KV, st.Hr * st.KV);
  const ops::Mat<const T> lat_m = mat(lat),
                          dk_m = mat(std::as_const(dk), st.B * keys, st.Hr * st.dqk),
                          dv_m = mat(std::as_const(dv), st.B * keys, st.Hr * st.dv);
  const ops::Mat<T> dlat_m = mat(dlat), dkv_m = mat(dkv_h);
  for_key_blocks(st, keys, [&](std::int64_t lat_row, std::int64_t key_row, std::int64_t rows) {
    merge_dkv(st, st.Hr, dk_m.row_range(key_row, rows), dv_m.row_range(key_row, rows),
              dkv_m.row_range(key_row, rows),
              dlat_m.row_range(lat_row, rows).col_range(st.C, st.dr));
  });
  dk.reset(), dv.reset();  // before the GEMMs: they are not needed there
  for_key_blocks(st, keys, [&](std::int64_t lat_row, std::int64_t key_row, std::int64_t rows) {
    const ops::Mat<const T> dkv_b = dkv_m.row_range(key_row, rows);
    ops::gemm(dlat_m.row_range(lat_row, rows).col_range(0, st.C), T(0), dkv_b, false, wkv_b_r,
              false);
    ops::gemm(dwkv_b_r, T(1), dkv_b, true, lat_m.row_range(lat_row, rows).col_range(0, st.C),
              false);
  });
  return dlat;
}

template <class T>
Tensor<T> Pieces<T>::to_heads(const Step& st, Tensor<T>& loc, std::int64_t d, const char* label,
                              const char* name) {
  Tensor<T> h = to_heads(st, mat(std::as_const(loc)), d, label, name);
  loc.reset();
  return h;
}

template <class T>
Tensor<T> Pieces<T>::to_heads(const Step& st, ops::In<T> loc, std::int64_t d, const char* label,
                              const char* name) {
  Tensor<T> h({st.B, st.Sq, st.Hr, d}, name);
  redistribute(st.ctx.comm, st.B, st.tokens, st.attention, loc.p, h.data(), d, label, loc.ld);
  return h;
}

template <class T>
Tensor<T> Pieces<T>::to_tokens(const Step& st, Tensor<T>& h, std::int64_t d, const char* label,
                               const char* name) {
  Tensor<T> loc({st.B, st.L, st.H * d}, name);
  redistribute(st.ctx.comm, st.B, st.attention, st.tokens, h.data(), loc.data(), d, label);
  h.reset();
  return loc;
}

template <class T>
Tensor<T> Pieces<T>::reduce_latent(const Step& st, Tensor<T>& dlat, StartedSeq<T>* started) {
  Tensor<T> dlat_loc({st.B, st.L, st.W}, "dlat_loc");
  if (started) {  // dlat goes with it: the collective may read it until the wait
    *started = start_reduce_scatter_seq(st.ctx.comm, st.ctx.layout, std::move(dlat),
                                        dlat_loc.data(), st.W, "latent_ag");
  } else {
    reduce_scatter_seq(st.ctx.comm, st.ctx.layout, dlat.data(), dlat_loc.data(), st.W, "latent_ag");
    dlat.reset();
  }
  return dlat_loc;
}

template <class T>
void Pieces<T>::attend(const Step& st, const AttnShape& s, T* o, T* stats, const T* q, const T* k,
                       const T* v, T* eager_lse, const NarrowedOperands* narrowed,
                       Tensor<bf16>* scratch) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  ops::count_attention(s, st.ctx.attention, ops::AttentionPass::forward,
                       [&] { return s.useful_flops_forward(); });
  // Eager writes the scores, reads them back and writes the probabilities.
  if (eager) ops::count_elementwise<T>(s.B * s.Hq * s.Sq * s.Sk, 3);
  const NarrowedOperands held = held_operands<T>(narrowed);
  const void* qp = read_ptr(held.q_held, held.q, q);
  const void* kp = read_ptr(held.k_held, held.k, k);
  const void* vp = read_ptr(held.v_held, held.v, v);
  if (ops::in_bf16<T>()) {
    // q, k, v rounded to bf16 (or, held narrowed, read as the bf16 values
    // they are), their products summed in fp32; o and lse come back fp32
    // (attention_flash_bf16.hpp says why), and o is rounded where it enters
    // the output projection's GEMM. The copies and the kernel's workspace
    // are pool tensors, made before runs() so that a count-only run
    // registers them too (ops_bf16.hpp).
    check_precision_supports(Precision::bf16, st.ctx.attention);
    if constexpr (std::is_same_v<T, float>) {
      if (s.B * s.Hq * s.Sq == 0) return;
      const Bf16AttentionParts parts =
          bf16_attention_parts(s, ops::AttentionPass::forward, held.flags(), false);
      Tensor<bf16> own;
      if (!scratch) own = bf16_attention_scratch(parts);
      Tensor<bf16>& buf = scratch ? *scratch : own;
      LAGA_CHECK(buf.bytes() >= parts.bytes(), "internal: a bf16 attention scratch of ",
                 buf.bytes(), " bytes for a call that needs ", parts.bytes());
      if (!ops::runs(s.B * s.Hq * s.Sq, {stats, o, qp, kp, vp})) return;
      const std::int64_t nq = s.B * s.Sq * s.Hq * s.dqk, nk = s.B * s.Sk * s.Hk * s.dqk,
                         nv = s.B * s.Sk * s.Hk * s.dv;
      auto* at = reinterpret_cast<unsigned char*>(buf.data());
      void* qc = at;
      void* kc = at + parts.q;
      void* vc = at + parts.q + parts.k;
      if (flash_bf16_isa() == FlashBf16Isa::fp32)
        // The bf16 kernels widen (flash_bf16_isa): the fp32 kernel on the
        // bf16 values, the same bits, one pass each.
        attention_flash_forward(s, o, stats, widened_operand(qc, q, held.q_held, held.q, nq),
                                widened_operand(kc, k, held.k_held, held.k, nk),
                                widened_operand(vc, v, held.v_held, held.v, nv));
      else
        attention_flash_forward_bf16(s, o, stats, bf16_operand(qc, q, held.q_held, held.q, nq),
                                     bf16_operand(kc, k, held.k_held, held.k, nk),
                                     bf16_operand(vc, v, held.v_held, held.v, nv),
                                     {at + parts.q + parts.k + parts.v, parts.workspace});
    }
    return;
  }
  if (!ops::runs(s.B * s.Hq * s.Sq, {stats, o, q, k, v})) return;
  if (eager)
    attention_eager_forward(s, o, stats, q, k, v, eager_lse);
  else
    attention_flash_forward(s, o, stats, q, k, v);
}

template <class T>
void Pieces<T>::attend_backward(const Step& st, const AttnShape& s, T* dq, T* dk, T* dv,
                                const T* dout, const T* q, const T* k, const T* v, const T* o,
                                const T* stats, T* dp, const T* eager_delta,
                                const NarrowedOperands* narrowed, Tensor<bf16>* scratch) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  // Per (query, key) pair and head, forward does q.k (dqk) and p.v (dv).
  // Eager's backward: dv = p^T do and dp = do v^T (dv each), dq = ds k and
  // dk = ds^T q (dqk each): twice forward. Flash recomputes q.k as well.
  const double per_pair_forward = double(s.dqk + s.dv);
  const double per_pair_backward = eager ? 2 * per_pair_forward : 3.0 * s.dqk + 2.0 * s.dv;
  ops::count_attention(s, st.ctx.attention, ops::AttentionPass::backward, [&] {
    return s.useful_flops_forward() * per_pair_backward / per_pair_forward;
  });
  // Eager reads the saved probabilities, writes dp and reads it back.
  if (eager) ops::count_elementwise<T>(s.B * s.Hq * s.Sq * s.Sk, 3);
  const NarrowedOperands held = held_operands<T>(narrowed);
  const void* qp = read_ptr(held.q_held, held.q, q);
  const void* kp = read_ptr(held.k_held, held.k, k);
  const void* vp = read_ptr(held.v_held, held.v, v);
  const void* doutp = read_ptr(held.dout_held, held.dout, dout);
  if (ops::in_bf16<T>()) {
    // dO, q, k, v rounded (the operands of dP = dO V^T, dV = P^T dO and
    // the recomputed scores), or, held narrowed, read as the bf16 values
    // they are; dq, dk, dv are the kernel's fp32 sums. Copies and workspace
    // as in forward: pool tensors made before runs().
    check_precision_supports(Precision::bf16, st.ctx.attention);
    if constexpr (std::is_same_v<T, float>) {
      if (s.B * s.Hq * s.Sq == 0) return;
      const Bf16AttentionParts parts =
          bf16_attention_parts(s, ops::AttentionPass::backward, held.flags(), false);
      Tensor<bf16> own;
      if (!scratch) own = bf16_attention_scratch(parts);
      Tensor<bf16>& buf = scratch ? *scratch : own;
      LAGA_CHECK(buf.bytes() >= parts.bytes(), "internal: a bf16 attention scratch of ",
                 buf.bytes(), " bytes for a call that needs ", parts.bytes());
      if (!ops::runs(s.B * s.Hq * s.Sq, {stats, dq, dk, dv, doutp, qp, kp, vp, o})) return;
      const std::int64_t nq = s.B * s.Sq * s.Hq * s.dqk, nk = s.B * s.Sk * s.Hk * s.dqk,
                         nv = s.B * s.Sk * s.Hk * s.dv, nd = s.B * s.Sq * s.Hq * s.dv;
      auto* at = reinterpret_cast<unsigned char*>(buf.data());
      void* qc = at;
      void* kc = at + parts.q;
      void* vc = at + parts.q + parts.k;
      void* dc = at + parts.q + parts.k + parts.v;
      if (flash_bf16_isa() == FlashBf16Isa::fp32)  // as forward
        attention_flash_backward(s, dq, dk, dv,
                                 widened_operand(dc, dout, held.dout_held, held.dout, nd),
                                 widened_operand(qc, q, held.q_held, held.q, nq),
                                 widened_operand(kc, k, held.k_held, held.k, nk),
                                 widened_operand(vc, v, held.v_held, held.v, nv), o, stats);
      else
        attention_flash_backward_bf16(
            s, dq, dk, dv, bf16_operand(dc, dout, held.dout_held, held.dout, nd),
            bf16_operand(qc, q, held.q_held, held.q, nq),
            bf16_operand(kc, k, held.k_held, held.k, nk),
            bf16_operand(vc, v, held.v_held, held.v, nv), o, stats,
            {at + parts.q + parts.k + parts.v + parts.dout, parts.workspace});
    }
    return;
  }
  if (!ops::runs(s.B * s.Hq * s.Sq, {stats, dq, dk, dv, doutp, qp, kp, vp, eager ? dp : o})) return;
  if (eager)
    attention_eager_backward(s, dq, dk, dv, dout, q, k, v, stats, dp, eager_delta);
  else
    attention_flash_backward(s, dq, dk, dv, dout, q, k, v, o, stats);
}

template <class T>
Tensor<bf16> Pieces<T>::attention_scratch(const AttnShape& s, ops::AttentionPass pass,
                                          const NarrowedOperands* narrowed) {
  if (!ops::in_bf16<T>()) return {};
  return bf16_attention_scratch(
      bf16_attention_parts(s, pass, narrowed ? narrowed->flags() : std::array<bool, 4>{}, true));
}

template <class T>
Tensor<T> Pieces<T>::attention_forward(const Step& st, const AttnShape& s, Tensor<T>& o,
                                       const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  Tensor<T> stats(eager ? Shape{s.B, s.Hq, s.Sq, s.Sk} : Shape{s.B, s.Hq, s.Sq},
                  eager ? "attn_stats eager probs" : "attn_stats flash lse");
  attend(st, s, o.data(), stats.data(), q.data(), k.data(), v.data());
  return stats;
}

template <class T>
void Pieces<T>::attention_backward(const Step& st, const AttnShape& s, Tensor<T>& dq, Tensor<T>& dk,
                                   Tensor<T>& dv, const Tensor<T>& dout, const Tensor<T>& q,
                                   const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>& o,
                                   Tensor<T>& stats) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  Tensor<T> dp;  // eager: one head's dp at a time
  if (eager) dp = Tensor<T>({s.Sq, s.Sk}, "eager dp scratch");
  const NarrowedOperands held{q.narrowed_data(),    k.narrowed_data(), v.narrowed_data(),
                              dout.narrowed_data(), q.narrowed(),      k.narrowed(),
                              v.narrowed(),         dout.narrowed()};
  const bool narrowed = q.narrowed() || k.narrowed() || v.narrowed() || dout.narrowed();
  attend_backward(st, s, dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                  o.data(), stats.data(), dp.data(), nullptr, narrowed ? &held : nullptr);
  dp.reset();
  stats.reset();
}

template <class T>
Tensor<T> Pieces<T>::project_out(const Step& st, const MlaParams<T>& w, const Tensor<T>& o_h,
                                 Tensor<T>& out) {
  Tensor<T> o_loc({st.B, st.L, st.H * st.dv}, "o_loc");
  redistribute(st.ctx.comm, st.B, st.attention, st.tokens, o_h.data(), o_loc.data(), st.dv,
               "out_a2a");
  out = Tensor<T>({st.B, st.L, st.D}, "out");
  ops::linear(mat(out), mat(o_loc), w.wo);
  // Backward reads it only as wo's gradient's GEMM operand, rounded there.
  ops::keep_narrowed(o_loc);
  return o_loc;
}

template <class T>
Tensor<T> Pieces<T>::project_out_backward(const Step& st, const MlaParams<T>& w,
                                          const Tensor<T>& dout, Tensor<T>& o_loc,
                                          MlaParams<T>& grads) {
  // o_loc may be held narrowed: wo's gradient reads it in place.
  Tensor<T> do_loc({st.B, st.L, st.H * st.dv}, "do_loc");
  ops::Mat<T> do_loc_m = mat(do_loc);
  ops::linear_backward(&do_loc_m, false, grads.wo, mat(dout), std::as_const(o_loc), w.wo);
  o_loc.reset();
  return to_heads(st, do_loc, st.dv, "out_a2a", "do_h");
}

template <class T>
void Pieces<T>::project_in_backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                    Tensor<T>& dq, Tensor<T>& dlat_loc, Tensor<T>& dproj,
                                    InputSaved<T>& in, Tensor<T>& dx, MlaParams<T>& grads,
                                    StartedSeq<T>* dlat_pending) {
  if (!dproj.defined()) dproj = Tensor<T>({st.B, st.L, st.Nq + st.W}, "dproj");
  if (dlat_pending) {
    query_backward(st, w, dq, in, dproj, grads);
    dlat_pending->wait(st.ctx.comm);
    latent_norm_backward(st, w, dlat_loc, in, dproj, grads);
  } else {
    latent_norm_backward(st, w, dlat_loc, in, dproj, grads);
    query_backward(st, w, dq, in, dproj, grads);
  }
  in.proj.reset(), in.kv_a.reset();
  // Both projections' backward in one GEMM each way: dx (N, D) = dproj
  // in_proj, and in_proj's gradient (wq's or wq_a's rows and wkv_a's)
  // += dproj^T x.
  dx = Tensor<T>({st.B, st.L, st.D}, "dx");
  ops::Mat<T> dx_m = mat(dx);
  ops::linear_backward(&dx_m, false, grads.in_proj, mat(std::as_const(dproj)), mat(x), w.in_proj);
  dproj.reset();
}

template <class T>
void Pieces<T>::latent_norm_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dlat_loc,
                                     InputSaved<T>& in, Tensor<T>& dproj, MlaParams<T>& grads) {
  // A rotation's Jacobian is its transpose: rotate the gradient back.
  st.rope(mat(dlat_loc).col_range(st.C, st.dr), 1, 0, true);
  // d kv_a = [d c | d k_pe], into dproj's last C + dr columns: d c through
  // the norm, d k_pe as it is.
  const ops::Mat<T> dkv_a = mat(dproj).col_range(st.Nq, st.W);
  const ops::Mat<const T> dlat = mat(std::as_const(dlat_loc));
  ops::rmsnorm_backward(dkv_a.col_range(0, st.C), grads.kv_norm, dlat.col_range(0, st.C),
                        in.kv_a_rows(st).col_range(0, st.C), w.kv_norm, in.kv_rstd);
  ops::copy(dkv_a.col_range(st.C, st.dr), dlat.col_range(st.C, st.dr));
  dlat_loc.reset();
  in.kv_rstd.reset();
}

template <class T>
void Pieces<T>::query_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq,
                               InputSaved<T>& in, Tensor<T>& dproj, MlaParams<T>& grads) {
  const bool per_head = st.ctx.variant.queries == QueryExchange::heads;
  if (st.rq == 0) {
    // dq is dproj's first Nq columns already (queries_to_tokens); rotated
    // back as the latent is.
    st.rope(mat(dproj).col_range(st.dn, st.Nq - st.dn), st.H, st.dqk, true);
    return;
  }
  // d qn (B, L, rq): through wq_b here, or already (the latent exchange's dq
  // is past its rotation and wq_b).
  Tensor<T> dqn_heads;
  if (per_head) {
    st.rope(mat(dq).col_range(st.dn, st.H * st.dqk - st.dn), st.H, st.dqk, true);
    dqn_heads = Tensor<T>({st.B, st.L, st.rq}, "dqn");
    ops::Mat<T> dqn_m = mat(dqn_heads);
    ops::linear_backward(&dqn_m, false, grads.wq_b, mat(std::as_const(dq)), mat(in.qn), w.wq_b);
    in.qn.reset();
    dq.reset();
  }
  const Tensor<T>& dqn = per_head ? dqn_heads : dq;
  // d qa, into dproj's first rq columns; qa is in.proj's.
  ops::rmsnorm_backward(mat(dproj).col_range(0, st.rq), grads.q_norm, mat(dqn),
                        mat(std::as_const(in.proj)).col_range(0, st.rq), w.q_norm, in.q_rstd);
  in.q_rstd.reset();
  dq.reset();
}

template <class T>
void Pieces<T>::split_kv(const Step& st, std::int64_t heads, ops::In<T> kv, ops::In<T> k_pe,
                         ops::Mat<T> km, ops::Mat<T> vm) {
  for (std::int64_t h = 0; h < heads; ++h) {
    ops::copy(km.col_range(h * st.dqk, st.dn), kv.col_range(h * st.KV, st.dn));
    ops::copy(km.col_range(h * st.dqk + st.dn, st.dr), k_pe);
    ops::copy(vm.col_range(h * st.dv, st.dv), kv.col_range(h * st.KV + st.dn, st.dv));
  }
}

template <class T>
void Pieces<T>::merge_dkv(const Step& st, std::int64_t heads, ops::In<T> dkm, ops::In<T> dvm,
                          ops::Mat<T> dkvm, ops::Mat<T> dk_pe) {
  for (std::int64_t h = 0; h < heads; ++h) {
    ops::copy(dkvm.col_range(h * st.KV, st.dn), dkm.col_range(h * st.dqk, st.dn));
    ops::copy(dkvm.col_range(h * st.KV + st.dn, st.dv), dvm.col_range(h * st.dv, st.dv));
    ops::add(dk_pe, dkm.col_range(h * st.dqk + st.dn, st.dr));
  }
}

template <class T>
typename Pieces<T>::LocalKv Pieces<T>::local_kv(const Step& st, const MlaParams<T>& w,
                                                const Tensor<T>& c_hat, const InputSaved<T>& in) {
  LocalKv r{Tensor<T>({st.B, st.L, st.H * st.dqk}, "k_loc"),
            Tensor<T>({st.B, st.L, st.H * st.dv}, "v_loc")};
  Tensor<T> kv({st.B, st.L, st.H * st.KV}, "kv");
  ops::linear(mat(kv), mat(c_hat), w.wkv_b);
  split_kv(st, st.H, mat(std::as_const(kv)), in.kv_a_rows(st).col_range(st.C, st.dr), mat(r.k),
           mat(r.v));
  return r;
}

template <class T>
Tensor<T> Pieces<T>::local_kv_backward(const Step& st, const MlaParams<T>& w, ops::In<T> dk,
                                       ops::In<T> dv, const Tensor<T>& c_hat, MlaParams<T>& grads) {
  Tensor<T> dlat_loc = Tensor<T>::zeros({st.B, st.L, st.W}, "dlat_loc");
  Tensor<T> dkv({st.B, st.L, st.H * st.KV}, "dkv");
  merge_dkv(st, st.H, dk, dv, mat(dkv), mat(dlat_loc).col_range(st.C, st.dr));
  ops::gemm(mat(dlat_loc).col_range(0, st.C), T(0), mat(std::as_const(dkv)), false, mat(w.wkv_b),
            false);
  ops::linear_backward<T>(nullptr, false, grads.wkv_b, mat(std::as_const(dkv)), mat(c_hat),
                          w.wkv_b);
  return dlat_loc;
}

template <class T>
typename LagaInputs<T>::Qkv LagaInputs<T>::forward(const Step& st, const MlaParams<T>& w,
                                                   const Tensor<T>& x, UpProjection up) {
  using P = Pieces<T>;
  const bool latent = st.ctx.variant.queries == QueryExchange::latent;
  Qkv r;
  P::project_in(st, w, x, in);
  if (st.ctx.variant.overlap == Overlap::on) {
    // The latent first: its all-gather is on the link while the queries are
    // projected (their own collective queues behind it); waited for only
    // where the up-projection reads it.
    StartedSeq<T> lat_ag;
    {
      Tensor<T> c_hat = P::project_latent(st, w, in, "c_hat");
      lat = P::gather_latent(st, c_hat, in.kv_a_rows(st), &lat_ag);
    }
    r.q_h = latent ? exchange_query_latent(st, w) : P::queries_to_heads(st, w, in);
    lat_ag.wait(st.ctx.comm);
  } else {
    if (latent) r.q_h = exchange_query_latent(st, w);
    Tensor<T> c_hat = P::project_latent(st, w, in, "c_hat");
    if (!latent) r.q_h = P::queries_to_heads(st, w, in);
    lat = P::gather_latent(st, c_hat, in.kv_a_rows(st));
  }
  if (up == UpProjection::stored) {
    P::up_project_kv(st, w, lat, st.Sk, r.k_h, r.v_h);
    // [c_hat | k_pe]: RMSNorm's and RoPE's rounded outputs, gathered as
    // bf16, so bf16 values; backward reads it as wkv_b's GEMM operand.
    ops::keep_narrowed(lat);
  }
  return r;
}

template <class T>
void LagaInputs<T>::backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                             Tensor<T>& dq_h, Tensor<T>& dk_h, Tensor<T>& dv_h, Tensor<T>& dx,
                             MlaParams<T>& grads) {
  Tensor<T> dproj;  // rq == 0: the per-head dq lands in it
  Tensor<T> dq = queries_backward(st, w, dq_h, dproj, grads);
  ops::widen_kept(lat);
  Tensor<T> dlat = Pieces<T>::up_project_kv_backward(st, w, lat, st.Sk, dk_h, dv_h, grads);
  latent_backward(st, w, x, dq, dproj, dlat, dx, grads);
}

template <class T>
void LagaInputs<T>::backward_from_latent(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                         Tensor<T>& dq_h, Tensor<T>& dlat, Tensor<T>& dx,
                                         MlaParams<T>& grads) {
  Tensor<T> dproj;
  Tensor<T> dq = queries_backward(st, w, dq_h, dproj, grads);
  latent_backward(st, w, x, dq, dproj, dlat, dx, grads);
}

template <class T>
Tensor<T> LagaInputs<T>::queries_backward(const Step& st, const MlaParams<T>& w, Tensor<T>& dq_h,
                                          Tensor<T>& dproj, MlaParams<T>& grads) {
  return st.ctx.variant.queries == QueryExchange::latent
             ? query_latent_backward(st, w, dq_h, grads)
             : Pieces<T>::queries_to_tokens(st, dq_h, dproj);
}

template <class T>
void LagaInputs<T>::latent_backward(const Step& st, const MlaParams<T>& w, const Tensor<T>& x,
                                    Tensor<T>& dq, Tensor<T>& dproj, Tensor<T>& dlat, Tensor<T>& dx,
                                    MlaParams<T>& grads) {
  using P = Pieces<T>;
  lat.reset();
  // Overlap: the reduce-scatter is on the link while the query path's
  // backward runs (project_in_backward waits for it before the latent's).
  StartedSeq<T> dlat_rs;
  StartedSeq<T>* started = st.ctx.variant.overlap == Overlap::on ? &dlat_rs : nullptr;
  Tensor<T> dlat_loc = P::reduce_latent(st, dlat, started);
  P::project_in_backward(st, w, x, dq, dlat_loc, dproj, in, dx, grads, started);
}

namespace {
// wq_b's (or its gradient's) rows of this rank's heads: (H_r dqk, rq), a
// const view of a const tensor.
template <class Weight>
auto own_rows(const Step& st, Weight& wq_b) {
  return mat(wq_b).row_range(st.h0 * st.dqk, st.Hr * st.dqk);
}
// The rope columns of q_h or dq_h (B Sq rows, H_r heads of dqk); a rank
// without heads has none to rotate.
template <class T>
void rotate_queries(const Step& st, Tensor<T>& q_h, bool inverse) {
  if (st.Hr == 0) return;
  st.rope_queries(mat(q_h, st.B * st.Sq, st.Hr * st.dqk).col_range(st.dn, st.Hr * st.dqk - st.dn),
                  st.Hr, st.dqk, inverse);
}
}  // namespace

template <class T>
Tensor<T> LagaInputs<T>::exchange_query_latent(const Step& st, const MlaParams<T>& w) {
  Pieces<T>::project_q_latent(st, w, in);
  qn_q = Tensor<T>({st.B, st.Sq, st.rq}, "qn_q");
  if (st.attends_all_queries)
    gather_seq(st.ctx.comm, st.ctx.layout, in.qn.data(), qn_q.data(), st.rq, "q_latent_ag");
  else
    redistribute(st.ctx.comm, st.B, st.tokens.rows_only(), st.attention.rows_only(), in.qn.data(),
                 qn_q.data(), st.rq, "q_latent_a2a");
  in.qn.reset();  // its rows are in qn_q, where wq_b's gradient reads them
  Tensor<T> q_h({st.B, st.Sq, st.Hr, st.dqk}, "q_h");
  ops::gemm(mat(q_h, st.B * st.Sq, st.Hr * st.dqk), T(0), mat(std::as_const(qn_q)), false,
            own_rows(st, w.wq_b), true);
  rotate_queries(st, q_h, false);
  return q_h;
}

template <class T>
Tensor<T> LagaInputs<T>::query_latent_backward(const Step& st, const MlaParams<T>& w,
                                               Tensor<T>& dq_h, MlaParams<T>& grads) {
  rotate_queries(st, dq_h, true);
  const ops::Mat<const T> dq_m = mat(std::as_const(dq_h), st.B * st.Sq, st.Hr * st.dqk);
  // wq_b's gradient first, so that qn_q is gone before d qn_q (both
  // (B, Sq, rq)) exists.
  ops::gemm(own_rows(st, grads.wq_b), T(1), dq_m, true, mat(std::as_const(qn_q)), false);
  qn_q.reset();
  Tensor<T> dqn_q({st.B, st.Sq, st.rq}, "dqn_q");
  ops::gemm(mat(dqn_q), T(0), dq_m, false, own_rows(st, w.wq_b), false);
  dq_h.reset();
  Tensor<T> dqn({st.B, st.L, st.rq}, "dqn");
  if (st.attends_all_queries)
    reduce_scatter_seq(st.ctx.comm, st.ctx.layout, dqn_q.data(), dqn.data(), st.rq, "q_latent_ag");
  else
    redistribute_sum(st.ctx.comm, st.B, st.attention.rows_only(), st.tokens.rows_only(),
                     dqn_q.data(), dqn.data(), st.rq, "q_latent_a2a");
  return dqn;
}

template <class T>
void HeadAttention<T>::forward(const Step& st, const MlaParams<T>& w, Tensor<T>& out,
                               Tensor<T>& o_loc) {
  o_att = Tensor<T>({st.B, st.S, st.Hr, st.dv}, "o_att");
  stats = Pieces<T>::attention_forward(st, st.head_attention(), o_att, q_h, k_h, v_h);
  o_loc = Pieces<T>::project_out(st, w, o_att, out);
  if (st.ctx.attention == AttentionKind::eager) o_att.reset();  // only flash's backward reads o
  // Backward reads q, k, v only as attention's operands, rounded there (o_att
  // stays fp32: flash's backward reads it in fp32, for D = rowsum(dO o)).
  ops::keep_narrowed(q_h), ops::keep_narrowed(k_h), ops::keep_narrowed(v_h);
}

template <class T>
typename HeadAttention<T>::Grads HeadAttention<T>::backward(const Step& st, Tensor<T>& do_h) {
  // Attention reads dO only as its bf16 operand and, widened exactly, for
  // D = rowsum(dO o): held at 2 bytes from here, it needs no copy in the
  // call's scratch (ops::keep_narrowed; the same bits).
  ops::keep_narrowed(do_h);
  Grads g;
  g.dq_h = Tensor<T>({st.B, st.S, st.Hr, st.dqk}, "dq_h");
  g.dk_h = Tensor<T>({st.B, st.S, st.Hr, st.dqk}, "dk_h");
  g.dv_h = Tensor<T>({st.B, st.S, st.Hr, st.dv}, "dv_h");
  Pieces<T>::attention_backward(st, st.head_attention(), g.dq_h, g.dk_h, g.dv_h, do_h, q_h, k_h,
                                v_h, o_att, stats);
  do_h.reset();
  q_h.reset(), k_h.reset(), v_h.reset(), o_att.reset();
  return g;
}

namespace {

// A range of n queries ending at token `end` sees keys [0, end): Sq = n,
// Sk = end, and the kernel's bottom-right alignment puts query i at token
// end - n + i. One call over the whole batch when the rank has one range and
// its rows are the batch's uniform slices (B = 1, or Sk = S = kv_rows so
// that the documents' (B, S) starts are the kernel's (B, Sk)); else one per
// batch row and range, the range that reaches Sk first in each row.
std::vector<AttnCall> attention_calls(const Step& st, std::int64_t kv_rows) {
  const bool eager = st.ctx.attention == AttentionKind::eager;
  const std::int64_t* starts = st.doc_start.empty() ? nullptr : st.doc_start.data();
  std::vector<AttnCall> calls;
  std::int64_t stats = 0;
  // Count-only (no documents there): batch row 0's calls, each standing for
  // all B rows' (AttnCall::repeat), so that the list does not grow with B.
  const bool counting = current_pool().count_only();
  LAGA_CHECK(!counting || !starts, "internal: documents in a count-only run");
  const std::int64_t repeat = counting ? st.B : 1;
  auto add = [&](std::int64_t batch, std::int64_t n, std::int64_t end, std::int64_t q_row,
                 std::int64_t kv_row, const std::int64_t* doc_start) {
    AttnCall c;
    c.shape =
        AttnShape{batch, n, end, st.Hr, st.Hr, st.dqk, st.dv, st.ctx.cfg.softmax_scale(), true};
    c.shape.doc_start = doc_start;
    c.q_row = q_row, c.kv_row = kv_row, c.stats = stats, c.all_keys = end == st.Sk;
    c.repeat = batch == 1 ? repeat : 1;
    stats += c.repeat * batch * st.Hr * n * (eager ? end : 1);
    calls.push_back(c);
  };
  const std::vector<TokenRange>& ranges = st.query_ranges;
  if (ranges.size() == 1 && (st.B == 1 || (st.Sk == st.S && kv_rows == st.S))) {
    add(st.B, ranges[0].size(), ranges[0].end, 0, 0, starts);
    return calls;
  }
  for (std::int64_t b = 0; b < (counting ? 1 : st.B); ++b) {
    std::int64_t row = b * st.Sq + st.Sq;  // past the last range's rows
    for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
      row -= it->size();
      add(1, it->size(), it->end, row, b * kv_rows, starts ? starts + b * st.S : nullptr);
    }
  }
  return calls;
}

// Row r of a (rows, H_r, d) view of t (of its bf16 values, held narrowed).
template <class T>
T* row(const Step& st, Tensor<T>& t, std::int64_t d, std::int64_t r) {
  return at(t.data(), r * st.Hr * d);
}
template <class T>
const bf16* narrowed_row(const Step& st, const Tensor<T>& t, std::int64_t d, std::int64_t r) {
  return at(t.narrowed_data(), r * st.Hr * d);
}

}  // namespace

template <class T>
void RangeAttention<T>::forward(const Step& st) {
  LAGA_CHECK(kv_rows >= st.Sk, "internal: RangeAttention over ", kv_rows,
             " key rows per batch row, but its queries see ", st.Sk);
  calls = attention_calls(st, kv_rows);
  const bool eager = st.ctx.attention == AttentionKind::eager;
  std::int64_t n = 0;  // every call's statistics: eager probabilities or flash lse
  for (const AttnCall& c : calls)
    n += c.repeat * c.shape.B * c.shape.Hq * c.shape.Sq * (eager ? c.shape.Sk : 1);
  o_att = Tensor<T>({st.B, st.Sq, st.Hr, st.dv}, "o_att");
  stats = Tensor<T>({n}, eager ? "attn_stats eager probs" : "attn_stats flash lse");
  for (const AttnCall& c : calls) {
    const ops::RepeatCounts rows(c.repeat);
    Pieces<T>::attend(st, c.shape, row(st, o_att, st.dv, c.q_row), at(stats.data(), c.stats),
                      row(st, q_h, st.dqk, c.q_row), row(st, k_h, st.dqk, c.kv_row),
                      row(st, v_h, st.dv, c.kv_row));
  }
  // As HeadAttention's: backward reads q, k, v only as attention's operands.
  ops::keep_narrowed(q_h), ops::keep_narrowed(k_h), ops::keep_narrowed(v_h);
}

template <class T>
typename RangeAttention<T>::Grads RangeAttention<T>::backward(const Step& st, Tensor<T>& do_h) {
  ops::keep_narrowed(do_h);  // as HeadAttention's
  Grads g;
  g.dq_h = Tensor<T>({st.B, st.Sq, st.Hr, st.dqk}, "dq_h");
  // Key rows past Sk are no call's: zero, where the tensor has them.
  const Shape dk_shape{st.B, kv_rows, st.Hr, st.dqk}, dv_shape{st.B, kv_rows, st.Hr, st.dv};
  g.dk_h = kv_rows > st.Sk ? Tensor<T>::zeros(dk_shape, "dk_h") : Tensor<T>(dk_shape, "dk_h");
  g.dv_h = kv_rows > st.Sk ? Tensor<T>::zeros(dv_shape, "dv_h") : Tensor<T>(dv_shape, "dv_h");
  {
    // Scratch: eager's dp of one head, and the keys' gradients of a call
    // that does not reach Sk, added into dk_h and dv_h after it.
    const bool eager = st.ctx.attention == AttentionKind::eager;
    std::int64_t dp = 0, part = 0;
    for (const AttnCall& c : calls) {
      dp = std::max(dp, c.shape.Sq * c.shape.Sk);
      if (!c.all_keys) part = std::max(part, c.shape.Sk);
    }
    Tensor<T> dp_scratch;
    if (eager) dp_scratch = Tensor<T>({dp}, "eager dp scratch");
    Tensor<T> dk_part({part, st.Hr, st.dqk}, "dk_part"), dv_part({part, st.Hr, st.dv}, "dv_part");
    for (const AttnCall& c : calls) {
      const ops::RepeatCounts rows(c.repeat);
      const AttnShape& s = c.shape;
      T* dk = c.all_keys ? row(st, g.dk_h, st.dqk, c.kv_row) : dk_part.data();
      T* dv = c.all_keys ? row(st, g.dv_h, st.dv, c.kv_row) : dv_part.data();
      const typename Pieces<T>::NarrowedOperands held{narrowed_row(st, q_h, st.dqk, c.q_row),
                                                      narrowed_row(st, k_h, st.dqk, c.kv_row),
                                                      narrowed_row(st, v_h, st.dv, c.kv_row),
                                                      narrowed_row(st, do_h, st.dv, c.q_row),
                                                      q_h.narrowed(),
                                                      k_h.narrowed(),
                                                      v_h.narrowed(),
                                                      do_h.narrowed()};
      const bool narrowed = q_h.narrowed() || k_h.narrowed() || v_h.narrowed() || do_h.narrowed();
      Pieces<T>::attend_backward(st, s, row(st, g.dq_h, st.dqk, c.q_row), dk, dv,
                                 row(st, do_h, st.dv, c.q_row), row(st, q_h, st.dqk, c.q_row),
                                 row(st, k_h, st.dqk, c.kv_row), row(st, v_h, st.dv, c.kv_row),
                                 row(st, o_att, st.dv, c.q_row), at(stats.data(), c.stats),
                                 dp_scratch.data(), nullptr, narrowed ? &held : nullptr);
      if (c.all_keys) continue;
      ops::add(mat(g.dk_h, st.B * kv_rows, st.Hr * st.dqk).row_range(c.kv_row, s.Sk),
               mat(std::as_const(dk_part), part, st.Hr * st.dqk).row_range(0, s.Sk));
      ops::add(mat(g.dv_h, st.B * kv_rows, st.Hr * st.dv).row_range(c.kv_row, s.Sk),
               mat(std::as_const(dv_part), part, st.Hr * st.dv).row_range(0, s.Sk));
    }
  }
  stats.reset(), do_h.reset();
  q_h.reset(), k_h.reset(), v_h.reset(), o_att.reset();
  return g;
}

template struct RangeAttention<float>;
template struct RangeAttention<double>;
template struct HeadAttention<float>;
template struct HeadAttention<double>;
template struct LagaInputs<float>;
template struct LagaInputs<double>;

template struct Pieces<float>;
template struct Pieces<double>;

}  // namespace detail

template <class T>
MlaSaved<T>::MlaSaved() = default;
template <class T>
MlaSaved<T>::~MlaSaved() = default;
template <class T>
MlaSaved<T>::MlaSaved(MlaSaved&&) noexcept = default;
template <class T>
MlaSaved<T>& MlaSaved<T>::operator=(MlaSaved&&) noexcept = default;
template <class T>
void MlaSaved<T>::clear() {
  tape_.reset();
  step_.reset();
}
template class MlaSaved<float>;
template class MlaSaved<double>;

namespace detail {

template <class T>
void BlockApi<T>::forward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                          Tensor<T>& out, MlaSaved<T>& saved) {
  saved.clear();
  saved.step_ = std::make_unique<Step>(ctx);
  const Step& st = *saved.step_;
  LAGA_CHECK(x.shape() == Shape({st.B, st.L, st.D}), "mla_forward: x on rank ", ctx.comm.rank(),
             " has shape ", to_string(x.shape()), " but this rank's shard needs ",
             to_string(Shape{st.B, st.L, st.D}));
  ctx.comm.set_phase(Phase::forward);
  const FormEntry& form = form_entry(ctx.variant.form);
  if constexpr (std::is_same_v<T, float>)
    saved.tape_ = form.f32(st, w, x, out);
  else
    saved.tape_ = form.f64(st, w, x, out);
}

template <class T>
void BlockApi<T>::backward(const BlockContext& ctx, const MlaParams<T>& w, const Tensor<T>& x,
                           const Tensor<T>& dout, MlaSaved<T>& saved, Tensor<T>& dx,
                           MlaParams<T>& grads) {
  LAGA_CHECK(!saved.empty(), "mla_backward: nothing saved; call mla_forward first");
  // The whole variant and the kernel: a backward of another variant would
  // read the tape of one form with the geometry of another.
  const BlockContext& ran = saved.step_->ctx;
  LAGA_CHECK(ran.variant == ctx.variant && ran.attention == ctx.attention,
             "mla_backward: forward ran ", to_string(ran.variant), " (head groups ",
             ran.variant.head_groups, ", ", to_string(ran.attention),
             ") but backward was asked for ", to_string(ctx.variant), " (head groups ",
             ctx.variant.head_groups, ", ", to_string(ctx.attention), ")");
  LAGA_CHECK(&saved.step_->ctx.comm == &ctx.comm,
             "mla_backward: called with another communicator than its forward");
  LAGA_CHECK(dout.shape() == x.shape(), "mla_backward: dout has shape ", to_string(dout.shape()),
             " but x has ", to_string(x.shape()));
  ctx.comm.set_phase(Phase::backward);
  saved.tape_->backward(*saved.step_, w, x, dout, dx, grads);
  saved.clear();
}

template <class T>
void BlockApi<T>::sync_gradients(Communicator& comm, MlaParams<T>& grads) {
  // One rank's gradients are the sum already; the all-reduce would only copy
  // every parameter's gradient twice (and stage it, in-process).
  if (comm.size() == 1) return;
  comm.set_phase(Phase::grad_sync);
  Tensor<T> flat({grads.numel()}, "grad_allreduce flat", MemCategory::comm_buffers);
  std::int64_t off = 0;
  grads.for_each([&](const std::string&, Tensor<T>& g) {
    ops::copy(ops::flat(flat).col_range(off, g.numel()), ops::flat(std::as_const(g)));
    off += g.numel();
  });
  wire::all_reduce_gradients(comm, flat.data(), flat.numel());
  off = 0;
  grads.for_each([&](const std::string&, Tensor<T>& g) {
    ops::copy(ops::flat(g), ops::flat(std::as_const(flat)).col_range(off, g.numel()));
    off += g.numel();
  });
}

template struct BlockApi<float>;
template struct BlockApi<double>;

}  // namespace detail

}  // namespace laga
