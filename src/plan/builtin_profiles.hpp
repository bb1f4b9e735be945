// The profiles of profiles/*.json as text, compiled in by CMake
// (src/plan/CMakeLists.txt generates builtin_profiles.cpp at configure time).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace laga::plan_detail {

// (name, JSON text) per shipped profile, by file name without .json.
const std::vector<std::pair<std::string, std::string>>& builtin_profiles();

}  // namespace laga::plan_detail
