// The NCCL transport (contract: cuda/nccl_comm.hpp).
#include "cuda/nccl_comm.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/collective_util.hpp"
#include "core/error.hpp"
#include "cuda/cuda_error.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/elementwise.hpp"

namespace laga::cuda {

namespace {

ncclComm_t nc(void* c) {
  return static_cast<ncclComm_t>(c);
}
cudaStream_t cs(void* s) {
  return static_cast<cudaStream_t>(s);
}
const char* at(const void* base, std::int64_t elems, std::int64_t e) {
  return static_cast<const char*>(base) + elems * e;
}
char* at(void* base, std::int64_t elems, std::int64_t e) {
  return static_cast<char*>(base) + elems * e;
}

// A small device array outside the pool (as MPI's own buffers are outside
// it): the counts' exchange and the reduction's part pointers.
struct Scratch {
  void* p = nullptr;
  std::size_t bytes = 0;
  void* get(std::size_t n) {
    if (n > bytes) {
      if (p) cudaFree(p);
      p = nullptr;
      check_cuda(cudaMalloc(&p, n), "cudaMalloc of the NCCL transport's scratch");
      bytes = n;
    }
    return p;
  }
  ~Scratch() {
    if (p) cudaFree(p);
  }
};
thread_local Scratch counts_scratch, parts_scratch;

// A host buffer handed to a collective, moved through a device copy: NCCL
// moves device memory only, and the tools gather their results and reports
// after the measured step from host memory (std::vectors, host tensors;
// tools/block_job.cpp, tools/compare_run.cpp). Device and managed pointers,
// and null ones (count-only), pass as they are; the copy is outside the pool,
// as MPI's own buffers are. done() copies an output back.
class HostStage {
 public:
  HostStage(const void* p, std::int64_t bytes) : ptr_(const_cast<void*>(p)) {
    if (!p || bytes <= 0) return;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) == cudaSuccess &&
        (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged))
      return;
    (void)cudaGetLastError();
    host_ = ptr_, bytes_ = static_cast<std::size_t>(bytes), ptr_ = nullptr;
    check_cuda(cudaMalloc(&ptr_, bytes_), "cudaMalloc of a host buffer's device copy (NCCL)");
    check_cuda(cudaMemcpy(ptr_, host_, bytes_, cudaMemcpyHostToDevice),
               "upload of a host buffer for NCCL");
  }
  ~HostStage() {
    if (host_) (void)cudaFree(ptr_);
  }
  HostStage(const HostStage&) = delete;
  HostStage& operator=(const HostStage&) = delete;
  void* get() const { return ptr_; }
  void done() const {
    if (host_)
      check_cuda(cudaMemcpy(host_, ptr_, bytes_, cudaMemcpyDeviceToHost),
                 "download of a host buffer from NCCL");
  }

 private:
  void* ptr_ = nullptr;
  void* host_ = nullptr;
  std::size_t bytes_ = 0;
};

// The bytes a v-collective's buffer spans: the end of its furthest block.
std::int64_t span_bytes(const std::int64_t* counts, const std::int64_t* displs, int P,
                        std::int64_t e) {
  std::int64_t end = 0;
  for (int j = 0; j < P; ++j)
    if (counts[j] > 0) end = std::max(end, displs[j] + counts[j]);
  return end * e;
}

}  // namespace

NcclId make_nccl_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  NcclId out{};
  static_assert(sizeof(id) == sizeof(NcclId));
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

NcclCommunicator::NcclCommunicator(const NcclId& id, int rank, int size, void* stream)
    : rank_(rank), size_(size), stream_(stream) {
  LAGA_CHECK(size >= 1 && rank >= 0 && rank < size, "NCCL communicator: rank ", rank, " of ", size,
             "; need 0 <= rank < size");
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof(uid));
  ncclComm_t c = nullptr;
  check_nccl(ncclCommInitRank(&c, size, uid, rank),
             cat("ncclCommInitRank (rank ", rank, " of ", size, ")"));
  comm_ = c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_) ncclCommDestroy(nc(comm_));
}

void NcclCommunicator::check_usable(CollectiveKind kind, const std::string& label) const {
  LAGA_CHECK(broken_.empty(), comm_detail::call_name(kind, label), " on rank ", rank_, " of ",
             size_, ": the NCCL communicator failed earlier (", broken_,
             "); make a new one (every rank)");
}

void NcclCommunicator::call_failed(const std::string& why) {
  if (broken_.empty()) broken_ = why;
}

