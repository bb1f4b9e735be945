#include "comm/mpi_comm.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "comm/collective_util.hpp"
#include "core/error.hpp"

namespace laga {

using namespace comm_detail;
using Clock = std::chrono::steady_clock;

namespace {

std::atomic<std::int64_t> g_orphaned_requests{0};

// A failed rank tells its peers why (see MpiCommunicator::notify_peers). The
// texts live for the whole process: the sends are freed, not waited for, so
// MPI may still read them at any time before MPI_Finalize.
constexpr int kNoticeKind = 7;                // tag kind bits no collective uses
constexpr std::size_t kMaxNoticeBytes = 480;  // well under OpenMPI's eager limit
std::mutex g_notice_mutex;
std::deque<std::string> g_notices;

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return cat("MPI error ", code);
  return std::string(text, static_cast<size_t>(len));
}

void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) fail(what, " failed: ", mpi_error_string(rc));
}

std::uint32_t label_hash(const std::string& label) {
  std::uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char ch : label) h = (h ^ ch) * 16777619u;
  return h;
}

// Polling cadence: spin while messages are likely in flight, then yield, then
// sleep a little so that 8 oversubscribed ranks on 2 cores still make progress
// (each MPI_Test* call also drives OpenMPI's progress engine, so the sleep is
// kept short).
void back_off(long polls) {
  if (polls < 64) return;
  if (polls < 1024) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(polls < 4096 ? 20 : 100));
}

bool mpi_is_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

}  // namespace

std::int64_t mpi_orphaned_requests() {
  return g_orphaned_requests.load();
}

// ---------------------------------------------------------------- session

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &thread_level_),
              "MPI_Init_thread");
    owns_ = true;
  } else {
    MPI_Query_thread(&thread_level_);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
}

MpiSession::~MpiSession() {
  if (!owns_ || !mpi_is_running()) return;
  if (const std::int64_t orphans = mpi_orphaned_requests(); orphans > 0) {
    abort(cat(orphans, " message(s) of timed-out collectives are still pending on rank ",
              world_rank_, " and MPI_Finalize could wait for them forever"),
          3);
  }
  MPI_Finalize();
}

void MpiSession::abort(const std::string& why, int code) {
  std::fprintf(stderr, "laga: aborting the MPI job: %s\n", why.c_str());
  std::fflush(stderr);
  if (mpi_is_running()) MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

bool launched_under_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"})
    if (std::getenv(var)) return true;
  return false;
}

// ---------------------------------------------------------------- one round

// One round of point-to-point messages of one collective, all under one tag:
// post sends and receives, then wait() until all completed or the deadline.
// Any failure cancels what it can, hands the rest to the communicator as
// orphans and marks it broken, then throws.
class MpiCommunicator::Round {
 public:
  Round(MpiCommunicator& c, CollectiveKind kind, DType dtype, const std::string& label,
        Clock::time_point deadline)
      : c_(c),
        kind_(kind),
        dtype_(dtype),
        label_(label),
        tag_(c.tag(c.rounds_++, kind, dtype, label)),
        deadline_(deadline) {}

  ~Round() {
    // Only reached with requests pending when posting threw half way.
    if (std::any_of(reqs_.begin(), reqs_.end(),
                    [](MPI_Request r) { return r != MPI_REQUEST_NULL; }))
      abandon();
  }
  Round(const Round&) = delete;
  Round& operator=(const Round&) = delete;

  // A null buffer (count-only) sends or expects an empty message.
  void send(int peer, const void* buf, std::int64_t bytes) {
    post(peer, const_cast<void*>(buf), buf ? bytes : 0, false);
  }
  void recv(int peer, void* buf, std::int64_t bytes) { post(peer, buf, buf ? bytes : 0, true); }

