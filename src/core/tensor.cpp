#include "core/tensor.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <type_traits>

#include "core/error.hpp"

namespace laga {

std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t e : shape)
    LAGA_CHECK(e >= 0, "tensor shape ", to_string(shape), " has a negative extent");
  for (std::int64_t e : shape) {
    // An overflowing product would wrap to a small or negative count and
    // allocate the wrong size; no machine holds 2^63 elements anyway.
    LAGA_CHECK(!__builtin_mul_overflow(n, e, &n), "tensor shape ", to_string(shape),
               " has more than 2^63 elements; the sizes that produced it (--seq, --batch, the "
               "config) are far beyond any machine");
  }
  return n;
}

std::string to_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

template <class T>
Tensor<T>::Tensor(Shape shape, MemCategory cat) : Tensor(std::move(shape), nullptr, cat) {}

template <class T>
Tensor<T>::Tensor(Shape shape, const char* name, MemCategory cat)
    : Tensor(std::move(shape), name, cat, false) {}

template <class T>
Tensor<T> Tensor<T>::born_narrowed(Shape shape, const char* name, MemCategory cat) {
  LAGA_CHECK((std::is_same_v<T, float>), "internal: only an fp32 tensor is held narrowed (shape ",
             to_string(shape), ")");
  return Tensor(std::move(shape), name, cat, true);
}

template <class T>
Tensor<T>::Tensor(Shape shape, const char* name, MemCategory cat, bool narrowed)
    : shape_(std::move(shape)), numel_(laga::numel(shape_)), category_(cat), narrowed_(narrowed) {
  MemoryPool& pool = current_pool();
  // bytes() must be exact (the pool counts it), so its product may not wrap.
  LAGA_CHECK(numel_ <= std::numeric_limits<std::int64_t>::max() / std::int64_t(sizeof(T)), "a ",
             to_string(category_), " tensor of shape ", to_string(shape_),
             " would need more than 2^63 bytes; use a smaller --seq/--batch or a larger --sp");
  const MemoryPool::Storage storage = acquire(pool, this->bytes());
  if (narrowed_)
    narrow_ = static_cast<bf16*>(storage.data);
  else
    data_ = static_cast<T*>(storage.data);
  mapped_ = storage.mapped;
  place_ = storage.place;
  pool_ = &pool;
  name_ = name;
  live_id_ = register_bytes(pool, this->bytes(), narrowed_ ? " bf16" : "");
}

template <class T>
std::int64_t Tensor<T>::register_bytes(MemoryPool& pool, std::int64_t bytes,
                                       const char* suffix) const {
  return pool.on_alloc(category_, bytes,
                       pool.live_tracking() ? std::string(name_ ? name_ : "tensor") + " " +
                                                  to_string(shape_) + suffix
                                            : "");
}

template <class T>
MemoryPool::Storage Tensor<T>::acquire(MemoryPool& pool, std::int64_t bytes) const {
  if (numel_ == 0) return {};
  // Count-only: no storage, but the pool's cache counts the block.
  const MemoryPool::Storage storage = pool.acquire_storage(bytes);
  if (!storage.data && !pool.count_only())
    fail("out of memory allocating ", bytes, " bytes (", static_cast<double>(bytes) / 1e9,
         " GB) for a tensor of shape ", to_string(shape_), " (", to_string(category_), ")",
         "; use a smaller --seq/--batch or a larger --sp (`laga compare --count-only` and "
         "`laga plan` give a job's peak per rank without allocating it)");
  return storage;
}

template <class T>
void Tensor<T>::replace_storage(bool narrowed, const std::function<void(void*)>& fill) {
  MemoryPool& pool = *pool_;
  const std::int64_t old_bytes = bytes(),
                     new_bytes = numel_ * std::int64_t(narrowed ? sizeof(bf16) : sizeof(T));
  const MemoryPool::Storage fresh = acquire(pool, new_bytes);
  const std::int64_t id = register_bytes(pool, new_bytes, narrowed ? " bf16" : "");
  if (fresh.data && storage()) fill(fresh.data);
  if (storage() || mapped_ > 0) pool.release_storage(held_storage(), old_bytes);
  pool.on_free(category_, old_bytes, live_id_);
  data_ = narrowed ? nullptr : static_cast<T*>(fresh.data);
  narrow_ = narrowed ? static_cast<bf16*>(fresh.data) : nullptr;
  narrowed_ = narrowed, mapped_ = fresh.mapped, place_ = fresh.place, live_id_ = id;
}

template <class T>
void Tensor<T>::narrow_to_bf16(Bf16Convert convert) {
  LAGA_CHECK((std::is_same_v<T, float>)&&pool_ && !narrowed_,
             "internal: only an fp32 tensor that owns its storage is held narrowed, once (shape ",
             to_string(shape_), ")");
  if constexpr (std::is_same_v<T, float>)
    replace_storage(true, [&](void* to) {
      bf16* n = static_cast<bf16*>(to);
      if (convert)
        convert(data_, n, numel_);
      else
        for (std::int64_t i = 0; i < numel_; ++i) n[i] = to_bf16(data_[i]);
    });
}

