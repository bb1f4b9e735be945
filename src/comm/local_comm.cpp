#include "comm/local_comm.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "comm/collective_util.hpp"
#include "core/error.hpp"
#include "core/precision.hpp"
#include "core/threads.hpp"

namespace laga {

using namespace comm_detail;
using Clock = std::chrono::steady_clock;

namespace {

// What one rank brings to one rendezvous. Counts are copied, not pointed to:
// peers validate them after the rendezvous, when a rank that failed the
// validation may already be unwinding and freeing its arrays. Buffer pointers
// are only dereferenced once validation has passed on every rank.
struct Post {
  std::int64_t call = 0;  // position in the rank's sequence of collectives
  int stage = 0;          // rendezvous index within the collective
  CollectiveKind kind = CollectiveKind::barrier;
  DType dtype = DType::f32;
  std::string label;
  const void* send = nullptr;
  void* recv = nullptr;
  std::vector<std::int64_t> counts_a, displs_a, counts_b;
  std::int64_t n = 0;
  Ring ring;  // ring_shift only
  const void* staging = nullptr;
  // Bytes this rank copied out of each rank's memory in the collective's
  // earlier stages: its measured receives, and its peers' measured sends.
  std::vector<std::int64_t> pulled;
  // Whether this rank's buffers with a non-zero count are all null (count-only)
  // / all non-null; both false when it moves nothing at all.
  bool any_unbacked = false;
  bool any_backed = false;
};

void note_buffer(Post& p, const void* ptr, std::int64_t count) {
  if (count <= 0) return;
  (ptr ? p.any_backed : p.any_unbacked) = true;
}

}  // namespace

class LocalGroup {
 public:
  LocalGroup(int P, DeviceMemory* device) : ranks_(static_cast<size_t>(P)), device_(device) {}
  int size() const { return static_cast<int>(ranks_.size()); }
  // The device the ranks' buffers are on (null: host memory).
  DeviceMemory* device() const { return device_; }

  // Arrives at rank's next rendezvous with `post` and waits for all P ranks.
  // Returns every rank's post for this rendezvous (when want_posts).
  //
  // At the first rendezvous of a collective (deadline set) the wait stops
  // early when a missing peer failed or finished, and at the deadline; the
  // rank then retracts its arrival and marks itself failed under the lock, so
  // a peer arriving just after can never read buffers this rank is about to
  // free. Later rendezvous of the same collective wait without a deadline:
  // between the first and the last rendezvous no rank can throw, so every
  // rank that passed the first reaches them, and leaving early would free
  // buffers that slower peers are still copying from.
  std::vector<Post> arrive(int rank, Post post, std::optional<Clock::time_point> deadline,
                           std::chrono::milliseconds timeout, bool want_posts) {
    std::unique_lock lock(m_);
    RankState& me = ranks_[rank];
    const std::int64_t step = ++me.step;
    me.posts[step % 2] = std::move(post);
    const Post& mine = me.posts[step % 2];
    if (std::all_of(ranks_.begin(), ranks_.end(),
                    [&](const RankState& s) { return s.step >= step; }))
      completed_ = std::max(completed_, step);
    cv_.notify_all();

    auto missing_peer_gone = [&] {
      for (const RankState& s : ranks_)
        if (s.step < step && (s.failed || s.finished)) return true;
      return false;
    };
    if (deadline)
      cv_.wait_until(lock, *deadline, [&] { return completed_ >= step || missing_peer_gone(); });
    else
      cv_.wait(lock, [&] { return completed_ >= step; });
    if (completed_ < step) {
      std::vector<int> missing, failed, finished;
      for (int j = 0; j < size(); ++j) {
        const RankState& s = ranks_[j];
        if (s.step >= step) continue;
        if (s.failed)
          failed.push_back(j);
        else if (s.finished)
          finished.push_back(j);
        else
          missing.push_back(j);
      }
      std::string why;
      if (failed.empty() && finished.empty()) {
        why = timeout_message(mine.kind, mine.label, rank, size(), timeout, missing);
      } else {
        why =
            cat(call_name(mine.kind, mine.label), " on rank ", rank, " of ", size(), " stopped: ");
        if (!failed.empty()) {
          const int first = *std::min_element(failed.begin(), failed.end(), [&](int a, int b) {
            return ranks_[a].fail_order < ranks_[b].fail_order;
          });
          // The earliest failure is the cause; later ones are mostly peers
          // that stopped because of it.
          std::vector<int> others;
          for (int j : failed)
            if (j != first) others.push_back(j);
          why += cat("rank ", first, " failed before reaching it (", ranks_[first].why, ")");
          if (!others.empty()) why += cat("; rank(s) ", rank_list(others), " stopped too");
        }
        if (!finished.empty()) {
          why += cat(failed.empty() ? "" : "; ", "rank(s) ", rank_list(finished),
                     " returned without calling it — every rank must run the same sequence of "
                     "collectives");
        }
        if (!missing.empty()) why += cat("; also waiting for rank(s) ", rank_list(missing));
      }
      me.step -= 1;
      mark_failed_locked(rank, why);
      throw Error(why);
    }
    std::vector<Post> posts;
    if (want_posts) {
      posts.reserve(ranks_.size());
      for (const RankState& s : ranks_) posts.push_back(s.posts[step % 2]);
    }
    return posts;
  }

