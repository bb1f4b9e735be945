// The form registry: every form, once (mla/forms.def lists their rows), and
// what is read off it for any form: names, the variant check, the
// placement (docs/architecture.md, "Adding a form").
#include "mla/form.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "mla/form_registry.hpp"

namespace laga {

namespace {

std::vector<detail::FormEntry> checked(std::vector<detail::FormEntry> forms) {
  std::vector<FormSpec> rows;
  for (const detail::FormEntry& e : forms) rows.push_back(e.spec);
  check_form_rows(rows);
  return forms;
}

const std::vector<detail::FormEntry>& registry() {
  static const std::vector<detail::FormEntry> forms = checked({
#define LAGA_FORM(enumerator, entry) detail::entry(),
#include "mla/forms.def"
#undef LAGA_FORM
  });
  return forms;
}

}  // namespace

namespace detail {

const FormEntry& form_entry(Form f) {
  for (const FormEntry& e : registry())
    if (e.spec.form == f) return e;
  fail("internal: form ", static_cast<int>(f), " is not in the registry (src/mla/forms.def)");
}

}  // namespace detail

const FormSpec& form_spec(Form f) {
  return detail::form_entry(f).spec;
}

void check_form_rows(const std::vector<FormSpec>& rows) {
  std::string refs;
  std::size_t n_refs = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const FormSpec& r = rows[i];
    const std::string name = r.name ? r.name : "";
    LAGA_CHECK(static_cast<std::size_t>(r.form) == i, "internal: the form registry's row ", i,
               " ('", name, "') is form ", static_cast<int>(r.form),
               "; each row must be its mla/forms.def line's form, in that order");
    LAGA_CHECK(!name.empty(), "internal: the form registry's row ", i, " has no name");
    for (std::size_t j = 0; j < i; ++j)
      LAGA_CHECK(name != rows[j].name, "internal: the form registry names '", name,
                 "' twice (rows ", j, " and ", i, "); each form's name must be its own");
    if (r.traits.reference) refs += cat(n_refs++ ? ", " : "", name);
  }
  LAGA_CHECK(n_refs == 1,
             "internal: the form registry must have exactly one reference form "
             "(FormTraits::reference: the one every other form is held to); it has ",
             n_refs, n_refs ? cat(": ", refs) : std::string(),
             ". Set reference in one row's traits (src/mla/form_NAME.cpp)");
}

Form reference_form() {
  for (const detail::FormEntry& e : registry())
    if (e.spec.traits.reference) return e.spec.form;
  fail("internal: the form registry has no reference form");  // check_form_rows refuses it
}

const char* to_string(Form f) {
  return form_spec(f).name;
}

Form parse_form(const std::string& s) {
  std::string names;
  for (const detail::FormEntry& e : registry()) {
    if (s == e.spec.name) return e.spec.form;
    names += names.empty() ? "" : ", ";
    names += e.spec.name;
  }
  fail("unknown form '", s, "'; choose one of ", names);
}

std::vector<Form> all_forms() {
  std::vector<Form> v;
  for (const detail::FormEntry& e : registry()) v.push_back(e.spec.form);
  return v;
}

std::string form_names(const std::string& sep) {
  std::string s;
  for (const detail::FormEntry& e : registry()) s += cat(s.empty() ? "" : sep, e.spec.name);
  return s;
}

std::string form_flows() {
  std::string s;
  for (const detail::FormEntry& e : registry()) s += cat("\n  ", e.spec.name, ": ", e.spec.flow);
  return s;
}

std::vector<Form> forms_with(bool FormTraits::*trait) {
  std::vector<Form> v;
  for (const detail::FormEntry& e : registry())
    if (e.spec.traits.*trait) v.push_back(e.spec.form);
  return v;
}

std::string names_of_forms_with(bool FormTraits::*trait) {
  return names_of(forms_with(trait));
}

std::string names_of(const std::vector<Form>& forms) {
  std::string s;
  for (std::size_t i = 0; i < forms.size(); ++i)
    s += cat(i == 0 ? "" : i + 1 == forms.size() ? " and " : ", ", to_string(forms[i]));
  return s.empty() ? "no form" : s;
}

const char* to_string(AttentionKind a) {
  return a == AttentionKind::eager ? "eager" : "flash";
}

