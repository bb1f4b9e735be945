// Deferred delivery, the test mode of the started collectives
// (communicator.hpp, "Overlap"): a started call's buffers checked at its
// start, its results held back and its recv poisoned until the wait, which
// checks what the caller did to them in between.
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "comm/collective_util.hpp"
#include "comm/communicator.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"

namespace laga {

using comm_detail::call_name;

namespace {

// FNV-1a of a buffer's bytes: a send buffer at start against itself at the wait.
std::uint64_t checksum(const void* p, std::int64_t bytes) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::int64_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// One element of the poison: quiet NaN, which every later result it reaches
// carries, in the dtype's bytes.
std::vector<unsigned char> poison_element(DType t) {
  std::vector<unsigned char> e(static_cast<size_t>(dtype_bytes(t)));
  auto put = [&e](auto nan) { std::memcpy(e.data(), &nan, sizeof nan); };
  switch (t) {
    case DType::f32:
      put(std::numeric_limits<float>::quiet_NaN());
      break;
    case DType::f64:
      put(std::numeric_limits<double>::quiet_NaN());
      break;
    case DType::bf16:
      put(to_bf16(std::numeric_limits<float>::quiet_NaN()));
      break;
  }
  return e;
}

// "send buffer", "recv block 2"
std::string buffer_name(const char* what, int index) {
  return index < 0 ? cat(what, " buffer") : cat(what, " block ", index);
}

}  // namespace

Communicator::DeferredCall Communicator::defer_check(CollectiveKind kind, const std::string& label,
                                                     DType dtype, std::vector<DeferredBuffer> send,
                                                     std::vector<DeferredBuffer> recv) const {
  DeferredCall call{kind, label, dtype, &current_pool(), {}, {}};
  const auto where = [&] {
    return cat(call_name(kind, label), " on rank ", rank(), " of ", size());
  };
  const auto keep = [&](std::vector<DeferredBuffer>& from, std::vector<DeferredBuffer>& to,
                        const char* what) {
    for (DeferredBuffer& b : from) {
      if (b.p == nullptr || b.bytes <= 0) continue;  // count-only or empty: nothing moves
      LAGA_CHECK(call.pool->storage_tracking(), where(),
                 ": deferred delivery (a test mode) checks that a started call's buffers stay "
                 "allocated until its wait through the rank's memory pool, whose storage tracking "
                 "is off; turn on MemoryPool::set_storage_tracking on the rank's thread before the "
                 "buffers are allocated (LocalRunOptions::deferred_delivery_for_testing does)");
      b.block = call.pool->storage_block(b.p, b.bytes);
      LAGA_CHECK(b.block != 0, where(), ": its ", buffer_name(what, b.index),
                 " is not storage of this rank's memory pool allocated while its storage tracking "
                 "was on; under deferred delivery every buffer of a started call must be a "
                 "tensor of the rank's pool, so that its wait can tell whether it is still "
                 "allocated");
      to.push_back(std::move(b));
    }
  };
  keep(send, call.send, "send");
  keep(recv, call.recv, "recv");
  return call;
}

void Communicator::defer(DeferredCall call) {
  for (DeferredBuffer& b : call.send) b.sum = checksum(b.p, b.bytes);
  const std::vector<unsigned char> nan = poison_element(call.dtype);
  for (DeferredBuffer& b : call.recv) {
    const auto* p = static_cast<unsigned char*>(b.p);
    b.staged.assign(p, p + b.bytes);
    for (std::int64_t i = 0; i < b.bytes; i += dtype_bytes(call.dtype))
      std::memcpy(static_cast<unsigned char*>(b.p) + i, nan.data(), nan.size());
  }
  if (!call.send.empty() || !call.recv.empty()) deferred_.emplace(started_ - 1, std::move(call));
}

void Communicator::deliver(const DeferredCall& call) const {
  const auto where = [&] {
    return cat(call_name(call.kind, call.label), " on rank ", rank(), " of ", size(),
               " (deferred delivery, a test mode)");
  };
  // Only a buffer still allocated is read; a released one is the finding.
  const auto allocated = [&](const DeferredBuffer& b, const char* what, const char* why) {
    LAGA_CHECK(call.pool->storage_block(b.p, b.bytes) == b.block, where(), ": its ",
               buffer_name(what, b.index), " was released before wait(); ", why,
               ", so keep it alive until then");
  };
  for (const DeferredBuffer& b : call.send) {
    allocated(b, "send",
              "an asynchronous transport (MPI nonblocking, NCCL) reads the send buffer until the "
              "wait");
    LAGA_CHECK(checksum(b.p, b.bytes) == b.sum, where(), ": its ", buffer_name("send", b.index),
               " changed between the start and wait(); an asynchronous transport reads the send "
               "buffer until the wait, so leave it as it is until then");
  }
  const std::vector<unsigned char> nan = poison_element(call.dtype);
  for (const DeferredBuffer& b : call.recv) {
    allocated(b, "recv", "the result lands there at the wait");
    const auto* p = static_cast<const unsigned char*>(b.p);
    bool untouched = true;
    for (std::int64_t i = 0; untouched && i < b.bytes; i += dtype_bytes(call.dtype))
      untouched = std::memcmp(p + i, nan.data(), nan.size()) == 0;
    LAGA_CHECK(untouched, where(), ": its ", buffer_name("recv", b.index),
               " was written between the start and wait(); the result lands there at the wait "
               "and would overwrite it");
  }
  for (const DeferredBuffer& b : call.recv) std::memcpy(b.p, b.staged.data(), b.staged.size());
}

}  // namespace laga