  void wait() {
    const int n = static_cast<int>(reqs_.size());
    std::vector<int> done_idx(static_cast<size_t>(n));
    std::vector<MPI_Status> statuses(static_cast<size_t>(n));
    int remaining = n;
    long polls = 0;
    while (remaining > 0) {
      int done = 0;
      const int rc = MPI_Testsome(n, reqs_.data(), &done, done_idx.data(), statuses.data());
      if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS)
        fail_round(cat(where(), ": MPI_Testsome failed: ", mpi_error_string(rc)));
      if (done == MPI_UNDEFINED) break;
      for (int k = 0; k < done; ++k) {
        const int i = done_idx[k];
        const MPI_Status& st = statuses[k];
        if (rc == MPI_ERR_IN_STATUS && st.MPI_ERROR != MPI_SUCCESS) {
          int eclass = 0;
          MPI_Error_class(st.MPI_ERROR, &eclass);
          if (is_recv_[i] && eclass == MPI_ERR_TRUNCATE) {
            fail_round(size_mismatch(i, "more than"));
          }
          fail_round(cat(where(), ": ", is_recv_[i] ? "receive from" : "send to", " rank ",
                         peer_[i], " failed: ", mpi_error_string(st.MPI_ERROR)));
        }
        if (is_recv_[i]) {
          int got = 0;
          MPI_Get_count(&st, MPI_BYTE, &got);
          if (got != bytes_[i]) fail_round(size_mismatch(i, cat(got, " bytes instead of")));
        }
      }
      remaining -= done;
      if (done > 0) {
        polls = 0;
        continue;
      }
      ++polls;
      if (polls % 16 == 0) probe_for_mismatch();
      if (Clock::now() >= deadline_) time_out();
      back_off(polls);
    }
    reqs_.clear();
  }

 private:
  void post(int peer, void* buf, std::int64_t bytes, bool is_recv) {
    static std::byte empty[1];
    std::byte* p = buf ? static_cast<std::byte*>(buf) : empty;
    // One message per peer, unless it exceeds the piece limit: pieces of one
    // (peer, tag) arrive in order, so both ends split them identically.
    std::int64_t offset = 0;
    do {
      const std::int64_t piece = std::min(bytes - offset, c_.max_message_bytes_);
      MPI_Request req = MPI_REQUEST_NULL;
      const int count = static_cast<int>(piece);
      const int rc = is_recv ? MPI_Irecv(p + offset, count, MPI_BYTE, peer, tag_, c_.comm_, &req)
                             : MPI_Isend(p + offset, count, MPI_BYTE, peer, tag_, c_.comm_, &req);
      if (rc != MPI_SUCCESS)
        fail_round(cat(where(), ": ", is_recv ? "MPI_Irecv from" : "MPI_Isend to", " rank ", peer,
                       " failed: ", mpi_error_string(rc)));
      reqs_.push_back(req);
      peer_.push_back(peer);
      is_recv_.push_back(is_recv);
      bytes_.push_back(piece);
      offset += piece;
    } while (offset < bytes);
  }

  std::string where() const {
    return cat(call_name(kind_, label_), " on rank ", c_.rank_, " of ", c_.size_);
  }

  std::string size_mismatch(int i, const std::string& got) const {
    return cat(where(), ": rank ", peer_[i], " sent ", got, " the ", bytes_[i],
               " bytes this rank expects (", bytes_[i] / dtype_bytes(dtype_), " ",
               to_string(dtype_),
               " elements); receive counts must equal what each peer sends (same counts on every "
               "rank for reductions, recv_counts[j] == rank j's send_count for gathers), and "
               "count-only must be on for all ranks or none");
  }

  // A peer whose next message to us has our round number but another
  // collective, dtype or label is in a different collective: say so now
  // rather than time out. A message of a later round is no evidence: the
  // probe drives progress, so the peer's message for this round may have just
  // completed our receive and its next one be queued behind it, before
  // MPI_Testsome reported the completion. A failure notice always stops us.
  void probe_for_mismatch() {
    std::vector<int> peers = pending_peers(true);
    for (int peer : peers) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(peer, MPI_ANY_TAG, c_.comm_, &flag, &st) != MPI_SUCCESS || !flag) continue;
      if (st.MPI_TAG == tag_) continue;
      if (((st.MPI_TAG >> (1 + c_.hash_bits_)) & 7) == kNoticeKind) {
        int len = 0;
        MPI_Get_count(&st, MPI_CHAR, &len);
        std::string text(static_cast<size_t>(std::max(len, 0)), '\0');
        MPI_Recv(text.data(), len, MPI_CHAR, peer, st.MPI_TAG, c_.comm_, MPI_STATUS_IGNORE);
        fail_round(cat(where(), " stopped: rank ", peer, " failed (", text, ")"));
      }
      if (c_.round_of(st.MPI_TAG) != c_.round_of(tag_)) continue;
      fail_round(cat("collective mismatch seen on rank ", c_.rank_, " of ", c_.size_,
                     ": this rank is in ", call_name(kind_, label_), " (", to_string(dtype_),
                     ", its collective #", c_.calls_, ") but rank ", peer, " sent it a message of ",
                     c_.describe_tag(st.MPI_TAG, tag_),
                     "; every rank must run the same sequence of collectives with the same labels "
                     "and dtypes"));
    }
  }

  std::vector<int> pending_peers(bool receives) const {
    std::vector<int> peers;
    for (size_t i = 0; i < reqs_.size(); ++i)
      if (reqs_[i] != MPI_REQUEST_NULL && static_cast<bool>(is_recv_[i]) == receives)
        peers.push_back(peer_[i]);
    std::sort(peers.begin(), peers.end());
    peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
    return peers;
  }

  [[noreturn]] void time_out() {
    std::vector<int> missing = pending_peers(true);
    if (missing.empty()) missing = pending_peers(false);
    fail_round(timeout_message(kind_, label_, c_.rank_, c_.size_, c_.timeout(), missing));
  }

  // `message` is complete (names the call, the rank and what to do).
  [[noreturn]] void fail_round(const std::string& message) {
    abandon();
    throw Error(message);
  }

  // Cancels pending receives and gives every pending request a short while to
  // finish; whatever is left is orphaned. (The caller, collective(), then
  // marks the communicator broken and tells the peers.)
  void abandon() {
    for (size_t i = 0; i < reqs_.size(); ++i)
      if (reqs_[i] != MPI_REQUEST_NULL && is_recv_[i]) MPI_Cancel(&reqs_[i]);
    const auto grace = Clock::now() + std::chrono::milliseconds(200);
    long polls = 0;
    for (;;) {
      bool pending = false;
      for (MPI_Request& r : reqs_) {
        if (r == MPI_REQUEST_NULL) continue;
        int flag = 0;
        MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
        pending = pending || !flag;
      }
      if (!pending || Clock::now() >= grace) break;
      back_off(++polls);
    }
    for (MPI_Request r : reqs_) {
      if (r == MPI_REQUEST_NULL) continue;
      c_.orphans_.push_back(r);
      g_orphaned_requests.fetch_add(1);
    }
    reqs_.clear();
  }

  MpiCommunicator& c_;
  CollectiveKind kind_;
  DType dtype_;
  const std::string& label_;
  int tag_;
  Clock::time_point deadline_;
  std::vector<MPI_Request> reqs_;
  std::vector<int> peer_;
  std::vector<char> is_recv_;
  std::vector<std::int64_t> bytes_;
};

