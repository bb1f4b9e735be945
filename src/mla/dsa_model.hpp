// DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) under sequence parallelism,
// in closed form: per form and rank, the bytes on the wire per (phase,
// label), the FLOPs, and the activation memory, from the config and the
// layout alone (docs/forms.md, "DSA: the lightning indexer and top-k
// attention"; docs/planning.md, "DSA").
//
// The indexer, as DeepSeek-V3.2-Exp's inference/model.py `Indexer` computes
// it (Hi index_n_heads, di index_head_dim, K index_topk, rq q_lora_rank):
//   q_I = wq_b_I(qr)           (L, Hi di)   qr = q_norm(wq_a x), the MLA's query latent
//   k_I = LayerNorm(wk(x))     (L, di)      one key per token, shared by the index heads
//   w   = weights_proj(x) Hi^-1/2 di^-1/2   (L, Hi)
//   I(t, s) = sum_h w_h(t) relu(q_I,h(t) . k_I(s))   for s <= t
//   top-k: the K keys of largest I(t, .) (every key when t + 1 <= K)
// and the MLA attends query t over its selected keys only.
//
// Of these forms the engine runs latent_gather (mla/dsa_cp.hpp),
// laga_indices and laga_recompute (mla/dsa_laga.hpp) and explicit
// (mla/dsa_explicit.hpp), whose ledgers tests/mla/test_dsa_cp.cpp,
// test_dsa_laga.cpp and test_dsa_explicit.cpp hold equal to
// dsa_predict_comm, and test_dsa_bf16.cpp at bf16's wire; ring_latent is what `laga plan --dsa`
// costs, written from the math (docs/forms.md: why it is not built). The forms run every
// computation through the op layer (mla/ops_dsa.hpp), and their op counts
// equal dsa_work's GEMM and indexer FLOPs (tests/mla/test_dsa_counts.cpp).
// The running forms' operands (latent_gather, laga_indices, laga_recompute,
// explicit) are pool tensors: they have count-only runs, and their pools'
// peaks are dsa_memory exactly (tests/mla/test_dsa_memory.cpp);
// ring_latent's dsa_memory is a closed form from the math. The comm terms are
// CommTerms' (comm_model.hpp): a DSA form's registry row's `collectives` can
// call dsa_collectives.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/precision.hpp"
#include "mla/comm_model.hpp"
#include "mla/config.hpp"
#include "mla/dsa_block.hpp"
#include "mla/layout.hpp"

namespace laga {

// DeepSeek's names (ModelArgs and config.json alike): index_n_heads,
// index_head_dim, index_topk. DeepSeek-V3.2: 64, 128, 2048. Described once,
// by MlaConfig's fields of the same names (mla/config.hpp: read by
// MlaConfig::read_dsa_keys, validated by MlaConfig::validate_dsa); a
// DsaConfig is those three fields on their own, made by of() or preset().
struct DsaConfig {
  std::int64_t index_n_heads = 64;
  std::int64_t index_head_dim = 128;
  std::int64_t index_topk = 2048;

