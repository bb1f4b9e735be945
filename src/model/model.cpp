#include "model/model.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "mla/ops.hpp"
#include "mla/ops_model.hpp"
#include "mla/wire.hpp"

namespace laga {

// ------------------------------------------------------------------ config

namespace {
// An MoE layer's expert bias: "layers.N.ffn.gate.bias".
bool ends_with(const std::string& name, const std::string& tail) {
  return name.size() > tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}
bool is_expert_bias(const std::string& name) {
  return ends_with(name, ".ffn.gate.bias");
}
}  // namespace

std::int64_t LmConfig::default_ffn_hidden(std::int64_t d) {
  return (8 * d / 3 + 63) / 64 * 64;
}

std::int64_t LmConfig::hidden() const {
  return ffn_hidden > 0 ? ffn_hidden : default_ffn_hidden(mla.dim);
}

LmConfig LmConfig::derive(std::int64_t d, std::int64_t heads, std::int64_t layers,
                          std::int64_t vocab, std::int64_t seq) {
  LAGA_CHECK(d > 0 && heads > 0 && d % heads == 0, "model: --d-model ", d,
             " must be a positive multiple of --heads ", heads,
             " (the head dim is d_model / heads); or give --nope-dim/--v-dim explicitly");
  LmConfig c;
  c.layers = layers;
  c.vocab = vocab;
  const std::int64_t hd = d / heads;
  c.mla.dim = d;
  c.mla.n_heads = heads;
  c.mla.q_lora_rank = 0;
  c.mla.qk_nope_head_dim = hd;
  c.mla.v_head_dim = hd;
  c.mla.qk_rope_head_dim = std::max<std::int64_t>(2, (hd / 2 + 1) / 2 * 2);
  c.mla.kv_lora_rank = 4 * hd;
  c.mla.original_seq_len = c.mla.max_seq_len = std::max<std::int64_t>(4096, seq);
  return c;
}

std::vector<std::string> LmConfig::preset_names() {
  return {"deepseek-v3"};
}

LmConfig LmConfig::preset(const std::string& name) {
  LmConfig c;
  if (name == "deepseek-v3") {
    // DeepSeek-V3's config.json (671B): hidden_size 7168, intermediate_size
    // 18432, moe_intermediate_size 2048, num_hidden_layers 61, vocab_size
    // 129280, n_routed_experts 256, num_experts_per_tok 8, n_shared_experts
    // 1, n_group 8, topk_group 4, routed_scaling_factor 2.5,
    // first_k_dense_replace 3, rms_norm_eps 1e-6.
    c.mla = MlaConfig::preset("deepseek-v3");
    c.layers = 61;
    c.vocab = 129280;
    c.ffn_hidden = 18432;
    c.norm_eps = 1e-6;
    MoeConfig m;
    m.n_routed_experts = 256, m.num_experts_per_tok = 8, m.moe_intermediate_size = 2048;
    m.n_shared_experts = 1, m.n_group = 8, m.topk_group = 4, m.routed_scaling_factor = 2.5;
    m.first_k_dense_replace = 3;
    c.moe = m;
  } else {
    std::string names;
    for (const std::string& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail("unknown model preset '", name, "'; choose one of: ", names,
         " (or give a DeepSeek-V3 config.json FILE)");
  }
  c.validate();
  return c;
}

LmConfig LmConfig::from_json(const nlohmann::json& j, const std::string& source) {
  LmConfig c;
  c.mla = MlaConfig::from_json(j, source);
  c.moe = MoeConfig::from_json(j, source);
  const bool hf = j.contains("hidden_size");
  const char* layers_key = hf ? "num_hidden_layers" : "n_layers";
  const char* ffn_key = hf ? "intermediate_size" : "inter_dim";
  const char* eps_key = hf ? "rms_norm_eps" : "lm_norm_eps";
  LAGA_CHECK(read_config_key(j, layers_key, c.layers, source), source, ": missing '", layers_key,
             "' (the number of layers the model has)");
  LAGA_CHECK(c.layers >= 1, source, ": '", layers_key, "' must be >= 1, got ", c.layers);
  LAGA_CHECK(read_config_key(j, "vocab_size", c.vocab, source), source,
             ": missing 'vocab_size' (the embedding's and the head's rows)");
  LAGA_CHECK(c.vocab >= 2 && c.vocab <= (std::int64_t{1} << 31) - 1, source, ": 'vocab_size' ",
             c.vocab, " must be in [2, 2^31 - 1] (the token ids are int32)");
  // A model whose every layer is MoE has no dense FFN to size.
  const bool dense_layer = !c.moe || c.moe->first_k_dense_replace > 0;
  const bool ffn_given = read_config_key(j, ffn_key, c.ffn_hidden, source);
  LAGA_CHECK(ffn_given || !dense_layer, source, ": missing '", ffn_key,
             "' (the dense SwiGLU width of the layers before first_k_dense_replace)");
  LAGA_CHECK(!ffn_given || c.ffn_hidden >= 1, source, ": '", ffn_key, "' must be >= 1, got ",
             c.ffn_hidden);
  read_config_key(j, eps_key, c.norm_eps, source);
  LAGA_CHECK(c.norm_eps >= kLeastNormEps && c.norm_eps < 1, source, ": '", eps_key, "' ",
             c.norm_eps, " must be in [", kLeastNormEps,
             ", 1) (the decoder norms' eps, 1e-6 in DeepSeek-V3; below 1e-30 1/sqrt(eps) leaves "
             "float's range for an all-zero row)");
  read_config_key(j, "bias_update_speed", c.bias_update_speed, source);
  try {
    c.validate();
  } catch (const Error& e) {
    fail(source, ": ", e.what());
  }
  return c;
}

LmConfig LmConfig::from_json_file(const std::string& path) {
  // MlaConfig's reader vets the path (no directory, FIFO or missing file)
  // and the JSON (valid, no key twice) before anything else reads it.
  (void)MlaConfig::from_json_file(path);
  std::ifstream in(path);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  LAGA_CHECK(in.good() || in.eof(), "cannot read config file '", path, "'; check its permissions");
  return from_json(parse_json_refusing_repeated_keys(text, "config file '" + path + "'"),
                   "config '" + path + "'");
}

void LmConfig::validate() const {
  mla.validate();
  LAGA_CHECK(layers >= 1, "model: --layers must be >= 1 (got ", layers, ")");
  LAGA_CHECK(layers < (1ll << 20), "model: ", layers,
             " layers is beyond any model (at most 2^20; DeepSeek-V3 has 61)");
  LAGA_CHECK(vocab >= 2, "model: --vocab must be >= 2 (got ", vocab, ")");
  LAGA_CHECK(vocab <= (std::int64_t{1} << 31) - 1, "model: --vocab ", vocab,
             " does not fit the int32 token ids");
  LAGA_CHECK(hidden() >= 1, "model: --ffn-hidden must be >= 1 (got ", ffn_hidden, ")");
  if (moe) moe->validate();  // names the MoE field under both of its names
  LAGA_CHECK(std::isfinite(bias_update_speed) && bias_update_speed >= 0,
             "model: bias_update_speed must be finite and >= 0 (got ", bias_update_speed,
             "); it is the step of the experts' bias balancing (DeepSeek-V3: 0.001), 0 disables "
             "it");
  // The biases only rank the experts; a step of 1 already reorders every
  // token's choice each step, past it the balancing is noise (and at 1e300
  // the biases overflow).
  LAGA_CHECK(bias_update_speed <= 1, "model: bias_update_speed ", bias_update_speed,
             " is beyond 1 (the step of the experts' bias balancing, DeepSeek-V3: 0.001: a step "
             "that large reorders every token's experts each step); check the config");
  LAGA_CHECK(norm_eps >= kLeastNormEps && norm_eps < 1, "model: norm_eps ", norm_eps,
             " must be in [", kLeastNormEps, ", 1) (the decoder norms' eps)");
  LAGA_CHECK(bias_update_speed == 0 || moe, "model: bias_update_speed ", bias_update_speed,
             " steers the biases of MoE experts, but the model has none; set n_routed_experts "
             "(and the other MoE settings) or drop bias_update_speed");
  LAGA_CHECK(bias_update_speed == 0 || !moe || moe->gate_has_bias(), "model: bias_update_speed ",
             bias_update_speed, " steers the gate's bias, but topk_method '",
             to_string(moe->topk_method),
             "' (DeepSeek-V2's gate) has none; drop bias_update_speed or use noaux_tc");
}

nlohmann::json LmConfig::to_json() const {
  nlohmann::json j = mla.to_json();
  j["n_layers"] = layers;
  j["vocab_size"] = vocab;
  j["inter_dim"] = hidden();
  j["lm_norm_eps"] = norm_eps;
  // A dense model's JSON is what it was before the MoE existed, so its
  // checkpoints still compare equal (model_changes).
  if (moe) {
    j.update(moe->to_json());
    j["bias_update_speed"] = bias_update_speed;
  }
  return j;
}

std::string LmConfig::summary() const {
  return cat("layers=", layers, " vocab=", vocab, " F=", hidden(), " ", mla.summary(),
             moe ? cat(" moe[", moe->summary(), " bias_update_speed=", bias_update_speed, "]")
                 : std::string());
}

// --------------------------------------------------------------- params

template <class T>
LmParams<T> LmParams<T>::zeros(const LmConfig& cfg, MemCategory cat) {
  const std::int64_t D = cfg.dim(), F = cfg.hidden(), V = cfg.vocab;
  LmParams p;
  p.embed = Tensor<T>::zeros({V, D}, cat);
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    LayerParams<T> L;
    L.attn_norm = Tensor<T>::zeros({D}, cat);
    L.attn = MlaParams<T>::zeros(cfg.mla, cat);
    L.indexer = LmIndexerParams<T>::zeros(cfg.mla, cat);
    L.ffn_norm = Tensor<T>::zeros({D}, cat);
    if (cfg.is_moe_layer(l)) {
      L.moe = MoeParams<T>::zeros(*cfg.moe, D, cat);
    } else {
      L.w1 = Tensor<T>::zeros({F, D}, cat);
      L.w2 = Tensor<T>::zeros({D, F}, cat);
      L.w3 = Tensor<T>::zeros({F, D}, cat);
    }
    p.layers.push_back(std::move(L));
  }
  p.norm = Tensor<T>::zeros({D}, cat);
  p.head = Tensor<T>::zeros({V, D}, cat);
  return p;
}

namespace {
template <class T, class Fn>
void visit(LmParams<T>& p, Fn&& fn) {
  fn("embed.weight", p.embed);
  for (size_t l = 0; l < p.layers.size(); ++l) {
    auto& L = p.layers[l];
    const std::string pre = "layers." + std::to_string(l) + ".";
    fn(pre + "attn_norm.weight", L.attn_norm);
    L.attn.for_each(std::function<void(const std::string&, Tensor<T>&)>(
        [&](const std::string& n, Tensor<T>& t) { fn(pre + "attn." + n, t); }));
    L.indexer.for_each([&](const std::string& n, Tensor<T>& t) { fn(pre + "attn." + n, t); });
    fn(pre + "ffn_norm.weight", L.ffn_norm);
    if (L.moe.gate.defined()) {
      L.moe.for_each([&](const std::string& n, Tensor<T>& t) { fn(pre + "ffn." + n, t); });
    } else {
      fn(pre + "ffn.w1.weight", L.w1);
      fn(pre + "ffn.w2.weight", L.w2);
      fn(pre + "ffn.w3.weight", L.w3);
    }
  }
  fn("norm.weight", p.norm);
  fn("head.weight", p.head);
}
}  // namespace

template <class T>
void LmParams<T>::for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn) {
  visit(*this, [&](const std::string& n, Tensor<T>& t) { fn(n, t); });
}
template <class T>
void LmParams<T>::for_each(
    const std::function<void(const std::string&, const Tensor<T>&)>& fn) const {
  // MlaParams' const for_each hands out const tensors; visit works on both.
  visit(const_cast<LmParams&>(*this), [&](const std::string& n, const Tensor<T>& t) { fn(n, t); });
}
template <class T>
std::int64_t LmParams<T>::numel() const {
  std::int64_t n = 0;
  for_each([&](const std::string&, const Tensor<T>& t) { n += t.numel(); });
  return n;
}