  void mark_failed(int rank, const std::string& why) {
    std::lock_guard lock(m_);
    mark_failed_locked(rank, why);
  }

  void mark_finished(int rank) {
    std::lock_guard lock(m_);
    ranks_[rank].finished = true;
    cv_.notify_all();
  }

  // A new run on the same communicators: ranks that finished the last one
  // will take part again. Only call while no rank is inside a collective.
  void reset_finished() {
    std::lock_guard lock(m_);
    for (RankState& s : ranks_) s.finished = false;
  }

  // Why rank failed, or nullopt; and the order of its failure in the group.
  std::optional<std::string> failure(int rank, int* order = nullptr) {
    std::lock_guard lock(m_);
    const RankState& s = ranks_[rank];
    if (!s.failed) return std::nullopt;
    if (order) *order = s.fail_order;
    return s.why;
  }

 private:
  struct RankState {
    std::int64_t step = 0;  // rendezvous arrived at so far
    // A rank can be one rendezvous ahead of its slowest peer (it cannot pass
    // the next one without it), so the posts of two consecutive steps suffice.
    std::array<Post, 2> posts;
    bool failed = false;
    bool finished = false;
    int fail_order = -1;
    std::string why;
  };

  void mark_failed_locked(int rank, const std::string& why) {
    RankState& s = ranks_[rank];
    if (!s.failed) {
      s.failed = true;
      s.fail_order = failures_++;
      s.why = why;
    }
    cv_.notify_all();
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::vector<RankState> ranks_;
  DeviceMemory* device_;
  std::int64_t completed_ = 0;  // highest step every rank has arrived at
  int failures_ = 0;
};

namespace {

// Checks, identically on every rank, that the posts of a collective's first
// rendezvous agree: same call, same buffers convention. Every rank sees the
// same posts, so either all ranks throw here or none does, and none has
// touched a peer's buffer yet.
void check_same_call(const std::vector<Post>& posts, int rank) {
  const Post& p0 = posts[0];
  bool same = true;
  for (const Post& p : posts)
    same = same && p.kind == p0.kind && p.label == p0.label && p.dtype == p0.dtype && p.stage == 0;
  if (!same) {
    std::string calls;
    for (size_t j = 0; j < posts.size(); ++j) {
      calls += cat(j ? ", " : "", "rank ", j, " called ", call_name(posts[j].kind, posts[j].label),
                   " (", to_string(posts[j].dtype), ", its collective #", posts[j].call, ")");
    }
    fail("collective mismatch seen on rank ", rank, " of ", posts.size(), ": ", calls,
         "; every rank must run the same sequence of collectives with the same labels and dtypes");
  }
  bool backed = false, unbacked = false;
  for (const Post& p : posts) {
    backed = backed || p.any_backed;
    unbacked = unbacked || p.any_unbacked;
  }
  if (backed && unbacked) {
    std::vector<int> count_only;
    for (size_t j = 0; j < posts.size(); ++j)
      if (posts[j].any_unbacked) count_only.push_back(static_cast<int>(j));
    fail(call_name(p0.kind, p0.label), ": rank(s) ", rank_list(count_only),
         " passed null (count-only) buffers with non-zero counts but other ranks passed real "
         "ones; count-only must be on for all ranks of a call or for none");
  }
}

}  // namespace

LocalCommunicator::LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {
  LAGA_CHECK(group_ && rank >= 0 && rank < group_->size(), "local communicator: rank ", rank,
             " is outside a group of ", group_ ? group_->size() : 0);
}

LocalCommunicator::~LocalCommunicator() {
  group_->mark_finished(rank_);
}

int LocalCommunicator::size() const {
  return group_->size();
}

void LocalCommunicator::mark_failed(const std::string& why) {
  group_->mark_failed(rank_, why);
}
void LocalCommunicator::mark_finished() {
  group_->mark_finished(rank_);
}

void LocalCommunicator::check_usable(CollectiveKind kind, const std::string& label) const {
  if (auto why = group_->failure(rank_)) {
    fail(call_name(kind, label), " on rank ", rank_, " of ", size(),
         ": this rank already failed in an earlier collective (", *why,
         "); the group is out of step — make new communicators");
  }
}

void LocalCommunicator::call_failed(const std::string& why) {
  group_->mark_failed(rank_, why);
}

namespace {

// n elements from src to dst: a memcpy, or, in a device-local group (ranks
// sharing one device, make_local_communicators' `device`), the device's
// device-to-device copy (cudaMemcpy on a GPU; the emulated device's checked
// copy, which refuses a buffer that is not its memory). Null ends
// (count-only) copy nothing.
void move_elems(DeviceMemory* device, void* dst, const void* src, std::int64_t n, DType t) {
  if (device && dst && src && n > 0) return device->on_device(dst, src, n * dtype_bytes(t));
  copy_elems(dst, src, n, t);
}

// The devices' registered reductions (register_device_reduction), by Device.
std::atomic<DeviceReduction> device_reductions[3];

// dst = the sum of srcs in rank order (sum_in_rank_order). In a device-local
// group the buffers are device memory, summed on the device by its
// registered reduction (CUDA's kernel, cuda/elementwise.hpp), or, on a
// device without one, by the host: the emulated device's memory, checked
// to be its memory first (docs/architecture.md, "The transports"). The
// debugging switch that permutes the order (set_reduction_order_seed) is
// the host's alone, so under it the host sums (CUDA's memory is managed:
// cuda/device_memory_cuda.hpp).
void sum_on(DeviceMemory* device, void* dst, const void* const* srcs, int P, std::int64_t n,
            DType t) {
  if (device && n > 0 && dst && !reduction_order_seed())
    if (const DeviceReduction sum = device_reductions[static_cast<int>(device->device())].load())
      return sum(dst, srcs, P, n, t);
  if (device && device->checks_operands()) {
    const std::int64_t bytes = n * dtype_bytes(t);
    LAGA_CHECK(device->holds(dst, bytes), "device-local reduction: the destination (", bytes,
               " bytes) is not ", to_string(device->device()), " device memory");
    for (int j = 0; j < P; ++j)
      LAGA_CHECK(device->holds(srcs[j], bytes), "device-local reduction: rank ", j, "'s block (",
                 bytes, " bytes) is not ", to_string(device->device()), " device memory");
  }
  sum_in_rank_order(dst, srcs, P, n, t);
}

// What one rank copies out of its peers' memory in one collective: the copy,
// and its count per source rank (measured received bytes).
class Puller {
 public:
  Puller(int P, DType dtype, DeviceMemory* device)
      : pulled_(static_cast<size_t>(P), 0), dtype_(dtype), device_(device) {}
  // n elements of rank `from`'s memory at src into dst; a null end (count-only)
  // copies nothing but counts what it would have copied.
  void copy(int from, void* dst, const void* src, std::int64_t n) {
    move_elems(device_, dst, src, n, dtype_);
    pulled_[from] += n * dtype_bytes(dtype_);
  }
  // Reads n elements of rank `from` (a reduction reads in place).
  void read(int from, std::int64_t n) { pulled_[from] += n * dtype_bytes(dtype_); }
  const std::vector<std::int64_t>& pulled() const { return pulled_; }

