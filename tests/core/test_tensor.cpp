// Tensor<T>: shapes, ownership (move, clone, reset), reshape, zeros, fill, and
// how every one of those registers with the memory pool.
#include "core/tensor.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "core/error.hpp"
#include "core/memory_pool.hpp"

namespace laga {
namespace {

template <class T>
class TensorTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TensorTest, Types);

TEST(Shape, NumelAndToString) {
  EXPECT_EQ(numel({2, 3, 4}), 24);
  EXPECT_EQ(numel({5}), 5);
  EXPECT_EQ(numel({3, 0, 7}), 0);
  EXPECT_EQ(numel({}), 1);  // the empty product
  EXPECT_EQ(to_string(Shape{2, 3, 4}), "[2, 3, 4]");
  EXPECT_EQ(to_string(Shape{}), "[]");
  EXPECT_THROW(numel({2, -1}), Error);
}

TEST(Tensor, IsMoveOnly) {
  static_assert(!std::is_copy_constructible_v<TensorF>);
  static_assert(!std::is_copy_assignable_v<TensorF>);
  static_assert(std::is_nothrow_move_constructible_v<TensorF>);
  static_assert(std::is_nothrow_move_assignable_v<TensorD>);
}

TYPED_TEST(TensorTest, ShapeAccessors) {
  MemoryPool pool;
  PoolScope scope(pool);
  Tensor<TypeParam> t({2, 3, 5}, MemCategory::parameters);
  EXPECT_TRUE(t.defined());
  EXPECT_TRUE(t.backed());
  ASSERT_NE(t.data(), nullptr);
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.numel(), 30);
  EXPECT_EQ(t.bytes(), 30 * static_cast<std::int64_t>(sizeof(TypeParam)));
  EXPECT_EQ(t.dim(0), 2);
  EXPECT_EQ(t.dim(1), 3);
  EXPECT_EQ(t.dim(2), 5);
  EXPECT_EQ(t.shape(), (Shape{2, 3, 5}));
  EXPECT_EQ(t.category(), MemCategory::parameters);
  EXPECT_THROW(t.dim(3), Error);
  EXPECT_THROW(t.dim(-1), Error);
  // 64-byte aligned storage (tensor.cpp promises one cache line).
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
}

TYPED_TEST(TensorTest, DefaultIsUndefinedAndEmpty) {
  Tensor<TypeParam> t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.bytes(), 0);
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_TRUE(t.backed());  // nothing to back
  EXPECT_EQ(t.rank(), 0);
}

TYPED_TEST(TensorTest, ZeroExtentIsDefinedButHoldsNothing) {
  MemoryPool pool;
  PoolScope scope(pool);
  Tensor<TypeParam> t({4, 0});
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.numel(), 0);
  EXPECT_TRUE(t.backed());
  EXPECT_EQ(pool.current(MemCategory::activations), 0);
}

TYPED_TEST(TensorTest, NegativeExtentThrows) {
  MemoryPool pool;
  PoolScope scope(pool);
  EXPECT_THROW(Tensor<TypeParam>({3, -2}), Error);
  EXPECT_EQ(pool.current_total(), 0);  // nothing registered for the failed tensor
}

TYPED_TEST(TensorTest, ZerosFillAndIndex) {
  MemoryPool pool;
  PoolScope scope(pool);
  // An uninitialised allocation that reuses memory could hold anything; zeros must not.
  auto z = Tensor<TypeParam>::zeros({7, 9}, MemCategory::gradients);
  EXPECT_EQ(z.category(), MemCategory::gradients);
  for (std::int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z[i], TypeParam(0)) << "element " << i;
  z.fill(TypeParam(2.5));
  for (std::int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z[i], TypeParam(2.5)) << "element " << i;
  z[3] = TypeParam(-1);
  EXPECT_EQ(z.data()[3], TypeParam(-1));
  const auto& cz = z;
  EXPECT_EQ(cz[3], TypeParam(-1));
}