template <class T>
void init_lm_params(LmParams<T>& p, std::uint64_t seed) {
  p.for_each([&](const std::string& name, Tensor<T>& t) {
    if (ends_with(name, ".bias")) {
      // DeepSeek-V3 starts the balancing from no correction; the DSA
      // indexer's LayerNorm bias starts at 0, as torch's LayerNorm does.
      t.fill(T(0));
    } else if (t.rank() == 1) {
      t.fill(T(1));
    } else {
      const double sd = name == "embed.weight" ? 1.0 : 1.0 / std::sqrt(double(t.dim(1)));
      ops::fill_normal(t, seed, name_stream(name), 0, sd);
    }
  });
}

bool lm_param_decays(const std::string& name) {
  if (name == "embed.weight") return false;
  // Biases (an expert's, the DSA indexer's LayerNorm's) are not decayed either.
  return name.find("norm.weight") == std::string::npos && !ends_with(name, ".bias");
}

bool lm_param_trains(const std::string& name) {
  return !is_expert_bias(name);
}

double LmContext::loss_tokens() const {
  const std::int64_t all = layout.batch * layout.seq * replicas();
  LAGA_CHECK(counted_targets >= 0 && counted_targets <= all, "LmContext: counted_targets ",
             counted_targets, " is outside [0, B*S = ", all, "]");
  return double(counted_targets > 0 ? counted_targets : all);
}

