#include "mla/config.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "io/json_repeated_keys.hpp"
#include "kernels/fp8_e4m3.hpp"

namespace laga {

using nlohmann::json;

double MlaConfig::softmax_scale() const {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (yarn()) {
    const double m = 0.1 * mscale * std::log(rope_factor) + 1.0;
    s *= m * m;
  }
  return s;
}

RopeParams MlaConfig::rope() const {
  RopeParams p;
  p.dim = rotates() ? qk_rope_head_dim : 0;  // NoPE: an empty table, nothing rotated
  p.theta = rope_theta;
  p.yarn = yarn();
  p.factor = rope_factor;
  p.original_seq_len = original_seq_len;
  p.beta_fast = beta_fast;
  p.beta_slow = beta_slow;
  return p;
}

namespace {
constexpr double kMaxRopeFactor = 1e6;
constexpr double kMaxRopeTheta = 1e12;
constexpr double kMaxYarnBeta = 1e6;
constexpr double kMaxMscale = 100;
constexpr std::int64_t kMaxSeqLen = std::int64_t(1) << 40;
}  // namespace

void MlaConfig::validate() const {
  auto positive = [](std::int64_t v, const char* name) {
    LAGA_CHECK(v > 0, "config: ", name, " must be positive, got ", v);
  };
  positive(dim, "dim");
  positive(n_heads, "n_heads");
  positive(kv_lora_rank, "kv_lora_rank");
  positive(qk_nope_head_dim, "qk_nope_head_dim");
  // qk_rope_head_dim may be 0: NoPE MLA (GLM-5.3-Flash's DSA layers; Kimi
  // K3 keeps 64 unrotated dims instead, mla_use_nope).
  LAGA_CHECK(qk_rope_head_dim >= 0,
             "config: qk_rope_head_dim must be 0 (no rope part) or positive, got ",
             qk_rope_head_dim);
  LAGA_CHECK(!(mla_use_nope && yarn_always),
             "config: mla_use_nope is true but yarn_always is set; NoPE rotates nothing");
  positive(v_head_dim, "v_head_dim");
  LAGA_CHECK(q_lora_rank >= 0, "config: q_lora_rank must be 0 (no q compression) or positive, got ",
             q_lora_rank);
  LAGA_CHECK(qk_rope_head_dim % 2 == 0,
             "config: qk_rope_head_dim must be even (RoPE rotates pairs), got ", qk_rope_head_dim);
  // The real-valued keys have physical ranges as the integers do: a value
  // past them is a typo or a hostile file, not a model (issue 54, T), and
  // is refused here naming the key rather than found later as a wrong
  // number or an overflow blamed on something else.
  LAGA_CHECK(rope_theta > 1.0, "config: rope_theta must be > 1, got ", rope_theta);
  LAGA_CHECK(rope_theta <= kMaxRopeTheta, "config: rope_theta ", rope_theta, " is beyond ",
             kMaxRopeTheta,
             " (RoPE's base; published models use 1e4 to 1e7; past 1e12 every pair but the "
             "first rotates by less than float's rounding)");
  LAGA_CHECK(norm_eps >= kLeastNormEps && norm_eps < 1, "config: norm_eps ", norm_eps,
             " must be in [", kLeastNormEps,
             ", 1) (the RMSNorms' eps, 1e-6 in DeepSeek-V3; below 1e-30 1/sqrt(eps) leaves "
             "float's range for an all-zero row)");
  LAGA_CHECK(original_seq_len > 0 && max_seq_len > 0,
             "config: original_seq_len and max_seq_len must be positive");
  // A query compression wider than the model is legal algebra but no model
  // has one: almost surely a typo (refused, docs/reliability.md).
  LAGA_CHECK(q_lora_rank <= dim, "config: q_lora_rank ", q_lora_rank, " is larger than dim ", dim,
             "; a low-rank query compression is narrower than the model (DeepSeek-V3: 1536 of "
             "7168); use 0 for none");
  LAGA_CHECK(original_seq_len <= kMaxSeqLen && max_seq_len <= kMaxSeqLen,
             "config: original_seq_len ", original_seq_len, " / max_seq_len ", max_seq_len,
             " beyond ", kMaxSeqLen, " tokens; check the config");
  if (yarn() && rotates()) {
    // YaRN stretches the context by rope_factor; 1e308 overflows its
    // frequency arithmetic. No model extends its context a million-fold.
    LAGA_CHECK(std::isfinite(rope_factor) && rope_factor <= kMaxRopeFactor, "config: rope_factor ",
               rope_factor, " is beyond ", kMaxRopeFactor,
               " (the context-extension factor of YaRN; DeepSeek-V3 uses 40)");
    LAGA_CHECK(rope_factor >= 1.0, "config: rope_factor must be >= 1 when YaRN is on (",
               yarn_always
                   ? std::string("the rope type is yarn")
                   : cat("max_seq_len ", max_seq_len, " > original_seq_len ", original_seq_len),
               "), got ", rope_factor);
    LAGA_CHECK(beta_fast > beta_slow && beta_slow > 0,
               "config: YaRN needs beta_fast > beta_slow > 0, got ", beta_fast, " and ", beta_slow);
    LAGA_CHECK(beta_fast <= kMaxYarnBeta, "config: beta_fast ", beta_fast, " is beyond ",
               kMaxYarnBeta,
               " (YaRN's rotation counts over the original context; DeepSeek-V3: 32 and 1)");
    LAGA_CHECK(mscale >= 0, "config: mscale must be >= 0, got ", mscale);
    LAGA_CHECK(mscale <= kMaxMscale, "config: mscale ", mscale, " is beyond ", kMaxMscale,
               " ((0.1 mscale ln(rope_factor) + 1)^2 multiplies the softmax scale; DeepSeek-V3: "
               "1)");
  }
  validate_dsa();
  // Sizes past this overflow int32 BLAS arguments somewhere; nobody needs them.
  LAGA_CHECK(n_heads * (qk_head_dim() + v_head_dim) < (1ll << 24) && dim < (1ll << 24),
             "config: dimensions too large (dim ", dim, ", n_heads ", n_heads, ")");
}

void MlaConfig::validate_dsa() const {
  const bool any = index_n_heads != 0 || index_head_dim != 0 || index_topk != 0;
  for (auto [on, name] :
       {std::pair{index_fp8, "index_fp8"}, std::pair{kv_fp8_round_trip, "kv_fp8_round_trip"}})
    LAGA_CHECK(any || !on, "config: ", name,
               " is true but DeepSeek Sparse Attention is off; it is part of DeepSeek-V3.2's "
               "fp8 DSA path, which only the DSA forms run, so set index_n_heads, "
               "index_head_dim and index_topk too, or drop ",
               name);
  if (!any) return;
  for (auto [v, name] :
       {std::pair{index_n_heads, "index_n_heads"}, std::pair{index_head_dim, "index_head_dim"},
        std::pair{index_topk, "index_topk"}})
    LAGA_CHECK(v > 0, "config: ", name,
               " must be positive when DeepSeek Sparse Attention is on, got ", v,
               " (set index_n_heads, index_head_dim and index_topk together, as DeepSeek-V3.2's "
               "config.json does: 64, 128, 2048; or none of them for dense MLA)");
  LAGA_CHECK(q_lora_rank > 0,
             "config: DSA needs q_lora_rank > 0: the lightning indexer (index_topk ", index_topk,
             ") projects its queries from the query latent (wq_b over q_lora_rank), but "
             "q_lora_rank is 0; set q_lora_rank (DeepSeek-V3.2: 1536) or remove the index_* keys");
  LAGA_CHECK(index_head_dim >= qk_rope_head_dim, "config: index_head_dim ", index_head_dim,
             " is narrower than qk_rope_head_dim ", qk_rope_head_dim,
             "; the indexer rotates its first qk_rope_head_dim dims (DeepSeek-V3.2: 128 and 64)");
  LAGA_CHECK(
      index_n_heads < (1ll << 16) && index_head_dim < (1ll << 16) && index_topk <= kMaxSeqLen,
      "config: indexer dimensions too large (index_n_heads ", index_n_heads, ", index_head_dim ",
      index_head_dim, ", index_topk ", index_topk, ")");
  // DeepSeek's fp8_index takes one k scale per key: index_head_dim is one
  // block of act_quant's 128 (kernels/dsa_indexer_fp8.hpp).
  LAGA_CHECK(!index_fp8 || index_head_dim == kActQuantBlock,
             "config: index_fp8 needs index_head_dim ", kActQuantBlock,
             " (one fp8 block per key, as DeepSeek's fp8_index takes), got ", index_head_dim,
             "; set index_head_dim ", kActQuantBlock, " or index_fp8 false");
  LAGA_CHECK(!kv_fp8_round_trip || kv_lora_rank % kActQuantBlock == 0,
             "config: kv_fp8_round_trip needs kv_lora_rank a multiple of ", kActQuantBlock,
             " (act_quant's blocks; DeepSeek-V3.2: 512), got ", kv_lora_rank,
             "; change kv_lora_rank or set kv_fp8_round_trip false");
}

std::vector<std::string> MlaConfig::preset_names() {
  return {"tiny", "small", "paper", "deepseek-v3", "deepseek-v2-lite",
          // DSA models' attention (their indexers: DsaConfig::preset)
          "deepseek-v3.2", "glm-5-like"};
}

MlaConfig MlaConfig::preset(const std::string& name) {
  MlaConfig c;
  if (name == "tiny") {
    c.dim = 48, c.n_heads = 4, c.kv_lora_rank = 24, c.qk_nope_head_dim = 8, c.qk_rope_head_dim = 4,
    c.v_head_dim = 6;
  } else if (name == "small") {
    // defaults above
  } else if (name == "paper" || name == "deepseek-v3" || name == "deepseek-v3.2") {
    // DeepSeek-V3 671B attention (config_671B.json); YaRN on as shipped.
    // DeepSeek-V3.2's MLA is V3's (config_671B_v3.2.json); its indexer is
    // DsaConfig::preset's.
    c.dim = 7168, c.n_heads = 128, c.kv_lora_rank = 512, c.qk_nope_head_dim = 128,
    c.qk_rope_head_dim = 64, c.v_head_dim = 128;
    c.q_lora_rank = name == "paper" ? 0 : 1536;
    c.rope_factor = 40, c.original_seq_len = 4096, c.max_seq_len = 163840;
    c.beta_fast = 32, c.beta_slow = 1, c.mscale = 1.0;
  } else if (name == "deepseek-v2-lite") {
    // DeepSeek-V2-Lite's attention (its config.json: hidden 2048, 16 heads,
    // no query latent); YaRN as shipped, its mscale_all_dim 0.707 being
    // ModelArgs' mscale. pith-train's ring benchmarks ran this model.
    c.dim = 2048, c.n_heads = 16, c.kv_lora_rank = 512, c.qk_nope_head_dim = 128,
    c.qk_rope_head_dim = 64, c.v_head_dim = 128, c.q_lora_rank = 0;
    c.rope_factor = 40, c.original_seq_len = 4096, c.max_seq_len = 163840;
    c.beta_fast = 32, c.beta_slow = 1, c.mscale = 0.707;
  } else if (name == "glm-5-like") {
    // GLM-5's attention as transformers' GlmMoeDsaConfig defaults give it
    // (docs/configs.md, "Presets": hidden 6144, 64 heads, no YaRN, θ 1e6).
    c.dim = 6144, c.n_heads = 64, c.q_lora_rank = 2048, c.kv_lora_rank = 512,
    c.qk_nope_head_dim = 192, c.qk_rope_head_dim = 64, c.v_head_dim = 256;
    c.rope_theta = 1e6, c.original_seq_len = 202752, c.max_seq_len = 202752;
  } else {
    std::string names;
    for (auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail("unknown preset '", name, "'; choose one of: ", names, " (or pass --config FILE.json)");
  }
  return c;
}

namespace {

// Integers in a config are dimensions and lengths: 2^53 (exact in a double)
// bounds them all, and keeps every later product of two far from overflow
// once validate() has bounded the dimensions.
constexpr std::int64_t kMaxConfigInt = std::int64_t(1) << 53;

template <class V>
bool read_key(const json& j, const char* key, V& out, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return false;
  if constexpr (std::is_integral_v<V>) {
    // Read exactly, and refuse what no int64 holds before converting: a cast
    // of 1e300 is undefined (it printed as -9223372036854775808).
    if (it->is_number_unsigned()) {
      const auto u = it->template get<std::uint64_t>();
      LAGA_CHECK(u <= std::uint64_t(kMaxConfigInt), source, ": '", key, "' is ", it->dump(),
                 ", beyond any model dimension (at most ", kMaxConfigInt, ")");
      out = static_cast<V>(u);
    } else if (it->is_number_integer()) {
      out = static_cast<V>(it->template get<std::int64_t>());
    } else {
      LAGA_CHECK(it->is_number_float(), source, ": '", key, "' must be an integer, got ",
                 it->dump());
      const double d = it->template get<double>();
      LAGA_CHECK(std::isfinite(d) && std::floor(d) == d, source, ": '", key,
                 "' must be an integer, got ", it->dump());
      LAGA_CHECK(std::abs(d) <= double(kMaxConfigInt), source, ": '", key, "' is ", it->dump(),
                 ", beyond any model dimension (at most ", kMaxConfigInt, ")");
      out = static_cast<V>(d);
    }
  } else {
    LAGA_CHECK(it->is_number(), source, ": '", key, "' must be a number, got ", it->dump());
    out = it->template get<V>();
    LAGA_CHECK(std::isfinite(static_cast<double>(out)), source, ": '", key,
               "' must be finite, got ", it->dump());
  }
  return true;
}

// A boolean key: absent or null leaves `out`; anything but true/false is
// refused naming the key.
bool read_bool_key(const json& j, const char* key, bool& out, const std::string& source) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return false;
  LAGA_CHECK(it->is_boolean(), source, ": '", key, "' must be true or false, got ", it->dump());
  out = it->get<bool>();
  return true;
}

// Kimi K3's two MLA switches (its config.json names, read under either key
// set): mla_use_nope and mla_use_output_gate. A NoPE config with a RoPE
// scaling block is contradictory (nothing rotates, yet YaRN would change the
// softmax scale): refused, naming both keys.
void read_kimi_keys(const json& j, MlaConfig& c, const std::string& source) {
  read_bool_key(j, "mla_use_nope", c.mla_use_nope, source);
  read_bool_key(j, "mla_use_output_gate", c.mla_use_output_gate, source);
  if (!c.mla_use_nope) return;
  for (const char* k : {"rope_scaling", "rope_parameters"}) {
    const auto it = j.find(k);
    if (it == j.end() || it->is_null() || !it->is_object()) continue;
    const auto type = it->find("type") != it->end() ? it->find("type") : it->find("rope_type");
    const bool plain =
        type == it->end() || (type->is_string() && type->get<std::string>() == "default");
    LAGA_CHECK(plain, source, ": mla_use_nope is true but '", k, "' asks for ", type->dump(),
               " RoPE scaling; with NoPE nothing rotates, so the scaling (and its softmax "
               "mscale) cannot apply: remove '",
               k, "' or set mla_use_nope false");
  }
}

// The RoPE block of a Hugging Face config.json, by transformers' own rules:
// transformers 4 writes `rope_theta` and `rope_scaling`, transformers 5
// `rope_parameters` (rope_theta inside). Every key of the block is read or
// refused: an ignored key that changes the math is a silently wrong model.
void read_hf_rope(const json& j, MlaConfig& c, const std::string& source) {
  const auto block = [&](const char* key) -> const json* {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  const json* scaling = block("rope_scaling");
  const json* params = block("rope_parameters");
  LAGA_CHECK(!(scaling && params), source,
             ": both 'rope_scaling' (transformers 4) and 'rope_parameters' (transformers 5) are "
             "given; keep the one your transformers wrote");
  read_key(j, "rope_theta", c.rope_theta, source);
  const json* rs = scaling ? scaling : params;
  if (!rs) return;
  const char* name = scaling ? "rope_scaling" : "rope_parameters";
  LAGA_CHECK(rs->is_object(), source, ": '", name, "' must be an object or null");
  if (params && params->contains("rope_theta")) {
    double theta = 0;
    read_key(*params, "rope_theta", theta, source);
    LAGA_CHECK(!j.contains("rope_theta") || j.at("rope_theta").is_null() || theta == c.rope_theta,
               source, ": rope_theta ", c.rope_theta, " and rope_parameters.rope_theta ", theta,
               " disagree; give one");
    c.rope_theta = theta;
  }
  // The type, under either spelling; two that differ are a contradiction.
  std::string type;
  for (const char* k : {"type", "rope_type"}) {
    const auto it = rs->find(k);
    if (it == rs->end() || it->is_null()) continue;
    LAGA_CHECK(it->is_string(), source, ": ", name, " '", k, "' must be a string, got ",
               it->dump());
    LAGA_CHECK(type.empty() || type == it->get<std::string>(), source, ": ", name, " says type '",
               type, "' and rope_type '", it->get<std::string>(),
               "'; they contradict each other: keep one");
    type = it->get<std::string>();
  }
  if (params && type == "default") type.clear();  // transformers 5's plain RoPE
  LAGA_CHECK(type.empty() || type == "yarn", source, ": ", name, " type '", type,
             "' is not supported; laga implements DeepSeek-V3's YaRN ('yarn') or plain RoPE");
  if (scaling) LAGA_CHECK(!type.empty(), source, ": rope_scaling gives no 'type' or 'rope_type'");
  const std::set<std::string> plain{"type", "rope_type", "rope_theta", "partial_rotary_factor"};
  const std::set<std::string> yarn{"type",
                                   "rope_type",
                                   "rope_theta",
                                   "factor",
                                   "original_max_position_embeddings",
                                   "beta_fast",
                                   "beta_slow",
                                   "mscale",
                                   "mscale_all_dim",
                                   "attention_factor",
                                   "truncate",
                                   "partial_rotary_factor"};
  for (const auto& [k, v] : rs->items())
    LAGA_CHECK((type.empty() ? plain : yarn).count(k) != 0, source, ": ", name, " key '", k,
               "' is not read by laga", type.empty() ? " for plain RoPE" : " for YaRN",
               "; it may change the math, so laga refuses it rather than ignore it (remove it if "
               "it does not apply)");
  if (rs->contains("partial_rotary_factor")) {
    double f = 1.0;
    read_key(*rs, "partial_rotary_factor", f, source);
    LAGA_CHECK(f == 1.0, source, ": ", name, " partial_rotary_factor ", f,
               " rotates part of the rope dims; DeepSeek-V3 rotates all qk_rope_head_dim (1.0)");
  }
  if (type.empty()) return;
  read_key(*rs, "factor", c.rope_factor, source);
  // HF's DeepSeek code defaults the original context to 4096 when absent.
  c.original_seq_len = 4096;
  read_key(*rs, "original_max_position_embeddings", c.original_seq_len, source);
  // transformers applies YaRN whenever the type is yarn; DeepSeek's own code
  // only when max_seq_len > original_seq_len. The flag is set only where the
  // two differ, so every other config's JSON is what it was.
  c.yarn_always = c.max_seq_len <= c.original_seq_len;
  read_key(*rs, "beta_fast", c.beta_fast, source);
  read_key(*rs, "beta_slow", c.beta_slow, source);
  if (const auto t = rs->find("truncate"); t != rs->end() && !t->is_null())
    LAGA_CHECK(t->is_boolean() && t->get<bool>(), source, ": ", name, " truncate ", t->dump(),
               ": DeepSeek's YaRN rounds the ramp's ends to whole dims (truncate true); laga "
               "implements only that");
  double ms = 1.0, ms_all = 0.0;
  read_key(*rs, "mscale", ms, source);
  read_key(*rs, "mscale_all_dim", ms_all, source);
  // transformers scales the softmax by get_mscale(factor, mscale_all_dim)^2
  // and cos/sin by an attention factor: get_mscale(factor, mscale) /
  // get_mscale(factor, mscale_all_dim) when both are non-zero, else
  // get_mscale(factor) = 0.1 ln(factor) + 1. DeepSeek's inference code (laga's
  // reference) has one mscale, on the softmax only, and never scales cos/sin.
  // They agree exactly when mscale == mscale_all_dim != 0 (every released V3
  // config: 1.0 and 1.0); anything else is refused, naming what transformers
  // would do.
  LAGA_CHECK(ms == ms_all, source, ": ", name, " mscale (", ms, ") != mscale_all_dim (", ms_all,
             rs->contains("mscale_all_dim") ? "" : ", absent: HF's default",
             "); HF would then scale cos/sin by their ratio, which DeepSeek's inference code "
             "(laga's reference) never does; set both to the same value");
  LAGA_CHECK(ms != 0 || c.rope_factor <= 1, source, ": ", name,
             " mscale = mscale_all_dim = 0: transformers then scales cos/sin by 0.1 ln(factor) + "
             "1 = ",
             0.1 * std::log(c.rope_factor) + 1,
             ", which DeepSeek's inference code (laga's reference) never does; set both to 1.0 as "
             "DeepSeek-V3 does");
  if (const auto a = rs->find("attention_factor"); a != rs->end() && !a->is_null()) {
    double f = 1.0;
    read_key(*rs, "attention_factor", f, source);
    LAGA_CHECK(f == 1.0, source, ": ", name, " attention_factor ", f,
               " scales cos/sin, which DeepSeek's inference code (laga's reference) never does; "
               "remove it or set 1.0");
  }
  c.mscale = ms_all;
}

}  // namespace

bool read_config_key(const json& j, const char* key, std::int64_t& out, const std::string& source) {
  return read_key(j, key, out, source);
}
bool read_config_key(const json& j, const char* key, double& out, const std::string& source) {
  return read_key(j, key, out, source);
}

void MlaConfig::read_dsa_keys(const nlohmann::json& j, const std::string& source) {
  // DeepSeek-V3.2's keys, the same names in its ModelArgs JSON and its
  // Hugging Face config.json; absent: dense MLA.
  const bool has_heads = read_key(j, "index_n_heads", index_n_heads, source);
  const bool has_dim = read_key(j, "index_head_dim", index_head_dim, source);
  const bool has_topk = read_key(j, "index_topk", index_topk, source);
  // laga's keys; validate_dsa checks them
  read_bool_key(j, "index_fp8", index_fp8, source);
  read_bool_key(j, "kv_fp8_round_trip", kv_fp8_round_trip, source);
  if (!has_heads && !has_dim && !has_topk) return;
  // DeepSeek's ModelArgs defaults them, but a config that names one and not
  // the others is ambiguous.
  const char* missing = !has_heads ? "index_n_heads" : !has_dim ? "index_head_dim" : "index_topk";
  LAGA_CHECK(has_heads && has_dim && has_topk, source, ": '", missing,
             "' is missing; a DSA config gives index_n_heads, index_head_dim and index_topk "
             "together (DeepSeek-V3.2: 64, 128, 2048)");
}

MlaConfig MlaConfig::from_json(const json& j, const std::string& source) {
  LAGA_CHECK(j.is_object(), source, ": expected a JSON object with the model's dimensions");
  // A multimodal Hugging Face config (Kimi K3's) keeps the language model's
  // keys under text_config.
  if (const auto t = j.find("text_config");
      t != j.end() && t->is_object() && !j.contains("hidden_size") && !j.contains("dim"))
    return from_json(*t, source + " text_config");
  MlaConfig c;
  read_kimi_keys(j, c, source);
  // Unlike ModelArgs' defaults, a JSON that omits a dimension is an error: a
  // silently defaulted head count gives silently wrong numbers.
  auto need = [&](const char* key, std::int64_t& out) {
    LAGA_CHECK(read_key(j, key, out, source), source, ": missing '", key,
               "' (the MLA block needs it; see docs/configs.md)");
  };
  if (j.contains("hidden_size")) {  // Hugging Face config.json
    need("hidden_size", c.dim);
    need("num_attention_heads", c.n_heads);
    c.q_lora_rank = 0;
    read_key(j, "q_lora_rank", c.q_lora_rank, source);  // null means no q compression
    need("kv_lora_rank", c.kv_lora_rank);
    need("qk_nope_head_dim", c.qk_nope_head_dim);
    need("qk_rope_head_dim", c.qk_rope_head_dim);
    need("v_head_dim", c.v_head_dim);
    // rms_norm_eps is the decoder layers' norms' eps, not q_a/kv_a's (1e-6 in
    // every published implementation): not read (MlaConfig::norm_eps).
    std::int64_t max_pos = 4096;
    read_key(j, "max_position_embeddings", max_pos, source);
    c.max_seq_len = max_pos;
    c.original_seq_len = max_pos;  // no YaRN unless the rope block says so
    read_hf_rope(j, c, source);
  } else {  // DeepSeek inference ModelArgs (or laga's own, which adds norm_eps)
    need("dim", c.dim);
    need("n_heads", c.n_heads);
    need("kv_lora_rank", c.kv_lora_rank);
    need("qk_nope_head_dim", c.qk_nope_head_dim);
    need("qk_rope_head_dim", c.qk_rope_head_dim);
    need("v_head_dim", c.v_head_dim);
    // ModelArgs defaults for what a config may leave out.
    c.q_lora_rank = 0;
    c.original_seq_len = 4096;
    c.max_seq_len = 4096 * 4;
    c.rope_factor = 40;
    read_key(j, "q_lora_rank", c.q_lora_rank, source);
    read_key(j, "rope_theta", c.rope_theta, source);
    read_key(j, "rope_factor", c.rope_factor, source);
    read_key(j, "original_seq_len", c.original_seq_len, source);
    read_key(j, "max_seq_len", c.max_seq_len, source);
    read_key(j, "beta_fast", c.beta_fast, source);
    read_key(j, "beta_slow", c.beta_slow, source);
    read_key(j, "mscale", c.mscale, source);
    read_key(j, "norm_eps", c.norm_eps, source);
    if (const auto y = j.find("yarn_always"); y != j.end() && !y->is_null()) {
      LAGA_CHECK(y->is_boolean(), source, ": 'yarn_always' must be true or false, got ", y->dump());
      c.yarn_always = y->get<bool>();
    }
  }
  c.read_dsa_keys(j, source);
  try {
    c.validate();
  } catch (const Error& e) {
    fail(source, ": ", e.what());
  }
  return c;
}

json parse_json_refusing_repeated_keys(const std::string& text, const std::string& where) {
  RepeatedKeys repeated;  // io/json_repeated_keys.hpp
  const json::parser_callback_t check_keys = [&](int, json::parse_event_t ev, json& parsed) {
    repeated.observe(ev, parsed);
    return true;
  };
  json j;
  try {
    j = json::parse(text, check_keys);
  } catch (const std::exception& e) {
    fail(where, " is not valid JSON: ", e.what());
  }
  LAGA_CHECK(repeated.first().empty(), where, ": key '", repeated.first(),
             "' appears twice in one object; JSON readers disagree on which wins, so remove one");
  return j;
}

MlaConfig MlaConfig::from_json_file(const std::string& path) {
  return from_json(read_config_json_file(path), "config '" + path + "'");
}

json read_config_json_file(const std::string& path) {
  // stat before opening: an ifstream on a FIFO with no writer blocks forever.
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  LAGA_CHECK(fs::exists(st), "cannot open config file '", path, "': no such file; check the path");
  LAGA_CHECK(!fs::is_directory(st), "config file '", path,
             "' is a directory; give the JSON file (config.json) inside it");
  LAGA_CHECK(fs::is_regular_file(st), "config file '", path,
             "' is not a regular file (a FIFO, socket or device); give a JSON file");
  std::ifstream in(path);
  LAGA_CHECK(in.good(), "cannot open config file '", path, "'; check its permissions");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return parse_json_refusing_repeated_keys(text, "config file '" + path + "'");
}

json MlaConfig::to_json() const {
  json j{{"dim", dim},
         {"n_heads", n_heads},
         {"q_lora_rank", q_lora_rank},
         {"kv_lora_rank", kv_lora_rank},
         {"qk_nope_head_dim", qk_nope_head_dim},
         {"qk_rope_head_dim", qk_rope_head_dim},
         {"v_head_dim", v_head_dim},
         {"rope_theta", rope_theta},
         {"rope_factor", rope_factor},
         {"original_seq_len", original_seq_len},
         {"max_seq_len", max_seq_len},
         {"beta_fast", beta_fast},
         {"beta_slow", beta_slow},
         {"mscale", mscale},
         {"norm_eps", norm_eps}};
  // Kimi K3's keys, written only when on, so every other config's JSON is
  // what it was.
  if (mla_use_nope) j["mla_use_nope"] = true;
  if (mla_use_output_gate) j["mla_use_output_gate"] = true;
  // laga's own key, written only when set (Hugging Face's rule, above), so
  // a ModelArgs-rule config's JSON is what it always was.
  if (yarn_always) j["yarn_always"] = true;
  if (dsa()) {  // written only when on, so a dense config's JSON is what it was
    j["index_n_heads"] = index_n_heads;
    j["index_head_dim"] = index_head_dim;
    j["index_topk"] = index_topk;
    if (index_fp8) j["index_fp8"] = true;
    if (kv_fp8_round_trip) j["kv_fp8_round_trip"] = true;
  }
  return j;
}

std::string MlaConfig::summary() const {
  return cat("D=", dim, " H=", n_heads, " rq=", q_lora_rank, " C=", kv_lora_rank,
             " dn=", qk_nope_head_dim, " dr=", qk_rope_head_dim, " dv=", v_head_dim,
             yarn() ? cat(" yarn(factor=", rope_factor, ")") : std::string(" rope"),
             dsa() ? cat(" dsa(HI=", index_n_heads, " dI=", index_head_dim, " topk=", index_topk,
                         index_fp8 ? " fp8" : "", kv_fp8_round_trip ? " kv_fp8" : "", ")")
                   : std::string());
}

}  // namespace laga