TYPED_TEST(TensorTest, ZerosClearsReusedMemory) {
  // Freed blocks are handed out again by malloc with their old contents (and
  // ASan fills fresh ones with 0xbe): zeros() must clear them.
  MemoryPool pool;
  PoolScope scope(pool);
  for (int round = 0; round < 4; ++round) {
    {
      Tensor<TypeParam> dirty({257});
      dirty.fill(std::numeric_limits<TypeParam>::quiet_NaN());
    }
    auto z = Tensor<TypeParam>::zeros({257});
    for (std::int64_t i = 0; i < z.numel(); ++i)
      ASSERT_EQ(z[i], TypeParam(0)) << "round " << round << " element " << i;
  }
}

TYPED_TEST(TensorTest, MoveConstructTransfersOwnership) {
  MemoryPool pool;
  PoolScope scope(pool);
  Tensor<TypeParam> a({3, 4});
  a.fill(TypeParam(1.5));
  TypeParam* p = a.data();
  Tensor<TypeParam> b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.shape(), (Shape{3, 4}));
  EXPECT_EQ(b[11], TypeParam(1.5));
  // The moved-from state is specified: empty and undefined.
  EXPECT_FALSE(a.defined());
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.numel(), 0);
  // Moving registers nothing new.
  EXPECT_EQ(pool.current(MemCategory::activations),
            12 * static_cast<std::int64_t>(sizeof(TypeParam)));
  EXPECT_EQ(pool.alloc_count(), 1);
}

// A view of rows shares its base's storage and registers nothing: the pool
// counts the base once; resetting the view leaves the base as it was.
TYPED_TEST(TensorTest, ViewRowsSharesStorageAndRegistersNothing) {
  MemoryPool pool;
  PoolScope scope(pool);
  const std::int64_t sz = sizeof(TypeParam);
  Tensor<TypeParam> base = Tensor<TypeParam>::zeros({5, 3}, MemCategory::parameters);
  Tensor<TypeParam> top = Tensor<TypeParam>::view_rows(base, 0, 2);
  Tensor<TypeParam> rest = Tensor<TypeParam>::view_rows(base, 2, 3);
  EXPECT_EQ(top.shape(), (Shape{2, 3}));
  EXPECT_EQ(rest.shape(), (Shape{3, 3}));
  EXPECT_EQ(top.data(), base.data());
  EXPECT_EQ(rest.data(), base.data() + 6);
  EXPECT_EQ(rest.category(), MemCategory::parameters);
  rest[0] = TypeParam(4);
  EXPECT_EQ(base[6], TypeParam(4));
  EXPECT_EQ(pool.current(MemCategory::parameters), 15 * sz);
  EXPECT_EQ(pool.alloc_count(), 1);
  rest.reset();
  EXPECT_EQ(pool.current(MemCategory::parameters), 15 * sz);
  EXPECT_EQ(base[6], TypeParam(4));
  EXPECT_THROW(Tensor<TypeParam>::view_rows(base, 4, 2), Error);
  // A view of an unbacked (count-only) tensor is unbacked.
  MemoryPool counting;
  counting.set_count_only(true);
  PoolScope count_scope(counting);
  Tensor<TypeParam> unbacked({4, 2});
  Tensor<TypeParam> v = Tensor<TypeParam>::view_rows(unbacked, 1, 2);
  EXPECT_EQ(v.data(), nullptr);
  EXPECT_FALSE(v.backed());
  EXPECT_EQ(counting.current(MemCategory::activations), 8 * sz);
}

