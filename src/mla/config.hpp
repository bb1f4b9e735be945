// MlaConfig — the dimensions and RoPE/YaRN settings of one MLA block, under
// DeepSeek-V3's ModelArgs names (docs/mla-math.md has the math).
//
//   D   dim                 H   n_heads             rq  q_lora_rank (0: wq)
//   C   kv_lora_rank        dn  qk_nope_head_dim    dr  qk_rope_head_dim
//   dv  v_head_dim
//
// Kimi K3's gated NoPE MLA (docs/mla-math.md, "Gated NoPE MLA") under its
// config.json names: mla_use_nope (the dr "rope" dims are kept, k_pe shared
// over heads, but never rotated; dr may also be 0) and mla_use_output_gate
// (o = o_heads * sigmoid(x wg^T) before wo).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kernels/rope.hpp"

namespace laga {

// Parses JSON text, refusing a key repeated in one object: nlohmann keeps
// the last silently and other readers the first, so a file that sets "dim"
// (or a profile's "bytes_per_s") twice means different things to different
// readers. Throws laga::Error: "<where>: not valid JSON (...)" or "<where>:
// key 'k' appears twice in one object; ...". Used by the config and the
// hardware-profile readers.
nlohmann::json parse_json_refusing_repeated_keys(const std::string& text, const std::string& where);
// A config file's JSON: the path vetted first (missing, a directory, a FIFO
// or device: each its own message, and nothing blocks), then parsed with
// parse_json_refusing_repeated_keys. What every --config reader starts from.
nlohmann::json read_config_json_file(const std::string& path);

// One key of a config JSON by the rules MlaConfig::from_json reads each of
// its keys by: absent or null returns false and leaves `out` as it was; an
// integer must be exact and at most 2^53 in size, a number finite; anything
// else throws laga::Error naming source and key. MoeConfig (model/moe_config)
// reads its keys through these, so both blocks of one config.json refuse the
// same things in the same words.
bool read_config_key(const nlohmann::json& j, const char* key, std::int64_t& out,
                     const std::string& source);
bool read_config_key(const nlohmann::json& j, const char* key, double& out,
                     const std::string& source);

// The least eps an RMSNorm of a config may have (MlaConfig::norm_eps and the
// model's norms alike): rstd = 1/sqrt(mean x^2 + eps) is at most
// 1/sqrt(eps), which must stay inside float's range for an all-zero or
// subnormal row (kernels/rmsnorm.cpp). Published models use 1e-6 to 1e-5.
inline constexpr double kLeastNormEps = 1e-30;

struct MlaConfig {
  std::int64_t dim = 256;
  std::int64_t n_heads = 8;
  std::int64_t q_lora_rank = 0;
  std::int64_t kv_lora_rank = 64;
  std::int64_t qk_nope_head_dim = 32;
  std::int64_t qk_rope_head_dim = 16;
  std::int64_t v_head_dim = 32;
  double rope_theta = 10000.0;
  double rope_factor = 40.0;
  std::int64_t original_seq_len = 4096;
  std::int64_t max_seq_len = 4096;  // YaRN is on iff max_seq_len > original_seq_len, or
  // Hugging Face's rule (a config.json whose rope type is yarn): on whatever
  // the lengths. DeepSeek's ModelArgs code turns it on by the lengths only.
  bool yarn_always = false;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  // Kimi K3 (config.json keys of the same names): no rotation anywhere, and
  // the full-rank, channel-wise sigmoid output gate wg (H*dv, D).
  bool mla_use_nope = false;
  bool mla_use_output_gate = false;
  // kv_norm and q_norm. DeepSeek's model.py, its modeling_deepseek.py and
  // transformers all build them with 1e-6 whatever a config.json's
  // rms_norm_eps says (that key is the decoder layers' norms): a Hugging
  // Face config leaves it at 1e-6; laga's own JSON may set it (norm_eps).
  double norm_eps = 1e-6;
  // DeepSeek Sparse Attention (DeepSeek-V3.2's lightning indexer,
  // docs/forms.md, "DeepSeek Sparse Attention (DSA)"), under the names of
  // DeepSeek's config.json and ModelArgs: the indexer's heads, their width
  // and how many keys each query attends. All three 0: dense MLA (every
  // model before V3.2); all three positive: DSA. validate() refuses a mix.
  std::int64_t index_n_heads = 0;
  std::int64_t index_head_dim = 0;
  std::int64_t index_topk = 0;
  // laga's key: the indexer scores as DeepSeek's inference code does, fp8
  // (Hadamard rotation, e4m3 act_quant with ue8m0 block scales, fp8_index;
  // docs/forms.md, "The fp8 indexer"); false: in the run's dtype. Needs
  // DSA on and index_head_dim 128. It decides the selection only: the KL
  // loss and its gradient read the run-dtype scores.
  bool index_fp8 = false;
  // laga's key: DeepSeek's fp8 simulation of the kv cache in MLA.forward
  // (act_quant of the kv_lora_rank latent after kv_norm, blocks of 128,
  // ue8m0, and back) in every DSA form's forward; needs DSA on and
  // kv_lora_rank a multiple of 128. Forward only: a backward with it on is
  // refused (docs/forms.md, "The fp8 indexer").
  bool kv_fp8_round_trip = false;

  bool dsa() const { return index_topk > 0; }
  std::int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Never with nothing to rotate (NoPE): no YaRN, no mscale on the softmax
  // (Kimi K3's scale is (dn + dr)^-1/2).
  bool yarn() const { return rotates() && (yarn_always || max_seq_len > original_seq_len); }
  // (dn + dr)^-1/2, times mscale^2 with mscale = 0.1 * mscale * ln(factor) + 1
  // under YaRN (DeepSeek-V3 MLA.__init__).
  double softmax_scale() const;
  // dim 0 when nothing rotates (mla_use_nope, or qk_rope_head_dim 0): the
  // RoPE op is then skipped (mla/ops.hpp, ops::rope).
  RopeParams rope() const;
  bool rotates() const { return !mla_use_nope && qk_rope_head_dim > 0; }

  // Throws laga::Error naming the first bad field and the fix.
  void validate() const;
  // The DSA keys' part of validate(): all three or none, and what the
  // indexer reads (the query latent, its rope dims) present. The one
  // validation of the indexer's dims (DsaConfig::validate calls it).
  void validate_dsa() const;
  // Reads index_n_heads, index_head_dim, index_topk, index_fp8 and kv_fp8_round_trip from a config
  // JSON into this config: the one reader of DSA's keys (from_json and DsaConfig::from_json call
  // it). None given: left 0 (dense MLA); some but not all: a laga::Error naming the missing one.
  void read_dsa_keys(const nlohmann::json& j, const std::string& source);

  // Presets: "small" (the default, seconds on 2 cores), "paper" (DeepSeek-V3
  // attention dims with rq = 0, as in the LAGA paper's §4), "deepseek-v3"
  // (rq = 1536, as shipped), "tiny" (for tests).
  static MlaConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();

  // Either DeepSeek's inference ModelArgs JSON (`dim`, `n_heads`, ...) or
  // Hugging Face's DeepSeek-V3 config.json (`hidden_size`,
  // `num_attention_heads`, `rope_scaling`, ...); keys that do not concern
  // the attention block (vocab, MoE, layers) are ignored.
  static MlaConfig from_json(const nlohmann::json& j, const std::string& source = "config");
  static MlaConfig from_json_file(const std::string& path);
  nlohmann::json to_json() const;  // ModelArgs names, plus norm_eps
  std::string summary() const;     // one line: D=.. H=.. ...
};

}  // namespace laga
