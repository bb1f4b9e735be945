// What the MPI backend's files share (mpi_session.cpp, mpi_notice.cpp,
// mpi_transport.cpp, mpi_comm.cpp); not part of the library's interface.
#pragma once

#include <mpi.h>

#include <string>

namespace laga::mpi_detail {

std::string mpi_error_string(int code);
// Throws laga::Error "<what> failed: <MPI's text>" unless rc is MPI_SUCCESS.
void mpi_check(int rc, const char* what);
// MPI is initialised and not yet finalised.
bool mpi_is_running();
// Polling cadence: spin while messages are likely in flight, then yield, then
// sleep a little so that 8 oversubscribed ranks on 2 cores still make progress
// (each MPI_Test* call also drives OpenMPI's progress engine, so the sleep is
// kept short).
void back_off(long polls);
// One more request left pending for good (mpi_orphaned_requests()).
void count_orphan();

// Tag kind bits that no collective uses: a failure notice (mpi_notice.cpp).
constexpr int kNoticeKind = 7;
// Receives the notice that `st` (from MPI_Iprobe) announces: its text.
std::string receive_notice(int peer, const MPI_Status& st, MPI_Comm comm);

}  // namespace laga::mpi_detail
