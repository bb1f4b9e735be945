// main() of every laga_test binary (instead of gtest_main), so that a test
// that does not run cannot pass silently:
//
//   - a binary that runs no test at all (a --gtest_filter that matches
//     nothing, a file whose tests were all removed) fails;
//   - every skipped test is printed as "laga-skip: Suite.Name: reason", and
//     the binary exits with kSkipExit, which CTest reports as "Skipped"
//     (SKIP_RETURN_CODE in tests/CMakeLists.txt) instead of "Passed";
//   - under CI (CI=true), a skipped test not listed in tests/allowed_skips.txt
//     fails the binary: a skip there must be one the suite has explained.
//
// A failure always wins: a binary with a failing and a skipped test exits 1.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>

namespace {

constexpr int kSkipExit = 77;  // the Automake convention CTest is told about

// Test names (Suite.Name, parameterised ones with their /index) from
// tests/allowed_skips.txt: one per line, the name first, then its reason;
// '#' starts a comment.
std::set<std::string> allowed_skips(std::string& error) {
  std::set<std::string> names;
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  if (!src) {
    error =
        "LAGA_SOURCE_DIR is not set, so tests/allowed_skips.txt cannot be read (run the "
        "test through ctest, or set it to the source tree)";
    return names;
  }
  const std::string path = std::string(src) + "/tests/allowed_skips.txt";
  std::ifstream in(path);
  if (!in) {
    error = path + " cannot be read";
    return names;
  }
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string name;
    if (words >> name && name[0] != '#') names.insert(name);
  }
  return names;
}

std::string skip_reason(const ::testing::TestResult& r) {
  for (int i = 0; i < r.total_part_count(); ++i) {
    const ::testing::TestPartResult& p = r.GetTestPartResult(i);
    if (p.skipped() && p.message() && *p.message()) return p.message();
  }
  return "(no reason given)";
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  if (u.test_to_run_count() == 0) {
    std::cerr << "laga: no test ran in this binary (is --gtest_filter wrong, or were its tests "
                 "removed?); an empty run is a failure, not a pass\n";
    return 1;
  }
  const char* ci = std::getenv("CI");
  const bool in_ci = ci && std::string(ci) == "true";
  std::string list_error;
  std::set<std::string> allowed;
  bool skipped = false, unexplained = false;
  for (int s = 0; s < u.total_test_suite_count(); ++s) {
    const ::testing::TestSuite& suite = *u.GetTestSuite(s);
    for (int t = 0; t < suite.total_test_count(); ++t) {
      const ::testing::TestInfo& info = *suite.GetTestInfo(t);
      if (!info.should_run() || !info.result()->Skipped()) continue;
      if (!skipped && in_ci) allowed = allowed_skips(list_error);
      skipped = true;
      const std::string name = std::string(suite.name()) + "." + info.name();
      std::cout << "laga-skip: " << name << ": " << skip_reason(*info.result()) << "\n";
      if (in_ci && !allowed.count(name)) {
        unexplained = true;
        std::cerr << "laga: " << name
                  << " was skipped under CI=true but is not listed in tests/allowed_skips.txt; "
                     "make it run here, or list it there with the reason it cannot\n";
      }
    }
  }
  if (!list_error.empty()) std::cerr << "laga: " << list_error << "\n";
  if (rc != 0 || unexplained) return 1;
  return skipped ? kSkipExit : 0;
}