// ------------------------------------------------------- forward/backward

// What one layer's backward needs, all (B*L_r, .) on this rank.
template <class T>
struct LayerSaved {
  Tensor<T> x, n1, rstd1;  // layer input, attn_norm output, its rstd
  MlaSaved<T> mla;
  Tensor<T> h, n2, rstd2;  // after the attention residual; ffn_norm output, rstd
  Tensor<T> a, b, g;       // dense: w1 n2, w3 n2, silu(a) * b   (N, F)
  MoeSaved<T> moe;         // MoE layer: its routing and experts' activations
};

template <class T>
struct LmSaved {
  std::vector<LayerSaved<T>> layers;
  Tensor<T> xf, nf, rstdf;  // final residual, norm output, rstd
  Tensor<T> logits;         // (N, V)
  Tensor<double> lse;       // (N)
};

template <class T>
LmStagePass<T>::LmStagePass() : saved(std::make_unique<LmSaved<T>>()) {}
template <class T>
LmStagePass<T>::~LmStagePass() = default;
template <class T>
LmStagePass<T>::LmStagePass(LmStagePass&&) noexcept = default;
template <class T>
LmStagePass<T>& LmStagePass<T>::operator=(LmStagePass&&) noexcept = default;

namespace {

// The whole model as one stage.
LmStage whole_model(const LmConfig& cfg) {
  return LmStage{0, cfg.layers, true, true};
}

// The MoE layers' expert placement for this context: null runs every expert
// on every rank; folded spreads them over the ranks (every replica's under
// data parallelism: world rank w is SP rank w % P of its replica), which need
// every rank's token count.
std::optional<ExpertParallel> expert_parallel(const LmContext& c) {
  if (!c.cfg.moe || c.experts == ExpertPlacement::every_rank) return std::nullopt;
  std::vector<std::int64_t> tokens;
  const int P = c.comm.size();
  for (int w = 0; w < c.everyone().size(); ++w)
    tokens.push_back(c.layout.batch * c.layout.seq_count[size_t(w % P)]);
  return ExpertParallel::folded(c.everyone(), c.cfg.moe->n_routed_experts, std::move(tokens),
                                c.expert_degree);
}

template <class T>
BlockContext block_ctx(const LmContext& c) {
  return BlockContext{c.cfg.mla, c.layout, c.comm, c.rope, c.variant, c.attention, c.documents};
}

// A DSA layer's attention context (model/dsa_layer.hpp).
DsaLayerContext dsa_ctx(const LmContext& c) {
  return DsaLayerContext{c.cfg.mla, c.layout, c.comm, c.dsa_stage};
}

// Returns this rank's SUM of token losses and fills s with what backward needs.
//
// The model's own ops are the op layer's (src/mla/ops.hpp, ops_model.hpp),
// like the block's, so the same code also runs under a count-only pool:
// every tensor is accounted, none is backed, no kernel runs, and the loss is
// 0. That run is the memory prediction of training (predict_train_memory,
// train.hpp).
//
// A pipeline stage (st) runs its layers only: without the embedding it
// starts from *x_io (its input, (N, D)); without the head it leaves its
// output in *x_io and returns 0.
template <class T>
double forward(const LmContext& c, const LmParams<T>& w, const LmStage& st,
               const std::int32_t* tokens, const std::int32_t* targets, Tensor<T>* x_io,
               LmSaved<T>& s) {
  const LmConfig& cfg = c.cfg;
  const std::int64_t B = c.layout.batch, L = c.layout.seq_count[size_t(c.comm.rank())];
  const std::int64_t N = B * L, D = cfg.dim(), F = cfg.hidden(), V = cfg.vocab;
  const double eps = cfg.norm_eps;
  const BlockContext bctx = block_ctx<T>(c);
  const std::optional<ExpertParallel> ep = expert_parallel(c);
  Tensor<T> x({B, L, D});
  if (!st.embedding) {
    ops::copy(ops::mat(x, N, D), ops::mat(*x_io, N, D));
  } else {
    ops::embedding(ops::mat(x, N, D), tokens, w.embed);
  }
  s.layers.resize(size_t(cfg.layers));
  if (c.routing) {
    c.routing->expert.assign(size_t(cfg.layers), {});
    c.routing->count.assign(size_t(cfg.layers), {});
  }
  for (std::int64_t l = st.first; l < st.last; ++l) {
    const LayerParams<T>& p = w.layers[size_t(l)];
    LayerSaved<T>& ls = s.layers[size_t(l)];
    ls.n1 = Tensor<T>({B, L, D});
    ls.rstd1 = Tensor<T>({N});
    ops::rmsnorm(ops::mat(ls.n1, N, D), ls.rstd1, ops::mat(x, N, D), p.attn_norm, eps);
    Tensor<T> att;
    if (cfg.mla.dsa()) {
      const double kl = dsa_layer_forward(dsa_ctx(c), p.attn, p.indexer, ls.n1, att);
      if (c.index_kl) *c.index_kl += kl;
    } else {
      mla_forward(bctx, p.attn, ls.n1, att, ls.mla);
    }
    // Kept at 2 bytes under bf16 (mla/ops.hpp, keep_narrowed): RMSNorm's
    // rounded y, a bf16 value (so are n2, a and b: RMSNorm's and the GEMMs'
    // fresh outputs); g is read back only as w2's GEMM operand.
    ops::keep_narrowed(ls.n1);
    ls.h = Tensor<T>({B, L, D});
    ops::copy(ops::mat(ls.h, N, D), ops::mat(x, N, D));
    ops::add(ops::mat(ls.h, N, D), ops::mat(att, N, D));
    att.reset();
    ls.x = std::move(x);
    ls.n2 = Tensor<T>({N, D});
    ls.rstd2 = Tensor<T>({N});
    ops::rmsnorm(ops::mat(ls.n2), ls.rstd2, ops::mat(ls.h, N, D), p.ffn_norm, eps);
    Tensor<T> m;  // the FFN's output (N, D)
    if (cfg.is_moe_layer(l)) {
      MoeForward<T> f = moe_forward(*cfg.moe, p.moe, ls.n2.data(), N, D, ep ? &*ep : nullptr);
      m = std::move(f.out);
      ls.moe = std::move(f.saved);
      if (c.routing) {
        c.routing->expert[size_t(l)] = ls.moe.routing.expert;
        c.routing->count[size_t(l)] = ls.moe.dispatch.count;
      }
    } else {
      ls.a = Tensor<T>({N, F});
      ls.b = Tensor<T>({N, F});
      ls.g = Tensor<T>({N, F});
      ops::linear(ops::mat(ls.a), ops::mat(ls.n2), p.w1);
      ops::linear(ops::mat(ls.b), ops::mat(ls.n2), p.w3);
      ops::swiglu(ops::mat(ls.g), ops::mat(ls.a), ops::mat(ls.b));
      m = Tensor<T>({N, D});
      ops::linear(ops::mat(m), ops::mat(ls.g), p.w2);
    }
    ops::keep_narrowed(ls.n2), ops::keep_narrowed(ls.a), ops::keep_narrowed(ls.b);
    ops::keep_narrowed(ls.g), keep_narrowed(ls.moe);
    x = Tensor<T>({B, L, D});
    ops::copy(ops::mat(x, N, D), ops::mat(ls.h, N, D));
    ops::add(ops::mat(x, N, D), ops::mat(m));
  }
  if (!st.head) {
    *x_io = std::move(x);
    return 0.0;
  }
  s.nf = Tensor<T>({N, D});
  s.rstdf = Tensor<T>({N});
  ops::rmsnorm(ops::mat(s.nf), s.rstdf, ops::mat(x, N, D), w.norm, eps);
  s.xf = std::move(x);
  s.logits = Tensor<T>({N, V});
  ops::linear(ops::mat(s.logits), ops::mat(s.nf), w.head);
  ops::keep_narrowed(s.nf);  // RMSNorm's y; the logits are overwritten by their gradient
  s.lse = Tensor<double>({N});
  Tensor<T> loss({N});
  return ops::cross_entropy(loss, s.lse, ops::mat(s.logits), targets);
}

// A pipeline stage (st): without the head it starts from *dx_io, the
// gradient of its output; without the embedding it leaves the gradient of
// its input there.
template <class T>
void backward(const LmContext& c, const LmParams<T>& w, const LmStage& st,
              const std::int32_t* tokens, const std::int32_t* targets, LmSaved<T>& s, double scale,
              Tensor<T>* dx_io, LmParams<T>& g) {
  const LmConfig& cfg = c.cfg;
  const std::int64_t B = c.layout.batch, L = c.layout.seq_count[size_t(c.comm.rank())];
  const std::int64_t N = B * L, D = cfg.dim(), F = cfg.hidden();
  const BlockContext bctx = block_ctx<T>(c);
  const std::optional<ExpertParallel> ep = expert_parallel(c);
  Tensor<T> dn({N, D});
  ops::Mat<T> dn_mat = ops::mat(dn);
  Tensor<T> dx;  // gradient of the residual stream (B, L, D)
  if (st.head) {
    // dlogits in place of the logits: they are not needed after this.
    ops::cross_entropy_backward(ops::mat(s.logits), ops::mat(s.logits), s.lse, targets, scale);
    // nf may be held narrowed: the head's gradient reads it in place.
    ops::linear_backward<T>(&dn_mat, false, g.head, ops::mat(s.logits), std::as_const(s.nf),
                            w.head);
    s.logits.reset();
    // dx only once the logits are gone: beside the (N, V) logits the head's
    // backward holds dn alone (the plan's closed form, model_plan.hpp
    // ActivationBytes::transient; at vocab 4096 the head sets the peak).
    dx = Tensor<T>({B, L, D});
    ops::rmsnorm_backward(ops::mat(dx, N, D), g.norm, ops::mat(dn), ops::mat(s.xf, N, D), w.norm,
                          s.rstdf);
  } else {
    dx = Tensor<T>({B, L, D});
    ops::copy(ops::mat(dx, N, D), ops::mat(*dx_io, N, D));
  }
  Tensor<T> tmp({B, L, D});
  for (std::int64_t l = st.last - 1; l >= st.first; --l) {
    const LayerParams<T>& p = w.layers[size_t(l)];
    LayerParams<T>& gp = g.layers[size_t(l)];
    LayerSaved<T>& ls = s.layers[size_t(l)];
    // x_out = h + ffn(n2): dx flows to h unchanged and through the FFN to
    // dn2 (N, D): dn for a dense layer, dmoe for an MoE layer.
    ops::widen_kept(ls.n2), ops::widen_kept(ls.a), ops::widen_kept(ls.b);
    ops::widen_kept(ls.g), widen_kept(ls.moe);
    Tensor<T> dmoe;
    if (cfg.is_moe_layer(l)) {
      dmoe = moe_backward(*cfg.moe, p.moe, ls.n2.data(), ls.moe, dx.data(), gp.moe,
                          ep ? &*ep : nullptr);
    } else {
      Tensor<T> dg({N, F});
      ops::Mat<T> dg_mat = ops::mat(dg);
      ops::linear_backward<T>(&dg_mat, false, gp.w2, ops::mat(dx, N, D), ops::mat(ls.g), p.w2);
      Tensor<T> da({N, F}), db({N, F});
      ops::swiglu_backward(ops::mat(da), ops::mat(db), ops::mat(dg), ops::mat(ls.a),
                           ops::mat(ls.b));
      dg.reset();
      ops::linear_backward<T>(&dn_mat, false, gp.w1, ops::mat(da), ops::mat(ls.n2), p.w1);
      ops::linear_backward<T>(&dn_mat, true, gp.w3, ops::mat(db), ops::mat(ls.n2), p.w3);
    }
    ops::rmsnorm_backward(ops::mat(tmp, N, D), gp.ffn_norm,
                          ops::mat(dmoe.defined() ? dmoe : dn, N, D), ops::mat(ls.h, N, D),
                          p.ffn_norm, ls.rstd2);
    dmoe.reset();
    ops::add(ops::mat(dx, N, D), ops::mat(tmp, N, D));  // now d h
    // h = x + attn(n1)
    Tensor<T> dn1;
    ops::widen_kept(ls.n1);
    if (cfg.mla.dsa()) {
      // The KL's gradient is that of its mean over the batch's query rows.
      const double kl_scale = 1.0 / double(c.layout.batch * c.layout.seq);
      dsa_layer_backward(dsa_ctx(c), p.attn, p.indexer, ls.n1, dx, kl_scale, dn1, gp.attn,
                         gp.indexer);
    } else {
      mla_backward(bctx, p.attn, ls.n1, dx, ls.mla, dn1, gp.attn);
    }
    ops::rmsnorm_backward(ops::mat(tmp, N, D), gp.attn_norm, ops::mat(dn1, N, D),
                          ops::mat(ls.x, N, D), p.attn_norm, ls.rstd1);
    ops::add(ops::mat(dx, N, D), ops::mat(tmp, N, D));  // now d x
    ls = LayerSaved<T>{};
  }
  if (!st.embedding) {
    *dx_io = std::move(dx);
    return;
  }
  ops::embedding_backward(g.embed, ops::mat(dx, N, D), tokens);
}

}  // namespace

