#include "comm/communicator.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/collective_util.hpp"
#include "comm/link_model.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"

namespace laga {

const char* to_string(Phase p) {
  switch (p) {
    case Phase::forward:
      return "forward";
    case Phase::backward:
      return "backward";
    case Phase::grad_sync:
      return "grad_sync";
    case Phase::count:
      break;
  }
  return "all";
}

const char* to_string(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_to_all:
      return "all_to_all";
    case CollectiveKind::all_gather:
      return "all_gather";
    case CollectiveKind::reduce_scatter:
      return "reduce_scatter";
    case CollectiveKind::all_reduce:
      return "all_reduce";
    case CollectiveKind::barrier:
      return "barrier";
    case CollectiveKind::ring_shift:
      return "ring_shift";
  }
  return "?";
}

const char* to_string(RingDirection d) {
  return d == RingDirection::forward ? "forward" : "backward";
}

std::string to_string(Ring ring) {
  if (ring.size == 0 && ring.stride == 1) return to_string(ring.direction);
  std::string s = cat(to_string(ring.direction), " in rings of ", ring.size);
  return ring.stride == 1 ? s : cat(s, ", stride ", ring.stride);
}

RingPeers ring_peers(int P, int r, Ring ring) {
  LAGA_CHECK(P >= 1 && r >= 0 && r < P, "ring_peers(P=", P, ", r=", r, "): need 0 <= r < P");
  LAGA_CHECK(ring.tiles(P), "ring_peers: rings of ", ring.size, " ranks at stride ", ring.stride,
             " do not tile a group of ", P,
             "; size * stride must divide P (size 0: one ring of every rank)");
  const int n = ring.ranks(P), s = ring.stride, block = n * s;
  const int base = r - r % block + r % s, place = (r % block) / s;
  const int next = base + ((place + 1) % n) * s, prev = base + ((place - 1 + n) % n) * s;
  return ring.direction == RingDirection::forward ? RingPeers{next, prev} : RingPeers{prev, next};
}

const char* to_string(Backend b) {
  switch (b) {
    case Backend::local:
      return "local";
    case Backend::mpi:
      return "mpi";
    case Backend::dry_run:
      return "dry-run";
    case Backend::self:
      return "self";
    case Backend::nccl:
      return "nccl";
  }
  return "?";
}

Backend parse_backend(const std::string& s) {
  for (Backend b : {Backend::local, Backend::mpi, Backend::dry_run, Backend::self, Backend::nccl})
    if (s == to_string(b)) return b;
  fail("unknown communicator backend '", s,
       "'; the backends are local, mpi, dry-run, self and nccl");
}

std::int64_t staging_elements(StagingRule rule, CollectiveKind kind, int P, std::int64_t own) {
  switch (rule) {
    case StagingRule::in_process:
      return kind == CollectiveKind::all_reduce ? own : 0;
    case StagingRule::mpi:
      return kind == CollectiveKind::reduce_scatter || kind == CollectiveKind::all_reduce
                 ? (P - 1) * own
                 : 0;
    case StagingRule::none:
      return 0;
  }
  return 0;
}

void Ledger::record(Phase phase, const std::string& label, WireBytes derived, WireBytes measured) {
  LAGA_CHECK(phase != Phase::count, "ledger: collective '", label,
             "' recorded under Phase::count, which only selects all phases in queries; set a real "
             "phase with set_phase()");
  const auto [it, first] = entries_.try_emplace({phase, label});
  if (first) order_.push_back(it->first);
  LedgerEntry& e = it->second;
  e.calls += 1;
  e.bytes_sent += derived.sent;
  e.bytes_received += derived.received;
  e.measured_sent += measured.sent;
  e.measured_received += measured.received;
}

WireBytes Traffic::total() const {
  WireBytes t;
  for (const WireBytes& w : peers_) t.sent += w.sent, t.received += w.received;
  return t;
}