void NcclCommunicator::finish(CollectiveKind kind, const std::string& label) {
  const auto deadline = std::chrono::steady_clock::now() + timeout();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(cs(stream_));
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check_cuda(q, comm_detail::call_name(kind, label));
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(nc(comm_), &async), "ncclCommGetAsyncError");
    check_nccl(async, comm_detail::call_name(kind, label));
    if (std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(nc(comm_));
      comm_ = nullptr;
      fail(comm_detail::call_name(kind, label), " on rank ", rank_, " of ", size_,
           ": did not complete within ", timeout().count(),
           " ms (NCCL cannot say which peer is missing); the NCCL communicator is aborted: check "
           "that every rank made this call");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::vector<std::int64_t> NcclCommunicator::gather_counts(const std::int64_t* mine, int n,
                                                          CollectiveKind kind,
                                                          const std::string& label) {
  const std::size_t row = sizeof(std::int64_t) * static_cast<std::size_t>(n);
  auto* dev = static_cast<char*>(counts_scratch.get(row * static_cast<std::size_t>(size_ + 1)));
  check_cuda(cudaMemcpyAsync(dev, mine, row, cudaMemcpyHostToDevice, cs(stream_)), "counts upload");
  check_nccl(ncclAllGather(dev, dev + row, row, ncclChar, nc(comm_), cs(stream_)),
             comm_detail::call_name(kind, label) + " (counts)");
  finish(kind, label);
  std::vector<std::int64_t> all(static_cast<std::size_t>(size_ * n));
  check_cuda(cudaMemcpy(all.data(), dev + row, row * static_cast<std::size_t>(size_),
                        cudaMemcpyDeviceToHost),
             "counts download");
  return all;
}

void NcclCommunicator::transport_all_to_all(const void* send, const std::int64_t* send_counts,
                                            const std::int64_t* send_displs, void* recv,
                                            const std::int64_t* recv_counts,
                                            const std::int64_t* recv_displs, DType dtype,
                                            const std::string& label, Traffic& moved) {
  const auto kind = CollectiveKind::all_to_all;
  const int P = size_, r = rank_;
  const std::int64_t e = dtype_bytes(dtype);
  const HostStage send_stage(send, span_bytes(send_counts, send_displs, P, e)),
      recv_stage(recv, span_bytes(recv_counts, recv_displs, P, e));
  send = send_stage.get(), recv = recv_stage.get();
  const auto all = gather_counts(send_counts, P, kind, label);
  for (int j = 0; j < P; ++j) {
    const std::int64_t sent = all[static_cast<std::size_t>(j * P + r)];
    LAGA_CHECK(sent == recv_counts[j],
               comm_detail::peer_count_message(kind, label, r, P, r, j, recv_counts[j],
                                               std::to_string(sent)));
  }
  const bool moves = send && recv;
  if (moves) check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    if (send_counts[j] > 0) {
      if (moves)
        check_nccl(
            ncclSend(at(send, send_displs[j], e), static_cast<std::size_t>(send_counts[j] * e),
                     ncclChar, j, nc(comm_), cs(stream_)),
            "ncclSend");
      moved.sent(j, send_counts[j] * e);
    }
    if (recv_counts[j] > 0) {
      if (moves)
        check_nccl(
            ncclRecv(at(recv, recv_displs[j], e), static_cast<std::size_t>(recv_counts[j] * e),
                     ncclChar, j, nc(comm_), cs(stream_)),
            "ncclRecv");
      moved.received(j, recv_counts[j] * e);
    }
  }
  if (!moves) return;
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  if (send_counts[r] > 0)
    check_cuda(cudaMemcpyAsync(at(recv, recv_displs[r], e), at(send, send_displs[r], e),
                               static_cast<std::size_t>(send_counts[r] * e),
                               cudaMemcpyDeviceToDevice, cs(stream_)),
               "own block copy");
  finish(kind, label);
  recv_stage.done();
}