template <class T>
double lm_loss(const LmContext& c, const LmParams<T>& w, const std::int32_t* tokens,
               const std::int32_t* targets) {
  LmSaved<T> s;
  double sum =
      forward(c, w, whole_model(c.cfg), tokens, targets, static_cast<Tensor<T>*>(nullptr), s);
  c.everyone().set_phase(Phase::forward);
  c.everyone().all_reduce(&sum, 1, "loss_allreduce");
  return sum / c.loss_tokens();
}

template <class T>
double lm_forward_backward(const LmContext& c, const LmParams<T>& w, const std::int32_t* tokens,
                           const std::int32_t* targets, LmParams<T>& grads) {
  LmSaved<T> s;
  double sum =
      forward(c, w, whole_model(c.cfg), tokens, targets, static_cast<Tensor<T>*>(nullptr), s);
  const double total = c.loss_tokens();
  grads.for_each([](const std::string&, Tensor<T>& t) { t.fill(T(0)); });
  backward(c, w, whole_model(c.cfg), tokens, targets, s, 1.0 / total,
           static_cast<Tensor<T>*>(nullptr), grads);

  // One all-reduce of every gradient flattened, then one of the loss. One
  // rank's gradients are the sum already: the all-reduce would only copy
  // every gradient twice through a buffer the size of the model.
  Communicator& all_ranks = c.everyone();
  all_ranks.set_phase(Phase::grad_sync);
  if (all_ranks.size() > 1) {
    Tensor<T> all({grads.numel()}, MemCategory::comm_buffers);  // every gradient, in order
    std::int64_t off = 0;
    grads.for_each([&](const std::string&, Tensor<T>& t) {
      ops::copy(ops::flat(all).col_range(off, t.numel()), ops::flat(t));
      off += t.numel();
    });
    wire::all_reduce_gradients(all_ranks, all.data(), all.numel());
    off = 0;
    grads.for_each([&](const std::string&, Tensor<T>& t) {
      ops::copy(ops::flat(t), ops::flat(all).col_range(off, t.numel()));
      off += t.numel();
    });
  }
  all_ranks.all_reduce(&sum, 1, "loss_allreduce");
  return sum / total;
}