 private:
  std::vector<std::int64_t> pulled_;
  DType dtype_;
  DeviceMemory* device_;
};

// Counts `pulled` (this rank's copies out of each rank's memory) as received,
// and what each peer copied out of this rank (the `pulled` of its post at the
// next rendezvous) as sent. The own entry of `pulled` is zero unless the
// transport wrongly read its own memory as a peer's, which then shows.
void count_moved(Traffic& moved, const std::vector<std::int64_t>& pulled,
                 const std::vector<Post>& next_posts, int rank) {
  for (size_t j = 0; j < pulled.size(); ++j) {
    moved.received(static_cast<int>(j), pulled[j]);
    if (static_cast<int>(j) != rank)
      moved.sent(static_cast<int>(j), next_posts[j].pulled[static_cast<size_t>(rank)]);
  }
}

// One rank's rendezvous in one collective, in their order. The first waits
// until the deadline (the call's timeout from its start: the rendezvous's
// construction) and checks that every rank makes the same call; the later
// ones wait without one (LocalGroup::arrive).
class Rendezvous {
 public:
  Rendezvous(LocalGroup& group, int rank, std::int64_t call, CollectiveKind kind, DType dtype,
             const std::string& label, std::chrono::milliseconds timeout)
      : group_(group),
        rank_(rank),
        call_(call),
        kind_(kind),
        dtype_(dtype),
        label_(label),
        timeout_(timeout),
        deadline_(Clock::now() + timeout) {}

