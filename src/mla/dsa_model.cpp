// DSA's closed forms (mla/dsa_model.hpp; docs/forms.md, "DSA").
#include "mla/dsa_model.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace laga {

namespace {
std::size_t z(std::int64_t i) {
  return static_cast<std::size_t>(i);
}
// The keys a rank's own rows read: every token up to its last row (its
// shard's end; the DSA forms refuse zigzag, where this would be its second
// chunk's end).
std::int64_t keys_read(const SpLayout& layout, int rank) {
  std::int64_t end = 0;
  for (const TokenRange& t : layout.seq_ranges[z(rank)]) end = std::max(end, t.end);
  return end;
}
// Indices (int32) and the KL target (fp32) keep 4 bytes under bf16.
constexpr std::int64_t kIndexBytes = 4;
constexpr std::int64_t kStatBytes = 4;

// The forms' registry (DsaFormTraits, mla/dsa_model.hpp): one row each.
constexpr DsaFormTraits kRows[] = {
    {DsaForm::latent_gather, "latent_gather", "latent_ag, index_k_ag",
     "dsa_latent_gather (mla/dsa_cp.hpp)"},
    {DsaForm::laga_indices, "laga_indices",
     "latent_ag, index_k_ag, q_a2a, topk_ag, index_target_rs, out_a2a",
     "dsa_laga (mla/dsa_laga.hpp)"},
    {DsaForm::laga_recompute, "laga_recompute",
     "latent_ag, index_k_ag, q_latent_ag, index_w_ag, index_target_rs, out_a2a",
     "dsa_laga (mla/dsa_laga.hpp)"},
    {DsaForm::explicit_form, "explicit",
     "index_k_ag, topk_ag, q_a2a, k_a2a, v_a2a, index_target_rs, out_a2a",
     "dsa_explicit (mla/dsa_explicit.hpp)"},
    {DsaForm::ring_latent, "ring_latent", "index_k_ring, latent_ring", nullptr},
};
using Row = DsaFormTraits;
}  // namespace

void DsaConfig::validate(const MlaConfig& mla) const {
  with(mla).validate_dsa();
}

MlaConfig DsaConfig::with(MlaConfig mla) const {
  mla.index_n_heads = index_n_heads;
  mla.index_head_dim = index_head_dim;
  mla.index_topk = index_topk;
  return mla;
}

std::optional<DsaConfig> DsaConfig::of(const MlaConfig& mla) {
  if (!mla.dsa()) return std::nullopt;
  return DsaConfig{mla.index_n_heads, mla.index_head_dim, mla.index_topk};
}

std::optional<DsaConfig> DsaConfig::from_json(const nlohmann::json& j, const std::string& source) {
  MlaConfig keys;  // only the three keys are read: MlaConfig::read_dsa_keys
  keys.read_dsa_keys(j, source);
  return of(keys);
}

std::optional<DsaConfig> DsaConfig::preset(const std::string& name) {
  if (name == "deepseek-v3.2") return DsaConfig{64, 128, 2048};
  if (name == "glm-5-like") return DsaConfig{32, 128, 2048};
  return std::nullopt;
}

std::int64_t DsaConfig::parameter_count(const MlaConfig& m) const {
  return index_n_heads * index_head_dim * m.q_lora_rank + index_head_dim * m.dim +
         2 * index_head_dim + index_n_heads * m.dim;
}

const char* to_string(DsaForm f) {
  for (const Row& r : kRows)
    if (r.form == f) return r.name;
  return "?";
}

const DsaFormTraits& dsa_form_traits(DsaForm f) {
  for (const Row& r : kRows)
    if (r.form == f) return r;
  fail("dsa_form_traits: DsaForm ", static_cast<int>(f), " has no row");
}

DsaForm parse_dsa_form(const std::string& s) {
  std::string names;
  for (const Row& r : kRows) {
    if (s == r.name) return r.form;
    names += (names.empty() ? "" : ", ") + std::string(r.name);
  }
  fail("unknown DSA form '", s, "'; choose one of: ", names);
}

std::vector<DsaForm> all_dsa_forms() {
  std::vector<DsaForm> v;
  for (const Row& r : kRows) v.push_back(r.form);
  return v;
}

bool dsa_head_sharded(DsaForm f) {
  return f == DsaForm::laga_indices || f == DsaForm::laga_recompute || f == DsaForm::explicit_form;
}

std::int64_t dsa_selected_pairs(const std::vector<TokenRange>& rows, std::int64_t K) {
  // sum_{t=b}^{e-1} min(K, t+1): the rows below K see t + 1 keys, the rest K.
  std::int64_t n = 0;
  for (const TokenRange& r : rows) {
    const std::int64_t lo = std::min(r.begin, K), hi = std::min(r.end, K);  // rows t < K
    n += (hi * (hi + 1) - lo * (lo + 1)) / 2;
    n += (r.end - r.begin - (hi - lo)) * K;
  }
  return n;
}

std::int64_t dsa_indexer_pairs(const std::vector<TokenRange>& rows) {
  std::int64_t n = 0;
  for (const TokenRange& r : rows) n += (r.end * (r.end + 1) - r.begin * (r.begin + 1)) / 2;
  return n;
}

namespace {

// The dense form whose placement a DSA form's terms are written in.
FormVariant placement_variant(DsaForm f) {
  switch (f) {
    case DsaForm::latent_gather:
      return Form::allgather_kv;  // own queries, every head
    case DsaForm::laga_indices:
      return Form::laga;
    case DsaForm::laga_recompute:
      return {Form::laga, QueryExchange::latent};
    case DsaForm::explicit_form:
      return Form::explicit_form;
    case DsaForm::ring_latent:
      return Form::ring_latent;
  }
  return Form::laga;
}

}  // namespace