void Ledger::record_entry(Phase phase, const std::string& label, const LedgerEntry& e) {
  const auto [it, first] = entries_.try_emplace({phase, label}, e);
  LAGA_CHECK(first, "ledger: '", label, "' in phase ", to_string(phase), " is already recorded");
  order_.push_back(it->first);
}

std::int64_t Ledger::bytes_sent(Phase phase) const {
  std::int64_t total = 0;
  for (const auto& [key, e] : entries_)
    if (phase == Phase::count || key.first == phase) total += e.bytes_sent;
  return total;
}

std::int64_t Ledger::bytes_received(Phase phase) const {
  std::int64_t total = 0;
  for (const auto& [key, e] : entries_)
    if (phase == Phase::count || key.first == phase) total += e.bytes_received;
  return total;
}

std::int64_t all_reduce_chunk(std::int64_t n, int P, int r) {
  LAGA_CHECK(P >= 1 && r >= 0 && r < P && n >= 0, "all_reduce_chunk(n=", n, ", P=", P, ", r=", r,
             "): need n >= 0 and 0 <= r < P");
  return n / P + (r < n % P ? 1 : 0);
}

std::vector<WireBytes> all_to_all_peer_bytes(const std::int64_t* send_counts,
                                             const std::int64_t* recv_counts, int P, int r,
                                             DType dtype) {
  std::vector<WireBytes> w(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j)
    if (j != r) w[j] = {send_counts[j] * dtype_bytes(dtype), recv_counts[j] * dtype_bytes(dtype)};
  return w;
}

std::vector<WireBytes> all_gather_peer_bytes(std::int64_t send_count,
                                             const std::int64_t* recv_counts, int P, int r,
                                             DType dtype) {
  // The own shard goes to every peer; each peer's shard comes back.
  std::vector<WireBytes> w(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j)
    if (j != r) w[j] = {send_count * dtype_bytes(dtype), recv_counts[j] * dtype_bytes(dtype)};
  return w;
}

std::vector<WireBytes> reduce_scatter_peer_bytes(const std::int64_t* counts, int P, int r,
                                                 DType dtype) {
  // Block j goes to rank j; every peer's copy of the own block comes in.
  std::vector<WireBytes> w(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j)
    if (j != r) w[j] = {counts[j] * dtype_bytes(dtype), counts[r] * dtype_bytes(dtype)};
  return w;
}

std::vector<WireBytes> all_reduce_peer_bytes(std::int64_t n, int P, int r, DType dtype) {
  // reduce-scatter: peer j's chunk out, its copy of the own chunk in;
  // all-gather: the reduced own chunk out, peer j's reduced chunk in.
  const std::int64_t own = all_reduce_chunk(n, P, r);
  std::vector<WireBytes> w(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    const std::int64_t both = (all_reduce_chunk(n, P, j) + own) * dtype_bytes(dtype);
    w[j] = {both, both};
  }
  return w;
}

std::vector<WireBytes> ring_shift_peer_bytes(std::int64_t send_count, std::int64_t recv_count,
                                             int P, int r, DType dtype, Ring ring) {
  // One neighbour each way (in a ring of two the same one); in a ring of
  // one the block goes to the rank itself, which is not traffic.
  std::vector<WireBytes> w(static_cast<size_t>(P));
  const RingPeers peers = ring_peers(P, r, ring);
  if (peers.to == r) return w;
  w[peers.to].sent += send_count * dtype_bytes(dtype);
  w[peers.from].received += recv_count * dtype_bytes(dtype);
  return w;
}

namespace {
WireBytes sum(const std::vector<WireBytes>& per_peer) {
  WireBytes t;
  for (const WireBytes& w : per_peer) t.sent += w.sent, t.received += w.received;
  return t;
}
}  // namespace

WireBytes all_to_all_wire_bytes(const std::int64_t* send_counts, const std::int64_t* recv_counts,
                                int P, int r, DType dtype) {
  return sum(all_to_all_peer_bytes(send_counts, recv_counts, P, r, dtype));
}

