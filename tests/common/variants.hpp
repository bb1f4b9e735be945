// The form variants a config admits, for the tests that run each of them:
// every form; with rq > 0 every form that can move the query latent
// (FormTraits::query_latent) with that exchange;
// and, optionally, every variant that can overlap, overlapped (another order
// of collectives and allocations).
#pragma once

#include <cstddef>
#include <vector>

#include "mla/block.hpp"
#include "mla/config.hpp"

namespace laga::test {

enum class WithOverlap { no, yes };

inline std::vector<FormVariant> form_variants(const MlaConfig& cfg, WithOverlap overlap) {
  std::vector<FormVariant> v;
  for (Form f : all_forms()) v.push_back(f);
  if (cfg.q_lora_rank > 0)
    for (Form f : forms_with(&FormTraits::query_latent)) v.push_back({f, QueryExchange::latent});
  if (overlap == WithOverlap::no) return v;
  const std::size_t n = v.size();
  for (std::size_t i = 0; i < n; ++i)
    if (form_spec(v[i].form).traits.overlap) {
      FormVariant o = v[i];
      o.overlap = Overlap::on;
      v.push_back(o);
    }
  return v;
}

}  // namespace laga::test