FormVariant dsa_placement(DsaForm f) {
  return placement_variant(f);
}

void dsa_collectives(CommTerms& t, const DsaConfig& dsa, DsaForm form, DsaStage stage) {
  const MlaConfig& cfg = t.cfg;
  const std::int64_t di = dsa.index_head_dim, Hi = dsa.index_n_heads, K = dsa.index_topk;
  const std::int64_t W = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
  // A term of width w in 4-byte elements (the int32 indices, the fp32 KL
  // target), whatever the terms' element: every term is a multiple of it.
  auto at4 = [&](PredictedBytes b) {
    b.sent = b.sent / t.elem_bytes * kIndexBytes;
    b.received = b.received / t.elem_bytes * kIndexBytes;
    return b;
  };
  // k_I gathered forward, its gradient reduce-scattered to the keys' owners
  // backward (wk's weight gradient needs each key's own x).
  auto index_keys = [&](Phase ph) {
    if (ph == Phase::forward)
      return t.add(ph, "index_k_ag", t.all_gather(di), CollectiveKind::all_gather);
    t.add(ph, "index_k_ag", t.reduce_scatter(di), CollectiveKind::reduce_scatter);
  };
  // Each rank's partial (its heads') sum of the slots' attention
  // probabilities, summed at the query's owner: the indexer's KL target,
  // at fp32 or the activations' element when wider (dsa_model.hpp).
  auto kl_target = [&](std::int64_t slots) {
    const PredictedBytes b = t.reduce_scatter(slots);
    t.add(Phase::forward, "index_target_rs", t.elem_bytes < kStatBytes ? at4(b) : b,
          CollectiveKind::reduce_scatter);
  };
  switch (form) {
    case DsaForm::latent_gather:
      t.latent_gather(Phase::forward);
      index_keys(Phase::forward);
      if (t.backward) t.latent_gather(Phase::backward), index_keys(Phase::backward);
      break;
    case DsaForm::laga_indices:
    case DsaForm::laga_recompute:
      t.head_parallel([&](Phase ph) {
        t.latent_gather(ph);
        index_keys(ph);
        if (ph != Phase::forward) return;
        if (stage == DsaStage::dense_warmup) return kl_target(t.layout.seq);  // every causal key
        if (form == DsaForm::laga_indices) {
          t.add(ph, "topk_ag", at4(t.all_gather(K)), CollectiveKind::all_gather);
        } else {  // w for every query; qr came with the query latent exchange
          t.add(ph, "index_w_ag", t.all_gather(Hi), CollectiveKind::all_gather);
        }
        kl_target(K);
      });
      break;
    case DsaForm::explicit_form:
      t.head_parallel([&](Phase ph) {
        t.to_heads(ph, "k_a2a", cfg.qk_head_dim());
        t.to_heads(ph, "v_a2a", cfg.v_head_dim);
        index_keys(ph);
        if (ph != Phase::forward) return;
        if (stage == DsaStage::dense_warmup) return kl_target(t.layout.seq);  // every causal key
        t.add(ph, "topk_ag", at4(t.all_gather(K)), CollectiveKind::all_gather);
        kl_target(K);
      });
      break;
    case DsaForm::ring_latent:
      // k_I's pass first (the top-k needs every score), then the latent's.
      t.ring_form("index_k_ring", "dindex_k_ring", di);
      t.ring_form("latent_ring", "dlatent_ring", W);
      break;
  }
}

CommPrediction dsa_predict_comm(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                                DsaForm form, int rank, WireElementBytes wire, bool backward,
                                bool grad_sync, DsaStage stage) {
  dsa.validate(cfg);
  CommTerms t(cfg, layout, placement_variant(form), rank, wire.activations, backward);
  dsa_collectives(t, dsa, form, stage);
  const std::int64_t W = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
  const int P = layout.ranks;
  if (grad_sync && P > 1) {
    // The block's parameters as comm_model.cpp writes them, and the
    // indexer's (DsaConfig::parameter_count).
    const std::int64_t D = cfg.dim, H = cfg.n_heads, C = cfg.kv_lora_rank, rq = cfg.q_lora_rank;
    const std::int64_t dqk = cfg.qk_head_dim(), dv = cfg.v_head_dim;
    const std::int64_t q = rq * D + rq + H * dqk * rq;
    const std::int64_t n =
        q + W * D + C + H * (cfg.qk_nope_head_dim + dv) * C + D * H * dv + dsa.parameter_count(cfg);
    const std::int64_t own = all_reduce_chunk(n, P, rank);
    const std::int64_t mine = ((n - own) + (P - 1) * own) * wire.gradients;
    t.add(Phase::grad_sync, "grad_allreduce", {mine, mine}, CollectiveKind::all_reduce);
  }
  return t.result;
}