void NcclCommunicator::transport_all_gather(const void* send, std::int64_t send_count, void* recv,
                                            const std::int64_t* recv_counts,
                                            const std::int64_t* recv_displs, DType dtype,
                                            const std::string& label, Traffic& moved) {
  const auto kind = CollectiveKind::all_gather;
  const int P = size_, r = rank_;
  const std::int64_t e = dtype_bytes(dtype);
  const HostStage send_stage(send, send_count * e),
      recv_stage(recv, span_bytes(recv_counts, recv_displs, P, e));
  send = send_stage.get(), recv = recv_stage.get();
  const auto all = gather_counts(&send_count, 1, kind, label);
  for (int j = 0; j < P; ++j)
    LAGA_CHECK(all[static_cast<std::size_t>(j)] == recv_counts[j],
               comm_detail::peer_count_message(kind, label, r, P, r, j, recv_counts[j],
                                               std::to_string(all[static_cast<std::size_t>(j)])));
  const bool moves = send && recv;
  if (moves) check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    if (send_count > 0) {
      if (moves)
        check_nccl(ncclSend(send, static_cast<std::size_t>(send_count * e), ncclChar, j, nc(comm_),
                            cs(stream_)),
                   "ncclSend");
      moved.sent(j, send_count * e);
    }
    if (recv_counts[j] > 0) {
      if (moves)
        check_nccl(
            ncclRecv(at(recv, recv_displs[j], e), static_cast<std::size_t>(recv_counts[j] * e),
                     ncclChar, j, nc(comm_), cs(stream_)),
            "ncclRecv");
      moved.received(j, recv_counts[j] * e);
    }
  }
  if (!moves) return;
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  char* own = at(recv, recv_displs[r], e);
  if (send_count > 0 && own != send)
    check_cuda(cudaMemcpyAsync(own, send, static_cast<std::size_t>(send_count * e),
                               cudaMemcpyDeviceToDevice, cs(stream_)),
               "own block copy");
  finish(kind, label);
  recv_stage.done();
}

void NcclCommunicator::reduce_into(const void* send, const std::int64_t* counts,
                                   const std::int64_t* displs, void* recv, DType dtype,
                                   CollectiveKind kind, const std::string& label, Traffic& moved) {
  const int P = size_, r = rank_;
  const std::int64_t e = dtype_bytes(dtype), own = counts[r];
  const bool moves = send && recv;
  // (P-1) x the own block: StagingRule::mpi, in the pool as comm_buffers.
  DeviceBuffer staging((P - 1) * own * e, "nccl reduce staging", MemCategory::comm_buffers);
  if (moves) check_nccl(ncclGroupStart(), "ncclGroupStart");
  int slot = 0;
  std::vector<const void*> parts(static_cast<std::size_t>(P));
  for (int j = 0; j < P; ++j) {
    if (j == r) {
      parts[static_cast<std::size_t>(j)] = at(send, displs[r], e);
      continue;
    }
    if (counts[j] > 0) {
      if (moves)
        check_nccl(ncclSend(at(send, displs[j], e), static_cast<std::size_t>(counts[j] * e),
                            ncclChar, j, nc(comm_), cs(stream_)),
                   "ncclSend");
      moved.sent(j, counts[j] * e);
    }
    char* into = staging.backed() ? at(staging.data(), slot * own, e) : nullptr;
    parts[static_cast<std::size_t>(j)] = into;
    ++slot;
    if (own > 0) {
      if (moves)
        check_nccl(
            ncclRecv(into, static_cast<std::size_t>(own * e), ncclChar, j, nc(comm_), cs(stream_)),
            "ncclRecv");
      moved.received(j, own * e);
    }
  }
  if (!moves) return;
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  if (own > 0) {
    auto* dev = static_cast<const void**>(parts_scratch.get(sizeof(void*) * parts.size()));
    check_cuda(cudaMemcpyAsync(dev, parts.data(), sizeof(void*) * parts.size(),
                               cudaMemcpyHostToDevice, cs(stream_)),
               "reduction parts upload");
    sum_in_rank_order(recv, dev, P, own, dtype, stream_);
  }
  finish(kind, label);
}

void NcclCommunicator::transport_reduce_scatter(const void* send, const std::int64_t* counts,
                                                const std::int64_t* displs, void* recv, DType dtype,
                                                const std::string& label, Traffic& moved) {
  const auto kind = CollectiveKind::reduce_scatter;
  const int P = size_, r = rank_;
  const std::int64_t e = dtype_bytes(dtype);
  const HostStage send_stage(send, span_bytes(counts, displs, P, e)),
      recv_stage(recv, counts[r] * e);
  // What each rank sends to this one (its counts[r]) against this rank's own block.
  const auto all = gather_counts(counts, P, kind, label);
  for (int j = 0; j < P; ++j) {
    const std::int64_t sent = all[static_cast<std::size_t>(j * P + r)];
    LAGA_CHECK(sent == counts[r], comm_detail::peer_count_message(kind, label, r, P, r, j,
                                                                  counts[r], std::to_string(sent)));
  }
  reduce_into(send_stage.get(), counts, displs, recv_stage.get(), dtype, kind, label, moved);
  recv_stage.done();
}

