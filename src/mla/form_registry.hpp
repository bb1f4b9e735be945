// The form registry's own rules and its one reference row (form.cpp;
// docs/architecture.md, "Adding a form"). Apart from form_spec.hpp so that
// the few readers of the reference include it, not every file of the build.
#pragma once

#include <vector>

#include "mla/form_spec.hpp"

namespace laga {

// The one reference form (FormTraits::reference: explicit today, the form
// every other form is held to). Every reader of "the reference" asks here:
// `laga verify` and `laga compare` (the form the others' deviation is
// measured against, run first), compare's and plan's ratios against it, and
// the model plan's MFU.
Form reference_form();

// The registry's own rules, checked when it is first read (at startup: the
// help texts read it) and by tests/mla/test_form_registry.cpp: one row a
// form, in mla/forms.def's order (rows[i].form is its i-th enumerator), the
// names distinct and non-empty, and exactly one row the reference. Throws
// laga::Error naming the rows that break one. The package's registry
// (python/laga_torch/forms.py, `registry`) checks the same at import.
void check_form_rows(const std::vector<FormSpec>& rows);

}  // namespace laga
