// Tensor<T> — a contiguous, row-major array of float, double, bf16 (a
// storage type only, core/bf16.hpp: mixed-precision activations and weight
// copies) or int32 (index tensors): owning, or a view of rows of another (Tensor::view_rows).
//
// Bytes are registered with the MemoryPool current on the allocating thread,
// under a MemCategory, and unregistered with that same pool when the tensor is
// freed (destroyed, reassigned or reset()), wherever that happens. When the
// pool is in count-only mode the tensor is accounted but not backed: data() is
// nullptr and kernels must not run on it (docs/accounting.md, "count-only").
// The pool also gives the storage (MemoryPool::acquire_storage): a large
// tensor may get a block an earlier tensor freed, so uninitialised storage
// holds old values, not zeros.
//
// Shapes are int64 extents, outermost first, as (B, S, H, d) in doc comments.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/memory_pool.hpp"

namespace laga {

using Shape = std::vector<std::int64_t>;
std::int64_t numel(const Shape& shape);
std::string to_string(const Shape& shape);

template <class T>
class Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage (zeros() when the contents must start at 0). The
  // name (a string literal: it is kept as a pointer) says what the tensor is
  // in the pool's live list (memory_pool.hpp, "Live tracking").
  explicit Tensor(Shape shape, MemCategory cat = MemCategory::activations);
  Tensor(Shape shape, const char* name, MemCategory cat = MemCategory::activations);
  static Tensor zeros(Shape shape, MemCategory cat = MemCategory::activations);
  static Tensor zeros(Shape shape, const char* name, MemCategory cat = MemCategory::activations);
  // An fp32 tensor held narrowed from the start (narrow_to_bf16 below):
  // uninitialised bf16 storage, 2 bytes an element, for values that arrive
  // as bf16 (a ring block off a bf16 wire, mla/ring.hpp), which would
  // otherwise be widened into 4 bytes an element only to be narrowed again.
  static Tensor born_narrowed(Shape shape, const char* name,
                              MemCategory cat = MemCategory::activations);

  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() { reset(); }

  // A view of rows [row0, row0 + rows) of base's outermost dimension: the same
  // storage, no bytes of its own (the pool counts base once, not the view
  // again). It must not outlive base's storage; reset() only forgets it.
  // Parameters packed for one GEMM use it (MlaParams::in_proj). A view of an
  // unbacked (count-only) tensor is unbacked.
  static Tensor view_rows(Tensor& base, std::int64_t row0, std::int64_t rows);

  // A deep copy, registered under `cat` with the current pool.
  Tensor clone(MemCategory cat) const;
  Tensor clone() const { return clone(category_); }

  // Frees the storage now (saved activations are dropped as soon as backward
  // is done with them, which is what makes the pool's peak meaningful).
  void reset();

  // Same elements, new extents: the product must not change.
  void reshape(Shape shape);

  // Held narrowed (bf16 mixed precision's tensors kept for backward,
  // mla/ops.hpp keep_narrowed): the storage replaced by the values rounded
  // to bf16, 2 bytes an element, registered with the same pool under the
  // same category; data() is null (an op on it is refused, as on an unbacked
  // tensor) until widen_from_bf16 gives back fp32 storage holding those
  // values (exactly: bf16 -> fp32 is exact). The new storage is registered
  // before the old is given back, as both exist while the values are
  // converted. Only an fp32 tensor that owns its storage narrows. `convert`
  // and `widen` (n values, the same bits as to_bf16's and to_float's) are
  // the vectorised, threaded conversions the op layer passes
  // (mla/ops_bf16.hpp); null: to_bf16 and to_float, one by one.
  using Bf16Convert = void (*)(const float*, bf16*, std::int64_t);
  using Bf16Widen = void (*)(const bf16*, float*, std::int64_t);
  void narrow_to_bf16(Bf16Convert convert = nullptr);
  void widen_from_bf16(Bf16Widen widen = nullptr);
  bool narrowed() const { return narrowed_; }
  const bf16* narrowed_data() const { return narrowed_ ? narrow_ : nullptr; }
  bf16* narrowed_data() { return narrowed_ ? narrow_ : nullptr; }

  T* data() { return data_; }
  const T* data() const { return data_; }
  bool backed() const { return data_ != nullptr || numel_ == 0; }
  bool defined() const { return !shape_.empty(); }
  const Shape& shape() const { return shape_; }
  std::int64_t dim(int i) const;
  int rank() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const { return numel_; }
  std::int64_t bytes() const {
    return numel_ * (narrowed_ ? std::int64_t(sizeof(bf16)) : std::int64_t(sizeof(T)));
  }
  MemCategory category() const { return category_; }
  // Where the storage is: its pool's device (core/device.hpp).
  Device device() const { return pool_ ? pool_->device() : Device::cpu; }

  T& operator[](std::int64_t i) { return data_[i]; }
  const T& operator[](std::int64_t i) const { return data_[i]; }

  void fill(T value);

 private:
  Shape shape_;
  std::int64_t numel_ = 0;
  T* data_ = nullptr;
  MemCategory category_ = MemCategory::activations;
  MemoryPool* pool_ = nullptr;
  std::int64_t live_id_ = 0;  // the pool's id while it tracks live tensors
  // > 0: pool_'s block cache gave the storage (or, count-only, counted it),
  // a block of this many mapped bytes.
  std::int64_t mapped_ = 0;
  BlockCache::Place place_;     // and the cache's name for that block
  const char* name_ = nullptr;  // what the pool's live list calls it
  bool narrowed_ = false;       // the storage is narrow_ (bf16), data_ is null
  bf16* narrow_ = nullptr;
  // Both constructors: storage of T, or of bf16 when `narrowed`.
  Tensor(Shape shape, const char* name, MemCategory cat, bool narrowed);
  // The storage as the pool handed it out: data_, or narrow_ when narrowed.
  void* storage() const { return narrowed_ ? static_cast<void*>(narrow_) : data_; }
  // The storage as release_storage takes it back.
  MemoryPool::Storage held_storage() const { return {storage(), mapped_, place_}; }
  // Registers `bytes` under this tensor's category and name (+ `suffix`).
  std::int64_t register_bytes(MemoryPool& pool, std::int64_t bytes, const char* suffix) const;
  // `bytes` of storage from pool (none for no elements, none but counted
  // when count-only); out of memory is an error naming the tensor.
  MemoryPool::Storage acquire(MemoryPool& pool, std::int64_t bytes) const;
  // Fresh storage of the other width (bf16 when `narrowed`), registered
  // before the old is given back, as both exist while `fill` writes the
  // values into it (not called when either has no storage: count-only).
  void replace_storage(bool narrowed, const std::function<void(void*)>& fill);
};

using TensorF = Tensor<float>;
using TensorD = Tensor<double>;
using TensorB16 = Tensor<bf16>;
// int32: index tensors (DSA's top-k selection, mla/dsa_cp.hpp), counted as
// the activations they sit beside.
using TensorI32 = Tensor<std::int32_t>;

extern template class Tensor<float>;
extern template class Tensor<double>;
extern template class Tensor<bf16>;
extern template class Tensor<std::int32_t>;

}  // namespace laga
