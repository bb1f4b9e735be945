// `laga plan --model`'s table and JSON (docs/planning.md, "A whole
// DeepSeek-V3 step"): what cmd_plan.cpp prints and writes for a model plan.
#pragma once

#include <string>

#include "plan/model_plan.hpp"

namespace laga::tools {

// Per (S, P, DP, PP) and form, the predicted step, its parts (with
// pipeline stages, the slowest device's), the memory per device, whether it
// fits, and the fewest devices that fit per S.
std::string model_table(const ModelPlanRequest& q, const ModelPlanResult& r);
// The same as JSON (the schema docs/planning.md gives).
std::string model_json(const ModelPlanRequest& q, const ModelPlanResult& r);

}  // namespace laga::tools
