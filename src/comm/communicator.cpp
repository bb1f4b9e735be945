// The Communicator interface's names and error wording, the base class --
// each collective's checks, its transport and ledger record through run(),
// the link model's hold, the started calls and their wait -- and the
// one-rank self communicator. Its ledger and byte rules are in ledger.cpp,
// the reductions' sum in reduction.cpp, deferred delivery (a test mode) in
// deferred_delivery.cpp.
#include "comm/communicator.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/collective_util.hpp"
#include "comm/link_model.hpp"
#include "core/error.hpp"

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

namespace {
// A collective's words, one row a kind: its name (to_string) and the rule a
// peer's count that disagrees breaks (comm_detail::peer_count_message).
struct KindWords {
  const char* name;
  const char* peer_rule;
};
KindWords words_of(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_to_all:
      return {"all_to_all", "recv_counts on each rank must equal what its peers send to it"};
    case CollectiveKind::all_gather:
      return {"all_gather", "recv_counts[j] must equal rank j's send_count on every rank"};
    case CollectiveKind::reduce_scatter:
      return {"reduce_scatter", "every rank must pass the same counts"};
    case CollectiveKind::all_reduce:
      return {"all_reduce", "every rank must pass the same n"};
    case CollectiveKind::barrier:
      return {"barrier", "a barrier moves no data"};
    case CollectiveKind::ring_shift:
      return {"ring_shift",
              "each rank's recv_count must equal the send_count of the rank it receives from"};
  }
  return {"?", ""};
}
}  // namespace

const char* to_string(CollectiveKind k) {
  return words_of(k).name;
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

namespace comm_detail {

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
  return cat(call_name(kind, label), " on rank ", rank, " of ", P, ": rank ", receiver, " expects ",
             expected, " elements from rank ", sender, " but rank ", sender, " sends it ", sent,
             "; ", words_of(kind).peer_rule,
             ", and count-only must be on for all ranks of a call or for none");
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

  // "<collective> '<label>' on rank r of P", the start of every message.
  std::string where() const {
    return cat(call_name(kind_, label_), " on rank ", rank_, " of ", P_);
  }

 private:
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
    // body checks the arguments (with `checks`, worded for this call), runs
    // the transport and returns the derived bytes per peer.
    const Checks checks(kind, label, rank(), size());
    const std::vector<WireBytes> derived = body(moved, checks);
    const WireBytes d = sum_of(derived), m = moved.total();
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
  run(CollectiveKind::all_to_all, label, [&](Traffic& moved, const Checks& c) {
    const int P = size(), r = rank();
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
  return pending_until(
      all_gather_call(send, send_count, recv, recv_counts, recv_displs, dtype, label, true),
      std::move(d));
}

PendingCollective Communicator::pending_until(std::chrono::steady_clock::time_point done,
                                              std::optional<DeferredCall> deferred) {
  if (deferred) defer(std::move(*deferred));
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
  return run(
      CollectiveKind::all_gather, label,
      [&](Traffic& moved, const Checks& c) {
        const int P = size(), r = rank();
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
  return pending_until(reduce_scatter_call(send, counts, displs, recv, dtype, label, true),
                       std::move(d));
}

std::chrono::steady_clock::time_point Communicator::reduce_scatter_call(
    const void* send, const std::int64_t* counts, const std::int64_t* displs, void* recv,
    DType dtype, const std::string& label, bool started) {
  return run(
      CollectiveKind::reduce_scatter, label,
      [&](Traffic& moved, const Checks& c) {
        const int P = size(), r = rank();
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
  return pending_until(
      ring_shift_call(send, send_count, recv, recv_count, dtype, label, ring, true), std::move(d));
}

std::chrono::steady_clock::time_point Communicator::ring_shift_call(
    const void* send, std::int64_t send_count, void* recv, std::int64_t recv_count, DType dtype,
    const std::string& label, Ring ring, bool started) {
  const CollectiveKind kind = CollectiveKind::ring_shift;
  return run(
      kind, label,
      [&](Traffic& moved, const Checks& c) {
        const int P = size(), r = rank();
        c.count(send_count, "send_count");
        c.count(recv_count, "recv_count");
        if (!ring.tiles(P))
          fail(c.where(), ": rings of ", ring.size, " ranks at stride ", ring.stride,
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
  run(CollectiveKind::all_reduce, label, [&](Traffic& moved, const Checks& c) {
    c.count(n, "n");
    transport_all_reduce(buf, n, dtype, label, moved);
    return all_reduce_peer_bytes(n, size(), rank(), dtype);
  });
}

void Communicator::barrier(const std::string& label) {
  run(CollectiveKind::barrier, label, [&](Traffic&, const Checks&) {
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
