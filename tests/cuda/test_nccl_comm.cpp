// The NCCL transport (cuda/nccl_comm.hpp). Without a device: making the
// communicator fails with a laga::Error naming the NCCL call, never a crash
// or a hang. With one (not CI's): a 1-rank group's collectives move the
// data on the device and its ledger records what the base class derives.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "cuda/device.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/nccl_comm.hpp"

namespace laga::cuda {
namespace {

TEST(NcclComm, WithoutADeviceTheRefusalNamesTheCall) {
  if (device_unavailable_reason().empty())
    GTEST_SKIP() << "a CUDA device is here: see OneRankMovesData";
  try {
    NcclCommunicator c(make_nccl_id(), 0, 1);
    FAIL() << "an NCCL communicator was made without a device";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(m.find("ncclGetUniqueId") != std::string::npos ||
                m.find("ncclCommInitRank") != std::string::npos)
        << m;
  }
}

TEST(NcclComm, OneRankMovesData) {
  const std::string why = device_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << "needs a CUDA device: " << why;
  MemoryPool pool;
  PoolScope scope(pool);
  NcclCommunicator c(make_nccl_id(), 0, 1);
  EXPECT_EQ(c.backend(), Backend::nccl);
  std::vector<float> h{1, 2, 3, 4}, back(4);
  DeviceBuffer a(16, "a"), b(16, "b");
  a.upload(h.data(), 16);
  const std::int64_t n = 4, zero = 0;
  c.all_gather_v(a.as<float>(), n, b.as<float>(), &n, &zero, "ag");
  b.download(back.data(), 16);
  EXPECT_EQ(back, h);
  c.all_reduce(a.as<float>(), 4, "ar");
  a.download(back.data(), 16);
  EXPECT_EQ(back, h);
  c.ring_shift(a.as<float>(), 4, b.as<float>(), 4, "ring");
  b.download(back.data(), 16);
  EXPECT_EQ(back, h);
  EXPECT_EQ(c.ledger().bytes_sent(), 0);  // one rank sends nothing
}

}  // namespace
}  // namespace laga::cuda
