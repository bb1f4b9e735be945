// Where a lane's elements of one warp-wide tensor-core product sit in its
// tiles: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type"), D (16 x 8,
// fp32) = A (16 x 16, bf16, row-major) B (16 x 8, bf16, column-major) + C.
// With g = lane / 4 and t = lane % 4:
//   A: 4 registers of 2 bf16 each, element i of 8 at (g + 8 [i in {2,3,6,7}],
//      2t + i % 2 + 8 [i >= 4]); register r holds elements 2r (low half) and 2r + 1;
//   B: 2 registers, element i of 4 at (k 2t + i % 2 + 8 [i >= 2], n g);
//   C, D: 4 fp32, element i at (g + 8 [i >= 2], 2t + i % 2).
// The fused latent kernel's up-projection (attention.cu, LatentKvTensorCore)
// builds its fragments from these and from latent_a_offset / latent_b_offset
// below, and tests/cuda/test_mma_fragment.cpp holds on the host that the maps
// are the PTX ISA's table (written out there from the ISA's text), that each
// covers its tile once, and that the kernel's tile loop, emulated lane by
// lane, is a naive GEMM; so a typo here is caught without a device. Host and
// device alike.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LAGA_HOST_DEVICE __host__ __device__
#else
#define LAGA_HOST_DEVICE
#endif

namespace laga::cuda::mma {

constexpr int kM = 16, kN = 8, kK = 16;               // the product's tile
constexpr int kAElems = 8, kBElems = 4, kCElems = 4;  // per lane

struct Coord {
  int row, col;
};

// Element i (0..7) of lane's A fragment: (row m, column k).
LAGA_HOST_DEVICE constexpr Coord a_coord(int lane, int i) {
  return {(lane >> 2) + 8 * ((i >> 1) & 1), 2 * (lane & 3) + (i & 1) + 8 * (i >> 2)};
}
// Element i (0..3) of lane's B fragment: (row k, column n).
LAGA_HOST_DEVICE constexpr Coord b_coord(int lane, int i) {
  return {2 * (lane & 3) + (i & 1) + 8 * (i >> 1), lane >> 2};
}
// Element i (0..3) of lane's C and D fragments: (row m, column n).
LAGA_HOST_DEVICE constexpr Coord c_coord(int lane, int i) {
  return {(lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)};
}

// The fused latent kernel's up-projection, K | V (key m, row e) = sum_q
// c (key m, latent q) w_kv (row e, latent q): A is the chunk's latent rows
// (n keys, stride ld_c), B is w_kv's head rows transposed (rows x C, stride
// C). Where element i of lane's fragment is, for the tile at (m0, n0) and the
// k-step k0: an offset into c (A) or w_kv (B), or -1 past the chunk's keys,
// the head's rows or C (the fragment holds 0 there).
LAGA_HOST_DEVICE constexpr std::int64_t latent_a_offset(int lane, int i, int m0, std::int64_t k0,
                                                        int n, std::int64_t C, std::int64_t ld_c) {
  const Coord x = a_coord(lane, i);
  const int key = m0 + x.row;
  const std::int64_t q = k0 + x.col;
  return key < n && q < C ? key * ld_c + q : -1;
}
LAGA_HOST_DEVICE constexpr std::int64_t latent_b_offset(int lane, int i, int n0, std::int64_t k0,
                                                        std::int64_t rows, std::int64_t C) {
  const Coord x = b_coord(lane, i);
  const std::int64_t e = n0 + x.col, q = k0 + x.row;
  return e < rows && q < C ? e * C + q : -1;
}

}  // namespace laga::cuda::mma

#undef LAGA_HOST_DEVICE
