// laga_cuda_check's shared pieces (check_main.cpp and check_sparse_moves.cpp):
// the result row, deterministic inputs, the relative error against a float64
// reference, host <-> device copies as f32 or bf16, a shape's label, and the
// checks that live in check_sparse_moves.cpp. Tolerances: check_main.cpp's
// header comment.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "cuda/device_buffer.hpp"
#include "kernels/attention.hpp"

namespace laga::cuda::check {

using Vec = std::vector<float>;

struct Result {
  std::string name, shape, dtype;
  double error = 0, tol = 0;
  bool pass() const { return error <= tol; }
};

// Deterministic inputs in [-1, 1), optionally rounded to bf16.
inline Vec inputs(std::int64_t n, std::uint32_t seed, bool bf16_values) {
  Vec v(static_cast<std::size_t>(n));
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (auto& e : v) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    e = static_cast<float>(x % 20000) / 10000.0f - 1.0f;
    if (bf16_values) e = to_float(to_bf16(e));
  }
  return v;
}
inline std::vector<double> widen(const Vec& v) {
  return {v.begin(), v.end()};
}

inline double rel_error(const Vec& got, const std::vector<double>& ref) {
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(double(got[i]) - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return std::isfinite(diff) ? diff / scale : INFINITY;
}

// A device copy of host floats, as f32 or as bf16.
inline DeviceBuffer up(const Vec& v, bool as_bf16, const char* name) {
  if (!as_bf16) {
    DeviceBuffer d(4 * std::int64_t(v.size()), name);
    d.upload(v.data(), d.bytes());
    return d;
  }
  std::vector<bf16> h(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) h[i] = to_bf16(v[i]);
  DeviceBuffer d(2 * std::int64_t(v.size()), name);
  d.upload(h.data(), d.bytes());
  return d;
}
inline Vec down(const DeviceBuffer& d, bool as_bf16) {
  if (!as_bf16) {
    Vec v(static_cast<std::size_t>(d.bytes() / 4));
    d.download(v.data(), d.bytes());
    return v;
  }
  std::vector<bf16> h(static_cast<std::size_t>(d.bytes() / 2));
  d.download(h.data(), d.bytes());
  Vec v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) v[i] = to_float(h[i]);
  return v;
}

inline std::string attn_shape(const AttnShape& s) {
  std::ostringstream o;
  o << "B " << s.B << " Sq " << s.Sq << " Sk " << s.Sk << " Hq " << s.Hq << " Hk " << s.Hk
    << " dqk " << s.dqk << " dv " << s.dv << (s.causal ? " causal" : "")
    << (s.doc_start ? " packed" : "");
  return o.str();
}

// check_sparse_moves.cpp: DSA's sparse attention rows, and the forms' data
// movement (copy_rows, fill).
void check_sparse_attention(std::vector<Result>& out);
void check_moves(std::vector<Result>& out);

}  // namespace laga::cuda::check