// ---------------------------------------------------------------- communicator

MpiCommunicator::MpiCommunicator(MPI_Comm base, std::chrono::milliseconds create_timeout) {
  LAGA_CHECK(mpi_is_running(),
             "make_mpi_communicator: MPI is not initialised (or already finalised); create a "
             "laga::MpiSession at the top of main and launch with mpirun");
  // Idup rather than Comm_dup: a rank that never calls it must not hang us.
  MPI_Request req = MPI_REQUEST_NULL;
  mpi_check(MPI_Comm_idup(base, &comm_, &req), "MPI_Comm_idup");
  const auto deadline = Clock::now() + create_timeout;
  long polls = 0;
  for (int flag = 0;;) {
    mpi_check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test (communicator creation)");
    if (flag) break;
    if (Clock::now() >= deadline) {
      g_orphaned_requests.fetch_add(1);
      fail("make_mpi_communicator timed out after ", create_timeout.count(),
           " ms: not every rank of the base communicator called it; every rank must create "
           "its communicators in the same order");
    }
    back_off(++polls);
  }
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);

  // Tag layout, low to high: label hash, dtype (1 bit), kind (3 bits), round
  // number. MPI only promises tags up to 32767; OpenMPI gives 2^31 - 1.
  int* tag_ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &flag);
  const std::int64_t ub = flag && tag_ub ? *tag_ub : 32767;
  int bits = 0;
  while (bits < 62 && ((std::int64_t{1} << (bits + 1)) - 1) <= ub) ++bits;
  LAGA_CHECK(bits >= 10, "MPI_TAG_UB = ", ub, " is too small for laga's message tags");
  seq_bits_ = std::min(16, bits - 4);
  hash_bits_ = std::min(11, bits - 4 - seq_bits_);
}

