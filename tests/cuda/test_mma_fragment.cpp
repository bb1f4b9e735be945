// The tensor-core fragment maps of the fused latent kernel's bf16
// up-projection (cuda/mma_fragment.hpp; attention.cu, LatentKvTensorCore),
// on the host: the kernel has not run on a GPU, so what can be held without
// one is held here. Each map must put every element of its tile in exactly
// one (lane, element), pair a register's two bf16 halves on neighbouring k
// (A's columns, B's rows: what one 32-bit register of the fragment holds),
// and give C's elements A's rows and B's columns within a lane's quad.
// What it cannot hold: that the PTX ISA's maps are these (the first GPU run
// does, laga_cuda_check's bf16 fused case).
#include <gtest/gtest.h>

#include <array>

#include "cuda/mma_fragment.hpp"

namespace laga::cuda::mma {
namespace {

TEST(MmaFragment, EachMapCoversItsTileOnce) {
  std::array<int, kM * kK> a{};
  std::array<int, kK * kN> b{};
  std::array<int, kM * kN> c{};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < kAElems; ++i) {
      const Coord x = a_coord(lane, i);
      ASSERT_TRUE(x.row >= 0 && x.row < kM && x.col >= 0 && x.col < kK) << lane << " " << i;
      ++a[x.row * kK + x.col];
    }
    for (int i = 0; i < kBElems; ++i) {
      const Coord x = b_coord(lane, i);
      ASSERT_TRUE(x.row >= 0 && x.row < kK && x.col >= 0 && x.col < kN) << lane << " " << i;
      ++b[x.row * kN + x.col];
    }
    for (int i = 0; i < kCElems; ++i) {
      const Coord x = c_coord(lane, i);
      ASSERT_TRUE(x.row >= 0 && x.row < kM && x.col >= 0 && x.col < kN) << lane << " " << i;
      ++c[x.row * kN + x.col];
    }
  }
  for (int n : a) EXPECT_EQ(n, 1);
  for (int n : b) EXPECT_EQ(n, 1);
  for (int n : c) EXPECT_EQ(n, 1);
}

TEST(MmaFragment, ARegisterHoldsNeighboursAlongK) {
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < kAElems / 2; ++r) {
      const Coord lo = a_coord(lane, 2 * r), hi = a_coord(lane, 2 * r + 1);
      EXPECT_EQ(lo.row, hi.row);
      EXPECT_EQ(hi.col, lo.col + 1);
      EXPECT_EQ(lo.col % 2, 0);
    }
    for (int r = 0; r < kBElems / 2; ++r) {
      const Coord lo = b_coord(lane, 2 * r), hi = b_coord(lane, 2 * r + 1);
      EXPECT_EQ(lo.col, hi.col);
      EXPECT_EQ(hi.row, lo.row + 1);
      EXPECT_EQ(lo.row % 2, 0);
    }
    // The lanes of a quad (same lane / 4) share A's rows and B's column; C's
    // row is A's, C's columns are the quad's B columns.
    EXPECT_EQ(c_coord(lane, 0).row, a_coord(lane, 0).row);
    EXPECT_EQ(c_coord(lane, 2).row, a_coord(lane, 2).row);
    EXPECT_EQ(b_coord(lane, 0).col, lane / 4);
  }
}

}  // namespace
}  // namespace laga::cuda::mma