WireBytes all_gather_wire_bytes(std::int64_t send_count, const std::int64_t* recv_counts, int P,
                                int r, DType dtype) {
  return sum(all_gather_peer_bytes(send_count, recv_counts, P, r, dtype));
}

WireBytes reduce_scatter_wire_bytes(const std::int64_t* counts, int P, int r, DType dtype) {
  return sum(reduce_scatter_peer_bytes(counts, P, r, dtype));
}

WireBytes all_reduce_wire_bytes(std::int64_t n, int P, int r, DType dtype) {
  return sum(all_reduce_peer_bytes(n, P, r, dtype));
}

WireBytes ring_shift_wire_bytes(std::int64_t send_count, std::int64_t recv_count, int P,
                                DType dtype, int ring_size) {
  return sum(ring_shift_peer_bytes(send_count, recv_count, P, 0, dtype,
                                   {RingDirection::forward, ring_size}));
}

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

const char* to_string(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
  }
  return "?";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

std::string call_name(CollectiveKind kind, const std::string& label) {
  return cat(laga::to_string(kind), " '", label, "'");
}

std::string timeout_message(CollectiveKind kind, const std::string& label, int rank, int P,
                            std::chrono::milliseconds timeout, const std::vector<int>& missing) {
  return cat(call_name(kind, label), " on rank ", rank, " of ", P, " timed out after ",
             timeout.count(), " ms waiting for rank(s) ", rank_list(missing),
             "; a peer failed or never called it — check that every rank runs the same sequence "
             "of collectives, or raise --comm-timeout");
}

std::string peer_count_message(CollectiveKind kind, const std::string& label, int rank, int P,
                               int receiver, int sender, std::int64_t expected,
                               const std::string& sent) {
  const char* rule = "";
  switch (kind) {
    case CollectiveKind::all_to_all:
      rule = "recv_counts on each rank must equal what its peers send to it";
      break;
    case CollectiveKind::all_gather:
      rule = "recv_counts[j] must equal rank j's send_count on every rank";
      break;
    case CollectiveKind::reduce_scatter:
      rule = "every rank must pass the same counts";
      break;
    case CollectiveKind::all_reduce:
      rule = "every rank must pass the same n";
      break;
    case CollectiveKind::barrier:
      rule = "a barrier moves no data";
      break;
    case CollectiveKind::ring_shift:
      rule = "each rank's recv_count must equal the send_count of the rank it receives from";
      break;
  }
  return cat(call_name(kind, label), " on rank ", rank, " of ", P, ": rank ", receiver, " expects ",
             expected, " elements from rank ", sender, " but rank ", sender, " sends it ", sent,
             "; ", rule, ", and count-only must be on for all ranks of a call or for none");
}

}  // namespace comm_detail

// ---------------------------------------------------------------- the base class

namespace {

using namespace comm_detail;

// One rank's own arguments, checked before anything moves; the same checks
// and words on every backend. Messages are built only on failure: these run
// on every call.
class Checks {
 public:
  Checks(CollectiveKind kind, const std::string& label, int rank, int P)
      : kind_(kind), label_(label), rank_(rank), P_(P) {}

  // A count or the j-th of an array of them (j < 0: a single count).
  void count(std::int64_t value, const char* what, int j = -1) const {
    if (value < 0)
      fail(where(), ": ", what, j >= 0 ? cat("[", j, "]") : "", " = ", value,
           " is negative; counts are element counts >= 0");
  }
  void counts(const std::int64_t* values, const char* what) const {
    for (int j = 0; j < P_; ++j) count(values[j], what, j);
  }
  // The own block: a (`a_what`, or a_what[rank]) against b_what[rank].
  void same_own(std::int64_t a, const char* a_what, bool a_indexed, std::int64_t b,
                const char* b_what, const char* why) const {
    if (a != b)
      fail(where(), ": ", a_what, a_indexed ? cat("[", rank_, "]") : "", " = ", a, " but ", b_what,
           "[", rank_, "] = ", b, "; ", why);
  }