MpiCommunicator::~MpiCommunicator() {
  // A broken communicator is never freed: messages of its failed collective
  // (and failure notices) may still be in flight, and a new communicator that
  // reused its context id would receive them as its own. Keeping it costs one
  // handle until MPI_Finalize.
  if (comm_ != MPI_COMM_NULL && broken_.empty() && mpi_is_running()) MPI_Comm_free(&comm_);
}

void MpiCommunicator::set_max_message_bytes(std::int64_t bytes) {
  LAGA_CHECK(bytes >= 1 && bytes <= (std::int64_t{1} << 30), "max_message_bytes = ", bytes,
             "; must be in [1, 2^30] (MPI counts are int)");
  max_message_bytes_ = bytes;
}

int MpiCommunicator::tag(std::int64_t round, CollectiveKind kind, DType dtype,
                         const std::string& label) const {
  const std::int64_t seq = round & ((std::int64_t{1} << seq_bits_) - 1);
  const std::int64_t hash = label_hash(label) & ((std::uint32_t{1} << hash_bits_) - 1);
  return static_cast<int>((seq << (4 + hash_bits_)) | (std::int64_t(kind) << (1 + hash_bits_)) |
                          (std::int64_t(dtype == DType::f64) << hash_bits_) | hash);
}

long MpiCommunicator::round_of(int t) const {
  return static_cast<long>(t) >> (4 + hash_bits_);
}

std::string MpiCommunicator::describe_tag(int t, int own) const {
  struct Fields {
    int hash, kind;
    bool f64;
  };
  auto decode = [&](int x) {
    return Fields{x & ((1 << hash_bits_) - 1), (x >> (1 + hash_bits_)) & 7,
                  static_cast<bool>((x >> hash_bits_) & 1)};
  };
  const Fields f = decode(t), mine = decode(own);
  if (f.kind == kNoticeKind) return "a failure notice";
  std::string s = cat(f.kind <= int(CollectiveKind::barrier) ? to_string(CollectiveKind(f.kind))
                                                             : "an unknown collective",
                      " (", f.f64 ? "f64" : "f32", ")");
  if (f.hash != mine.hash) s += " with a different label";
  return s;
}

void MpiCommunicator::check_usable(CollectiveKind kind, const std::string& label) const {
  if (!broken_.empty()) {
    fail(call_name(kind, label), " on rank ", rank_, " of ", size_,
         ": this communicator failed in an earlier collective (", broken_,
         "); the ranks are out of step — make a new communicator or end the job");
  }
}

template <class Body>
void MpiCommunicator::collective(CollectiveKind kind, const std::string& label, Body&& body) {
  check_usable(kind, label);
  try {
    body(Clock::now() + timeout());
  } catch (const std::exception& e) {
    if (broken_.empty()) {
      broken_ = e.what();
      notify_peers(broken_);
    }
    throw;
  }
  ++calls_;
}

