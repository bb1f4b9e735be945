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
// builds its fragments from these, and tests/cuda/test_mma_fragment.cpp holds
// on the host that each covers its tile once, so a typo here is caught
// without a device. Host and device alike.
#pragma once

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

}  // namespace laga::cuda::mma

#undef LAGA_HOST_DEVICE