  // A byte range of a buffer; empty for a null (count-only) buffer. Named
  // `what` + index (index < 0: no index) in messages.
  struct Region {
    std::uintptr_t begin = 0, end = 0;
    const char* what = "";
    int index = -1;
    bool empty() const { return begin == end; }
    bool overlaps(const Region& o) const {
      return !empty() && !o.empty() && begin < o.end && o.begin < end;
    }
    bool same(const Region& o) const { return begin == o.begin && end == o.end; }
    std::string name() const { return index < 0 ? what : cat(what, " ", index); }
  };
  static Region region(const void* base, std::int64_t displ, std::int64_t count, DType t,
                       const char* what, int index = -1) {
    if (base == nullptr || count == 0) return {0, 0, what, index};
    const auto b = reinterpret_cast<std::uintptr_t>(at(base, displ, t));
    return {b, b + static_cast<std::uintptr_t>(count * dtype_bytes(t)), what, index};
  }
  static std::vector<Region> blocks(const void* base, const std::int64_t* displs,
                                    const std::int64_t* counts, int P, DType t, const char* what) {
    std::vector<Region> v(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) v[j] = region(base, displs[j], counts[j], t, what, j);
    return v;
  }

  // Receive blocks of different peers must not overlap each other.
  void disjoint(const std::vector<Region>& recv_blocks) const {
    for (size_t i = 0; i < recv_blocks.size(); ++i)
      for (size_t j = i + 1; j < recv_blocks.size(); ++j)
        if (recv_blocks[i].overlaps(recv_blocks[j]))
          fail(where(), ": ", recv_blocks[i].name(), " overlaps ", recv_blocks[j].name(),
               "; the receive regions of different peers must not overlap");
  }
  // `a` must not overlap any of `bs`, except where both are `allowed` exactly
  // (in place).
  void apart(const Region& a, const std::vector<Region>& bs, const Region* allowed,
             const char* rule) const {
    for (const Region& b : bs) {
      if (!a.overlaps(b)) continue;
      if (!(allowed && a.same(*allowed) && b.same(*allowed)))
        fail(where(), ": ", a.name(), " overlaps ", b.name(), "; ", rule);
    }
  }

 private:
  std::string where() const {
    return cat(call_name(kind_, label_), " on rank ", rank_, " of ", P_);
  }

  CollectiveKind kind_;
  const std::string& label_;
  int rank_, P_;
};

std::string peer_list(const std::vector<WireBytes>& derived,
                      const std::vector<WireBytes>& measured) {
  std::string s;
  for (size_t j = 0; j < derived.size(); ++j) {
    const WireBytes &d = derived[j], &m = measured[j];
    if (d.sent == m.sent && d.received == m.received) continue;
    s += cat(s.empty() ? "" : "; ", "rank ", j, ": sent ", d.sent, "/", m.sent, ", received ",
             d.received, "/", m.received);
  }
  return s;
}

}  // namespace

namespace {

// Returns at `until`: asleep while it is far, then spinning, since a sleep
// overshoots by tens of microseconds and shaped calls can be that short.
void wait_until(std::chrono::steady_clock::time_point until) {
  using namespace std::chrono_literals;
  using Clock = std::chrono::steady_clock;
  constexpr auto spin = 200us;
  if (until - Clock::now() > spin) std::this_thread::sleep_until(until - spin);
  while (Clock::now() < until) std::this_thread::yield();
}

}  // namespace

PendingCollective& PendingCollective::operator=(PendingCollective&& o) noexcept {
  if (this != &o) {
    if (pending_) owner_->complete(*this, false);
    owner_ = o.owner_, id_ = o.id_, done_at_ = o.done_at_;
    pending_ = std::exchange(o.pending_, false);
  }
  return *this;
}

PendingCollective::~PendingCollective() {
  if (pending_) owner_->complete(*this, false);
}

