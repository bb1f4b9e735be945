// The MPI backend's process-wide part: MPI_Init/MPI_Finalize (MpiSession),
// launcher detection, and the count of orphaned requests that decides
// between MPI_Finalize and MPI_Abort at exit.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/mpi_comm.hpp"
#include "comm/mpi_detail.hpp"
#include "core/error.hpp"

namespace laga {

namespace mpi_detail {

namespace {
std::atomic<std::int64_t> g_orphaned_requests{0};
}  // namespace

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return cat("MPI error ", code);
  return std::string(text, static_cast<size_t>(len));
}

void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) fail(what, " failed: ", mpi_error_string(rc));
}

bool mpi_is_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

void back_off(long polls) {
  if (polls < 64) return;
  if (polls < 1024) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(polls < 4096 ? 20 : 100));
}

void count_orphan() {
  g_orphaned_requests.fetch_add(1);
}

}  // namespace mpi_detail

using namespace mpi_detail;

std::int64_t mpi_orphaned_requests() {
  return mpi_detail::g_orphaned_requests.load();
}

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

int mpi_launcher_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"})
    if (const char* v = std::getenv(var)) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && n > 0 && n < (1L << 30)) return static_cast<int>(n);
    }
  return 0;
}

}  // namespace laga
