// A small MLA language model (DeepSeek-V3's layers: MLA and a dense SwiGLU FFN,
// or DeepSeek-V3's MoE FFN after the first first_k_dense_replace layers) and
// its sequence-parallel forward + backward:
//
//   x = embed[tokens]                                   (B, L_r, D)
//   per layer l (prefix layers.l.):
//     h = x + attn(attn_norm(x))                        MLA, any form, SP
//     x = h + ffn.w2(silu(ffn.w1 n) * ffn.w3 n),  n = ffn_norm(h)     dense layer
//     x = h + moe(n)                                    MoE layer (moe.hpp), token-local
//   logits = head(norm(x))                              (B, L_r, V)
//   loss = mean over the counted targets of all ranks of cross-entropy:
//          all B*S, or, for packed rows, those not marked kIgnoreTarget
//
// Everything but the MLA block is token-local, so rank r runs it on its own
// seq shard (B, L_r); the MLA block's collectives are the chosen form's.
// Parameters are replicated on every rank; their gradients are partial per
// rank and summed over the SP group by ONE all-reduce of all of them
// flattened (label "grad_allreduce", phase grad_sync; none at P 1). The loss needs the
// global token count: each rank's local sum is all-reduced ("loss_allreduce").
// Under data parallelism (LmContext::world) both span every replica's ranks.
//
// Names follow DeepSeek-V3's inference checkpoint: embed.weight,
// layers.N.attn_norm.weight, layers.N.attn.<MLA names>, layers.N.ffn_norm.weight,
// layers.N.ffn.w1.weight (F, D), ffn.w3.weight (F, D), ffn.w2.weight (D, F)
// (dense layers) or layers.N.ffn.gate.weight (E, D), ffn.gate.bias (E),
// ffn.experts.e.w1/w2/w3.weight, ffn.shared_experts.w1/w2/w3.weight (MoE
// layers, moe.hpp), norm.weight, head.weight (V, D).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "comm/communicator.hpp"
#include "core/tensor.hpp"
#include "mla/block.hpp"
#include "mla/config.hpp"
#include "mla/layout.hpp"
#include "mla/params.hpp"
#include "model/dsa_layer.hpp"
#include "model/moe.hpp"

namespace laga {

struct LmConfig {
  MlaConfig mla;  // mla.dim is the model width D
  std::int64_t layers = 2;
  std::int64_t vocab = 256;
  std::int64_t ffn_hidden = 0;  // F; 0 means default_ffn_hidden(D)
  double norm_eps = 1e-6;       // attn_norm, ffn_norm, norm
  // DeepSeek-V3's MoE FFN (docs/moe.md, "In the model"): when set, layers l >=
  // moe->first_k_dense_replace use it in place of the dense SwiGLU (which the
  // first ones keep, of width hidden()). nullopt: every layer dense.
  std::optional<MoeConfig> moe;
  // gamma, the "bias update speed" of the auxiliary-loss-free balancing: after
  // every optimizer step each MoE layer's gate.bias moves by -gamma for the
  // experts that got more than the mean load, +gamma for those that got fewer
  // (update_expert_bias; DeepSeek-V3 used 0.001). 0: the bias stays as it is.
  double bias_update_speed = 0.0;

  std::int64_t dim() const { return mla.dim; }
  std::int64_t hidden() const;
  bool is_moe_layer(std::int64_t l) const { return moe && l >= moe->first_k_dense_replace; }

  // The MLA dims for a width D and H heads, by DeepSeek's head ratios
  // (V2-Lite / V3: dn = dv = 128, dr = 64, C = 512 = 4 dn): dn = dv = D / H,
  // dr = dn / 2 (rounded up to even, at least 2), C = 4 dn, rq = 0 (wq),
  // no YaRN (max_seq_len = original_seq_len = max(4096, seq)).
  static LmConfig derive(std::int64_t d_model, std::int64_t heads, std::int64_t layers,
                         std::int64_t vocab, std::int64_t seq);
  // SwiGLU width 8/3 D rounded up to a multiple of 64 (LLaMA's rule; 1408 at D = 512).
  static std::int64_t default_ffn_hidden(std::int64_t d_model);