DsaRankWork dsa_work(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                     DsaForm form, int rank) {
  dsa.validate(cfg);
  const double B = static_cast<double>(layout.batch), S = static_cast<double>(layout.seq);
  const double L = static_cast<double>(layout.seq_count[z(rank)]);
  const double H = static_cast<double>(cfg.n_heads),
               Hr = static_cast<double>(layout.head_count[z(rank)]);
  const double D = static_cast<double>(cfg.dim), rq = static_cast<double>(cfg.q_lora_rank);
  const double C = static_cast<double>(cfg.kv_lora_rank),
               dn = static_cast<double>(cfg.qk_nope_head_dim);
  const double dqk = static_cast<double>(cfg.qk_head_dim()),
               dv = static_cast<double>(cfg.v_head_dim);
  const double W = C + static_cast<double>(cfg.qk_rope_head_dim);
  const double Hi = static_cast<double>(dsa.index_n_heads),
               di = static_cast<double>(dsa.index_head_dim);
  const std::vector<TokenRange>& own = layout.seq_ranges[z(rank)];
  const std::vector<TokenRange> all{{0, layout.seq}};
  const double sel_own = B * static_cast<double>(dsa_selected_pairs(own, dsa.index_topk));
  const double sel_all = B * static_cast<double>(dsa_selected_pairs(all, dsa.index_topk));
  const double idx_own = B * static_cast<double>(dsa_indexer_pairs(own));
  const double idx_all = B * static_cast<double>(dsa_indexer_pairs(all));
  // Per indexer (query, key) pair: the Hi dot products of width di, and
  // each head's relu(.) times w_h added to the sum (2 FLOPs a head).
  const double idx_pair = Hi * (2 * di + 2);

  // Every form, its own tokens: wq_a, wkv_a, wo; the indexer's wk and
  // weights_proj (their weight gradients only backward).
  double main_gemm = 2 * B * L * D * (rq + W) + 2 * B * L * H * dv * D;
  double index_gemm = 2 * B * L * D * (di + Hi);
  double attention = 0, indexer = 0, bwd_factor = (3 * dqk + 2 * dv) / (dqk + dv);
  double recomputed_gemm = 0;  // ring_latent's up-projection, again in backward
  switch (form) {
    case DsaForm::latent_gather:
      main_gemm += 2 * B * L * rq * H * dqk;                         // wq_b, every head
      main_gemm += 2 * B * L * H * dn * C + 2 * B * L * H * C * dv;  // W_UK into q, W_UV after
      index_gemm += 2 * B * L * rq * Hi * di;
      attention = 2 * sel_own * H * (W + C);
      bwd_factor = (3 * W + 2 * C) / (W + C);
      indexer = idx_own * idx_pair;
      break;
    case DsaForm::laga_indices:
      main_gemm += 2 * B * L * rq * H * dqk + 2 * B * S * C * Hr * (dn + dv);
      index_gemm += 2 * B * L * rq * Hi * di;
      attention = 2 * sel_all * Hr * (dqk + dv);
      indexer = idx_own * idx_pair;
      break;
    case DsaForm::laga_recompute:
      main_gemm += 2 * B * S * rq * Hr * dqk + 2 * B * S * C * Hr * (dn + dv);
      // Every query's q_I from the gathered query latent, and the rank's
      // own rows' again for their KL (dsa_indexer_project on the own rows).
      index_gemm += 2 * B * S * rq * Hi * di + 2 * B * L * rq * Hi * di;
      attention = 2 * sel_all * Hr * (dqk + dv);
      indexer = idx_all * idx_pair;
      break;
    case DsaForm::explicit_form:
      main_gemm += 2 * B * L * rq * H * dqk + 2 * B * L * C * H * (dn + dv);
      index_gemm += 2 * B * L * rq * Hi * di;
      attention = 2 * sel_all * Hr * (dqk + dv);
      indexer = idx_own * idx_pair;
      break;
    case DsaForm::ring_latent:
      main_gemm += 2 * B * L * rq * H * dqk;
      recomputed_gemm = 2 * B * S * C * H * (dn + dv);  // every block's K/V, every head
      main_gemm += recomputed_gemm;
      index_gemm += 2 * B * L * rq * Hi * di;
      attention = 2 * sel_own * H * (dqk + dv);
      indexer = idx_own * idx_pair;
      break;
  }
  DsaRankWork w;
  w.forward = {main_gemm + index_gemm, attention, indexer};
  // The KL backward over the rank's own queries' selected pairs: the
  // logits again, then dq_I and dk_I.
  const double index_bwd = 3 * sel_own * Hi * 2 * di;
  // The indexer's weight gradients: its projections of the rank's own rows
  // once (the KL is over them), whatever the forward projected.
  const double index_gemm_bwd = 2 * B * L * D * (di + Hi) + 2 * B * L * rq * Hi * di;
  w.backward = {2 * main_gemm + recomputed_gemm + index_gemm_bwd, bwd_factor * attention,
                index_bwd};
  return w;
}

