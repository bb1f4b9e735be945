// Failure notices: a rank whose collective failed tells each peer why, so a
// peer waiting for it stops at once with the reason instead of timing out.
// Nobody is obliged to receive a notice; the sends are freed, not waited for.
#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>

#include "comm/mpi_comm.hpp"
#include "comm/mpi_detail.hpp"

namespace laga {

namespace {
// The texts live for the whole process: their sends are freed, not waited
// for, so MPI may still read them at any time before MPI_Finalize.
constexpr std::size_t kMaxNoticeBytes = 480;  // well under OpenMPI's eager limit
std::mutex g_notice_mutex;
std::deque<std::string> g_notices;
}  // namespace

std::string mpi_detail::receive_notice(int peer, const MPI_Status& st, MPI_Comm comm) {
  int len = 0;
  MPI_Get_count(&st, MPI_CHAR, &len);
  std::string text(static_cast<size_t>(std::max(len, 0)), '\0');
  MPI_Recv(text.data(), len, MPI_CHAR, peer, st.MPI_TAG, comm, MPI_STATUS_IGNORE);
  return text;
}

void MpiCommunicator::notify_peers(const std::string& why) {
  // A peer still waiting for this rank in this or a later collective finds
  // the notice when it probes for mismatches (mpi_transport.cpp) and stops.
  const int notice_tag =
      static_cast<int>(((rounds_ & ((std::int64_t{1} << seq_bits_) - 1)) << (kind_shift() + 3)) |
                       (std::int64_t{mpi_detail::kNoticeKind} << kind_shift()));
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

}  // namespace laga
