// laga compare on a DSA config (compare_dsa.cpp): the DSA forms' agreement
// with single-rank explicit DSA, their ledgers beside dsa_predict_comm and
// their memory closed form (dsa_memory).
#pragma once

#include <functional>

#include "tools/compare.hpp"

namespace laga::tools {

// Runs on every process of the job when the model is a DSA config and
// returns true (the table and --json written by the reporting process);
// false, running nothing, for a dense config. `given(option)`: whether the
// option was on the command line (the dense forms' options are refused by
// name).
bool run_dsa_compare(const CompareOptions& o, const std::function<bool(const char*)>& given);

}  // namespace laga::tools
