// The lightning indexer's fp8 scoring (IndexerShape::scores ==
// IndexScores::fp8; docs/forms.md, "The fp8 indexer"): DeepSeek-V3.2-Exp's
// Indexer.forward from rotate_activation on, on the CPU,
//   q' = act_quant(rotate_activation(q_i,h))   (q' e4m3 values, scale sq_i,h)
//   k' = act_quant(rotate_activation(k_j))     (k' e4m3 values, scale sk_j)
//   I_ij = sk_j sum_h ReLU(q'_i,h . k'_j) (w_i,h sq_i,h)       (fp8_index)
// with d_I = 128 = one block (DeepSeek's fp8_index takes one k scale per
// key, so its code runs only with index_head_dim equal to its block_size)
// and scale_fmt ue8m0 (V3.2's config). Arithmetic: the rotation in double,
// rounded to fp32 before act_quant (DeepSeek rotates bf16 and quantizes
// what the transform returns); each q'.k' is exact (products of e4m3 values
// summed in double are exact); the head sum in double, rounded once to fp32
// after the k scale. DeepSeek's fp8_index accumulates in fp32 on tensor cores:
// the scores agree to fp32 rounding, not bit for bit (a top-k boundary within
// that gap can differ; the harness refuses such a case, docs/testing.md).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/dsa_indexer.hpp"
#include "kernels/fp8_e4m3.hpp"

namespace laga {

inline constexpr Fp8ScaleFmt kIndexFp8ScaleFmt = Fp8ScaleFmt::ue8m0;  // V3.2's scale_fmt

// q' (B Sq H_I, d_I) and k' (B Sk, d_I) quantized once per call, each
// row's scale beside it.
struct DsaFp8Operands {
  std::vector<float> q, q_scale, k, k_scale;
};

// Rotates and quantizes q (B, Sq, H_I, d_I) and k (B, Sk, d_I). Throws
// laga::Error where d_I is not 128 or a value is not finite.
template <class T>
DsaFp8Operands dsa_fp8_operands(const IndexerShape& s, const T* q, const T* k);

// I_ij of the keys [j0, j1) of query row (b, i) into out[j - j0].
template <class T>
void dsa_fp8_row_scores(const IndexerShape& s, const DsaFp8Operands& op, std::int64_t b,
                        std::int64_t i, const T* w, std::int64_t j0, std::int64_t j1, T* out);

}  // namespace laga