// Held narrowed (bf16 mixed precision's kept tensors): the values rounded to
// bf16 in 2 bytes an element under the same category; the fp32 storage
// given back after the bf16 is registered (the peak sees both); data() null
// until widened, which gives back exactly the bf16 values; moves carry the
// state, and a view, clone or fill of a narrowed tensor is refused. Count-
// only pools count the same bytes.
TEST(Tensor, NarrowedHoldsBf16ValuesAtTwoBytes) {
  MemoryPool pool;
  PoolScope scope(pool);
  TensorF t({3, 4}, MemCategory::activations);
  for (std::int64_t i = 0; i < 12; ++i) t[i] = 1.0f + float(i) / 3.0f;  // most not bf16 values
  const std::int64_t before_peak = pool.peak_total();
  t.narrow_to_bf16();
  EXPECT_TRUE(t.narrowed());
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_FALSE(t.backed());
  EXPECT_EQ(t.bytes(), 24);
  EXPECT_EQ(pool.current(MemCategory::activations), 24);
  EXPECT_EQ(pool.peak_total(), std::max<std::int64_t>(before_peak, 48 + 24));
  for (std::int64_t i = 0; i < 12; ++i)
    EXPECT_EQ(t.narrowed_data()[i], to_bf16(1.0f + float(i) / 3.0f));
  EXPECT_THROW(TensorF::view_rows(t, 0, 1), Error);
  EXPECT_THROW(t.clone(), Error);
  EXPECT_THROW(t.fill(0.0f), Error);
  EXPECT_THROW(t.narrow_to_bf16(), Error);  // once
  TensorF moved = std::move(t);
  EXPECT_TRUE(moved.narrowed());
  EXPECT_FALSE(t.narrowed());
  moved.widen_from_bf16();
  EXPECT_FALSE(moved.narrowed());
  EXPECT_EQ(pool.current(MemCategory::activations), 48);
  for (std::int64_t i = 0; i < 12; ++i)
    EXPECT_EQ(moved[i], to_float(to_bf16(1.0f + float(i) / 3.0f)));
  EXPECT_THROW(moved.widen_from_bf16(), Error);
  moved.narrow_to_bf16();
  moved.reset();
  EXPECT_EQ(pool.current_total(), 0);
  // Only fp32 narrows.
  TensorD d({2});
  EXPECT_THROW(d.narrow_to_bf16(), Error);
  // Count-only: the same bytes, no storage.
  MemoryPool counting;
  counting.set_count_only(true);
  PoolScope count_scope(counting);
  TensorF c({5});
  c.narrow_to_bf16();
  EXPECT_EQ(counting.current(MemCategory::activations), 10);
  c.widen_from_bf16();
  EXPECT_EQ(counting.current(MemCategory::activations), 20);
  EXPECT_EQ(counting.peak_total(), 30);
}

// Born narrowed (a ring block off a bf16 wire): 2 bytes an element from the
// start, never the 4 of an fp32 tensor narrowed later (the peak sees only
// the bf16 bytes); it widens as any narrowed tensor, and a count-only pool
// counts the same bytes.
TEST(Tensor, BornNarrowedHoldsTwoBytesFromTheStart) {
  MemoryPool pool;
  PoolScope scope(pool);
  TensorF t = TensorF::born_narrowed({3, 4}, "block", MemCategory::comm_buffers);
  EXPECT_TRUE(t.narrowed());
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_EQ(t.bytes(), 24);
  EXPECT_EQ(pool.current(MemCategory::comm_buffers), 24);
  EXPECT_EQ(pool.peak_total(), 24);
  for (std::int64_t i = 0; i < 12; ++i) t.narrowed_data()[i] = to_bf16(float(i) - 5.5f);
  t.widen_from_bf16();
  EXPECT_EQ(pool.current(MemCategory::comm_buffers), 48);
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_EQ(t[i], float(i) - 5.5f);
  t.reset();
  EXPECT_EQ(pool.current_total(), 0);
  EXPECT_THROW(TensorD::born_narrowed({2}, "block"), Error);  // only fp32 narrows
  MemoryPool counting;
  counting.set_count_only(true);
  PoolScope count_scope(counting);
  TensorF c = TensorF::born_narrowed({5}, "block");
  EXPECT_TRUE(c.narrowed());
  EXPECT_EQ(counting.current(MemCategory::activations), 10);
}

TYPED_TEST(TensorTest, MoveAssignFreesTheOldStorage) {
  MemoryPool pool;
  PoolScope scope(pool);
  const std::int64_t sz = sizeof(TypeParam);
  Tensor<TypeParam> a({10}, MemCategory::activations);
  Tensor<TypeParam> b({3}, MemCategory::gradients);
  b.fill(TypeParam(7));
  EXPECT_EQ(pool.current(MemCategory::activations), 10 * sz);
  EXPECT_EQ(pool.current(MemCategory::gradients), 3 * sz);
  a = std::move(b);  // a's 10 activations are freed; it now owns b's gradients
  EXPECT_EQ(pool.current(MemCategory::activations), 0);
  EXPECT_EQ(pool.current(MemCategory::gradients), 3 * sz);
  EXPECT_EQ(a.category(), MemCategory::gradients);
  EXPECT_EQ(a.numel(), 3);
  EXPECT_EQ(a[2], TypeParam(7));
  EXPECT_FALSE(b.defined());
  // Self-move leaves the tensor intact.
  auto& alias = a;
  a = std::move(alias);
  EXPECT_EQ(a.numel(), 3);
  EXPECT_EQ(a[0], TypeParam(7));
  EXPECT_EQ(pool.current(MemCategory::gradients), 3 * sz);
}

