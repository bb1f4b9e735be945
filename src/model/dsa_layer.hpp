// DeepSeek Sparse Attention as a layer's attention in the language model
// (`laga train` on a config with index_n_heads, index_head_dim and
// index_topk; docs/forms.md, "DeepSeek Sparse Attention (DSA)", and
// docs/convergence.md, "The same text with DeepSeek Sparse Attention").
//
// The layer's attention is mla/dsa_block.hpp's block at --sp 1 (per-head
// keys, DeepSeek's prefill) and mla/dsa_cp.hpp's query-local latent gather
// at --sp > 1 (contiguous layout): the same numbers up to rounding. Each
// layer holds the lightning indexer's weights (LmIndexerParams, under
// DeepSeek's names layers.N.attn.indexer.*), trained by AdamW with the rest
// and written to checkpoints with them.
//
// Training semantics are the block's (DeepSeek-V3.2's report, §2.1):
//   - stage (DsaStage): the first `index_warmup` steps run dense_warmup (the
//     main attention over every causal key, the indexer's KL over them),
//     the rest sparse (the main attention over the indexer's top-k keys, the
//     KL over the selected set). The main model trains in both stages: the
//     block gives the LM gradient in both, and laga's runs start from
//     scratch, not from a trained dense checkpoint as DeepSeek's warm-up
//     does (which freezes all but the indexer; not offered here).
//   - the LM gradient never reaches the indexer (top-k has none); the
//     indexer's gradient is its KL's only, its input (x, qr) detached, so it
//     reaches the indexer's weights and nothing else.
//   - the KL is the mean over query rows of each layer (the block's sum over
//     rows divided by B*S), its gradient that mean's; the indexer's
//     gradients are left out of --clip's global norm (another loss: the LM's
//     clipping does not scale it, nor it the LM's) and of the logged
//     grad_norm. The log's index_kl is that mean averaged over the layers.
// The attention's backward recomputes the block's forward from its saved
// input (the block gives forward and backward in one call), so a DSA layer
// runs its attention forward twice a step.
// Memory: the layer runs under a count-only pool as the rest of the model
// does (its copies, sums and the block's backward input go through the op
// layer: ops::copy, add, scale, backward_input), so laga train's prediction
// (predict_train_memory: one step of each stage the run has) covers a DSA
// model, its pool part equal to a real run's peak
// (TrainMemory.DsaPoolPredictionEqualsTheMeasuredPeak). Outside the pool,
// as the block's results are: the indexer's weights copied to host vectors
// and the block's out, dx and indexer gradients handed back as vectors
// (DsaBlockResult), each the size of a weight or of this rank's (B, L, D).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "comm/communicator.hpp"
#include "core/tensor.hpp"
#include "mla/dsa_block.hpp"
#include "mla/layout.hpp"
#include "mla/params.hpp"

namespace laga {

// One layer's indexer (DsaIndexerParams' tensors, as the model's Tensors).
template <class T>
struct LmIndexerParams {
  Tensor<T> wq_b, wk, k_norm_weight, k_norm_bias, weights_proj;
  // Allocated (zeros) when cfg has DSA keys; else left undefined.
  static LmIndexerParams zeros(const MlaConfig& cfg, MemCategory cat);
  bool defined() const { return wq_b.defined(); }
  // (name, tensor), names relative to the layer's attn. ("indexer.wq_b.weight", ...),
  // DsaIndexerParams::named()'s order; nothing when undefined.
  void for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn);
};

// Whether a model parameter (LmParams::for_each's name) is an indexer's.
bool lm_param_is_indexer(const std::string& name);

// What a DSA layer's attention needs beside its weights.
struct DsaLayerContext {
  const MlaConfig& cfg;
  const SpLayout& layout;
  Communicator& comm;
  DsaStage stage = DsaStage::sparse;
};

// out (B, L, D) = the layer's attention of x (B, L, D), this rank's rows.
// Returns the rank's KL summed over its query rows (DsaBlockResult::kl_loss).
template <class T>
double dsa_layer_forward(const DsaLayerContext& c, const MlaParams<T>& w,
                         const LmIndexerParams<T>& iw, const Tensor<T>& x, Tensor<T>& out);

// dx (B, L, D) from dout: the block run again with dout. Adds the LM
// gradient of the MLA weights to g and the KL gradient, scaled by
// kl_scale, to gi (both this rank's partials under --sp > 1).
template <class T>
void dsa_layer_backward(const DsaLayerContext& c, const MlaParams<T>& w,
                        const LmIndexerParams<T>& iw, const Tensor<T>& x, const Tensor<T>& dout,
                        double kl_scale, Tensor<T>& dx, MlaParams<T>& g, LmIndexerParams<T>& gi);

}  // namespace laga
