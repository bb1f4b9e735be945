// The form registry: every form, once. Adding a form is its file
// (form_NAME.cpp, defining NAME_entry()), its value in enum Form
// (block.hpp) and one row here (docs/architecture.md, "Adding a form").
#include "mla/form.hpp"

#include <array>

#include "core/error.hpp"

namespace laga {

namespace {

const std::array<detail::FormEntry, 4>& registry() {
  static const std::array<detail::FormEntry, 4> forms{detail::explicit_entry(),
                                                      detail::absorbed_entry(),
                                                      detail::laga_entry(), detail::laga2d_entry()};
  return forms;
}

}  // namespace

namespace detail {

const FormEntry& form_entry(Form f) {
  for (const FormEntry& e : registry())
    if (e.form == f) return e;
  fail("internal: form ", static_cast<int>(f), " is not in the registry (src/mla/form.cpp)");
}

}  // namespace detail

const char* to_string(Form f) {
  return detail::form_entry(f).name;
}

Form parse_form(const std::string& s) {
  std::string names;
  for (const detail::FormEntry& e : registry()) {
    if (s == e.name) return e.form;
    names += names.empty() ? "" : ", ";
    names += e.name;
  }
  fail("unknown form '", s, "'; choose one of ", names);
}

std::vector<Form> all_forms() {
  std::vector<Form> v;
  for (const detail::FormEntry& e : registry()) v.push_back(e.form);
  return v;
}

}  // namespace laga
