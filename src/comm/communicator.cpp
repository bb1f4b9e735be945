#include "comm/communicator.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/collective_util.hpp"
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
  }
  return "?";
}

void Ledger::record(Phase phase, const std::string& label, std::int64_t sent,
                    std::int64_t received) {
  LAGA_CHECK(phase != Phase::count, "ledger: collective '", label,
             "' recorded under Phase::count, which only selects all phases in queries; set a real "
             "phase with set_phase()");
  const auto [it, first] = entries_.try_emplace({phase, label});
  if (first) order_.push_back(it->first);
  LedgerEntry& e = it->second;
  e.calls += 1;
  e.bytes_sent += sent;
  e.bytes_received += received;
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

WireBytes all_to_all_wire_bytes(const std::int64_t* send_counts, const std::int64_t* recv_counts,
                                int P, int r, DType dtype) {
  WireBytes w;
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    w.sent += send_counts[j];
    w.received += recv_counts[j];
  }
  w.sent *= dtype_bytes(dtype);
  w.received *= dtype_bytes(dtype);
  return w;
}

WireBytes all_gather_wire_bytes(std::int64_t send_count, const std::int64_t* recv_counts, int P,
                                int r, DType dtype) {
  WireBytes w;
  w.sent = (P - 1) * send_count * dtype_bytes(dtype);
  for (int j = 0; j < P; ++j)
    if (j != r) w.received += recv_counts[j];
  w.received *= dtype_bytes(dtype);
  return w;
}

WireBytes reduce_scatter_wire_bytes(const std::int64_t* counts, int P, int r, DType dtype) {
  WireBytes w;
  for (int j = 0; j < P; ++j)
    if (j != r) w.sent += counts[j];
  w.sent *= dtype_bytes(dtype);
  w.received = (P - 1) * counts[r] * dtype_bytes(dtype);
  return w;
}

WireBytes all_reduce_wire_bytes(std::int64_t n, int P, int r, DType dtype) {
  const std::int64_t own = all_reduce_chunk(n, P, r);
  // reduce-scatter: every chunk but the own one out, P-1 copies of it in;
  // all-gather: the reduced own chunk to P-1 peers, every other chunk in.
  const std::int64_t elems = (n - own) + (P - 1) * own;
  return {elems * dtype_bytes(dtype), elems * dtype_bytes(dtype)};
}

namespace comm_detail {

namespace {
template <class T>
void sum_in_rank_order_t(T* dst, const T* const* srcs, int P, std::int64_t n) {
  // A block-sized accumulator keeps dst == srcs[j] safe (every source element
  // is read before its dst element is written) and stays in L1.
  constexpr std::int64_t kBlock = 1024;
  T acc[kBlock];
  for (std::int64_t base = 0; base < n; base += kBlock) {
    const std::int64_t m = std::min(kBlock, n - base);
    const T* s0 = srcs[0] + base;
    for (std::int64_t i = 0; i < m; ++i) acc[i] = s0[i];
    for (int j = 1; j < P; ++j) {
      const T* sj = srcs[j] + base;
      for (std::int64_t i = 0; i < m; ++i) acc[i] += sj[i];
    }
    std::memcpy(dst + base, acc, static_cast<std::size_t>(m) * sizeof(T));
  }
}
}  // namespace

void sum_in_rank_order(void* dst, const void* const* srcs, int P, std::int64_t n, DType dtype) {
  if (n == 0) return;
  if (dtype == DType::f32) {
    std::vector<const float*> typed(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) typed[j] = static_cast<const float*>(srcs[j]);
    sum_in_rank_order_t(static_cast<float*>(dst), typed.data(), P, n);
  } else {
    std::vector<const double*> typed(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) typed[j] = static_cast<const double*>(srcs[j]);
    sum_in_rank_order_t(static_cast<double*>(dst), typed.data(), P, n);
  }
}

Staging::Staging(DType dtype, std::int64_t n) {
  if (dtype == DType::f32)
    f32_ = TensorF({n}, MemCategory::comm_buffers);
  else
    f64_ = TensorD({n}, MemCategory::comm_buffers);
}

void copy_elems(void* dst, const void* src, std::int64_t n, DType t) {
  if (n == 0 || dst == nullptr || src == nullptr || dst == src) return;
  std::memmove(dst, src, static_cast<std::size_t>(n * dtype_bytes(t)));
}

const char* to_string(DType t) {
  return t == DType::f32 ? "f32" : "f64";
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

void check_counts(const std::int64_t* counts, int P, const char* what, CollectiveKind kind,
                  const std::string& label) {
  for (int j = 0; j < P; ++j)
    LAGA_CHECK(counts[j] >= 0, call_name(kind, label), ": ", what, "[", j, "] = ", counts[j],
               " is negative; counts are element counts >= 0");
}

}  // namespace comm_detail

namespace {

using namespace comm_detail;

// One rank: every collective is a copy of the own block.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }

  void all_to_all_v(const void* send, const std::int64_t* send_counts,
                    const std::int64_t* send_displs, void* recv, const std::int64_t* recv_counts,
                    const std::int64_t* recv_displs, DType dtype,
                    const std::string& label) override {
    check_counts(send_counts, 1, "send_counts", CollectiveKind::all_to_all, label);
    LAGA_CHECK(send_counts[0] == recv_counts[0], call_name(CollectiveKind::all_to_all, label),
               " on a 1-rank communicator: send_counts[0] = ", send_counts[0],
               " but recv_counts[0] = ", recv_counts[0], "; they must be equal");
    copy_elems(recv ? at(recv, recv_displs[0], dtype) : nullptr,
               send ? at(send, send_displs[0], dtype) : nullptr, send_counts[0], dtype);
    ledger_.record(phase_, label, 0, 0);
  }

  void all_gather_v(const void* send, std::int64_t send_count, void* recv,
                    const std::int64_t* recv_counts, const std::int64_t* recv_displs, DType dtype,
                    const std::string& label) override {
    LAGA_CHECK(send_count >= 0 && send_count == recv_counts[0],
               call_name(CollectiveKind::all_gather, label),
               " on a 1-rank communicator: send_count = ", send_count,
               " but recv_counts[0] = ", recv_counts[0], "; they must be equal");
    copy_elems(recv ? at(recv, recv_displs[0], dtype) : nullptr, send, send_count, dtype);
    ledger_.record(phase_, label, 0, 0);
  }

  void reduce_scatter_v(const void* send, const std::int64_t* counts, const std::int64_t* displs,
                        void* recv, DType dtype, const std::string& label) override {
    check_counts(counts, 1, "counts", CollectiveKind::reduce_scatter, label);
    copy_elems(recv, send ? at(send, displs[0], dtype) : nullptr, counts[0], dtype);
    ledger_.record(phase_, label, 0, 0);
  }

  void all_reduce(void*, std::int64_t n, DType, const std::string& label) override {
    LAGA_CHECK(n >= 0, call_name(CollectiveKind::all_reduce, label), ": n = ", n, " is negative");
    ledger_.record(phase_, label, 0, 0);
  }

  void barrier(const std::string& label) override { ledger_.record(phase_, label, 0, 0); }
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() {
  return std::make_unique<SelfCommunicator>();
}

}  // namespace laga
