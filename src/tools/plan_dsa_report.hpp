// `laga plan`'s table and JSON for a DSA config (docs/planning.md, "DSA"):
// what cmd_plan.cpp prints and writes when the preset or config has an
// indexer (plan/dsa_plan.hpp).
#pragma once

#include <string>

#include "plan/dsa_plan.hpp"

namespace laga::tools {

// Per (S, P) and DSA form: bytes sent per rank (and of those the
// indexer's), peak activation memory, FLOPs, predicted step, tokens/s,
// communication share, whether it fits; the winner.
std::string dsa_table(const DsaPlanRequest& q, const std::vector<DsaPlanCase>& cases);
// The same as JSON: {"dsa": {...}, "plans": [...], "cases": [...]}.
std::string dsa_json(const DsaPlanRequest& q, const std::vector<DsaPlanCase>& cases);

}  // namespace laga::tools