void NcclCommunicator::transport_all_reduce(void* buf, std::int64_t n, DType dtype,
                                            const std::string& label, Traffic& moved) {
  const auto kind = CollectiveKind::all_reduce;
  const int P = size_, r = rank_;
  const std::int64_t e = dtype_bytes(dtype);
  const HostStage stage(buf, n * e);
  buf = stage.get();
  const auto all = gather_counts(&n, 1, kind, label);
  for (int j = 0; j < P; ++j)
    LAGA_CHECK(all[static_cast<std::size_t>(j)] == n,
               comm_detail::peer_count_message(kind, label, r, P, r, j, n,
                                               std::to_string(all[static_cast<std::size_t>(j)])));
  std::vector<std::int64_t> chunks(static_cast<std::size_t>(P)),
      displs(static_cast<std::size_t>(P));
  for (int j = 0, d = 0; j < P; d += static_cast<int>(chunks[static_cast<std::size_t>(j)]), ++j) {
    chunks[static_cast<std::size_t>(j)] = all_reduce_chunk(n, P, j);
    displs[static_cast<std::size_t>(j)] = d;
  }
  // Reduce-scatter of the chunks (in place: the own chunk's sum lands in
  // buf), then the all-gather of the summed chunks.
  reduce_into(buf, chunks.data(), displs.data(),
              buf ? at(buf, displs[static_cast<std::size_t>(r)], e) : nullptr, dtype, kind, label,
              moved);
  const bool moves = buf != nullptr;
  if (moves) check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    const std::int64_t mine = chunks[static_cast<std::size_t>(r)],
                       theirs = chunks[static_cast<std::size_t>(j)];
    if (mine > 0) {
      if (moves)
        check_nccl(
            ncclSend(at(buf, displs[static_cast<std::size_t>(r)], e),
                     static_cast<std::size_t>(mine * e), ncclChar, j, nc(comm_), cs(stream_)),
            "ncclSend");
      moved.sent(j, mine * e);
    }
    if (theirs > 0) {
      if (moves)
        check_nccl(
            ncclRecv(at(buf, displs[static_cast<std::size_t>(j)], e),
                     static_cast<std::size_t>(theirs * e), ncclChar, j, nc(comm_), cs(stream_)),
            "ncclRecv");
      moved.received(j, theirs * e);
    }
  }
  if (!moves) return;
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  finish(kind, label);
  stage.done();
}

void NcclCommunicator::transport_barrier(const std::string& label) {
  const std::int64_t one = 1;
  gather_counts(&one, 1, CollectiveKind::barrier, label);  // returns once every rank is there
}

void NcclCommunicator::transport_ring_shift(const void* send, std::int64_t send_count, void* recv,
                                            std::int64_t recv_count, DType dtype, Ring ring,
                                            const std::string& label, Traffic& moved) {
  const auto kind = CollectiveKind::ring_shift;
  const int P = size_, r = rank_;
  const std::int64_t e = dtype_bytes(dtype);
  const RingPeers peers = ring_peers(P, r, ring);
  const HostStage send_stage(send, send_count * e), recv_stage(recv, recv_count * e);
  send = send_stage.get(), recv = recv_stage.get();
  const auto all = gather_counts(&send_count, 1, kind, label);
  const std::int64_t sent = all[static_cast<std::size_t>(peers.from)];
  LAGA_CHECK(sent == recv_count, comm_detail::peer_count_message(kind, label, r, P, r, peers.from,
                                                                 recv_count, std::to_string(sent)));
  const bool moves = send && recv;
  if (peers.to == r) {  // a ring of one: the block comes back to itself
    if (moves && send_count > 0)
      check_cuda(cudaMemcpyAsync(recv, send, static_cast<std::size_t>(send_count * e),
                                 cudaMemcpyDeviceToDevice, cs(stream_)),
                 "ring of one copy");
    if (moves) finish(kind, label), recv_stage.done();
    return;
  }
  if (moves) check_nccl(ncclGroupStart(), "ncclGroupStart");
  if (send_count > 0) {
    if (moves)
      check_nccl(ncclSend(send, static_cast<std::size_t>(send_count * e), ncclChar, peers.to,
                          nc(comm_), cs(stream_)),
                 "ncclSend");
    moved.sent(peers.to, send_count * e);
  }
  if (recv_count > 0) {
    if (moves)
      check_nccl(ncclRecv(recv, static_cast<std::size_t>(recv_count * e), ncclChar, peers.from,
                          nc(comm_), cs(stream_)),
                 "ncclRecv");
    moved.received(peers.from, recv_count * e);
  }
  if (!moves) return;
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  finish(kind, label);
  recv_stage.done();
}

}  // namespace laga::cuda