template <class T>
double lm_stage_forward(const LmContext& c, const LmParams<T>& w, const LmStage& stage,
                        const std::int32_t* tokens, const std::int32_t* targets, Tensor<T>& x,
                        LmStagePass<T>& pass) {
  LAGA_CHECK(stage.first >= 0 && stage.first <= stage.last && stage.last <= c.cfg.layers,
             "lm_stage_forward: layers [", stage.first, ", ", stage.last, ") are not of the ",
             c.cfg.layers, " layers");
  return forward(c, w, stage, tokens, targets, &x, *pass.saved);
}

template <class T>
void lm_stage_backward(const LmContext& c, const LmParams<T>& w, const LmStage& stage,
                       const std::int32_t* tokens, const std::int32_t* targets, double scale,
                       Tensor<T>& dx, LmStagePass<T>& pass, LmParams<T>& grads) {
  backward(c, w, stage, tokens, targets, *pass.saved, scale, &dx, grads);
}

std::vector<std::vector<std::int64_t>> group_expert_load(Communicator& comm, const LmConfig& cfg,
                                                         const ExpertRouting& routing) {
  std::vector<std::vector<std::int64_t>> load(size_t(cfg.layers));
  if (!cfg.moe) return load;
  const std::int64_t E = cfg.moe->n_routed_experts;
  std::vector<double> all;  // every MoE layer's (E) counts, in layer order
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    if (!cfg.is_moe_layer(l)) continue;
    const std::vector<std::int64_t>& c = routing.count.at(size_t(l));
    LAGA_CHECK(std::int64_t(c.size()) == E, "group_expert_load: layer ", l, " recorded ", c.size(),
               " expert counts for n_routed_experts ", E,
               "; pass the routing a forward of this model recorded (LmContext::routing)");
    all.insert(all.end(), c.begin(), c.end());
  }
  if (comm.size() > 1 && !all.empty()) {
    comm.set_phase(Phase::grad_sync);
    comm.all_reduce(all.data(), std::int64_t(all.size()), "expert_load_allreduce");
  }
  size_t off = 0;
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    if (!cfg.is_moe_layer(l)) continue;
    for (std::int64_t e = 0; e < E; ++e) load[size_t(l)].push_back(std::int64_t(all[off++]));
  }
  return load;
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template struct LmParams<T>;                                                                     \
  template void init_lm_params<T>(LmParams<T>&, std::uint64_t);                                    \
  template double lm_forward_backward<T>(const LmContext&, const LmParams<T>&,                     \
                                         const std::int32_t*, const std::int32_t*, LmParams<T>&);  \
  template double lm_loss<T>(const LmContext&, const LmParams<T>&, const std::int32_t*,            \
                             const std::int32_t*);                                                 \
  template struct LmStagePass<T>;                                                                  \
  template double lm_stage_forward<T>(const LmContext&, const LmParams<T>&, const LmStage&,        \
                                      const std::int32_t*, const std::int32_t*, Tensor<T>&,        \
                                      LmStagePass<T>&);                                            \
  template void lm_stage_backward<T>(const LmContext&, const LmParams<T>&, const LmStage&,         \
                                     const std::int32_t*, const std::int32_t*, double, Tensor<T>&, \
                                     LmStagePass<T>&, LmParams<T>&);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