  // This rank's post for the next rendezvous, with its buffers.
  Post post(const void* send = nullptr, void* recv = nullptr) const {
    Post p;
    p.call = call_;
    p.stage = stage_;
    p.kind = kind_;
    p.dtype = dtype_;
    p.label = label_;
    p.send = send;
    p.recv = recv;
    return p;
  }
  // Arrives with `p`; every rank's post.
  std::vector<Post> arrive(Post p) {
    const bool first = stage_++ == 0;
    std::vector<Post> posts = group_.arrive(
        rank_, std::move(p), first ? std::optional(deadline_) : std::nullopt, timeout_, true);
    if (first) check_same_call(posts, rank_);
    return posts;
  }
  // The last: tells the peers what this rank copied out of each of them, and
  // counts what they copied out of it.
  void last(const Puller& puller, Traffic& moved) {
    Post done = post();
    done.pulled = puller.pulled();
    count_moved(moved, puller.pulled(), arrive(std::move(done)), rank_);
  }

 private:
  LocalGroup& group_;
  int rank_;
  std::int64_t call_;
  CollectiveKind kind_;
  DType dtype_;
  const std::string& label_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  int stage_ = 0;  // the next rendezvous's index within the collective
};

}  // namespace

void LocalCommunicator::transport_all_to_all(const void* send, const std::int64_t* send_counts,
                                             const std::int64_t* send_displs, void* recv,
                                             const std::int64_t* recv_counts,
                                             const std::int64_t* recv_displs, DType dtype,
                                             const std::string& label, Traffic& moved) {
  const CollectiveKind kind = CollectiveKind::all_to_all;
  const int P = size();
  Rendezvous rendezvous(*group_, rank_, calls_done(), kind, dtype, label, timeout());
  Post p = rendezvous.post(send, recv);
  p.counts_a.assign(send_counts, send_counts + P);
  p.displs_a.assign(send_displs, send_displs + P);
  p.counts_b.assign(recv_counts, recv_counts + P);
  std::int64_t sent = 0, received = 0;
  for (int j = 0; j < P; ++j) sent += send_counts[j], received += recv_counts[j];
  note_buffer(p, send, sent);
  note_buffer(p, recv, received);
  const std::vector<Post> posts = rendezvous.arrive(std::move(p));
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < P; ++j)
      if (posts[i].counts_b[j] != posts[j].counts_a[i])
        fail(peer_count_message(kind, label, rank_, P, i, j, posts[i].counts_b[j],
                                std::to_string(posts[j].counts_a[i])));
  // The block from peer j is peer j's send block for this rank.
  auto block_of = [&](int j) {
    return posts[j].send ? at(posts[j].send, posts[j].displs_a[rank_], dtype) : nullptr;
  };
  Puller puller(P, dtype, group_->device());
  const TransportFault fault = take_fault();
  bool faulted = fault == TransportFault::none;
  for (int j = 0; j < P; ++j) {
    void* dst = recv ? at(recv, recv_displs[j], dtype) : nullptr;
    if (j == rank_) {  // the own block: a local copy, not traffic
      move_elems(group_->device(), dst, block_of(j), recv_counts[j], dtype);
      continue;
    }
    if (!faulted && recv_counts[j] > 0) {  // tests only (TransportFault)
      faulted = true;
      if (fault == TransportFault::short_send) {
        puller.copy(j, dst, block_of(j), recv_counts[j] - 1);
      } else if (fault == TransportFault::wrong_peer) {
        const int w = (j + 1) % P;  // its block for this rank, cut to fit
        puller.copy(w, dst, block_of(w), std::min(recv_counts[j], posts[w].counts_a[rank_]));
      }
      continue;  // TransportFault::skip_peer: nothing
    }
    puller.copy(j, dst, block_of(j), recv_counts[j]);
  }
  rendezvous.last(puller, moved);
}

void LocalCommunicator::transport_all_gather(const void* send, std::int64_t send_count, void* recv,
                                             const std::int64_t* recv_counts,
                                             const std::int64_t* recv_displs, DType dtype,
                                             const std::string& label, Traffic& moved) {
  const CollectiveKind kind = CollectiveKind::all_gather;
  const int P = size();
  Rendezvous rendezvous(*group_, rank_, calls_done(), kind, dtype, label, timeout());
  Post p = rendezvous.post(send, recv);
  p.n = send_count;
  p.counts_b.assign(recv_counts, recv_counts + P);
  std::int64_t received = 0;
  for (int j = 0; j < P; ++j) received += recv_counts[j];
  note_buffer(p, send, send_count);
  note_buffer(p, recv, received);
  const std::vector<Post> posts = rendezvous.arrive(std::move(p));
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < P; ++j)
      if (posts[i].counts_b[j] != posts[j].n)
        fail(peer_count_message(kind, label, rank_, P, i, j, posts[i].counts_b[j],
                                std::to_string(posts[j].n)));
  Puller puller(P, dtype, group_->device());
  for (int j = 0; j < P; ++j) {
    void* dst = recv ? at(recv, recv_displs[j], dtype) : nullptr;
    if (j == rank_)
      move_elems(group_->device(), dst, send, send_count, dtype);
    else
      puller.copy(j, dst, posts[j].send, recv_counts[j]);
  }
  rendezvous.last(puller, moved);
}

