// The tensor-core fragment maps of the fused latent kernel's bf16
// up-projection (cuda/mma_fragment.hpp; attention.cu, LatentKvTensorCore),
// on the host: the kernel has not run on a GPU, so what can be held without
// one is held here. Each map must put every element of its tile in exactly
// one (lane, element), pair a register's two bf16 halves on neighbouring k
// (A's columns, B's rows: what one 32-bit register of the fragment holds),
// and give C's elements A's rows and B's columns within a lane's quad.
// The maps are also held against the PTX ISA's table, written out below from
// the ISA's text (PTX ISA 8.x, 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16
// with floating point type", .bf16 A and B, .f32 C/D), and the kernel's
// up-projection tile loop (attention.cu, LatentKvTensorCore: its warps'
// tiles, the k-steps, the padding, the stores) is emulated lane by lane,
// the mma by that table, against a naive GEMM. What it cannot hold: that the
// hardware does what the ISA says, and the register packing (bf16_pair: the
// lower-indexed element in the low half, as the ISA's "elements low to
// high"), which is device code (the first GPU run does, laga_cuda_check's
// bf16 fused case).
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

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

// The PTX ISA's table, as its text gives it (groupID = %laneid >> 2,
// threadID_in_group = %laneid % 4), not as mma_fragment.hpp computes it.
Coord ptx_a(int lane, int i) {
  const int group = lane >> 2, tig = lane % 4;
  const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
  const int col = i < 4 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
  return {row, col};
}
Coord ptx_b(int lane, int i) {
  const int group = lane >> 2, tig = lane % 4;
  const int row = i < 2 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
  return {row, group};
}
Coord ptx_c(int lane, int i) {
  const int group = lane >> 2, tig = lane % 4;
  return {i < 2 ? group : group + 8, tig * 2 + (i & 1)};
}

TEST(MmaFragment, MapsAreThePtxIsaTable) {
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < kAElems; ++i) {
      EXPECT_EQ(a_coord(lane, i).row, ptx_a(lane, i).row) << "A lane " << lane << " a" << i;
      EXPECT_EQ(a_coord(lane, i).col, ptx_a(lane, i).col) << "A lane " << lane << " a" << i;
    }
    for (int i = 0; i < kBElems; ++i) {
      EXPECT_EQ(b_coord(lane, i).row, ptx_b(lane, i).row) << "B lane " << lane << " b" << i;
      EXPECT_EQ(b_coord(lane, i).col, ptx_b(lane, i).col) << "B lane " << lane << " b" << i;
    }
    for (int i = 0; i < kCElems; ++i) {
      EXPECT_EQ(c_coord(lane, i).row, ptx_c(lane, i).row) << "C lane " << lane << " c" << i;
      EXPECT_EQ(c_coord(lane, i).col, ptx_c(lane, i).col) << "C lane " << lane << " c" << i;
    }
  }
}

// LatentKvTensorCore::load's up-projection on the host: 4 warps take the
// chunk's 16 x 8 tiles in turn, each lane's fragments read through
// latent_a_offset / latent_b_offset as the kernel reads them, the warp's mma
// done by the ISA's table (the tiles rebuilt from the 32 lanes' fragments,
// D = A B + C, D handed back by the table), each lane storing its four sums
// at c_coord as the kernel does. Extents off the tile sizes (21 keys, 21
// rows, C 40, a padded ld_c); small integer values, so every sum is exact
// and the result must equal the naive c w^T exactly, each element written
// once.
TEST(MmaFragment, EmulatedUpProjectionIsANaiveGemm) {
  const int n = 21, warps = 4;
  const std::int64_t rows = 21, C = 40, ld_c = C + 3;
  std::vector<float> c(static_cast<size_t>(n * ld_c)), w(static_cast<size_t>(rows * C));
  for (size_t x = 0; x < c.size(); ++x) c[x] = float(int(x * 7 % 11) - 5);
  for (size_t x = 0; x < w.size(); ++x) w[x] = float(int(x * 5 % 9) - 4);
  std::vector<float> out(static_cast<size_t>(n * rows), 0.f);
  std::vector<int> writes(out.size(), 0);
  const int mt = (n + kM - 1) / kM, nt = static_cast<int>((rows + kN - 1) / kN);
  for (int warp = 0; warp < warps; ++warp)
    for (int tile = warp; tile < mt * nt; tile += warps) {
      const int m0 = (tile / nt) * kM, n0 = (tile % nt) * kN;
      float acc[32][kCElems] = {};
      for (std::int64_t k0 = 0; k0 < C; k0 += kK) {
        float a[kM][kK] = {}, b[kK][kN] = {};
        int a_seen[kM][kK] = {}, b_seen[kK][kN] = {};
        for (int lane = 0; lane < 32; ++lane) {
          for (int i = 0; i < kAElems; ++i) {
            const std::int64_t at = latent_a_offset(lane, i, m0, k0, n, C, ld_c);
            const Coord x = ptx_a(lane, i);  // where the hardware takes a_i from
            a[x.row][x.col] = at < 0 ? 0.f : c[size_t(at)];
            ++a_seen[x.row][x.col];
          }
          for (int i = 0; i < kBElems; ++i) {
            const std::int64_t at = latent_b_offset(lane, i, n0, k0, rows, C);
            const Coord x = ptx_b(lane, i);
            b[x.row][x.col] = at < 0 ? 0.f : w[size_t(at)];
            ++b_seen[x.row][x.col];
          }
        }
        for (int r = 0; r < kM; ++r)
          for (int q = 0; q < kK; ++q) ASSERT_EQ(a_seen[r][q], 1) << r << "," << q;
        for (int q = 0; q < kK; ++q)
          for (int e = 0; e < kN; ++e) ASSERT_EQ(b_seen[q][e], 1) << q << "," << e;
        for (int lane = 0; lane < 32; ++lane)
          for (int i = 0; i < kCElems; ++i) {
            const Coord x = ptx_c(lane, i);
            for (int q = 0; q < kK; ++q) acc[lane][i] += a[x.row][q] * b[q][x.col];
          }
      }
      for (int lane = 0; lane < 32; ++lane)
        for (int i = 0; i < kCElems; ++i) {
          const Coord x = c_coord(lane, i);  // the kernel's store
          const int jj = m0 + x.row;
          const std::int64_t e = n0 + x.col;
          if (jj >= n || e >= rows) continue;
          out[size_t(jj * rows + e)] = acc[lane][i];
          ++writes[size_t(jj * rows + e)];
        }
    }
  for (int j = 0; j < n; ++j)
    for (std::int64_t e = 0; e < rows; ++e) {
      double want = 0;
      for (std::int64_t q = 0; q < C; ++q)
        want += double(c[size_t(j * ld_c + q)]) * w[size_t(e * C + q)];
      EXPECT_EQ(writes[size_t(j * rows + e)], 1) << j << "," << e;
      EXPECT_EQ(out[size_t(j * rows + e)], want) << "key " << j << " row " << e;
    }
}

}  // namespace
}  // namespace laga::cuda::mma
