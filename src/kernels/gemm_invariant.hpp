// The invariant GEMM (issue 56, docs/invariance.md): C = alpha S + beta C,
// where every element S(i, j) = sum over k of op(A)(i, k) op(B)(k, j) is
// summed in one fixed order -- the pairwise tree defined below -- whatever
// the row count M, the column count N, the strides, the thread count or the
// ISA the kernel runs on. So a token's row of x W^T has the same bits
// whether its rank holds 1 row or 10^5, and a sum over a token range that
// is a subtree of the global sequence's tree has the same bits whichever
// rank computes it (mla/canonical_sum.hpp builds the reduction over tokens on
// that).
//
// The order (the "padded pairwise tree" over k): the K products
// p_k = op(A)(i, k) op(B)(k, j), each rounded once (no fused multiply-add:
// the file is compiled with -ffp-contract=off), are the leaves 0 .. K-1 of a
// complete binary tree of 2^ceil(log2 K) leaves whose missing leaves are
// absent; a node with both children present is left + right (one rounded
// add), a node with only its left child passes it up unchanged. The tree of
// the leaves [a, a + 2^l) for a a multiple of 2^l is a subtree of any larger
// such tree, which is what lets a sum over a range of the global sequence be
// cut into aligned pieces and combined later with the same bits.
//
// The kernel works on blocks of 8 k (the tree's bottom three levels,
// unrolled) and keeps the levels above as a binary counter, so it streams K
// once; it is vectorised over columns j, which changes no element's order.
#pragma once

#include <cstdint>

namespace laga {

// C (M, N) = alpha * S + beta * C, op(A) (M, K), op(B) (K, N), row-major,
// strides in elements; S the padded pairwise tree above. beta 0 ignores C's
// old contents. T: float or double.
template <class T>
void gemm_invariant(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
                    T alpha, const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta,
                    T* C, std::int64_t ldc);

// The same sum by the tree's definition (recursion on halves, one element at
// a time): the reference gemm_invariant is held to bit for bit.
template <class T>
void gemm_invariant_reference(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N,
                              std::int64_t K, T alpha, const T* A, std::int64_t lda, const T* B,
                              std::int64_t ldb, T beta, T* C, std::int64_t ldc);

}  // namespace laga
