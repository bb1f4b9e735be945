// The sum every backend's reductions go through (in rank order, or in the
// debugging switch's permuted order), the staging buffers the memory pool
// sees, and the element copy (collective_util.hpp).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "comm/collective_util.hpp"
#include "comm/communicator.hpp"
#include "core/bf16.hpp"
#include "core/memory_pool.hpp"

namespace laga {

namespace {
// Set before the ranks start and only read while they run; atomics so that
// the in-process ranks' threads read it without a race.
std::atomic<bool> g_perturb{false};
std::atomic<std::uint64_t> g_perturb_seed{0};
}  // namespace

void set_reduction_order_seed(std::optional<std::uint64_t> seed) {
  g_perturb_seed.store(seed.value_or(0));
  g_perturb.store(seed.has_value());
}

std::optional<std::uint64_t> reduction_order_seed() {
  if (!g_perturb.load()) return std::nullopt;
  return g_perturb_seed.load();
}

namespace comm_detail {

namespace {
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The order block `block` of a reduction adds its P sources in under the
// switch: a Fisher-Yates shuffle of 0..P-1 from (seed, block). A function of
// those alone, so every rank and backend draws the same one.
void permuted_order(std::uint64_t seed, std::int64_t block, int P, int* order) {
  for (int j = 0; j < P; ++j) order[j] = j;
  std::uint64_t state = splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(block)));
  for (int j = P - 1; j > 0; --j) {
    state = splitmix64(state);
    std::swap(order[j], order[state % static_cast<std::uint64_t>(j + 1)]);
  }
}

// The type a sum of T is accumulated in: T itself, but fp32 for bf16, whose
// sum is rounded once, when it is stored (communicator.hpp, DType).
template <class T>
using Accumulator = std::conditional_t<std::is_same_v<T, bf16>, float, T>;
inline float widen(bf16 x) {
  return to_float(x);
}
inline float widen(float x) {
  return x;
}
inline double widen(double x) {
  return x;
}
template <class T>
T narrow(Accumulator<T> x) {
  if constexpr (std::is_same_v<T, bf16>)
    return to_bf16(x);
  else
    return x;
}

template <class T>
void sum_in_rank_order_t(T* dst, const T* const* srcs, int P, std::int64_t n) {
  // A block-sized accumulator keeps dst == srcs[j] safe (every source element
  // is read before its dst element is written) and stays in L1.
  constexpr std::int64_t kBlock = 1024;
  Accumulator<T> acc[kBlock];
  const std::optional<std::uint64_t> seed = reduction_order_seed();
  std::vector<int> order(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) order[size_t(j)] = j;
  for (std::int64_t base = 0; base < n; base += kBlock) {
    const std::int64_t m = std::min(kBlock, n - base);
    // The one place the reduction order is chosen: rank order unless the
    // debugging switch is on (set_reduction_order_seed).
    if (seed) permuted_order(*seed, base / kBlock, P, order.data());
    const T* s0 = srcs[order[0]] + base;
    for (std::int64_t i = 0; i < m; ++i) acc[i] = widen(s0[i]);
    for (int j = 1; j < P; ++j) {
      const T* sj = srcs[order[size_t(j)]] + base;
      for (std::int64_t i = 0; i < m; ++i) acc[i] += widen(sj[i]);
    }
    for (std::int64_t i = 0; i < m; ++i) dst[base + i] = narrow<T>(acc[i]);
  }
}
}  // namespace

void sum_in_rank_order(void* dst, const void* const* srcs, int P, std::int64_t n, DType dtype) {
  if (n == 0) return;
  auto typed = [&]<class T>(T* out) {
    std::vector<const T*> in(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) in[size_t(j)] = static_cast<const T*>(srcs[j]);
    sum_in_rank_order_t(out, in.data(), P, n);
  };
  switch (dtype) {
    case DType::f32:
      return typed(static_cast<float*>(dst));
    case DType::f64:
      return typed(static_cast<double*>(dst));
    case DType::bf16:
      return typed(static_cast<bf16*>(dst));
  }
}

Staging::Staging(DType dtype, std::int64_t n) {
  switch (dtype) {
    case DType::f32:
      f32_ = TensorF({n}, MemCategory::comm_buffers);
      break;
    case DType::f64:
      f64_ = TensorD({n}, MemCategory::comm_buffers);
      break;
    case DType::bf16:
      bf16_ = Tensor<bf16>({n}, MemCategory::comm_buffers);
      break;
  }
}

void* Staging::data() {
  if (f32_.defined()) return f32_.data();
  if (f64_.defined()) return f64_.data();
  return bf16_.data();
}

void copy_elems(void* dst, const void* src, std::int64_t n, DType t) {
  if (n == 0 || dst == nullptr || src == nullptr || dst == src) return;
  std::memmove(dst, src, static_cast<std::size_t>(n * dtype_bytes(t)));
}

}  // namespace comm_detail

}  // namespace laga