void Communicator::wait(PendingCollective& p) {
  if (!p.pending_) return;
  LAGA_CHECK(p.owner_ == this, "internal: a started collective waited for on another communicator");
  complete(p, true);
}

void Communicator::complete(PendingCollective& p, bool deliver_results) {
  const auto start = std::chrono::steady_clock::now();
  wait_until(p.done_at_);
  seconds_in_collectives_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  p.pending_ = false;
  // Without delivery (a destructor, maybe unwinding) the buffers are not
  // touched: they may be freed already.
  const auto d = deferred_.find(p.id_);
  if (d != deferred_.end()) {
    const DeferredCall call = std::move(d->second);
    deferred_.erase(d);
    if (deliver_results) deliver(call);
  }
  if (observer_) {
    CollectiveEvent e;
    e.what = CollectiveEvent::What::waited;
    e.phase = phase_;
    e.id = p.id_;
    observer_(e);
  }
}

// ---------------------------------------------------------------- deferred delivery

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
  for (const DeferredBuffer& b : call.send) {
    // Only a buffer still allocated is read; a released one is the finding.
    LAGA_CHECK(call.pool->storage_block(b.p, b.bytes) == b.block, where(), ": its ",
               buffer_name("send", b.index),
               " was released before wait(); an asynchronous transport (MPI nonblocking, NCCL) "
               "reads the send buffer until the wait, so keep it alive until then");
    LAGA_CHECK(checksum(b.p, b.bytes) == b.sum, where(), ": its ", buffer_name("send", b.index),
               " changed between the start and wait(); an asynchronous transport reads the send "
               "buffer until the wait, so leave it as it is until then");
  }
  const std::vector<unsigned char> nan = poison_element(call.dtype);
  for (const DeferredBuffer& b : call.recv) {
    LAGA_CHECK(call.pool->storage_block(b.p, b.bytes) == b.block, where(), ": its ",
               buffer_name("recv", b.index),
               " was released before wait(); the result lands there at the wait, so keep it "
               "alive until then");
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

void Communicator::set_link_model(const LinkModel* link) {
  if (link) validate(*link, "link model");
  link_model_ = link ? std::make_shared<const LinkModel>(*link) : nullptr;
}

void Communicator::check_usable(CollectiveKind, const std::string&) const {}
void Communicator::call_failed(const std::string&) {}

template <class Body>
std::chrono::steady_clock::time_point Communicator::run(CollectiveKind kind,
                                                        const std::string& label, Body&& body,
                                                        bool started, int ranks) {
  check_usable(kind, label);
  const auto start = std::chrono::steady_clock::now();
  auto done = start;
  try {
    Traffic moved(size());
    // body checks the arguments, runs the transport and returns the derived
    // bytes per peer.
    const std::vector<WireBytes> derived = body(moved);
    const WireBytes d = sum(derived), m = moved.total();
    ledger_.record(phase_, label, d, m);
    bool same = true;
    for (size_t j = 0; j < derived.size(); ++j)
      same = same && derived[j].sent == moved.per_peer()[j].sent &&
             derived[j].received == moved.per_peer()[j].received;
    LAGA_CHECK(same, call_name(kind, label), " on rank ", rank(), " of ", size(),
               ": the transport moved other bytes than the call's counts give: derived ", d.sent,
               " bytes sent and ", d.received, " received, measured ", m.sent, " sent and ",
               m.received,
               " received (per peer, derived/measured: ", peer_list(derived, moved.per_peer()),
               "); the ", to_string(backend()),
               " backend lost or misdirected data — a bug in laga, not in the caller");
    if (link_model_) {
      const double s =
          collective_seconds(kind, ranks == 0 ? size() : ranks, d, single_level(*link_model_));
      // Past this the clock's nanoseconds overflow and the hold would be
      // silently wrong; a day is beyond any run this models.
      LAGA_CHECK(s <= 86400.0, call_name(kind, label), " on rank ", rank(),
                 ": the link model would hold it ", s,
                 " s (more than a day); give the link a higher bandwidth or lower latency");
      done = std::max(start, link_free_at_) +
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                 std::chrono::duration<double>(s));
      link_free_at_ = done;
      if (!started) wait_until(done);
    }
    if (observer_)
      observer_({CollectiveEvent::What::issued, kind, phase_, label, d, started,
                 started ? started_ : -1, ranks == 0 ? size() : ranks});
    if (started) ++started_;
  } catch (const std::exception& e) {
    call_failed(e.what());
    throw;
  }
  ++calls_;
  seconds_in_collectives_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return done;
}