AttentionKind parse_attention(const std::string& s) {
  if (s == "eager") return AttentionKind::eager;
  if (s == "flash") return AttentionKind::flash;
  fail("unknown attention kernel '", s, "'; choose eager or flash");
}

void check_precision_supports(Precision p, AttentionKind a) {
  LAGA_CHECK(p != Precision::bf16 || a == AttentionKind::flash, "--dtype ", to_string(p),
             " runs flash attention only (--attention ", to_string(a),
             "); pass --attention flash, or --dtype fp32 for eager");
}

const char* to_string(QueryExchange q) {
  return q == QueryExchange::heads ? "heads" : "latent";
}

QueryExchange parse_query_exchange(const std::string& s) {
  if (s == "heads") return QueryExchange::heads;
  if (s == "latent") return QueryExchange::latent;
  fail("unknown query exchange '", s, "'; choose heads or latent");
}

const char* to_string(Overlap o) {
  return o == Overlap::on ? "on" : "off";
}

Overlap parse_overlap(const std::string& s) {
  if (s == "off") return Overlap::off;
  if (s == "on") return Overlap::on;
  fail("unknown --overlap value '", s, "'; choose on or off");
}

std::string to_string(FormVariant v) {
  return cat(to_string(v.form), v.queries == QueryExchange::latent ? "+q-latent" : "",
             v.overlap == Overlap::on ? "+overlap" : "");
}

namespace {
// "use --form laga or laga2d": the forms that have the trait, as --form values.
std::string use_forms_with(bool FormTraits::*trait) {
  std::string s;
  const std::vector<Form> forms = forms_with(trait);
  for (std::size_t i = 0; i < forms.size(); ++i)
    s += cat(i == 0 ? "use --form " : i + 1 == forms.size() ? " or " : ", ", to_string(forms[i]));
  return s;
}
}  // namespace

void check_overlap(FormVariant v) {
  LAGA_CHECK(v.overlap == Overlap::off || form_spec(v.form).traits.overlap,
             "--overlap on applies to the ", names_of_forms_with(&FormTraits::overlap),
             " forms (they overlap their collectives with compute); the ", to_string(v.form),
             " form has no overlapped path: ", use_forms_with(&FormTraits::overlap),
             ", or --overlap off");
}

void check_query_exchange(const MlaConfig& cfg, FormVariant v) {
  if (v.queries == QueryExchange::heads) return;
  const std::string what =
      cat("--q-latent applies to the ", names_of_forms_with(&FormTraits::query_latent),
          " forms with q_lora_rank > 0; ");
  LAGA_CHECK(form_spec(v.form).traits.query_latent, what, "not to the ", to_string(v.form),
             " form, which sends per-head queries: ", use_forms_with(&FormTraits::query_latent),
             ", or drop --q-latent");
  LAGA_CHECK(cfg.q_lora_rank > 0, what,
             "the config has q_lora_rank 0 (queries come from wq directly: there is no query "
             "latent to gather); give q_lora_rank > 0 (--preset deepseek-v3, a --config with "
             "it, or train's --q-lora-rank) or drop --q-latent");
}

void check_head_groups(const SpLayout& layout, FormVariant v) {
  if (!form_spec(v.form).traits.head_groups) {
    const std::vector<Form> grids = forms_with(&FormTraits::head_groups);
    LAGA_CHECK(v.head_groups == 0, "--head-groups applies to the ",
               names_of_forms_with(&FormTraits::head_groups),
               grids.size() == 1 ? " form" : " forms", " only, not to ", to_string(v.form), ": ",
               use_forms_with(&FormTraits::head_groups), ", or drop --head-groups");
    return;
  }
  attention_placement(layout, v);  // its grid refuses head groups that do not fit
}

void check_variant(const MlaConfig& cfg, const SpLayout& layout, FormVariant v) {
  check_query_exchange(cfg, v);
  check_overlap(v);
  check_head_groups(layout, v);
}

Placement attention_placement(const SpLayout& layout, FormVariant v) {
  return form_spec(v.form).attention(layout, v);
}

std::string describe_variant(FormVariant v, const SpLayout& layout) {
  const FormSpec& f = form_spec(v.form);
  if (!f.geometry) return to_string(v);
  return cat(to_string(v), " (", f.geometry(layout, v), ")");
}

}  // namespace laga