void LocalCommunicator::transport_reduce_scatter(const void* send, const std::int64_t* counts,
                                                 const std::int64_t* displs, void* recv,
                                                 DType dtype, const std::string& label,
                                                 Traffic& moved) {
  const CollectiveKind kind = CollectiveKind::reduce_scatter;
  const int P = size();
  Rendezvous rendezvous(*group_, rank_, calls_done(), kind, dtype, label, timeout());
  Post p = rendezvous.post(send, recv);
  p.counts_a.assign(counts, counts + P);
  p.displs_a.assign(displs, displs + P);
  std::int64_t total = 0;
  for (int j = 0; j < P; ++j) total += counts[j];
  note_buffer(p, send, total);
  note_buffer(p, recv, counts[rank_]);
  const std::vector<Post> posts = rendezvous.arrive(std::move(p));
  // Rank i expects its own block size from every peer j.
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < P; ++j)
      if (posts[j].counts_a[i] != posts[i].counts_a[i])
        fail(peer_count_message(kind, label, rank_, P, i, j, posts[i].counts_a[i],
                                std::to_string(posts[j].counts_a[i])));
  Puller puller(P, dtype, group_->device());
  for (int j = 0; j < P; ++j)
    if (j != rank_) puller.read(j, counts[rank_]);
  if (recv && counts[rank_] > 0) {
    std::vector<const void*> srcs(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) srcs[j] = at(posts[j].send, posts[j].displs_a[rank_], dtype);
    sum_on(group_->device(), recv, srcs.data(), P, counts[rank_], dtype);
  }
  rendezvous.last(puller, moved);
}

