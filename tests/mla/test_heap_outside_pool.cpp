// What a form keeps from forward to backward outside the memory pool, which
// neither the pool's peaks nor the memory model (its count-only run) can see
// (docs/accounting.md, "bf16 operand copies and attention scratch"). This
// binary replaces the global operator new and delete with ones that count
// the bytes live through them, and holds every form's bf16 forward to
// keeping no more heap past its return than its fp32 forward does: every
// bf16 operand copy a bf16 run keeps for backward is a pool tensor.
// laga_fused's rounded rows of wkv_b (form_laga_fused.cpp) were a
// std::vector here once (issue 52), 4 H_r (dn + dv) C bytes outside both.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>

#include "comm/communicator.hpp"
#include "common/block_inputs.hpp"
#include "core/memory_pool.hpp"
#include "core/precision.hpp"
#include "mla/block.hpp"
#include "mla/form_spec.hpp"
#include "mla/memory_model.hpp"

namespace {

// Net bytes allocated through operator new and not yet deleted, counted
// while g_counting is set (by any thread: OpenMP's too), in blocks of
// kBuffer bytes or more: buffers of values, not the metadata every kept
// tensor carries (its shape, 8 bytes a dimension), which a bf16 run's
// extra pool tensors have too.
std::atomic<bool> g_counting{false};
std::atomic<std::int64_t> g_live{0};

// Each block carries its size in a 16-byte prefix (new's alignment here).
constexpr std::size_t kPrefix = 16;
constexpr std::size_t kBuffer = 256;
struct Prefix {
  std::size_t size;
  bool counted;
};
static_assert(sizeof(Prefix) <= kPrefix);

void* counted_new(std::size_t n) {
  auto* p = static_cast<unsigned char*>(std::malloc(n + kPrefix));
  if (!p) throw std::bad_alloc();
  const bool counted = g_counting.load(std::memory_order_relaxed) && n >= kBuffer;
  *reinterpret_cast<Prefix*>(p) = {n, counted};
  if (counted) g_live += std::int64_t(n);
  return p + kPrefix;
}
void counted_delete(void* q) noexcept {
  if (!q) return;
  auto* p = static_cast<unsigned char*>(q) - kPrefix;
  const Prefix pre = *reinterpret_cast<Prefix*>(p);
  if (pre.counted) g_live -= std::int64_t(pre.size);
  std::free(p);
}

}  // namespace

void* operator new(std::size_t n) {
  return counted_new(n);
}
void* operator new[](std::size_t n) {
  return counted_new(n);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_new(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_new(n);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept {
  counted_delete(p);
}
void operator delete[](void* p) noexcept {
  counted_delete(p);
}
void operator delete(void* p, std::size_t) noexcept {
  counted_delete(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  counted_delete(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  counted_delete(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  counted_delete(p);
}

namespace laga {
namespace {

// The heap bytes a forward leaves held when it returns (its tape's, beside
// its pool tensors), after a warm-up step that makes whatever lives for
// the process (oneDNN's primitives, the kernels' per-thread buffers).
std::int64_t heap_kept_by_forward(const MlaConfig& cfg, const SpLayout& lay, Form form,
                                  Precision precision) {
  const UsePrecision scope(precision);
  const RopeTable rope(cfg.rope(), lay.seq);
  auto comm = make_self_communicator();
  const BlockContext ctx{cfg, lay, *comm, rope, {form}, AttentionKind::flash, nullptr};
  const test::BlockInputs<float> in = test::make_inputs(cfg, lay.batch, lay.seq);
  auto step = [&](bool count) {
    TensorF out, dx;
    MlaSaved<float> saved;
    auto grads = MlaParams<float>::zeros(cfg, MemCategory::gradients);
    g_live = 0;
    g_counting = count;
    mla_forward(ctx, in.w, in.x, out, saved);
    g_counting = false;
    const std::int64_t kept = g_live.load();
    mla_backward(ctx, in.w, in.x, in.dout, saved, dx, grads);
    return kept;
  };
  step(false);
  step(false);
  return step(true);
}

TEST(HeapOutsidePool, Bf16ForwardKeepsNoMoreHeapThanFp32) {
  const MlaConfig cfg = test::block_config(7);
  const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, 1);
  for (Form form : all_forms()) {
    const std::int64_t fp32 = heap_kept_by_forward(cfg, lay, form, Precision::fp32);
    const std::int64_t bf16 = heap_kept_by_forward(cfg, lay, form, Precision::bf16);
    EXPECT_EQ(bf16, fp32) << to_string(form)
                          << ": heap bytes held from forward to backward outside the pool (fp32 "
                          << fp32 << ", bf16 " << bf16 << ")";
  }
}

}  // namespace
}  // namespace laga