  // MlaConfig::validate_dsa of `with(mla)`: throws laga::Error naming the
  // field (every dimension positive, index_head_dim >= qk_rope_head_dim,
  // q_lora_rank > 0).
  void validate(const MlaConfig& mla) const;
  // mla with this indexer's three fields set.
  MlaConfig with(MlaConfig mla) const;
  // The indexer of a config: nullopt when it is dense MLA (mla.dsa() false).
  static std::optional<DsaConfig> of(const MlaConfig& mla);
  // The three keys of a config JSON (MlaConfig::read_dsa_keys): nullopt when
  // none is given, all three when any is, or a laga::Error naming the
  // missing one.
  static std::optional<DsaConfig> from_json(const nlohmann::json& j, const std::string& source);
  // The indexer of a preset (MlaConfig::preset): "deepseek-v3.2"
  // (config_671B_v3.2.json: 64, 128, 2048), "glm-5-like" (transformers'
  // GlmMoeDsaConfig: 32, 128, 2048); nullopt for a dense preset.
  static std::optional<DsaConfig> preset(const std::string& name);
  // The indexer's parameters: wq_b (Hi di, rq), wk (di, D), k_norm's weight
  // and bias (di each), weights_proj (Hi, D).
  std::int64_t parameter_count(const MlaConfig& mla) const;
};

// The sequence-parallel forms of a DSA block that `laga plan --dsa` costs.
enum class DsaForm {
  // Queries stay on their rank with every head: all-gather the latent
  // [c | k_pe] and the index keys k_I, run the indexer and the top-k for
  // the rank's queries, attend in latent space (W_UK folded into q, W_UV
  // after); backward reduce-scatters both gradients. The field's choice
  // (Megatron-Core, hyper-parallel, PaddleFleet, prime-rl).
  latent_gather,
  // LAGA, head-sharded: q all-to-all (or the query latent gathered), the
  // latent and k_I gathered, each rank runs the indexer for its own
  // queries, and the top-k indices of every query are all-gathered (every
  // rank attends every query for its heads): S K 4 bytes received per rank.
  laga_indices,
  // LAGA, head-sharded, the indexer recomputed: the query latent qr, k_I
  // and w all-gathered, every rank runs the indexer for every query (P
  // times the indexer FLOPs), no indices move.
  laga_recompute,
  // Megatron's explicit: per-head Q, K, V all-to-all; the indexer as
  // laga_indices (k_I gathered, indices all-gathered).
  explicit_form,
  // The latent ring: queries local; a first pass of the k_I blocks builds
  // each query's top-k, a second of the latent blocks attends the selected
  // keys it holds; backward passes both again and brings their gradients
  // home (P calls each).
  ring_latent,
};
const char* to_string(DsaForm f);
// A DSA form's registry row, described once (dsa_model.cpp's table) and read
// by `laga plan --dsa`, `laga forward` and `laga compare` (tools/dsa_job.hpp)
// and the tests: its name, what it moves (its ledger labels, whose bytes
// dsa_predict_comm gives per rank: the one closed form of every DSA form,
// with dsa_memory for its memory), and the engine function that runs it
// (null: costed from the closed form only, not built; docs/forms.md).
struct DsaFormTraits {
  DsaForm form;
  const char* name;
  const char* moves;
  const char* runner;
};
const DsaFormTraits& dsa_form_traits(DsaForm f);
inline bool dsa_form_runs(DsaForm f) {
  return dsa_form_traits(f).runner != nullptr;
}
DsaForm parse_dsa_form(const std::string& s);  // a name above; an unknown one lists them
std::vector<DsaForm> all_dsa_forms();
// Whether every rank attends every query for its own heads (head-sharded)
// rather than its own queries for every head.
bool dsa_head_sharded(DsaForm f);

// The selected (query, key) pairs of the query rows `rows` (token
// positions; one document per row of the batch): sum over t of min(K, t+1).
std::int64_t dsa_selected_pairs(const std::vector<TokenRange>& rows, std::int64_t topk);
// The indexer's (query, key) pairs of the rows: sum over t of t + 1.
std::int64_t dsa_indexer_pairs(const std::vector<TokenRange>& rows);

// The dense form whose placement (FormSpec::attention) a DSA form's terms
// are written in: laga's for laga_indices, laga's with the query latent for
// laga_recompute, explicit's, ring_latent's, and allgather_kv's (own
// queries, every head) for latent_gather.
FormVariant dsa_placement(DsaForm f);
// Files the form's collectives in `terms` (made with dsa_placement(form)),
// forward and, when terms.backward, backward: what a DSA form's registry
// row's `collectives` is to call, so that its ledger is tested equal to
// this closed form as the dense forms' are (tests/mla/test_forms.cpp).
// `stage`: what the head-sharded forms move depends on it (below).
void dsa_collectives(CommTerms& terms, const DsaConfig& dsa, DsaForm form,
                     DsaStage stage = DsaStage::sparse);

// Bytes on the wire of rank r per (phase, label), exactly as CommTerms
// files the dense forms' (comm_model.hpp). The indices move as int32 (bf16
// holds integers exactly only to 256) and the head-summed attention
// distribution (the indexer's KL target) at et = max(4, e): fp32 under
// bf16, the run's element in fp32 and fp64 (a float64 run's target is not
// rounded to fp32) -- a statistic, each rank's part a partial sum over its
// heads, which in bf16 would make the target depend on P and the head
// split; everything else (the latent, k_I, w, q, k, v, the query latent,
// the outputs, and their gradients) at wire.activations, bf16 under bf16
// as a bf16 trainer moves them; the gradient all-reduce (over the MLA's
// and the indexer's parameters) at wire.gradients. The engine's forms move
// exactly this in fp32, float64 and bf16 (mla/dsa_rows.hpp, "What the DSA
// forms' collectives move"; docs/forms.md, "DSA in bf16"). Labels beyond
// the dense forms':
//   index_k_ag       (P-1) B L_r di e        k_I all-gathered (backward: its
//                                            gradient reduce-scattered)
//   index_w_ag       (P-1) B L_r Hi e        laga_recompute: w all-gathered
//   topk_ag          (P-1) B L_r K 4         the indices, all-gathered
//   index_target_rs  sum_{j!=r} B L_j K et   head-sharded: each rank's
//                                            partial head sum of the selected
//                                            keys' probabilities, to the
//                                            query's owner (forward)
//   index_k_ring, dindex_k_ring              ring_latent's k_I passes
// The dense warm-up (stage dense_warmup) changes the head-sharded forms
// only: the main attention reads every causal key, so no indices move (no
// topk_ag) and laga_recompute gathers no w (no index_w_ag: each query's
// owner runs the indexer for its own rows, as laga_indices does), and the
// KL target is over every causal key, S slots a query (index_target_rs
// sum_{j!=r} B L_j S et). The other forms move the same in both stages.
CommPrediction dsa_predict_comm(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                                DsaForm form, int rank, WireElementBytes wire, bool backward,
                                bool grad_sync, DsaStage stage = DsaStage::sparse);

// FLOPs of rank r, per phase (forward; backward), split as the time model
// prices them: GEMMs (projections, up-projections, absorption, wo), the
// main attention over the selected pairs, and the indexer's scores.
// Backward: the GEMMs' input and weight gradients (2x forward; the
// indexer's projections of the rank's own rows 1x, their input being
// detached and the KL over the own rows -- laga_recompute projects every
// query's q_I forward, and its own rows' again, but only those backward),
// flash attention's (3 dqk + 2 dv) / (dqk + dv) of its forward,
// and the indexer's KL backward over the selected pairs only (its logits
// recomputed there, then dq_I and dk_I: 3x the selected pairs' forward).
struct DsaWork {
  double gemm_flops = 0;
  double attention_flops = 0;  // main attention, selected pairs only
  double indexer_flops = 0;    // the indexer's scores (q_I . k_I, relu, weighted head sum)
  double total() const { return gemm_flops + attention_flops + indexer_flops; }
};
struct DsaRankWork {
  DsaWork forward, backward;
};
DsaRankWork dsa_work(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                     DsaForm form, int rank);

// Activation memory of rank r in bytes, as the rank's MemoryPool counts
// MemCategory::activations while the form runs forward and backward (the
// parameters' gradients are MemCategory::gradients, not here). For the
// forms the engine runs (every one but ring_latent) it is the code's
// allocation sequence written out tensor by tensor (dsa_model.cpp: each
// tensor made and freed (reset) where the form's code does), with the op
// layer's bf16 operand copies under RunDtype::bf16 (whose tensors are fp32:
// the DSA forms hold fp32 and round only the sparse attention's operands,
// docs/forms.md "DSA in bf16"): `peak` is exactly the pool's peak, and
// tests/mla/test_dsa_memory.cpp holds it equal to a real run's and a
// count-only run's (MemoryPool::set_count_only) on every rank. `saved` is
// what is live when backward begins (the output included), `forward_peak`
// the peak of a forward-only run (no dout), `peak_where` the allocation
// that reaches the peak ("backward: d latent (B, Sk, C + dr)") and `terms`
// what is live there, largest first. ring_latent (not built, so not run
// under a pool) keeps a closed form from the math: activations at the dtype's
// element (bf16: 2), indices and statistics at 4, `peak` = `saved` plus
// backward's largest working set.
struct DsaMemoryTerm {
  std::string name;
  std::int64_t bytes = 0;
};
struct DsaMemory {
  std::int64_t saved = 0, peak = 0, forward_peak = 0;
  std::string peak_where;
  std::vector<DsaMemoryTerm> terms;
};
DsaMemory dsa_memory(const MlaConfig& cfg, const DsaConfig& dsa, const SpLayout& layout,
                     DsaForm form, int rank, RunDtype dtype, DsaStage stage = DsaStage::sparse);

}  // namespace laga
