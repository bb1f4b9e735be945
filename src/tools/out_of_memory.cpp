// operator new and delete, replaced for the laga executable (the standard's
// replaceable allocation functions), so that an allocation that finds no
// memory says how large it was: "std::bad_alloc" alone names neither what
// nor how much. Tensors say more (shape, bytes, category: core/tensor.cpp);
// this covers every other container (a RoPE table, a token buffer). main.cpp
// prints what() as "laga: error: out of memory: ...". delete is replaced with
// new, so that both sides are malloc/free, also under AddressSanitizer.
// A file of its own: with the callers in view GCC would flag free() on memory
// from operator new (-Wmismatched-new-delete), which is the point here.
#include <cstdio>
#include <cstdlib>
#include <new>

namespace {

class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::size_t bytes) {
    // No allocation here: there is no memory.
    std::snprintf(message_, sizeof message_,
                  "out of memory: a request for %zu bytes (%.3g GB) found no memory; use a "
                  "smaller --seq, --batch or --vocab, or a larger --sp",
                  bytes, static_cast<double>(bytes) / 1e9);
  }
  const char* what() const noexcept override { return message_; }

 private:
  char message_[200];
};

}  // namespace

void* operator new(std::size_t bytes) {
  for (;;) {
    if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
    const std::new_handler handler = std::get_new_handler();
    if (handler == nullptr) throw OutOfMemory(bytes);
    handler();
  }
}
void* operator new[](std::size_t bytes) {
  return ::operator new(bytes);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
