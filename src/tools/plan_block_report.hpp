// `laga plan`'s table and JSON for the block's forms (docs/planning.md):
// what cmd_plan.cpp prints and writes for a block plan (the model's and the
// DSA forms' are plan_model_report.hpp's and plan_dsa_report.hpp's).
#pragma once

#include <string>
#include <vector>

#include "plan/planner.hpp"

namespace laga::tools {

// Per (S, P) and form: the bytes each rank sends, the activation peak, the
// predicted step and throughput, whether it fits, and each case's winner and
// crossover; with the profile, the layout and how the calls were costed.
std::string plan_table(const PlanRequest& q, const std::vector<PlanCase>& cases);
// The same as JSON (the schema docs/planning.md gives).
std::string plan_json(const PlanRequest& q, const std::vector<PlanCase>& cases);

// printf's `f` of one number, and bytes in GB (10^9 bytes, "%.3f"): the
// plan's tables and messages.
std::string plan_number(const char* f, double v);
std::string plan_gb(double bytes);

}  // namespace laga::tools
