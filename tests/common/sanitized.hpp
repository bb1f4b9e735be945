// Whether this test binary is the sanitizer pass's (scripts/test.sh's
// build-asan: AddressSanitizer + UndefinedBehaviorSanitizer). A few of the
// suite's longest tests repeat the same code path many times over (a finite
// difference per element, a 20-step run); under the sanitizers they repeat
// it fewer times, every case still run, while the main pass keeps the full
// count (docs/testing.md, "Suite time"). The sanitizers need the code paths,
// not the repetitions; the numbers are the main pass's to check.
#pragma once

// GCC says __SANITIZE_ADDRESS__; clang says only
// __has_feature(address_sanitizer) (as src/core/block_cache.cpp).
#if defined(__SANITIZE_ADDRESS__)
#define LAGA_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LAGA_TEST_SANITIZED 1
#endif
#endif
#ifndef LAGA_TEST_SANITIZED
#define LAGA_TEST_SANITIZED 0
#endif

namespace laga::test {
inline constexpr bool kSanitized = LAGA_TEST_SANITIZED != 0;
}  // namespace laga::test
