// laga forms: the form registry as it is in this build (mla/forms.def), one
// row per form: its name, its data flow, and what it admits (FormTraits).
// Scripts and tests read the JSON rather than listing the forms themselves,
// so a new form is under them from its first build.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

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
    {"exact_at_one_rank", &FormTraits::exact_at_one_rank}};

ojson forms_json() {
  ojson forms = ojson::array();
  for (Form f : all_forms()) {
    const FormSpec& s = form_spec(f);
    ojson traits = ojson::object();
    for (const auto& [name, trait] : kTraits) traits[name] = s.traits.*trait;
    forms.push_back({{"name", s.name}, {"flow", s.flow}, {"traits", traits}});
  }
  return {{"forms", forms}};
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
      std::cout << s.name << (s.traits.reference ? " (the reference)" : "") << "\n  " << s.flow
                << "\n  admits:" << (admits.empty() ? " no variant options" : admits) << "\n";
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
