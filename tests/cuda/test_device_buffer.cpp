// DeviceBuffer's accounting (cuda/device_buffer.hpp): the bytes, categories,
// names and peaks a device buffer registers with the pool, the count-only
// run that makes no CUDA call (so it runs here, without a GPU), and the
// refusal when there is no device to allocate on.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "cuda/device.hpp"
#include "cuda/device_buffer.hpp"

namespace laga::cuda {
namespace {

TEST(DeviceBuffer, CountOnlyRegistersBytesWithoutStorage) {
  MemoryPool pool;
  pool.set_count_only(true);
  pool.set_live_tracking(true);
  PoolScope scope(pool);
  {
    DeviceBuffer a(1000, "q_dev", MemCategory::activations);
    DeviceBuffer w(256, "wkv_b_dev", MemCategory::parameters);
    EXPECT_FALSE(a.backed());
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(pool.current(MemCategory::activations), 1000);
    EXPECT_EQ(pool.current(MemCategory::parameters), 256);
    {
      DeviceBuffer t(4000, "scores_dev");
      EXPECT_EQ(pool.current_total(), 5256);
    }
    EXPECT_EQ(pool.current_total(), 1256);
    EXPECT_EQ(pool.peak_total(), 5256);
    EXPECT_EQ(pool.working_peak_snapshot().where, "scores_dev");
    // A move carries the registration; the moved-from buffer has none.
    DeviceBuffer b = std::move(a);
    EXPECT_EQ(b.bytes(), 1000);
    EXPECT_EQ(a.bytes(), 0);
    EXPECT_EQ(pool.current_total(), 1256);
    // Copies on an unbacked buffer do nothing; the wrong size is still refused.
    char host[1000] = {};
    b.upload(host, 1000);
    b.download(host, 1000);
    b.zero();
    try {
      b.upload(host, 999);
      FAIL() << "a short upload was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("999 bytes given for a buffer of 1000"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(pool.current_total(), 0);
  EXPECT_EQ(pool.peak(MemCategory::activations), 5000);
}

TEST(DeviceBuffer, ZeroBytesRegistersNothing) {
  MemoryPool pool;
  PoolScope scope(pool);
  DeviceBuffer z(0, "empty");
  EXPECT_EQ(pool.alloc_count(), 0);
  EXPECT_FALSE(z.backed());
  EXPECT_THROW(DeviceBuffer(-1, "negative"), Error);
}

// A real pool allocates with cudaMalloc: on a machine without a device the
// refusal names the bytes and the buffer and leaves nothing registered; with
// one, the bytes are registered and the storage works both ways.
TEST(DeviceBuffer, RealAllocationRefusedWithoutDeviceOrRoundTrips) {
  MemoryPool pool;
  PoolScope scope(pool);
  if (!device_unavailable_reason().empty()) {
    try {
      DeviceBuffer b(4096, "x_dev");
      FAIL() << "cudaMalloc succeeded with no usable device";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("cudaMalloc of 4096 bytes for 'x_dev' failed"), std::string::npos) << m;
    }
    EXPECT_EQ(pool.current_total(), 0);
    EXPECT_EQ(pool.alloc_count(), 0);
    return;
  }
  DeviceBuffer b(4096, "x_dev");
  EXPECT_TRUE(b.backed());
  EXPECT_EQ(pool.current_total(), 4096);
  std::string in(4096, 'a'), out(4096, 'b');
  b.upload(in.data(), 4096);
  b.download(out.data(), 4096);
  EXPECT_EQ(in, out);
}

}  // namespace
}  // namespace laga::cuda