void MpiCommunicator::notify_peers(const std::string& why) {
  // A peer still waiting for this rank in this or a later collective finds
  // the notice when it probes for mismatches and stops at once with `why`,
  // instead of timing out. Nobody is obliged to receive it.
  const int notice_tag =
      static_cast<int>(((rounds_ & ((std::int64_t{1} << seq_bits_) - 1)) << (4 + hash_bits_)) |
                       (std::int64_t{kNoticeKind} << (1 + hash_bits_)));
  const char* text = nullptr;
  {
    std::lock_guard lock(g_notice_mutex);
    text = g_notices.emplace_back(why.substr(0, kMaxNoticeBytes)).c_str();
  }
  const int len = static_cast<int>(std::strlen(text));
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(text, len, MPI_CHAR, j, notice_tag, comm_, &req) == MPI_SUCCESS)
      MPI_Request_free(&req);
  }
}

void MpiCommunicator::all_to_all_v(const void* send, const std::int64_t* send_counts,
                                   const std::int64_t* send_displs, void* recv,
                                   const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                                   DType dtype, const std::string& label) {
  const CollectiveKind kind = CollectiveKind::all_to_all;
  collective(kind, label, [&](Clock::time_point deadline) {
    check_counts(send_counts, size_, "send_counts", kind, label);
    check_counts(recv_counts, size_, "recv_counts", kind, label);
    const std::int64_t elem = dtype_bytes(dtype);
    Round round(*this, kind, dtype, label, deadline);
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      round.recv(j, recv ? at(recv, recv_displs[j], dtype) : nullptr, recv_counts[j] * elem);
    }
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      round.send(j, send ? at(send, send_displs[j], dtype) : nullptr, send_counts[j] * elem);
    }
    round.wait();
    // Checked after the exchange so the peers still complete this call.
    LAGA_CHECK(send_counts[rank_] == recv_counts[rank_], call_name(kind, label), " on rank ", rank_,
               ": send_counts[", rank_, "] = ", send_counts[rank_], " but recv_counts[", rank_,
               "] = ", recv_counts[rank_], "; the block a rank keeps must match");
    copy_elems(recv ? at(recv, recv_displs[rank_], dtype) : nullptr,
               send ? at(send, send_displs[rank_], dtype) : nullptr, send_counts[rank_], dtype);
    const WireBytes w = all_to_all_wire_bytes(send_counts, recv_counts, size_, rank_, dtype);
    ledger_.record(phase_, label, w.sent, w.received);
  });
}

void MpiCommunicator::all_gather_v(const void* send, std::int64_t send_count, void* recv,
                                   const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                                   DType dtype, const std::string& label) {
  const CollectiveKind kind = CollectiveKind::all_gather;
  collective(kind, label, [&](Clock::time_point deadline) {
    LAGA_CHECK(send_count >= 0, call_name(kind, label), ": send_count = ", send_count,
               " is negative");
    check_counts(recv_counts, size_, "recv_counts", kind, label);
    const std::int64_t elem = dtype_bytes(dtype);
    Round round(*this, kind, dtype, label, deadline);
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      round.recv(j, recv ? at(recv, recv_displs[j], dtype) : nullptr, recv_counts[j] * elem);
    }
    for (int j = 0; j < size_; ++j)
      if (j != rank_) round.send(j, send, send_count * elem);
    round.wait();
    LAGA_CHECK(send_count == recv_counts[rank_], call_name(kind, label), " on rank ", rank_,
               ": send_count = ", send_count, " but recv_counts[", rank_,
               "] = ", recv_counts[rank_], "; they must be equal");
    copy_elems(recv ? at(recv, recv_displs[rank_], dtype) : nullptr, send, send_count, dtype);
    const WireBytes w = all_gather_wire_bytes(send_count, recv_counts, size_, rank_, dtype);
    ledger_.record(phase_, label, w.sent, w.received);
  });
}

