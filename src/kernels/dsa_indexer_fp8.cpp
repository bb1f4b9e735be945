#include "kernels/dsa_indexer_fp8.hpp"

#include "core/error.hpp"
#include "kernels/hadamard.hpp"

namespace laga {

namespace {

// rotate_activation then act_quant of `rows` rows of d values.
template <class T>
void rotate_quantize(const T* x, std::int64_t rows, std::int64_t d, std::vector<float>& values,
                     std::vector<float>& scales) {
  std::vector<double> r(x, x + rows * d);
  hadamard_rotate(r.data(), rows, d);
  const std::vector<float> r32(r.begin(), r.end());
  values.resize(static_cast<std::size_t>(rows * d));
  scales.resize(static_cast<std::size_t>(rows * (d / kActQuantBlock)));
  act_quant(r32.data(), rows, d, kActQuantBlock, kIndexFp8ScaleFmt, values.data(), scales.data());
}

}  // namespace

template <class T>
DsaFp8Operands dsa_fp8_operands(const IndexerShape& s, const T* q, const T* k) {
  const AttnShape& a = s.attn;
  LAGA_CHECK(a.dqk == kActQuantBlock, "indexer: the fp8 scoring (index_fp8) needs index_head_dim ",
             kActQuantBlock, " (one fp8 block per key, as DeepSeek's fp8_index takes), got ", a.dqk,
             "; set index_head_dim ", kActQuantBlock, " or turn index_fp8 off");
  DsaFp8Operands op;
  rotate_quantize(q, a.B * a.Sq * a.Hq, a.dqk, op.q, op.q_scale);
  rotate_quantize(k, a.B * a.Sk, a.dqk, op.k, op.k_scale);
  return op;
}

template <class T>
void dsa_fp8_row_scores(const IndexerShape& s, const DsaFp8Operands& op, std::int64_t b,
                        std::int64_t i, const T* w, std::int64_t j0, std::int64_t j1, T* out) {
  const AttnShape& a = s.attn;
  const std::int64_t bi = b * a.Sq + i, d = a.dqk;
  const float* qrow = op.q.data() + bi * a.Hq * d;
  // DeepSeek's weights * q_scale (fp32), per head.
  std::vector<float> wq(static_cast<std::size_t>(a.Hq));
  for (std::int64_t h = 0; h < a.Hq; ++h)
    wq[std::size_t(h)] = float(w[bi * a.Hq + h]) * op.q_scale[std::size_t(bi * a.Hq + h)];
  for (std::int64_t j = j0; j < j1; ++j) {
    const std::int64_t bj = b * a.Sk + j;
    const float* krow = op.k.data() + bj * d;
    double sum = 0;
    for (std::int64_t h = 0; h < a.Hq; ++h) {
      double dot = 0;  // exact: e4m3 x e4m3 products summed in double
      for (std::int64_t e = 0; e < d; ++e) dot += double(qrow[h * d + e]) * double(krow[e]);
      if (dot > 0) sum += double(float(dot)) * double(wq[std::size_t(h)]);
    }
    out[j - j0] = T(float(sum * double(op.k_scale[std::size_t(bj)])));
  }
}

#define LAGA_INSTANTIATE(T)                                                                     \
  template DsaFp8Operands dsa_fp8_operands<T>(const IndexerShape&, const T*, const T*);         \
  template void dsa_fp8_row_scores<T>(const IndexerShape&, const DsaFp8Operands&, std::int64_t, \
                                      std::int64_t, const T*, std::int64_t, std::int64_t, T*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