void LocalCommunicator::transport_all_reduce(void* buf, std::int64_t n, DType dtype,
                                             const std::string& label, Traffic& moved) {
  const CollectiveKind kind = CollectiveKind::all_reduce;
  const int P = size();
  Rendezvous rendezvous(*group_, rank_, calls_done(), kind, dtype, label, timeout());
  std::vector<std::int64_t> offset(static_cast<size_t>(P) + 1, 0);
  for (int j = 0; j < P; ++j) offset[j + 1] = offset[j] + all_reduce_chunk(n, P, j);
  const std::int64_t own = offset[rank_ + 1] - offset[rank_];
  // The own reduced chunk can only go back into buf once no peer reads
  // buf's chunk any more, hence staging and a rendezvous in between.
  Staging staging(dtype, staging_for(kind, own));
  LAGA_CHECK(!(buf && n > 0 && own > 0 && !staging.data()), call_name(kind, label), " on rank ",
             rank_, " of ", P,
             ": buf has storage but this thread's memory pool is count-only, so the reduction "
             "has no staging; run real data under a pool that is not count-only");
  Post p = rendezvous.post(buf);
  p.n = n;
  note_buffer(p, buf, n);
  const std::vector<Post> posts = rendezvous.arrive(std::move(p));
  // Rank i's reduce-scatter expects chunk i of its own n from every peer j,
  // which sends chunk i of its n. (Unequal n always differ in some rank's
  // own chunk, so this finds every unequal n.)
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < P; ++j) {
      const std::int64_t want = all_reduce_chunk(posts[i].n, P, i);
      const std::int64_t got = all_reduce_chunk(posts[j].n, P, i);
      if (want != got)
        fail(peer_count_message(kind, label, rank_, P, i, j, want, std::to_string(got)));
    }
  Puller scatter(P, dtype, group_->device());
  for (int j = 0; j < P; ++j)
    if (j != rank_) scatter.read(j, own);
  if (buf && staging.data() && own > 0) {
    std::vector<const void*> srcs(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) srcs[j] = at(posts[j].send, offset[rank_], dtype);
    sum_on(group_->device(), staging.data(), srcs.data(), P, own, dtype);
  }
  Post reduced = rendezvous.post();
  reduced.staging = staging.data();
  reduced.pulled = scatter.pulled();
  const std::vector<Post> chunks = rendezvous.arrive(std::move(reduced));
  Puller gather(P, dtype, group_->device());
  for (int j = 0; j < P; ++j) {
    void* dst = buf ? at(buf, offset[j], dtype) : nullptr;
    if (j == rank_)
      move_elems(group_->device(), dst, chunks[j].staging, own, dtype);
    else
      gather.copy(j, dst, chunks[j].staging, offset[j + 1] - offset[j]);
  }
  count_moved(moved, scatter.pulled(), chunks, rank_);
  rendezvous.last(gather, moved);
}

void LocalCommunicator::transport_ring_shift(const void* send, std::int64_t send_count, void* recv,
                                             std::int64_t recv_count, DType dtype, Ring ring,
                                             const std::string& label, Traffic& moved) {
  // A rendezvous of the whole group, although only neighbours exchange: the
  // last one keeps send alive until the rank that reads it is done.
  const CollectiveKind kind = CollectiveKind::ring_shift;
  const int P = size();
  Rendezvous rendezvous(*group_, rank_, calls_done(), kind, dtype, label, timeout());
  Post p = rendezvous.post(send, recv);
  p.n = send_count;
  p.counts_b.assign(1, recv_count);
  p.ring = ring;
  note_buffer(p, send, send_count);
  note_buffer(p, recv, recv_count);
  const std::vector<Post> posts = rendezvous.arrive(std::move(p));
  for (int j = 0; j < P; ++j)
    if (!(posts[j].ring == posts[0].ring))
      fail(call_name(kind, label), " on rank ", rank_, " of ", P, ": rank 0 shifts ",
           to_string(posts[0].ring), " but rank ", j, " ", to_string(posts[j].ring),
           "; every rank of a ring_shift must pass the same direction, ring size and stride");
  for (int i = 0; i < P; ++i) {
    const int from = ring_peers(P, i, ring).from;
    if (posts[i].counts_b[0] != posts[from].n)
      fail(peer_count_message(kind, label, rank_, P, i, from, posts[i].counts_b[0],
                              std::to_string(posts[from].n)));
  }
  const int from = ring_peers(P, rank_, ring).from;
  Puller puller(P, dtype, group_->device());
  if (from == rank_) {  // a ring of one: the block comes back, not traffic
    move_elems(group_->device(), recv, send, send_count, dtype);
  } else if (const TransportFault fault = take_fault();
             fault != TransportFault::none && recv_count > 0) {  // tests only (TransportFault)
    if (fault == TransportFault::short_send) {
      puller.copy(from, recv, posts[from].send, recv_count - 1);
    } else if (fault == TransportFault::wrong_peer) {
      const int w = (from + 1) % P;  // its block, cut to fit (forward: this rank's own)
      puller.copy(w, recv, posts[w].send, std::min(recv_count, posts[w].n));
    }  // TransportFault::skip_peer: nothing
  } else {
    puller.copy(from, recv, posts[from].send, recv_count);
  }
  rendezvous.last(puller, moved);
}