  // The model of a DeepSeek-V3 config (`laga train --config`), in either of
  // the formats MlaConfig::from_json reads (told apart by `hidden_size`):
  // the attention block (MlaConfig::from_json), the MoE (MoeConfig::from_json;
  // none: every layer dense), and the model's own sizes:
  //   layers       num_hidden_layers (HF) | n_layers (ModelArgs)   required
  //   vocab        vocab_size                                      required
  //   ffn_hidden   intermediate_size | inter_dim    required when a layer is dense
  //   norm_eps     rms_norm_eps | lm_norm_eps                      default 1e-6
  //   bias_update_speed (laga's own key, both formats)             default 0
  // Throws laga::Error naming source, the key and the fix.
  static LmConfig from_json(const nlohmann::json& j, const std::string& source = "config");
  // A whole model by name (`laga plan --model NAME`): "deepseek-v3" is
  // DeepSeek-V3 671B as its config.json gives it (MLA preset deepseek-v3, 61
  // layers of which the first 3 dense with F 18432, then MoE E 256, k 8,
  // I 2048, 1 shared, 8 groups, 4 per token, scale 2.5; vocab 129280; the
  // multi-token-prediction module left out). Unknown: laga::Error listing
  // preset_names().
  static LmConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  static LmConfig from_json_file(const std::string& path);

  void validate() const;
  nlohmann::json to_json() const;
  std::string summary() const;
};

template <class T>
struct LayerParams {
  Tensor<T> attn_norm, ffn_norm;
  Tensor<T> w1, w2, w3;  // dense layers (undefined in MoE layers)
  MoeParams<T> moe;      // MoE layers (empty in dense layers)
  MlaParams<T> attn;
  // DSA models only (model/dsa_layer.hpp): the lightning indexer, named
  // layers.N.attn.indexer.* after attn's own tensors; undefined otherwise.
  LmIndexerParams<T> indexer;
};

template <class T>
struct LmParams {
  Tensor<T> embed, norm, head;
  std::vector<LayerParams<T>> layers;

  static LmParams zeros(const LmConfig& cfg, MemCategory cat);
  // Every tensor with its full name, in a fixed order (embed, layers in
  // order, norm, head): the order of the flattened gradient all-reduce and of
  // checkpoint files.
  void for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn);
  void for_each(const std::function<void(const std::string&, const Tensor<T>&)>& fn) const;
  std::int64_t numel() const;
};

// Every element depends only on (seed, full name, index): linear weights
// N(0, 1/fan_in), embed N(0, 1), norm weights 1.
template <class T>
void init_lm_params(LmParams<T>& p, std::uint64_t seed);

// Whether AdamW's weight decay applies: 2-D linear weights yes; RMSNorm
// weights and the embedding no (decaying a norm gain pulls it to 0, not to
// its neutral 1; embedding rows of rare tokens would decay with no signal).
bool lm_param_decays(const std::string& name);

// Whether the optimizer updates it from its gradient: every parameter but an
// MoE layer's expert bias (ffn.gate.bias, DeepSeek's e_score_correction_bias),
// which only selects experts, has no gradient, and is moved by
// update_expert_bias instead (LmConfig::bias_update_speed).
bool lm_param_trains(const std::string& name);

// What the MoE layers routed in one forward on this rank, per layer (both
// empty for a dense layer): each token's selected experts (N k, best first,
// Routing::expert) and the copies each expert received ((E), Dispatch::count).
struct ExpertRouting {
  std::vector<std::vector<std::int32_t>> expert;
  std::vector<std::vector<std::int64_t>> count;
};