void Communicator::all_to_all_v(const void* send, const std::int64_t* send_counts,
                                const std::int64_t* send_displs, void* recv,
                                const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                                DType dtype, const std::string& label) {
  const CollectiveKind kind = CollectiveKind::all_to_all;
  run(kind, label, [&](Traffic& moved) {
    const int P = size(), r = rank();
    const Checks c(kind, label, r, P);
    c.counts(send_counts, "send_counts");
    c.counts(recv_counts, "recv_counts");
    c.same_own(send_counts[r], "send_counts", true, recv_counts[r], "recv_counts",
               "the block a rank keeps must have the same size both ways");
    const auto in = Checks::blocks(recv, recv_displs, recv_counts, P, dtype, "recv block");
    c.disjoint(in);
    for (const auto& out : Checks::blocks(send, send_displs, send_counts, P, dtype, "send block"))
      c.apart(out, in, nullptr,
              "an all_to_all_v cannot run in place; use separate send and recv buffers");
    transport_all_to_all(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype,
                         label, moved);
    return all_to_all_peer_bytes(send_counts, recv_counts, P, r, dtype);
  });
}

void Communicator::all_gather_v(const void* send, std::int64_t send_count, void* recv,
                                const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                                DType dtype, const std::string& label) {
  all_gather_call(send, send_count, recv, recv_counts, recv_displs, dtype, label, false);
}

PendingCollective Communicator::start_all_gather_v(const void* send, std::int64_t send_count,
                                                   void* recv, const std::int64_t* recv_counts,
                                                   const std::int64_t* recv_displs, DType dtype,
                                                   const std::string& label) {
  std::optional<DeferredCall> d;
  if (deferred_delivery_) {
    // In place, the own recv block is the send buffer: checked as that.
    const int r = rank();
    const bool in_place = send && recv && send == at(recv, recv_displs[r], dtype);
    std::vector<DeferredBuffer> in;
    for (int j = 0; j < size() && recv; ++j)
      if (!(in_place && j == r))
        in.push_back({at(recv, recv_displs[j], dtype), recv_counts[j] * dtype_bytes(dtype), j});
    d = defer_check(CollectiveKind::all_gather, label, dtype,
                    {{const_cast<void*>(send), send_count * dtype_bytes(dtype)}}, std::move(in));
  }
  const auto done =
      all_gather_call(send, send_count, recv, recv_counts, recv_displs, dtype, label, true);
  if (d) defer(std::move(*d));
  return pending_until(done);
}

PendingCollective Communicator::pending_until(std::chrono::steady_clock::time_point done) {
  PendingCollective p;
  p.owner_ = this;
  p.id_ = started_ - 1;
  p.done_at_ = done;
  p.pending_ = true;
  return p;
}

std::chrono::steady_clock::time_point Communicator::all_gather_call(
    const void* send, std::int64_t send_count, void* recv, const std::int64_t* recv_counts,
    const std::int64_t* recv_displs, DType dtype, const std::string& label, bool started) {
  const CollectiveKind kind = CollectiveKind::all_gather;
  return run(
      kind, label,
      [&](Traffic& moved) {
        const int P = size(), r = rank();
        const Checks c(kind, label, r, P);
        c.count(send_count, "send_count");
        c.counts(recv_counts, "recv_counts");
        c.same_own(send_count, "send_count", false, recv_counts[r], "recv_counts",
                   "a rank's own slot must hold exactly what it contributes");
        const auto in = Checks::blocks(recv, recv_displs, recv_counts, P, dtype, "recv block");
        c.disjoint(in);
        const Checks::Region own = in[r];
        c.apart(Checks::region(send, 0, send_count, dtype, "send"), in, &own,
                "an all_gather_v is in place only as send == recv + recv_displs[rank]");
        transport_all_gather(send, send_count, recv, recv_counts, recv_displs, dtype, label, moved);
        return all_gather_peer_bytes(send_count, recv_counts, P, r, dtype);
      },
      started);
}

