// The DSA forms' registry row (DsaFormTraits, mla/dsa_model.hpp), which
// `laga forms`, `laga forward`, `laga compare` and `laga plan --dsa` read:
// each row's `moves` names exactly the labels its closed form
// (dsa_predict_comm) files forward in the sparse stage, at P 2 and 3 with
// uneven shards, so the description cannot drift from the ledger the
// forms' tests hold equal to it; the forms with a runner are the four the
// engine runs (mla/dsa_cp.hpp, dsa_laga.hpp, dsa_explicit.hpp), and names
// round-trip through parse_dsa_form.
#include <gtest/gtest.h>

#include <set>
#include <sstream>
#include <string>

#include "mla/dsa_model.hpp"

namespace laga {
namespace {

std::set<std::string> split(const std::string& s) {
  std::set<std::string> out;
  std::istringstream in(s);
  for (std::string t; std::getline(in, t, ',');) {
    const std::size_t b = t.find_first_not_of(' ');
    out.insert(b == std::string::npos ? std::string() : t.substr(b));
  }
  return out;
}

TEST(DsaFormRegistry, MovesNamesTheClosedFormsForwardLabels) {
  MlaConfig cfg = MlaConfig::preset("tiny");
  cfg.q_lora_rank = 8;
  const DsaConfig dsa{2, 4, 3};
  for (int P : {2, 3}) {
    const SpLayout lay = SpLayout::even(2, 11, cfg.n_heads, P);
    for (DsaForm f : all_dsa_forms()) {
      std::set<std::string> labels;
      for (int r = 0; r < P; ++r)
        for (const auto& [key, b] :
             dsa_predict_comm(cfg, dsa, lay, f, r, {4, 4}, /*backward=*/false, false))
          if (key.first == Phase::forward && b.calls > 0) labels.insert(key.second);
      EXPECT_EQ(split(dsa_form_traits(f).moves), labels) << to_string(f) << " P " << P;
    }
  }
}

TEST(DsaFormRegistry, RunnersAreTheEnginesFormsAndNamesRoundTrip) {
  std::set<std::string> runs;
  for (DsaForm f : all_dsa_forms()) {
    EXPECT_EQ(parse_dsa_form(to_string(f)), f);
    EXPECT_EQ(dsa_form_traits(f).form, f);
    if (dsa_form_runs(f)) runs.insert(to_string(f));
  }
  EXPECT_EQ(runs,
            (std::set<std::string>{"latent_gather", "laga_indices", "laga_recompute", "explicit"}));
}

}  // namespace
}  // namespace laga