struct LmContext {
  const LmConfig& cfg;
  const SpLayout& layout;
  Communicator& comm;
  const RopeTable& rope;             // positions [0, layout.seq)
  FormVariant variant = Form::laga;  // every block's
  AttentionKind attention = AttentionKind::eager;
  // Packed rows (`laga train --pack-eos`, model/data.hpp): the documents the
  // block's attention and RoPE stay inside (null: one per row), and how many
  // targets of the whole batch, every rank's, count in the loss: the mean's
  // denominator, since a target marked kIgnoreTarget adds 0 to the sum
  // (0: all B*S count).
  const Documents* documents = nullptr;
  std::int64_t counted_targets = 0;
  // When set, every forward records its MoE layers' routing here (this
  // rank's tokens only; resized to cfg.layers): the expert-bias update reads
  // the counts, the tests the selection.
  ExpertRouting* routing = nullptr;
  // DSA models (model/dsa_layer.hpp): the stage every layer runs, and, when
  // set, where a forward adds its layers' indexer KL (this rank's query
  // rows, summed over them and over the layers).
  DsaStage dsa_stage = DsaStage::sparse;
  double* index_kl = nullptr;
  // Where the MoE layers' routed experts run (moe.hpp): folded spreads them
  // over the group's ranks (expert parallelism; every rank still holds every
  // expert's weights, docs/moe.md "Expert parallelism").
  ExpertPlacement experts = ExpertPlacement::every_rank;
  // folded: the EP degree G, groups of G consecutive ranks each holding all
  // experts (ExpertParallel); 0: every rank of the group in one (G = P).
  int expert_degree = 0;
  // Data parallelism (`laga train --dp`): when set, comm is one replica's
  // SP group and world every rank of the run, replica d the world ranks
  // [d P, (d + 1) P); layout is the replica's (its own rows of the batch).
  // The attention's collectives run on comm; the loss, the gradient
  // all-reduce, the expert load and the MoE's expert parallelism (EP groups
  // of consecutive world ranks: EP over the replicas) on world. null: comm
  // is the whole run.
  Communicator* world = nullptr;
  Communicator& everyone() const { return world ? *world : comm; }
  int replicas() const { return world ? world->size() / comm.size() : 1; }
  // The loss mean's denominator: counted_targets, or every replica's B*S.
  double loss_tokens() const;
};

// One forward + backward on this rank. tokens and targets (B, L_r) are the
// rank's shard. grads is overwritten with the gradients of the GLOBAL mean
// loss, already summed over the group. Returns the global mean loss (the same
// value on every rank).
template <class T>
double lm_forward_backward(const LmContext& ctx, const LmParams<T>& w, const std::int32_t* tokens,
                           const std::int32_t* targets, LmParams<T>& grads);

// A pipeline stage's share of the model (model/pipeline.hpp): layers
// [first, last), the embedding on the first stage, the final norm, head and
// loss on the last.
struct LmStage {
  std::int64_t first = 0, last = 0;
  bool embedding = true, head = true;
};
template <class T>
struct LmSaved;  // what a forward keeps for its backward (model.cpp)
// One micro-batch in flight on a stage: its saved tensors, forward to backward.
template <class T>
struct LmStagePass {
  LmStagePass();
  ~LmStagePass();
  LmStagePass(LmStagePass&&) noexcept;
  LmStagePass& operator=(LmStagePass&&) noexcept;
  std::unique_ptr<LmSaved<T>> saved;
};
// The stage's forward on this rank's tokens: x (N, D) is its input unless
// it holds the embedding (tokens are), and becomes its output unless it
// holds the head; with the head, returns the rank's SUM of token losses
// (else 0). The same ops, in the same order, as lm_forward_backward's.
template <class T>
double lm_stage_forward(const LmContext& c, const LmParams<T>& w, const LmStage& stage,
                        const std::int32_t* tokens, const std::int32_t* targets, Tensor<T>& x,
                        LmStagePass<T>& pass);
// Its backward: dx (N, D) is the gradient of its output unless it holds the
// head (the loss, scaled by `scale`, is), and becomes that of its input
// unless it holds the embedding. The stage's gradients are ADDED to grads;
// nothing is all-reduced.
template <class T>
void lm_stage_backward(const LmContext& c, const LmParams<T>& w, const LmStage& stage,
                       const std::int32_t* tokens, const std::int32_t* targets, double scale,
                       Tensor<T>& dx, LmStagePass<T>& pass, LmParams<T>& grads);

// Forward only: the global mean loss (for finite differences and evaluation).
template <class T>
double lm_loss(const LmContext& ctx, const LmParams<T>& w, const std::int32_t* tokens,
               const std::int32_t* targets);

// The copies each expert of each MoE layer received in one forward of the
// whole group: routing.count (this rank's) summed over the ranks by one
// all-reduce of every layer's counts ("expert_load_allreduce", phase
// grad_sync; none at P 1), in doubles, exact below 2^53. Returns one (E)
// vector per layer, empty for dense layers; every rank gets the same, so
// update_expert_bias moves every replica of a bias alike.
std::vector<std::vector<std::int64_t>> group_expert_load(Communicator& comm, const LmConfig& cfg,
                                                         const ExpertRouting& routing);

}  // namespace laga
