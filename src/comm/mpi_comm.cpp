// The MPI communicator itself: its duplicate of the base communicator, the
// message tags, and the state that makes a failed communicator refuse later
// calls. The session is in mpi_session.cpp, failure notices in
// mpi_notice.cpp, the transport in mpi_transport.cpp.
#include "comm/mpi_comm.hpp"

#include <algorithm>
#include <chrono>

#include "comm/collective_util.hpp"
#include "comm/mpi_detail.hpp"
#include "core/error.hpp"

namespace laga {

using namespace comm_detail;
using namespace mpi_detail;
using Clock = std::chrono::steady_clock;

// A kind's 3 tag bits must never read as a failure notice.
static_assert(int(CollectiveKind::ring_shift) < mpi_detail::kNoticeKind,
              "CollectiveKind outgrew the MPI tag's kind bits");

namespace {
std::uint32_t label_hash(const std::string& label) {
  std::uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char ch : label) h = (h ^ ch) * 16777619u;
  return h;
}
}  // namespace

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
      count_orphan();
      fail("make_mpi_communicator timed out after ", create_timeout.count(),
           " ms: not every rank of the base communicator called it; every rank must create "
           "its communicators in the same order");
    }
    back_off(++polls);
  }
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);

  // Tag layout, low to high: label hash, dtype (kDtypeBits), kind (3 bits),
  // round number. MPI only promises tags up to 32767; OpenMPI gives 2^31 - 1.
  int* tag_ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &flag);
  const std::int64_t ub = flag && tag_ub ? *tag_ub : 32767;
  int bits = 0;
  while (bits < 62 && ((std::int64_t{1} << (bits + 1)) - 1) <= ub) ++bits;
  LAGA_CHECK(bits >= 10, "MPI_TAG_UB = ", ub, " is too small for laga's message tags");
  seq_bits_ = std::min(16, bits - kDtypeBits - 3);
  hash_bits_ = std::min(11, bits - kDtypeBits - 3 - seq_bits_);
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
  return static_cast<int>((seq << (kind_shift() + 3)) | (std::int64_t(kind) << kind_shift()) |
                          (std::int64_t(dtype) << hash_bits_) | hash);
}

long MpiCommunicator::round_of(int t) const {
  return static_cast<long>(t) >> (kind_shift() + 3);
}

std::string MpiCommunicator::describe_tag(int t, int own) const {
  struct Fields {
    int hash, kind, dtype;
  };
  auto decode = [&](int x) {
    return Fields{x & ((1 << hash_bits_) - 1), (x >> kind_shift()) & 7,
                  (x >> hash_bits_) & ((1 << kDtypeBits) - 1)};
  };
  const Fields f = decode(t), mine = decode(own);
  if (f.kind == mpi_detail::kNoticeKind) return "a failure notice";
  std::string s =
      cat(f.kind <= int(CollectiveKind::ring_shift) ? to_string(CollectiveKind(f.kind))
                                                    : "an unknown collective",
          " (", f.dtype <= int(DType::bf16) ? to_string(DType(f.dtype)) : "an unknown dtype", ")");
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

void MpiCommunicator::call_failed(const std::string& why) {
  if (broken_.empty()) {
    broken_ = why;
    notify_peers(broken_);
  }
}

std::unique_ptr<Communicator> make_mpi_communicator() {
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm base) {
  return std::make_unique<MpiCommunicator>(base);
}

}  // namespace laga
