// The form registry's own rules (check_form_rows, mla/form_registry.hpp):
// the build's rows pass, and a registry that breaks one is refused with a
// message naming the rows -- two rows claiming to be the reference (every
// pair of forms tried, so a new form's row is covered from its first build),
// none, a name given twice, a row out of forms.def's order. reference_form()
// is the one row with the trait, and every reader asks it.
#include "mla/form_registry.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error_of.hpp"

namespace laga {
namespace {

using test::error_of;

std::vector<FormSpec> rows() {
  std::vector<FormSpec> r;
  for (Form f : all_forms()) r.push_back(form_spec(f));
  return r;
}

TEST(FormRegistry, TheBuildsRowsPass) {
  EXPECT_EQ(error_of([] { check_form_rows(rows()); }), "");
  int refs = 0;
  for (Form f : all_forms()) refs += form_spec(f).traits.reference ? 1 : 0;
  EXPECT_EQ(refs, 1);
  EXPECT_TRUE(form_spec(reference_form()).traits.reference);
  EXPECT_EQ(forms_with(&FormTraits::reference), std::vector<Form>{reference_form()});
}

TEST(FormRegistry, TwoReferenceRowsAreRefused) {
  const std::vector<FormSpec> base = rows();
  for (std::size_t i = 0; i < base.size(); ++i)
    for (std::size_t j = i + 1; j < base.size(); ++j) {
      std::vector<FormSpec> r = base;
      for (FormSpec& s : r) s.traits.reference = false;
      r[i].traits.reference = r[j].traits.reference = true;
      const std::string e = error_of([&] { check_form_rows(r); });
      EXPECT_NE(e.find("exactly one reference form"), std::string::npos) << e;
      EXPECT_NE(e.find(cat("it has 2: ", r[i].name, ", ", r[j].name)), std::string::npos) << e;
    }
  std::vector<FormSpec> all = base;
  for (FormSpec& s : all) s.traits.reference = true;
  EXPECT_NE(error_of([&] { check_form_rows(all); }).find(cat("it has ", all.size(), ": ")),
            std::string::npos);
}

TEST(FormRegistry, NoReferenceRowIsRefused) {
  std::vector<FormSpec> r = rows();
  for (FormSpec& s : r) s.traits.reference = false;
  const std::string e = error_of([&] { check_form_rows(r); });
  EXPECT_NE(e.find("exactly one reference form"), std::string::npos) << e;
  EXPECT_NE(e.find("it has 0."), std::string::npos) << e;
}

TEST(FormRegistry, NamesAndOrderAreTheRowsOwn) {
  const std::vector<FormSpec> base = rows();
  ASSERT_GE(base.size(), 2u);
  std::vector<FormSpec> twice = base;
  twice.back().name = twice.front().name;
  EXPECT_NE(
      error_of([&] { check_form_rows(twice); }).find(cat("names '", base.front().name, "' twice")),
      std::string::npos);
  std::vector<FormSpec> nameless = base;
  nameless[1].name = "";
  EXPECT_NE(error_of([&] { check_form_rows(nameless); }).find("row 1 has no name"),
            std::string::npos);
  std::vector<FormSpec> swapped = base;
  std::swap(swapped[0], swapped[1]);
  EXPECT_NE(error_of([&] { check_form_rows(swapped); }).find("forms.def line's form"),
            std::string::npos);
  std::vector<FormSpec> missing(base.begin() + 1, base.end());
  EXPECT_NE(error_of([&] { check_form_rows(missing); }).find("forms.def line's form"),
            std::string::npos);
}

}  // namespace
}  // namespace laga