template <class T>
void Tensor<T>::widen_from_bf16(Bf16Widen widen) {
  LAGA_CHECK(narrowed_, "internal: widen a tensor that is not narrowed (shape ", to_string(shape_),
             ")");
  if constexpr (std::is_same_v<T, float>)  // only fp32 narrows
    replace_storage(false, [&](void* to) {
      float* w = static_cast<float*>(to);
      if (widen)
        widen(narrow_, w, numel_);
      else
        for (std::int64_t i = 0; i < numel_; ++i) w[i] = to_float(narrow_[i]);
    });
}

template <class T>
Tensor<T> Tensor<T>::zeros(Shape shape, MemCategory cat) {
  return zeros(std::move(shape), nullptr, cat);
}

template <class T>
Tensor<T> Tensor<T>::zeros(Shape shape, const char* name, MemCategory cat) {
  Tensor t(std::move(shape), name, cat);
  if (!t.data_) return t;
  // A device pool's tensor is zeroed on its device, not by the host
  // (issue 52: no host loop over device memory in a form's step).
  if (DeviceMemory* device = t.pool_->device_memory())
    device->zero(t.data_, t.bytes());
  else
    std::memset(t.data_, 0, static_cast<std::size_t>(t.bytes()));
  return t;
}

template <class T>
Tensor<T>::Tensor(Tensor&& o) noexcept
    : shape_(std::move(o.shape_)),
      numel_(o.numel_),
      data_(o.data_),
      category_(o.category_),
      pool_(o.pool_),
      live_id_(o.live_id_),
      mapped_(o.mapped_),
      place_(o.place_),
      name_(o.name_),
      narrowed_(o.narrowed_),
      narrow_(o.narrow_) {
  o.live_id_ = 0;
  o.mapped_ = 0;
  o.place_ = {};
  o.narrowed_ = false;
  o.narrow_ = nullptr;
  o.shape_.clear();
  o.numel_ = 0;
  o.data_ = nullptr;
  o.pool_ = nullptr;
}

template <class T>
Tensor<T>& Tensor<T>::operator=(Tensor&& o) noexcept {
  if (this != &o) {
    reset();
    shape_ = std::move(o.shape_);
    numel_ = o.numel_;
    data_ = o.data_;
    category_ = o.category_;
    pool_ = o.pool_;
    live_id_ = o.live_id_;
    mapped_ = o.mapped_;
    place_ = o.place_;
    name_ = o.name_;
    narrowed_ = o.narrowed_;
    narrow_ = o.narrow_;
    o.live_id_ = 0;
    o.mapped_ = 0;
    o.place_ = {};
    o.narrowed_ = false;
    o.narrow_ = nullptr;
    o.shape_.clear();
    o.numel_ = 0;
    o.data_ = nullptr;
    o.pool_ = nullptr;
  }
  return *this;
}

template <class T>
Tensor<T> Tensor<T>::view_rows(Tensor& base, std::int64_t row0, std::int64_t rows) {
  LAGA_CHECK(!base.narrowed_, "internal: a view of a narrowed tensor (widen it first)");
  LAGA_CHECK(base.rank() >= 1 && row0 >= 0 && rows >= 0 && row0 + rows <= base.dim(0),
             "internal: a view of rows [", row0, ", ", row0 + rows, ") of a tensor of shape ",
             to_string(base.shape_));
  Tensor v;
  v.shape_ = base.shape_;
  v.shape_[0] = rows;
  v.numel_ = laga::numel(v.shape_);
  const std::int64_t row_elements = base.dim(0) == 0 ? 0 : base.numel_ / base.dim(0);
  v.data_ = base.data_ ? base.data_ + row0 * row_elements : nullptr;
  v.category_ = base.category_;
  // pool_ stays null: the pool never hears of a view; reset() gives nothing back.
  return v;
}

template <class T>
Tensor<T> Tensor<T>::clone(MemCategory cat) const {
  if (!defined()) return Tensor();  // shape {} would otherwise allocate one element
  LAGA_CHECK(!narrowed_, "internal: a clone of a narrowed tensor (widen it first)");
  Tensor t(shape_, cat);
  if (t.data_ && data_) std::memcpy(t.data_, data_, static_cast<std::size_t>(bytes()));
  return t;
}

template <class T>
void Tensor<T>::reset() {
  if (pool_) {
    if (storage() || mapped_ > 0) pool_->release_storage(held_storage(), bytes());
    pool_->on_free(category_, bytes(), live_id_);
  }
  live_id_ = 0;
  data_ = nullptr;
  narrow_ = nullptr;
  narrowed_ = false;
  mapped_ = 0;
  place_ = {};
  pool_ = nullptr;
  shape_.clear();
  numel_ = 0;
}

template <class T>
void Tensor<T>::reshape(Shape shape) {
  LAGA_CHECK(laga::numel(shape) == numel_, "cannot reshape a tensor of shape ", to_string(shape_),
             " to ", to_string(shape), ": element counts differ");
  shape_ = std::move(shape);
}

template <class T>
std::int64_t Tensor<T>::dim(int i) const {
  LAGA_CHECK(i >= 0 && i < rank(), "dimension ", i, " out of range for shape ", to_string(shape_));
  return shape_[static_cast<size_t>(i)];
}

template <class T>
void Tensor<T>::fill(T value) {
  LAGA_CHECK(!narrowed_, "internal: fill of a narrowed tensor (widen it first)");
  if (data_) std::fill(data_, data_ + numel_, value);
}

template class Tensor<float>;
template class Tensor<double>;
template class Tensor<bf16>;  // zeros() is +0 in bf16 too: all bits clear
template class Tensor<std::int32_t>;

}  // namespace laga