void Communicator::reduce_scatter_v(const void* send, const std::int64_t* counts,
                                    const std::int64_t* displs, void* recv, DType dtype,
                                    const std::string& label) {
  reduce_scatter_call(send, counts, displs, recv, dtype, label, false);
}

PendingCollective Communicator::start_reduce_scatter_v(const void* send, const std::int64_t* counts,
                                                       const std::int64_t* displs, void* recv,
                                                       DType dtype, const std::string& label) {
  std::optional<DeferredCall> d;
  if (deferred_delivery_) {
    // In place, the own send block is recv: checked as that.
    const int r = rank();
    const bool in_place = send && recv && recv == at(send, displs[r], dtype);
    std::vector<DeferredBuffer> out;
    for (int j = 0; j < size() && send; ++j)
      if (!(in_place && j == r))
        out.push_back({const_cast<std::byte*>(at(send, displs[j], dtype)),
                       counts[j] * dtype_bytes(dtype), j});
    d = defer_check(CollectiveKind::reduce_scatter, label, dtype, std::move(out),
                    {{recv, counts[r] * dtype_bytes(dtype)}});
  }
  const auto done = reduce_scatter_call(send, counts, displs, recv, dtype, label, true);
  if (d) defer(std::move(*d));
  return pending_until(done);
}

std::chrono::steady_clock::time_point Communicator::reduce_scatter_call(
    const void* send, const std::int64_t* counts, const std::int64_t* displs, void* recv,
    DType dtype, const std::string& label, bool started) {
  const CollectiveKind kind = CollectiveKind::reduce_scatter;
  return run(
      kind, label,
      [&](Traffic& moved) {
        const int P = size(), r = rank();
        const Checks c(kind, label, r, P);
        c.counts(counts, "counts");
        const auto out = Checks::blocks(send, displs, counts, P, dtype, "send block");
        const Checks::Region own = out[r];
        c.apart(Checks::region(recv, 0, counts[r], dtype, "recv"), out, &own,
                "a reduce_scatter_v writes into send only as recv == send + displs[rank]");
        transport_reduce_scatter(send, counts, displs, recv, dtype, label, moved);
        return reduce_scatter_peer_bytes(counts, P, r, dtype);
      },
      started);
}

void Communicator::ring_shift(const void* send, std::int64_t send_count, void* recv,
                              std::int64_t recv_count, DType dtype, const std::string& label,
                              Ring ring) {
  ring_shift_call(send, send_count, recv, recv_count, dtype, label, ring, false);
}

PendingCollective Communicator::start_ring_shift(const void* send, std::int64_t send_count,
                                                 void* recv, std::int64_t recv_count, DType dtype,
                                                 const std::string& label, Ring ring) {
  std::optional<DeferredCall> d;
  if (deferred_delivery_)
    d = defer_check(CollectiveKind::ring_shift, label, dtype,
                    {{const_cast<void*>(send), send_count * dtype_bytes(dtype)}},
                    {{recv, recv_count * dtype_bytes(dtype)}});
  const auto done = ring_shift_call(send, send_count, recv, recv_count, dtype, label, ring, true);
  if (d) defer(std::move(*d));
  return pending_until(done);
}