TYPED_TEST(TensorTest, CloneIsDeepAndRegistersUnderItsCategory) {
  MemoryPool pool;
  PoolScope scope(pool);
  const std::int64_t sz = sizeof(TypeParam);
  Tensor<TypeParam> a({2, 3}, MemCategory::parameters);
  for (std::int64_t i = 0; i < 6; ++i) a[i] = static_cast<TypeParam>(i) + TypeParam(0.25);
  Tensor<TypeParam> same = a.clone();
  Tensor<TypeParam> g = a.clone(MemCategory::gradients);
  EXPECT_EQ(same.category(), MemCategory::parameters);
  EXPECT_EQ(g.category(), MemCategory::gradients);
  EXPECT_EQ(same.shape(), a.shape());
  EXPECT_NE(same.data(), a.data());
  for (std::int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(same[i], a[i]);
    EXPECT_EQ(g[i], a[i]);
  }
  a[0] = TypeParam(-9);  // deep: the clones do not follow
  EXPECT_EQ(same[0], TypeParam(0.25));
  EXPECT_EQ(pool.current(MemCategory::parameters), 12 * sz);
  EXPECT_EQ(pool.current(MemCategory::gradients), 6 * sz);
}

TYPED_TEST(TensorTest, CloneOfUndefinedIsUndefined) {
  MemoryPool pool;
  PoolScope scope(pool);
  Tensor<TypeParam> none;
  Tensor<TypeParam> c = none.clone();
  EXPECT_FALSE(c.defined());
  EXPECT_EQ(c.numel(), 0);
  EXPECT_EQ(pool.current_total(), 0);
}

TYPED_TEST(TensorTest, ResetFreesNowAndIsIdempotent) {
  MemoryPool pool;
  PoolScope scope(pool);
  Tensor<TypeParam> a({100}, MemCategory::comm_buffers);
  EXPECT_EQ(pool.current(MemCategory::comm_buffers),
            100 * static_cast<std::int64_t>(sizeof(TypeParam)));
  a.reset();
  EXPECT_EQ(pool.current(MemCategory::comm_buffers), 0);
  EXPECT_FALSE(a.defined());
  EXPECT_EQ(a.data(), nullptr);
  a.reset();  // a second reset must not free twice (the pool would throw)
  EXPECT_EQ(pool.current(MemCategory::comm_buffers), 0);
}

TYPED_TEST(TensorTest, ReshapeKeepsDataAndChecksCount) {
  MemoryPool pool;
  PoolScope scope(pool);
  Tensor<TypeParam> t({2, 6});
  for (std::int64_t i = 0; i < 12; ++i) t[i] = static_cast<TypeParam>(i);
  TypeParam* p = t.data();
  t.reshape({3, 2, 2});
  EXPECT_EQ(t.shape(), (Shape{3, 2, 2}));
  EXPECT_EQ(t.data(), p);
  EXPECT_EQ(t[11], TypeParam(11));
  try {
    t.reshape({5, 2});
    FAIL() << "reshape to a different element count must throw";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[3, 2, 2]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[5, 2]"), std::string::npos) << msg;
  }
  EXPECT_EQ(t.shape(), (Shape{3, 2, 2}));  // unchanged by the failed reshape
  EXPECT_THROW(t.reshape({-3, -4}), Error);
  EXPECT_EQ(t.bytes(), 12 * static_cast<std::int64_t>(sizeof(TypeParam)));
}

TYPED_TEST(TensorTest, DestructorUnregisters) {
  MemoryPool pool;
  PoolScope scope(pool);
  {
    Tensor<TypeParam> a({8, 8});
    Tensor<TypeParam> b({4}, MemCategory::optimizer);
    EXPECT_EQ(pool.current_total(), 68 * static_cast<std::int64_t>(sizeof(TypeParam)));
  }
  EXPECT_EQ(pool.current_total(), 0);
  EXPECT_EQ(pool.peak_total(), 68 * static_cast<std::int64_t>(sizeof(TypeParam)));
}

}  // namespace
}  // namespace laga