void MpiCommunicator::reduce_scatter_v(const void* send, const std::int64_t* counts,
                                       const std::int64_t* displs, void* recv, DType dtype,
                                       const std::string& label) {
  const CollectiveKind kind = CollectiveKind::reduce_scatter;
  collective(kind, label, [&](Clock::time_point deadline) {
    check_counts(counts, size_, "counts", kind, label);
    const std::int64_t elem = dtype_bytes(dtype);
    const std::int64_t own = counts[rank_];
    // Peer j's contribution to the own block lands in slot j (j < rank) or
    // j - 1 (j > rank).
    Staging staging(dtype, (size_ - 1) * own);
    auto slot = [&](int j) -> void* {
      return staging.data() ? at(staging.data(), (j < rank_ ? j : j - 1) * own, dtype) : nullptr;
    };
    Round round(*this, kind, dtype, label, deadline);
    for (int j = 0; j < size_; ++j)
      if (j != rank_) round.recv(j, slot(j), own * elem);
    for (int j = 0; j < size_; ++j)
      if (j != rank_) round.send(j, send ? at(send, displs[j], dtype) : nullptr, counts[j] * elem);
    round.wait();
    if (recv && own > 0) {
      std::vector<const void*> srcs(static_cast<size_t>(size_));
      for (int j = 0; j < size_; ++j)
        srcs[j] = j == rank_ ? at(send, displs[rank_], dtype) : slot(j);
      sum_in_rank_order(recv, srcs.data(), size_, own, dtype);
    }
    const WireBytes w = reduce_scatter_wire_bytes(counts, size_, rank_, dtype);
    ledger_.record(phase_, label, w.sent, w.received);
  });
}

void MpiCommunicator::all_reduce(void* buf, std::int64_t n, DType dtype, const std::string& label) {
  const CollectiveKind kind = CollectiveKind::all_reduce;
  collective(kind, label, [&](Clock::time_point deadline) {
    LAGA_CHECK(n >= 0, call_name(kind, label), ": n = ", n, " is negative");
    const int P = size_;
    const std::int64_t elem = dtype_bytes(dtype);
    std::vector<std::int64_t> offset(static_cast<size_t>(P) + 1, 0);
    for (int j = 0; j < P; ++j) offset[j + 1] = offset[j] + all_reduce_chunk(n, P, j);
    const std::int64_t own = offset[rank_ + 1] - offset[rank_];
    auto chunk = [&](int j) -> void* { return buf ? at(buf, offset[j], dtype) : nullptr; };

    Staging staging(dtype, (P - 1) * own);
    auto slot = [&](int j) -> void* {
      return staging.data() ? at(staging.data(), (j < rank_ ? j : j - 1) * own, dtype) : nullptr;
    };
    {
      Round scatter(*this, kind, dtype, label, deadline);
      for (int j = 0; j < P; ++j)
        if (j != rank_) scatter.recv(j, slot(j), own * elem);
      for (int j = 0; j < P; ++j)
        if (j != rank_) scatter.send(j, chunk(j), (offset[j + 1] - offset[j]) * elem);
      scatter.wait();
    }
    if (buf && own > 0) {
      std::vector<const void*> srcs(static_cast<size_t>(P));
      for (int j = 0; j < P; ++j) srcs[j] = j == rank_ ? chunk(rank_) : slot(j);
      sum_in_rank_order(chunk(rank_), srcs.data(), P, own, dtype);
    }
    {
      Round gather(*this, kind, dtype, label, deadline);
      for (int j = 0; j < P; ++j)
        if (j != rank_) gather.recv(j, chunk(j), (offset[j + 1] - offset[j]) * elem);
      for (int j = 0; j < P; ++j)
        if (j != rank_) gather.send(j, chunk(rank_), own * elem);
      gather.wait();
    }
    const WireBytes w = all_reduce_wire_bytes(n, P, rank_, dtype);
    ledger_.record(phase_, label, w.sent, w.received);
  });
}

void MpiCommunicator::barrier(const std::string& label) {
  const CollectiveKind kind = CollectiveKind::barrier;
  collective(kind, label, [&](Clock::time_point deadline) {
    Round round(*this, kind, DType::f32, label, deadline);
    for (int j = 0; j < size_; ++j)
      if (j != rank_) round.recv(j, nullptr, 0);
    for (int j = 0; j < size_; ++j)
      if (j != rank_) round.send(j, nullptr, 0);
    round.wait();
    ledger_.record(phase_, label, 0, 0);
  });
}

std::unique_ptr<Communicator> make_mpi_communicator() {
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm base) {
  return std::make_unique<MpiCommunicator>(base);
}

}  // namespace laga
