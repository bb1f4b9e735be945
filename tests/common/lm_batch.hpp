// Token batches for the language model's tests (tests/model): a seeded
// (B, S) batch of inputs and targets, one rank's rows of it, and a run's
// losses.
#pragma once

#include <cstdint>
#include <vector>

#include "common/check.hpp"
#include "model/model.hpp"
#include "model/train.hpp"

namespace laga::test {

struct Batch {
  std::int64_t B = 2, S = 7;
  std::vector<std::int32_t> tok, tgt;  // (B, S)
};
inline Batch batch(const LmConfig& c) {
  Batch b;
  TestRng rng(11);
  for (std::int64_t i = 0; i < b.B * b.S; ++i) {
    b.tok.push_back(std::int32_t(rng.next_u64() % std::uint64_t(c.vocab)));
    b.tgt.push_back(std::int32_t(rng.next_u64() % std::uint64_t(c.vocab)));
  }
  return b;
}

// Rows [off, off + L) of every sequence.
inline std::vector<std::int32_t> shard(const std::vector<std::int32_t>& v, std::int64_t B,
                                       std::int64_t S, std::int64_t off, std::int64_t L) {
  std::vector<std::int32_t> out;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L; ++i) out.push_back(v[size_t(b * S + off + i)]);
  return out;
}

inline std::vector<double> losses(const std::vector<StepRecord>& r) {
  std::vector<double> v;
  for (const auto& s : r) v.push_back(s.loss);
  return v;
}

}  // namespace laga::test
