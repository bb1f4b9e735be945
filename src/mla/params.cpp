#include "mla/params.hpp"

#include <cmath>
#include <map>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace laga {

std::vector<std::pair<std::string, Shape>> mla_param_shapes(const MlaConfig& c) {
  const std::int64_t H = c.n_heads, dqk = c.qk_head_dim();
  std::vector<std::pair<std::string, Shape>> v;
  if (c.q_lora_rank == 0) {
    v.push_back({"wq.weight", {H * dqk, c.dim}});
  } else {
    v.push_back({"wq_a.weight", {c.q_lora_rank, c.dim}});
    v.push_back({"q_norm.weight", {c.q_lora_rank}});
    v.push_back({"wq_b.weight", {H * dqk, c.q_lora_rank}});
  }
  v.push_back({"wkv_a.weight", {c.kv_lora_rank + c.qk_rope_head_dim, c.dim}});
  v.push_back({"kv_norm.weight", {c.kv_lora_rank}});
  v.push_back({"wkv_b.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}});
  v.push_back({"wo.weight", {c.dim, H * c.v_head_dim}});
  if (c.mla_use_output_gate) v.push_back({"wg.weight", {H * c.v_head_dim, c.dim}});
  return v;
}

namespace {
template <class P, class F>
void visit(P& p, F&& fn) {
  auto maybe = [&](const char* name, auto& t) {
    if (t.defined()) fn(std::string(name), t);
  };
  maybe("wq.weight", p.wq);
  maybe("wq_a.weight", p.wq_a);
  maybe("q_norm.weight", p.q_norm);
  maybe("wq_b.weight", p.wq_b);
  maybe("wkv_a.weight", p.wkv_a);
  maybe("kv_norm.weight", p.kv_norm);
  maybe("wkv_b.weight", p.wkv_b);
  maybe("wo.weight", p.wo);
  maybe("wg.weight", p.wg);
}
}  // namespace

namespace {
// Points the query projection (wq when `per_head_q`, else wq_a) at the first
// rows of p.in_proj and wkv_a at its last `wkv_a_rows`.
template <class T>
void view_in_proj(MlaParams<T>& p, bool per_head_q, std::int64_t wkv_a_rows) {
  const std::int64_t q_rows = p.in_proj.dim(0) - wkv_a_rows;
  (per_head_q ? p.wq : p.wq_a) = Tensor<T>::view_rows(p.in_proj, 0, q_rows);
  p.wkv_a = Tensor<T>::view_rows(p.in_proj, q_rows, wkv_a_rows);
}
}  // namespace

template <class T>
MlaParams<T> MlaParams<T>::zeros(const MlaConfig& cfg, MemCategory cat) {
  MlaParams p;
  std::map<std::string, Tensor<T>*> slot = {
      {"q_norm.weight", &p.q_norm}, {"wq_b.weight", &p.wq_b}, {"kv_norm.weight", &p.kv_norm},
      {"wkv_b.weight", &p.wkv_b},   {"wo.weight", &p.wo},     {"wg.weight", &p.wg}};
  std::int64_t in_rows = 0;  // wq (wq_a) and wkv_a: rows of in_proj
  for (auto& [name, shape] : mla_param_shapes(cfg)) {
    if (name == "wq.weight" || name == "wq_a.weight" || name == "wkv_a.weight")
      in_rows += shape[0];
    else
      *slot.at(name) = Tensor<T>::zeros(shape, cat);
  }
  p.in_proj = Tensor<T>::zeros({in_rows, cfg.dim}, "in_proj", cat);
  view_in_proj(p, cfg.q_lora_rank == 0, cfg.kv_lora_rank + cfg.qk_rope_head_dim);
  return p;
}

template <class T>
MlaParams<T> MlaParams<T>::clone(MemCategory cat) const {
  MlaParams p;
  for (auto [dst, src] : {std::pair{&p.in_proj, &in_proj},
                          {&p.q_norm, &q_norm},
                          {&p.wq_b, &wq_b},
                          {&p.kv_norm, &kv_norm},
                          {&p.wkv_b, &wkv_b},
                          {&p.wo, &wo},
                          {&p.wg, &wg}})
    *dst = src->clone(cat);  // an undefined tensor clones to an undefined one
  // The views onto the copy, with the rows the originals had.
  if (in_proj.defined()) view_in_proj(p, wq.defined(), wkv_a.dim(0));
  return p;
}

template <class T>
void MlaParams<T>::for_each(const std::function<void(const std::string&, Tensor<T>&)>& fn) {
  visit(*this, fn);
}
template <class T>
void MlaParams<T>::for_each(
    const std::function<void(const std::string&, const Tensor<T>&)>& fn) const {
  visit(*this, fn);
}

template <class T>
std::int64_t MlaParams<T>::numel() const {
  std::int64_t n = 0;
  for_each([&](const std::string&, const Tensor<T>& t) { n += t.numel(); });
  return n;
}

std::uint64_t name_stream(const std::string& name) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

template <class T>
void init_params(MlaParams<T>& p, std::uint64_t seed, double norm_jitter) {
  p.for_each([&](const std::string& name, Tensor<T>& t) {
    if (!t.data()) return;  // count-only
    if (t.rank() == 1) {    // RMSNorm weight
      fill_normal(t.data(), t.numel(), seed, name_stream(name), 0, norm_jitter);
      for (std::int64_t i = 0; i < t.numel(); ++i) t[i] += T(1);
    } else {
      fill_normal(t.data(), t.numel(), seed, name_stream(name), 0,
                  1.0 / std::sqrt(static_cast<double>(t.dim(1))));
    }
  });
}

std::string hf_param_name(const std::string& n, int layer) {
  static const std::map<std::string, std::string> hf = {
      {"wq.weight", "q_proj.weight"},
      {"wq_a.weight", "q_a_proj.weight"},
      {"q_norm.weight", "q_a_layernorm.weight"},
      {"wq_b.weight", "q_b_proj.weight"},
      {"wkv_a.weight", "kv_a_proj_with_mqa.weight"},
      {"kv_norm.weight", "kv_a_layernorm.weight"},
      {"wkv_b.weight", "kv_b_proj.weight"},
      {"wo.weight", "o_proj.weight"},
      {"wg.weight", "g_proj.weight"}};  // Kimi K3 (modeling_kimi_linear.py's g_proj)
  auto it = hf.find(n);
  LAGA_CHECK(it != hf.end(), "no Hugging Face name for parameter '", n, "'");
  return cat("model.layers.", layer, ".self_attn.", it->second);
}

template struct MlaParams<float>;
template struct MlaParams<double>;
template void init_params<float>(MlaParams<float>&, std::uint64_t, double);
template void init_params<double>(MlaParams<double>&, std::uint64_t, double);

}  // namespace laga
