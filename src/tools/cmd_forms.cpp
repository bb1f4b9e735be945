// laga forms: the form registry as it is in this build (mla/forms.def), one
// row per form: its name, its data flow, what it admits (FormTraits), where
// its ranks attend and how the keys reach them (read off the row's
// placement and collectives). tests/tools/test_forms_registry.py holds the
// package's registry (python/laga_torch/forms.py) equal to it.
// Then the DSA forms' rows (DsaFormTraits, mla/dsa_model.hpp; "dsa_forms").
// Scripts and tests read the JSON rather than listing the forms themselves,
// so a new form is under them from its first build.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "mla/comm_model.hpp"
#include "mla/dsa_model.hpp"
#include "mla/form_registry.hpp"
#include "mla/form_spec.hpp"
#include "tools/cli_common.hpp"
#include "tools/commands.hpp"

namespace laga::tools {
namespace {

using ojson = nlohmann::ordered_json;

struct FormsOptions {
  std::string json;
};

// The traits by name, in FormTraits' order.
constexpr std::pair<const char*, bool FormTraits::*> kTraits[] = {
    {"query_latent", &FormTraits::query_latent},
    {"overlap", &FormTraits::overlap},
    {"head_groups", &FormTraits::head_groups},
    {"reference", &FormTraits::reference},
    {"exact_at_one_rank", &FormTraits::exact_at_one_rank},
    {"invariant", &FormTraits::invariant}};

// The probe layout attends() and keys() read a row on (S 16, H 2, P 4),
// and the row's variant there (the grid forms at 2 head groups).
SpLayout probe_layout() {
  return SpLayout::even(1, 16, 2, 4);
}
FormVariant probe_variant(const FormSpec& s) {
  FormVariant v(s.form);
  if (s.traits.head_groups) v.head_groups = 2;
  return v;
}

// Where the row places each rank's attention (FormSpec::attention), read off
// it on a probe layout (S 16, H 2, P 4; the grid forms at 2 head groups x 2
// context groups): "heads" (every token, the rank's heads: the head-sharded
// forms), "own" (its own tokens, all heads: the context-parallel forms) or
// "grid" (part of the tokens and part of the heads).
std::string attends(const FormSpec& s) {
  const SpLayout lay = probe_layout();
  const Placement p = s.attention(lay, probe_variant(s));
  bool every_token = true, every_head = true;
  for (int r = 0; r < lay.ranks; ++r) {
    every_token = every_token && p.rows(r) == lay.seq;
    every_head = every_head && p.head_count[std::size_t(r)] == lay.heads;
  }
  return every_token ? "heads" : every_head ? "own" : "grid";
}

// How the keys reach the attention, read off the row's collectives (its
// closed form, FormSpec::collectives) at the probe layout's rank 0, forward:
// "ring" (blocks passed round a ring, *_ring), "gather" (per-head K and V
// all-gathered, k_ag), "latent" (the latent all-gathered, latent_ag) or
// "heads" (per-head K and V all-to-all, k_a2a); with the ring's block
// ("kv" or "latent", the label's stem) for the ring forms.
std::pair<std::string, std::string> keys(const FormSpec& s) {
  std::string ring, gather, latent;
  for (const auto& [key, bytes] :
       predict_comm(MlaConfig{}, probe_layout(), probe_variant(s), 0, 4, false, false)) {
    const std::string& label = key.second;
    if (label.size() > 5 && label.ends_with("_ring")) ring = label.substr(0, label.size() - 5);
    if (label == "k_ag") gather = label;
    if (label == "latent_ag") latent = label;
  }
  if (!ring.empty()) return {"ring", ring};
  return {!gather.empty() ? "gather" : !latent.empty() ? "latent" : "heads", ""};
}

ojson forms_json() {
  ojson forms = ojson::array();
  for (Form f : all_forms()) {
    const FormSpec& s = form_spec(f);
    ojson traits = ojson::object();
    for (const auto& [name, trait] : kTraits) traits[name] = s.traits.*trait;
    const auto [how, block] = keys(s);
    ojson row = {{"name", s.name},
                 {"flow", s.flow},
                 {"traits", traits},
                 {"attends", attends(s)},
                 {"keys", how}};
    if (!block.empty()) row["ring_block"] = block;
    forms.push_back(row);
  }
  // The DSA forms (a config with the index keys): their registry row
  // (DsaFormTraits, mla/dsa_model.hpp), which forward and compare run.
  ojson dsa = ojson::array();
  for (DsaForm f : all_dsa_forms()) {
    const DsaFormTraits& t = dsa_form_traits(f);
    dsa.push_back({{"name", t.name},
                   {"moves", t.moves},
                   {"runs", dsa_form_runs(f)},
                   {"runner", t.runner ? t.runner : ""},
                   {"head_sharded", dsa_head_sharded(f)}});
  }
  return {{"forms", forms}, {"reference", to_string(reference_form())}, {"dsa_forms", dsa}};
}

void run_forms(const FormsOptions& o) {
  vet_outputs({{"--json", o.json}});
  if (o.json != "-") {
    for (Form f : all_forms()) {
      const FormSpec& s = form_spec(f);
      std::string admits;
      if (s.traits.query_latent) admits += " --q-latent";
      if (s.traits.overlap) admits += " --overlap";
      if (s.traits.head_groups) admits += " --head-groups";
      if (s.traits.invariant) admits += " --invariant";
      std::cout << s.name << (s.traits.reference ? " (the reference)" : "") << "\n  " << s.flow
                << "\n  admits:" << (admits.empty() ? " no variant options" : admits) << "\n";
    }
    std::cout << "DSA forms (a config with index_n_heads, index_head_dim, index_topk):\n";
    for (DsaForm f : all_dsa_forms()) {
      const DsaFormTraits& t = dsa_form_traits(f);
      std::cout << t.name << "\n  moves " << t.moves << "\n  "
                << (t.runner ? cat("runs: ", t.runner)
                             : std::string("closed form only (laga plan --dsa)"))
                << "\n";
    }
  }
  if (!o.json.empty()) write_output(o.json, forms_json().dump(2) + "\n");
}

void register_forms(CLI::App& app) {
  auto o = std::make_shared<FormsOptions>();
  CLI::App* c = app.add_subcommand(
      "forms",
      "List the forms of this build: each one's data flow and the variant options it admits");
  c->add_option("--json", o->json, "write the registry as JSON to this file ('-' for stdout)");
  c->callback([o] { run_forms(*o); });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_forms);

}  // namespace laga::tools