void LocalCommunicator::transport_barrier(const std::string& label) {
  Rendezvous rendezvous(*group_, rank_, calls_done(), CollectiveKind::barrier, DType::f32, label,
                        timeout());
  rendezvous.arrive(rendezvous.post());
}

void register_device_reduction(Device device, DeviceReduction sum) {
  LAGA_CHECK(device != Device::cpu, "register_device_reduction: the host's sum is built in");
  device_reductions[static_cast<int>(device)].store(sum);
}

std::vector<std::unique_ptr<Communicator>> make_local_communicators(int P, DeviceMemory* device) {
  LAGA_CHECK(P >= 1, "make_local_communicators: P = ", P, "; need at least one rank");
  auto group = std::make_shared<LocalGroup>(P, device);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) comms.push_back(std::make_unique<LocalCommunicator>(group, r));
  return comms;
}

void run_local_ranks(std::vector<std::unique_ptr<Communicator>>& comms,
                     const std::function<void(Communicator&)>& body,
                     const LocalRunOptions& options) {
  const int P = static_cast<int>(comms.size());
  LAGA_CHECK(P >= 1, "run_local_ranks: no communicators; make them with make_local_communicators");
  std::vector<LocalCommunicator*> locals(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    locals[r] = dynamic_cast<LocalCommunicator*>(comms[r].get());
    LAGA_CHECK(locals[r] && locals[r]->rank() == r && locals[r]->group() == locals[0]->group(),
               "run_local_ranks: communicator ", r, " is not rank ", r,
               " of one local group; pass the vector make_local_communicators returned");
  }
  LAGA_CHECK(!options.pools || static_cast<int>(options.pools->size()) == P,
             "run_local_ranks: ", options.pools ? options.pools->size() : 0, " memory pools for ",
             P, " ranks; pass one per rank");
  locals[0]->group()->reset_finished();
  const int threads = options.threads_per_rank > 0 ? options.threads_per_rank : threads_per_rank(P);
  if (options.timeout.count() > 0)
    for (auto& c : comms) c->set_timeout(options.timeout);

  std::vector<std::string> errors(static_cast<size_t>(P));
  std::vector<char> threw(static_cast<size_t>(P), 0);
  std::vector<std::thread> threads_of_ranks;
  threads_of_ranks.reserve(static_cast<size_t>(P));
  // Each rank runs at the precision of the thread that starts them (--dtype:
  // core/precision.hpp), as it would under MPI, where the body runs on it.
  const Precision precision = op_precision;
  const GradReduce grad_reduce = op_grad_reduce;
  for (int r = 0; r < P; ++r) {
    threads_of_ranks.emplace_back([&, r] {
      MemoryPool own_pool;
      PoolScope scope(options.pools ? (*options.pools)[r] : own_pool);
      const UsePrecision at_precision(precision, grad_reduce);
      try {
        set_rank_threads(threads);
        if (options.deferred_delivery_for_testing) {
          current_pool().set_storage_tracking(true);
          comms[r]->set_deferred_delivery_for_testing(true);
        }
        body(*comms[r]);
        locals[r]->mark_finished();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        threw[r] = 1;
        locals[r]->mark_failed(e.what());
      } catch (...) {
        errors[r] = "unknown exception (not derived from std::exception)";
        threw[r] = 1;
        locals[r]->mark_failed(errors[r]);
      }
    });
  }
  for (std::thread& t : threads_of_ranks) t.join();

  int first = -1, first_order = 0;
  for (int r = 0; r < P; ++r) {
    if (!threw[r]) continue;
    int order = 0;
    locals[r]->group()->failure(r, &order);
    if (first < 0 || order < first_order) first = r, first_order = order;
  }
  if (first >= 0) throw Error(cat("rank ", first, " of ", P, ": ", errors[first]));
}

void run_local_ranks(int P, const std::function<void(Communicator&)>& body,
                     const LocalRunOptions& options) {
  auto comms = make_local_communicators(P, options.device);
  run_local_ranks(comms, body, options);
}

}  // namespace laga