namespace {

// A form's allocations in the order its code makes them: the pool's
// current bytes, their peak, where it is reached and what is live there
// (MemoryPool's activations, as the form's run registers them).
struct Timeline {
  std::vector<DsaMemoryTerm> live, at_peak;
  std::int64_t current = 0, peak = 0;
  std::string where, phase = "forward";
  void alloc(const std::string& name, std::int64_t bytes) {
    live.push_back({name, bytes});
    current += bytes;
    if (current > peak) peak = current, where = cat(phase, ": ", name), at_peak = live;
  }
  void free(const std::string& name) {
    for (auto it = live.begin(); it != live.end(); ++it)
      if (it->name == name) {
        current -= it->bytes;
        live.erase(it);
        return;
      }
    fail("internal: dsa_memory frees '", name, "', which is not live");
  }
  // Made and freed inside one op (bf16's operand copies, an op's scratch).
  void transient(const std::string& name, std::int64_t bytes) {
    alloc(name, bytes);
    free(name);
  }
};

// The shared pieces' allocations, once each as their code is: dsa_rows.hpp's
// dsa_own_rows (q only with_q), dsa_indexer_rows, dsa_index_key_grads_home,
// then dsa_block.hpp's dsa_indexer_project_backward.
void own_rows(Timeline& t, std::int64_t N, const MlaConfig& cfg, bool with_q, std::int64_t e) {
  const std::int64_t rq = cfg.q_lora_rank, H = cfg.n_heads, C = cfg.kv_lora_rank;
  const std::int64_t dr = cfg.qk_rope_head_dim, dqk = cfg.qk_nope_head_dim + dr;
  t.alloc("qa (B, L, rq)", N * rq * e);
  t.alloc("qr (B, L, rq)", N * rq * e);
  t.alloc("rstd_q (B, L)", N * e);
  if (with_q) t.alloc("q (B, L, H, dqk)", N * H * dqk * e);
  t.alloc("kv (B, L, C + dr)", N * (C + dr) * e);
  t.alloc("c (B, L, C)", N * C * e);
  t.alloc("rstd_kv (B, L)", N * e);
  t.alloc("k_pe (B, L, dr)", N * dr * e);
}
void indexer_rows(Timeline& t, std::int64_t N, std::int64_t Hi, std::int64_t di, std::int64_t e) {
  t.alloc("index queries q_I (B, L, Hi, di)", N * Hi * di * e);
  t.alloc("index k_pre (B, L, di)", N * di * e);
  t.alloc("index keys k_I (B, L, di)", N * di * e);
  t.alloc("index k mean, rstd (B, L)", 2 * N * e);
  t.alloc("index weights w (B, L, Hi)", N * Hi * e);
}
void index_key_grads_home(Timeline& t, std::int64_t NS, std::int64_t N, std::int64_t di,
                          std::int64_t e) {
  t.alloc("d index keys padded (B, S, di)", NS * di * e);
  t.alloc("d index keys own (B, L, di)", N * di * e);
  t.free("d index keys padded (B, S, di)");
  t.free("d index keys (B, Sk, di)");
}
void indexer_project_backward(Timeline& t, std::int64_t N, std::int64_t di, std::int64_t e) {
  t.transient("d index k_pre (B, L, di)", N * di * e);
  for (const char* n :
       {"d index queries (B, L, Hi, di)", "d index keys own (B, L, di)",
        "d index weights (B, L, Hi)", "index k_pre (B, L, di)", "index k mean, rstd (B, L)"})
    t.free(n);
}

// DsaMemory of a finished timeline: `saved` what was live when backward
// began (`saved_bytes`), forward's peak apart.
DsaMemory memory_of(const Timeline& t, std::int64_t saved, std::int64_t forward_peak) {
  DsaMemory m;
  m.saved = saved, m.peak = t.peak, m.forward_peak = forward_peak, m.peak_where = t.where;
  m.terms = t.at_peak;
  std::stable_sort(
      m.terms.begin(), m.terms.end(),
      [](const DsaMemoryTerm& a, const DsaMemoryTerm& b) { return a.bytes > b.bytes; });
  return m;
}

// dsa_latent_gather (mla/dsa_cp.cpp), tensor by tensor in its order, with
// the op layer's bf16 operand copies (mla/ops_sparse.cpp, Bf16Copies) and
// the shared pieces' (mla/dsa_rows.cpp dsa_own_rows and
// dsa_own_rows_backward, mla/dsa_block.cpp dsa_indexer_project and its
// backward).
DsaMemory latent_gather_memory(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                               int rank, RunDtype dtype, DsaStage stage) {
  const std::int64_t e = dtype == RunDtype::fp64 ? 8 : 4;   // bf16 runs hold fp32 tensors
  const std::int64_t bf = dtype == RunDtype::bf16 ? 2 : 0;  // bf16's rounded operand copies
  const std::int64_t B = layout.batch, S = layout.seq, L = layout.seq_count[z(rank)];
  const std::int64_t Sk = keys_read(layout, rank);
  const std::int64_t N = B * L, NK = B * Sk;
  const std::int64_t H = cfg.n_heads, D = cfg.dim, rq = cfg.q_lora_rank, C = cfg.kv_lora_rank;
  const std::int64_t dr = cfg.qk_rope_head_dim, dqk = cfg.qk_head_dim(), dv = cfg.v_head_dim;
  const std::int64_t W = C + dr, Hi = dsa.index_n_heads, di = dsa.index_head_dim;
  const std::int64_t K = dsa.index_topk, KA = stage == DsaStage::dense_warmup ? Sk : K;
  Timeline t;
  // the own rows (dsa_own_rows)
  own_rows(t, N, cfg, true, e);
  t.alloc("latent (B, L, C + dr)", N * W * e);
  t.free("c (B, L, C)"), t.free("k_pe (B, L, dr)");
  // the indexer's projections (dsa_indexer_project)
  indexer_rows(t, N, Hi, di, e);
  // the gathers, rank-major, then as (B, Sk) rows
  t.alloc("latent gathered (B, S, C + dr)", B * S * W * e);
  t.alloc("index keys gathered (B, S, di)", B * S * di * e);
  t.free("latent (B, L, C + dr)"), t.free("index keys k_I (B, L, di)");
  t.alloc("latent (B, Sk, C + dr)", NK * W * e);
  t.alloc("index keys (B, Sk, di)", NK * di * e);
  t.free("latent gathered (B, S, C + dr)"), t.free("index keys gathered (B, S, di)");
  t.alloc("values c (B, Sk, C)", NK * C * e);
  t.alloc("top-k indices (B, L, K) int32", N * K * kIndexBytes);
  if (stage == DsaStage::dense_warmup) t.alloc("every causal key (B, L, Sk) int32", N * Sk * 4);
  t.alloc("absorbed queries (B, L, H, C + dr)", N * H * W * e);
  t.alloc("latent output (B, L, H, C)", N * H * C * e);
  t.alloc("wo input (B, L, H dv)", N * H * dv * e);
  t.alloc("lse (B, H, L)", B * H * L * e);
  if (bf) t.transient("bf16 attention operands q, k, v", (N * H * W + NK * W + NK * C) * bf);
  t.alloc("output (B, L, D)", N * D * e);
  t.alloc("KL target (B, L, KA)", N * KA * e);
  if (bf) t.transient("bf16 KL target operands q, k", (N * H * W + NK * W) * bf);
  t.alloc("d index queries (B, L, Hi, di)", N * Hi * di * e);
  t.alloc("d index keys (B, Sk, di)", NK * di * e);
  t.alloc("d index weights (B, L, Hi)", N * Hi * e);
  t.free("KL target (B, L, KA)"), t.free("index queries q_I (B, L, Hi, di)");
  t.free("index weights w (B, L, Hi)"), t.free("index keys (B, Sk, di)");
  const std::int64_t forward_peak = t.peak, saved = t.current;
  t.phase = "backward";
  // k_I's gradient home, the indexer's weights
  t.alloc("d index keys rank-major (B, S, di)", B * S * di * e);
  t.free("d index keys (B, Sk, di)");
  t.alloc("d index keys own (B, L, di)", N * di * e);
  t.free("d index keys rank-major (B, S, di)");
  indexer_project_backward(t, N, di, e);
  // the LM backward
  t.alloc("dx (B, L, D)", N * D * e);
  t.alloc("d wo input (B, L, H dv)", N * H * dv * e);
  t.free("wo input (B, L, H dv)");
  t.alloc("d latent output (B, L, H, C)", N * H * C * e);
  t.free("d wo input (B, L, H dv)");
  t.alloc("d absorbed queries (B, L, H, C + dr)", N * H * W * e);
  t.alloc("d latent (B, Sk, C + dr)", NK * W * e);
  t.alloc("d values (B, Sk, C)", NK * C * e);
  if (bf)
    t.transient("bf16 attention operands dout, q, k, v",
                (N * H * C + N * H * W + NK * W + NK * C) * bf);
  for (const char* n :
       {"d latent output (B, L, H, C)", "absorbed queries (B, L, H, C + dr)",
        "latent (B, Sk, C + dr)", "values c (B, Sk, C)", "latent output (B, L, H, C)",
        "lse (B, H, L)", "top-k indices (B, L, K) int32"})
    t.free(n);
  if (stage == DsaStage::dense_warmup) t.free("every causal key (B, L, Sk) int32");
  t.free("d values (B, Sk, C)");
  t.alloc("d latent rank-major (B, S, C + dr)", B * S * W * e);
  t.free("d latent (B, Sk, C + dr)");
  t.alloc("d latent own (B, L, C + dr)", N * W * e);
  t.free("d latent rank-major (B, S, C + dr)");
  t.alloc("dq (B, L, H, dqk)", N * H * dqk * e);
  t.alloc("dc (B, L, C)", N * C * e);
  t.free("d absorbed queries (B, L, H, C + dr)"), t.free("q (B, L, H, dqk)");
  // dsa_own_rows_backward
  t.alloc("dqr (B, L, rq)", N * rq * e);
  t.transient("dqa (B, L, rq)", N * rq * e);
  return memory_of(t, saved, forward_peak);
}

// dsa_explicit (mla/dsa_explicit.cpp), tensor by tensor in its order, as
// latent_gather_memory: the rank's own rows, every row's q, k, v for its
// H_r heads, the KL target's part of every row, the exchanges' staging
// apart (MemCategory::comm_buffers).
DsaMemory explicit_memory(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                          int rank, RunDtype dtype, DsaStage stage) {
  const std::int64_t e = dtype == RunDtype::fp64 ? 8 : 4;  // bf16 runs hold fp32 tensors
  const std::int64_t B = layout.batch, S = layout.seq, L = layout.seq_count[z(rank)];
  const std::int64_t Sk = keys_read(layout, rank);
  const std::int64_t N = B * L, NK = B * Sk, NS = B * S, Hr = layout.head_count[z(rank)];
  // bf16's rounded operand copies, made only where the rank has heads
  const std::int64_t bf = dtype == RunDtype::bf16 && Hr > 0 ? 2 : 0;
  const std::int64_t H = cfg.n_heads, D = cfg.dim, rq = cfg.q_lora_rank, C = cfg.kv_lora_rank;
  const std::int64_t dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim, dqk = dn + dr;
  const std::int64_t dv = cfg.v_head_dim, W = C + dr, Hi = dsa.index_n_heads;
  const std::int64_t di = dsa.index_head_dim, K = dsa.index_topk;
  const bool sparse = stage == DsaStage::sparse;
  const std::int64_t KA = sparse ? K : S;
  Timeline t;
  // the own rows (dsa_own_rows), K and V of every head
  own_rows(t, N, cfg, true, e);
  t.alloc("kv_b (B, L, H, dn + dv)", N * H * (dn + dv) * e);
  t.alloc("k (B, L, H, dqk)", N * H * dqk * e);
  t.alloc("v (B, L, H, dv)", N * H * dv * e);
  t.free("kv_b (B, L, H, dn + dv)"), t.free("k_pe (B, L, dr)");
  // the indexer's projections, its keys gathered
  indexer_rows(t, N, Hi, di, e);
  t.alloc("index keys gathered (B, S, di)", NS * di * e);
  t.free("index keys k_I (B, L, di)");
  t.alloc("index keys (B, Sk, di)", NK * di * e);
  t.free("index keys gathered (B, S, di)");
  t.alloc("top-k indices (B, L, K) int32", N * K * kIndexBytes);
  t.alloc("every row's key set (B, S, KA) int32", NS * KA * kIndexBytes);
  if (sparse) t.transient("selections rank-major (B, S, K) int32", NS * K * kIndexBytes);
  // q, k, v to the heads, the attention
  t.alloc("q_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
  t.alloc("k_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
  t.alloc("v_h (B, S, H_r, dv)", NS * Hr * dv * e);
  t.free("q (B, L, H, dqk)"), t.free("k (B, L, H, dqk)"), t.free("v (B, L, H, dv)");
  t.alloc("head output (B, S, H_r, dv)", NS * Hr * dv * e);
  t.alloc("lse (B, H_r, S)", B * Hr * S * e);
  if (bf) t.transient("bf16 attention operands q, k, v", NS * Hr * (2 * dqk + dv) * bf);
  t.alloc("wo input (B, L, H dv)", N * H * dv * e);
  t.alloc("output (B, L, D)", N * D * e);
  // the KL target: the rank's heads' part of every row, summed at the owners
  t.alloc("KL target part (B, S, KA)", NS * KA * e);
  t.alloc("KL target (B, L, KA)", N * KA * e);
  if (bf) t.transient("bf16 KL target operands q, k", NS * Hr * 2 * dqk * bf);
  t.free("KL target part (B, S, KA)");
  if (!sparse) {
    t.alloc("own rows' causal keys (B, L, Sk) int32", N * Sk * 4);
    t.alloc("KL target (B, L, Sk)", N * Sk * e);
    t.free("KL target (B, L, KA)");
  }
  t.alloc("d index queries (B, L, Hi, di)", N * Hi * di * e);
  t.alloc("d index keys (B, Sk, di)", NK * di * e);
  t.alloc("d index weights (B, L, Hi)", N * Hi * e);
  t.free("index keys (B, Sk, di)");
  t.free(sparse ? "KL target (B, L, KA)" : "KL target (B, L, Sk)");
  if (!sparse) t.free("own rows' causal keys (B, L, Sk) int32");
  t.free("index queries q_I (B, L, Hi, di)"), t.free("index weights w (B, L, Hi)");
  t.free("top-k indices (B, L, K) int32");
  const std::int64_t forward_peak = t.peak, saved = t.current;
  t.phase = "backward";
  // k_I's gradient home (dsa_index_key_grads_home), the indexer's weights
  index_key_grads_home(t, NS, N, di, e);
  indexer_project_backward(t, N, di, e);
  // the LM backward: the output's gradient to the heads and back
  t.alloc("dx (B, L, D)", N * D * e);
  t.alloc("d wo input (B, L, H dv)", N * H * dv * e);
  t.alloc("d head output (B, S, H_r, dv)", NS * Hr * dv * e);
  t.free("wo input (B, L, H dv)"), t.free("d wo input (B, L, H dv)");
  t.alloc("dq_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
  t.alloc("dk_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
  t.alloc("dv_h (B, S, H_r, dv)", NS * Hr * dv * e);
  if (bf) t.transient("bf16 attention operands dout, q, k, v", NS * Hr * (2 * dv + 2 * dqk) * bf);
  for (const char* n :
       {"d head output (B, S, H_r, dv)", "q_h (B, S, H_r, dqk)", "k_h (B, S, H_r, dqk)",
        "v_h (B, S, H_r, dv)", "head output (B, S, H_r, dv)", "lse (B, H_r, S)",
        "every row's key set (B, S, KA) int32"})
    t.free(n);
  t.alloc("dq (B, L, H, dqk)", N * H * dqk * e);
  t.alloc("dk (B, L, H, dqk)", N * H * dqk * e);
  t.alloc("dv (B, L, H, dv)", N * H * dv * e);
  t.free("dq_h (B, S, H_r, dqk)"), t.free("dk_h (B, S, H_r, dqk)"), t.free("dv_h (B, S, H_r, dv)");
  t.alloc("dkv (B, L, C + dr)", N * W * e);
  t.alloc("dc (B, L, C)", N * C * e);
  // dsa_head_kv_backward
  t.alloc("d kv_b (B, L, H, dn + dv)", N * H * (dn + dv) * e);
  t.free("dk (B, L, H, dqk)"), t.free("dv (B, L, H, dv)");
  t.free("d kv_b (B, L, H, dn + dv)"), t.free("c (B, L, C)");
  // dsa_own_rows_backward
  t.alloc("dqr (B, L, rq)", N * rq * e);
  t.transient("dqa (B, L, rq)", N * rq * e);
  return memory_of(t, saved, forward_peak);
}

// dsa_laga (mla/dsa_laga.cpp: laga_indices and laga_recompute), tensor by
// tensor in its order, as explicit_memory: the rank's own rows, the
// gathered latent and index keys, every row's q_h, k_h, v_h for its H_r
// heads, the KL target's part of every row; the exchanges' staging apart
// (MemCategory::comm_buffers).
DsaMemory laga_memory(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                      DsaForm form, int rank, RunDtype dtype, DsaStage stage) {
  const std::int64_t e = dtype == RunDtype::fp64 ? 8 : 4;  // bf16 runs hold fp32 tensors
  const std::int64_t B = layout.batch, S = layout.seq, L = layout.seq_count[z(rank)];
  const std::int64_t Sk = keys_read(layout, rank);
  const std::int64_t N = B * L, NK = B * Sk, NS = B * S, Hr = layout.head_count[z(rank)];
  // bf16's rounded operand copies, made only where the rank has heads
  const std::int64_t bf = dtype == RunDtype::bf16 && Hr > 0 ? 2 : 0;
  const std::int64_t H = cfg.n_heads, D = cfg.dim, rq = cfg.q_lora_rank, C = cfg.kv_lora_rank;
  const std::int64_t dn = cfg.qk_nope_head_dim, dr = cfg.qk_rope_head_dim, dqk = dn + dr;
  const std::int64_t dv = cfg.v_head_dim, W = C + dr, Hi = dsa.index_n_heads;
  const std::int64_t di = dsa.index_head_dim, K = dsa.index_topk;
  const bool sparse = stage == DsaStage::sparse, indices = form == DsaForm::laga_indices;
  const std::int64_t KA = sparse ? K : S;
  Timeline t;
  // the own rows (dsa_own_rows; q for laga_indices only), the latent to send
  own_rows(t, N, cfg, indices, e);
  t.alloc("latent own (B, L, C + dr)", N * W * e);
  t.free("c (B, L, C)"), t.free("k_pe (B, L, dr)");
  // the indexer's projections
  indexer_rows(t, N, Hi, di, e);
  // the queries at their heads: q sent (laga_indices), or the query latent
  // gathered and up-projected there (laga_recompute)
  t.alloc("q_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
  if (indices)
    t.free("q (B, L, H, dqk)");
  else
    t.alloc("query latent gathered (B, S, rq)", NS * rq * e);
  // the latent and the index keys of every token
  t.alloc("latent gathered (B, S, C + dr)", NS * W * e);
  t.alloc("index keys gathered (B, S, di)", NS * di * e);
  t.free("latent own (B, L, C + dr)"), t.free("index keys k_I (B, L, di)");
  t.alloc("latent c gathered (B, S, C)", NS * C * e);
  t.alloc("index keys (B, Sk, di)", NK * di * e);
  // the selection: the rank's rows', every row's where the attention reads it
  t.alloc("top-k indices (B, L, K) int32", N * K * kIndexBytes);
  if (indices || !sparse) {
    t.free("index keys gathered (B, S, di)");
    if (sparse) {  // dsa_gather_indices
      t.alloc("selections rank-major (B, S, K) int32", NS * K * kIndexBytes);
      t.alloc("every row's key set (B, S, KA) int32", NS * K * kIndexBytes);
      t.free("selections rank-major (B, S, K) int32");
    }
  } else {  // the indexer of every row, recomputed
    t.alloc("index weights gathered (B, S, Hi)", NS * Hi * e);
    t.alloc("index queries of every row (B, S, Hi, di)", NS * Hi * di * e);
    t.alloc("every row's key set (B, S, KA) int32", NS * K * kIndexBytes);
    t.free("index weights gathered (B, S, Hi)");
    t.free("index queries of every row (B, S, Hi, di)");
    t.free("index keys gathered (B, S, di)");
  }
  if (!sparse) t.alloc("every row's key set (B, S, KA) int32", NS * S * kIndexBytes);
  // the rank's heads: k, v up-projected, the attention, the KL target's part
  t.alloc("k_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
  t.alloc("v_h (B, S, H_r, dv)", NS * Hr * dv * e);
  t.alloc("head output (B, S, H_r, dv)", NS * Hr * dv * e);
  t.alloc("lse (B, H_r, S)", B * Hr * S * e);
  t.alloc("KL target part (B, S, KA)", NS * KA * e);
  if (Hr > 0) t.transient("kv_b (B, S, H_r, dn + dv)", NS * Hr * (dn + dv) * e);
  if (bf) t.transient("bf16 attention operands q, k, v", NS * Hr * (2 * dqk + dv) * bf);
  if (bf) t.transient("bf16 KL target operands q, k", NS * Hr * 2 * dqk * bf);
  t.free("latent gathered (B, S, C + dr)");
  t.alloc("wo input (B, L, H dv)", N * H * dv * e);
  t.alloc("output (B, L, D)", N * D * e);
  // the KL target summed at the rows' owners, the KL
  t.alloc("KL target (B, L, KA)", N * KA * e);
  t.free("KL target part (B, S, KA)");
  if (!sparse) t.alloc("own rows' causal keys (B, L, S) int32", N * S * kIndexBytes);
  t.alloc("d index queries (B, L, Hi, di)", N * Hi * di * e);
  t.alloc("d index keys (B, Sk, di)", NK * di * e);
  t.alloc("d index weights (B, L, Hi)", N * Hi * e);
  t.free("index keys (B, Sk, di)"), t.free("KL target (B, L, KA)");
  if (!sparse) t.free("own rows' causal keys (B, L, S) int32");
  t.free("index queries q_I (B, L, Hi, di)"), t.free("index weights w (B, L, Hi)");
  t.free("output (B, L, D)"), t.free("top-k indices (B, L, K) int32");
  const std::int64_t forward_peak = t.peak, saved = t.current;
  t.phase = "backward";
  // k_I's gradient home (dsa_index_key_grads_home), the indexer's weights
  index_key_grads_home(t, NS, N, di, e);
  indexer_project_backward(t, N, di, e);
  // the LM backward: the output's gradient to the heads, the heads'
  t.alloc("dx (B, L, D)", N * D * e);
  t.alloc("d wo input (B, L, H dv)", N * H * dv * e);
  t.alloc("d head output (B, S, H_r, dv)", NS * Hr * dv * e);
  t.free("wo input (B, L, H dv)"), t.free("d wo input (B, L, H dv)");
  t.alloc("dq_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
  t.alloc("d latent gathered (B, S, C + dr)", NS * W * e);
  const char* heads_read[] = {"d head output (B, S, H_r, dv)",
                              "q_h (B, S, H_r, dqk)",
                              "k_h (B, S, H_r, dqk)",
                              "v_h (B, S, H_r, dv)",
                              "head output (B, S, H_r, dv)",
                              "lse (B, H_r, S)",
                              "every row's key set (B, S, KA) int32"};
  if (Hr > 0) {
    t.alloc("dk_h (B, S, H_r, dqk)", NS * Hr * dqk * e);
    t.alloc("dv_h (B, S, H_r, dv)", NS * Hr * dv * e);
    if (bf) t.transient("bf16 attention operands dout, q, k, v", NS * Hr * (2 * dv + 2 * dqk) * bf);
    for (const char* n : heads_read) t.free(n);
    t.alloc("d kv_b (B, S, H_r, dn + dv)", NS * Hr * (dn + dv) * e);
    t.alloc("dc gathered (B, S, C)", NS * C * e);
    t.free("dk_h (B, S, H_r, dqk)"), t.free("dv_h (B, S, H_r, dv)");
    t.free("d kv_b (B, S, H_r, dn + dv)"), t.free("dc gathered (B, S, C)");
  } else {
    for (const char* n : heads_read) t.free(n);
  }
  t.free("latent c gathered (B, S, C)");
  // the latent's gradient to its owners, the queries' to theirs
  t.alloc("dkv (B, L, C + dr)", N * W * e);
  t.free("d latent gathered (B, S, C + dr)");
  if (indices) {
    t.alloc("dq (B, L, H, dqk)", N * H * dqk * e);
    t.free("dq_h (B, S, H_r, dqk)");
  } else {
    t.alloc("dqr (B, L, rq)", N * rq * e);
    t.alloc("dqr gathered (B, S, rq)", NS * rq * e);
    t.free("dq_h (B, S, H_r, dqk)"), t.free("query latent gathered (B, S, rq)");
    t.free("dqr gathered (B, S, rq)");
  }
  t.alloc("dc (B, L, C)", N * C * e);
  // dsa_own_rows_backward (which makes dqr from dq for laga_indices)
  if (indices) t.alloc("dqr (B, L, rq)", N * rq * e);
  t.transient("dqa (B, L, rq)", N * rq * e);
  return memory_of(t, saved, forward_peak);
}

// The closed form of the one form not run under a pool, ring_latent (not
// built: docs/forms.md), its terms from the math (activations at e,
// indices and statistics at 4): `saved` what the
// form holds from forward to backward (its output included), `peak` saved
// plus backward's largest working set, named by its first term.
DsaMemory unmeasured_memory(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                            DsaForm form, int rank, std::int64_t e) {
  dsa.validate(cfg);
  const std::int64_t B = layout.batch, S = layout.seq, L = layout.seq_count[z(rank)];
  const std::int64_t H = cfg.n_heads, D = cfg.dim;
  const std::int64_t rq = cfg.q_lora_rank, C = cfg.kv_lora_rank, dqk = cfg.qk_head_dim();
  const std::int64_t dv = cfg.v_head_dim, W = C + cfg.qk_rope_head_dim;
  const std::int64_t Hi = dsa.index_n_heads, di = dsa.index_head_dim, K = dsa.index_topk;
  DsaMemory m;
  std::vector<DsaMemoryTerm> transient;
  auto keep = [&](const char* name, std::int64_t bytes) { m.terms.push_back({name, bytes}); };
  auto work = [&](const char* name, std::int64_t bytes) { transient.push_back({name, bytes}); };
  const bool sharded = dsa_head_sharded(form);
  const std::int64_t rows = sharded ? S : L;  // the query rows the rank attends
  // Every form: the output, and the indexer's own queries for its KL backward.
  keep("output (B, L, D)", B * L * D * e);
  keep("index queries q_I (B, L, Hi, di)", B * L * Hi * di * e);
  keep("index weights w (B, L, Hi)", B * L * Hi * e);
  keep("top-k indices (B, rows, K) int32", B * rows * K * kIndexBytes);
  keep("KL target (B, L, K) fp32", B * L * K * kStatBytes);
  keep("query latent (B, L, rq)", B * L * rq * e);
  switch (form) {
    case DsaForm::latent_gather:
    case DsaForm::laga_indices:
    case DsaForm::laga_recompute:
    case DsaForm::explicit_form:
      fail("internal: unmeasured_memory of ", to_string(form),
           ", whose dsa_memory is its pool's (laga_memory and the others above)");
    case DsaForm::ring_latent: {
      const std::int64_t Lmax = layout.largest_shard_tokens();
      keep("latent (B, L, C + dr)", B * L * W * e);
      keep("index keys (B, L, di)", B * L * di * e);
      keep("q (B, L, H, dqk)", B * L * H * dqk * e);
      keep("output (B, L, H, dv)", B * L * H * dv * e);
      keep("lse (B, H, L) fp32", B * H * L * kStatBytes);
      work("a block's K, V and their gradients (B, L_max, H, 2 (dqk + dv))",
           2 * B * Lmax * H * (dqk + dv) * e);
      work("dq (B, L, H, dqk)", B * L * H * dqk * e);
      break;
    }
  }
  for (const DsaMemoryTerm& t : m.terms) m.saved += t.bytes;
  std::int64_t working = 0;
  for (const DsaMemoryTerm& t : transient) working += t.bytes;
  m.peak = m.saved + working;
  m.forward_peak = m.saved;
  m.peak_where =
      cat("backward: ", transient.empty() ? std::string("nothing") : transient.front().name);
  m.terms.insert(m.terms.end(), transient.begin(), transient.end());
  return m;
}

}  // namespace

DsaMemory dsa_memory(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                     DsaForm form, int rank, RunDtype dtype, DsaStage stage) {
  dsa.validate(cfg);
  if (form == DsaForm::latent_gather)
    return latent_gather_memory(cfg, dsa, layout, rank, dtype, stage);
  if (form == DsaForm::explicit_form) return explicit_memory(cfg, dsa, layout, rank, dtype, stage);
  if (form == DsaForm::laga_indices || form == DsaForm::laga_recompute)
    return laga_memory(cfg, dsa, layout, form, rank, dtype, stage);
  const std::int64_t e = dtype == RunDtype::fp64 ? 8 : dtype == RunDtype::bf16 ? 2 : 4;
  return unmeasured_memory(cfg, dsa, layout, form, rank, e);
}

}  // namespace laga
