// The range of link figures laga accepts, from --link (tools/cli_common.cpp)
// and from a hardware profile's links (plan/hardware_profile.cpp): one
// description, so the two cannot drift. Outside it no real link lies, and a
// collective's modelled hold grows past what the clock can add (at 1 kB/s a
// 1 GB collective holds a rank for 11 days; past ~292 years the clock's
// nanoseconds overflow and the hold was silently not applied, issue 26).
#pragma once

namespace laga {

inline constexpr double kLeastLinkBytesPerS = 1e3;  // 1 kB/s
inline constexpr double kMostLinkBytesPerS = 1e15;  // 1 PB/s
inline constexpr double kMostLinkLatencyUs = 1e7;   // 10 s

}  // namespace laga