std::chrono::steady_clock::time_point Communicator::ring_shift_call(
    const void* send, std::int64_t send_count, void* recv, std::int64_t recv_count, DType dtype,
    const std::string& label, Ring ring, bool started) {
  const CollectiveKind kind = CollectiveKind::ring_shift;
  return run(
      kind, label,
      [&](Traffic& moved) {
        const int P = size(), r = rank();
        const Checks c(kind, label, r, P);
        c.count(send_count, "send_count");
        c.count(recv_count, "recv_count");
        if (!ring.tiles(P))
          fail(call_name(kind, label), " on rank ", r, " of ", P, ": rings of ", ring.size,
               " ranks at stride ", ring.stride,
               " do not tile the group; pass a ring size and stride whose product divides ", P,
               " (size 0: one ring of every rank)");
        // In a ring of one the block comes back to its sender: the peer
        // check needs no peer, so it is made here, alike on every backend.
        if (ring.ranks(P) == 1 && recv_count != send_count)
          fail(peer_count_message(kind, label, r, P, r, r, recv_count, std::to_string(send_count)));
        c.apart(Checks::region(send, 0, send_count, dtype, "send"),
                {Checks::region(recv, 0, recv_count, dtype, "recv")}, nullptr,
                "a ring_shift cannot run in place, since the block arriving would overwrite the "
                "one leaving; use separate send and recv buffers");
        transport_ring_shift(send, send_count, recv, recv_count, dtype, ring, label, moved);
        return ring_shift_peer_bytes(send_count, recv_count, P, r, dtype, ring);
      },
      started, ring.span(size()));
}

void Communicator::all_reduce(void* buf, std::int64_t n, DType dtype, const std::string& label) {
  const CollectiveKind kind = CollectiveKind::all_reduce;
  run(kind, label, [&](Traffic& moved) {
    Checks(kind, label, rank(), size()).count(n, "n");
    transport_all_reduce(buf, n, dtype, label, moved);
    return all_reduce_peer_bytes(n, size(), rank(), dtype);
  });
}

void Communicator::barrier(const std::string& label) {
  run(CollectiveKind::barrier, label, [&](Traffic&) {
    transport_barrier(label);
    return std::vector<WireBytes>(static_cast<size_t>(size()));
  });
}

// ---------------------------------------------------------------- one rank

namespace {

// One rank: every collective is a copy of the own block (a ring_shift's
// block comes back to its sender); nothing moves between ranks, so nothing
// is measured.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Backend backend() const override { return Backend::self; }
  StagingRule staging_rule() const override { return StagingRule::none; }

 protected:
  void transport_all_to_all(const void* send, const std::int64_t* send_counts,
                            const std::int64_t* send_displs, void* recv, const std::int64_t*,
                            const std::int64_t* recv_displs, DType dtype, const std::string&,
                            Traffic&) override {
    copy_elems(recv ? at(recv, recv_displs[0], dtype) : nullptr,
               send ? at(send, send_displs[0], dtype) : nullptr, send_counts[0], dtype);
  }
  void transport_all_gather(const void* send, std::int64_t send_count, void* recv,
                            const std::int64_t*, const std::int64_t* recv_displs, DType dtype,
                            const std::string&, Traffic&) override {
    copy_elems(recv ? at(recv, recv_displs[0], dtype) : nullptr, send, send_count, dtype);
  }
  void transport_reduce_scatter(const void* send, const std::int64_t* counts,
                                const std::int64_t* displs, void* recv, DType dtype,
                                const std::string&, Traffic&) override {
    copy_elems(recv, send ? at(send, displs[0], dtype) : nullptr, counts[0], dtype);
  }
  void transport_all_reduce(void*, std::int64_t, DType, const std::string&, Traffic&) override {}
  void transport_barrier(const std::string&) override {}
  void transport_ring_shift(const void* send, std::int64_t send_count, void* recv, std::int64_t,
                            DType dtype, Ring, const std::string&, Traffic&) override {
    copy_elems(recv, send, send_count, dtype);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() {
  return std::make_unique<SelfCommunicator>();
}

}  // namespace laga
