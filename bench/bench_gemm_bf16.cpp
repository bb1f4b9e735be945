// bf16 GEMMs (kernels/gemm_bf16.hpp, issue 27) against laga's fp32 GEMM on
// the D 2048 block's projections (H 16, C 512, dn 128, dr 64, dv 128, T 2048
// tokens at P 1): the fused input projection D -> H(dn+dr) + C+dr, the
// up-projection wkv_b C -> H(dn+dv) and the output projection wo H dv -> D,
// each as its forward NT (T, out, in), dx = dy W NN (T, in, out) and
// dW = dy^T x TN (out, in, T). GFLOP = 2 M N K. All rows of one product are
// timed alternately (every round calls each in turn), and the note after
// them gives the median over rounds of each round's fp32 ms / bf16 ms.
//
// Rows per product:
//   f32          laga::gemm<float> on the fp32 inputs (oneDNN's dnnl_sgemm)
//   bf16         gemm_bf16 with an fp32 C (products summed in fp32)
//   bf16_out     gemm_bf16 with a bf16 C (activations: y, dx)
//   bf16_acc     dW += dy^T x into the fp32 gradient (beta 1, the training op)
//   bf16_packed  oneDNN's matmul on W reordered once into the blocked layout
//                it asks for (format_tag::any): whether packing the weight
//                pays; its reorder is timed alone on the next rows, from the
//                bf16 copy (reorder_w) and from the fp32 master weight in one
//                pass that converts as it packs (reorder_w_f32)
//   bf16_strided gemm_bf16 with x's rows padded (lda > in): oneDNN 2.6 runs
//                that on its jit gemm, not brgemm (gemm_bf16.hpp)
//   cvt_w        convert_to_bf16 of W (out x in): the per-step copy of an
//                fp32 master weight; the note puts it against the bf16 GEMM
// %peak of the bf16 rows is against the bf16 dot-product peak (VDPBF16PS,
// harness.hpp), of the f32 row against the AVX-512 FMA peak.
//
// #wrong: sampled rows of C against double loops on the same inputs as the
// row's (the bf16-rounded ones for bf16 rows): 1e-5 max|ref| for fp32 C,
// 2^-8 + 1e-5 for a bf16 C (one rounding to 8 significand bits).
#include <omp.h>

#include <algorithm>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "gemm_backends.hpp"
#include "harness.hpp"
#include "kernels/bf16_convert.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_bf16.hpp"

namespace {

using dnnl::memory;
using laga::bf16;

struct Linear {
  const char* what;
  std::int64_t in, out;
};

std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  laga::convert_to_bf16(x.data(), y.data(), std::int64_t(x.size()));
  return y;
}
std::vector<float> widened(const std::vector<bf16>& x) {
  std::vector<float> y(x.size());
  laga::convert_to_float(x.data(), y.data(), std::int64_t(x.size()));
  return y;
}

// C (M, N) = op(A) op(B) on oneDNN's matmul with B reordered, once, into the
// layout the primitive picks for it: what a pre-packed bf16 weight copy
// would run. Made outside the timing; run() is one matmul.
class PackedMatmul {
 public:
  PackedMatmul(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const bf16* A,
               const bf16* B, const float* B_f32, float* C)
      : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {
    const memory::desc a({M, K}, memory::data_type::bf16,
                         ta ? memory::dims{1, M} : memory::dims{K, 1});
    const memory::desc b_plain({K, N}, memory::data_type::bf16,
                               tb ? memory::dims{1, K} : memory::dims{N, 1});
    const memory::desc b_any({K, N}, memory::data_type::bf16, memory::format_tag::any);
    const memory::desc c({M, N}, memory::data_type::f32, memory::dims{N, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b_any, c), engine_);
    implementation_ = pd.impl_info_str();
    matmul_ = dnnl::matmul(pd);
    a_ = memory(a, engine_, const_cast<bf16*>(A));
    c_ = memory(c, engine_, C);
    b_plain_ = memory(b_plain, engine_, const_cast<bf16*>(B));
    b_packed_ = memory(pd.weights_desc(), engine_);
    reorder_ = dnnl::reorder(b_plain_, b_packed_);
    // The fp32 master weight straight into the packed bf16 layout: one pass
    // that converts and packs, instead of convert_to_bf16 then reorder.
    b_f32_ = memory(
        memory::desc({K, N}, memory::data_type::f32, tb ? memory::dims{1, K} : memory::dims{N, 1}),
        engine_, const_cast<float*>(B_f32));
    reorder_f32_ = dnnl::reorder(b_f32_, b_packed_);
    pack();
  }
  void pack_from_f32() {
    reorder_f32_.execute(stream_, b_f32_, b_packed_);
    stream_.wait();
  }
  void pack() {
    reorder_.execute(stream_, b_plain_, b_packed_);
    stream_.wait();
  }
  void run() {
    matmul_.execute(stream_,
                    {{DNNL_ARG_SRC, a_}, {DNNL_ARG_WEIGHTS, b_packed_}, {DNNL_ARG_DST, c_}});
    stream_.wait();
  }
  const std::string& implementation() const { return implementation_; }

 private:
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul matmul_;
  dnnl::reorder reorder_, reorder_f32_;
  memory a_, c_, b_plain_, b_packed_, b_f32_;
  std::string implementation_;
};

}  // namespace

LAGA_BENCH(gemm_bf16,
           "bf16 GEMMs (fp32 accumulation) vs fp32, alternating, on the block's shapes") {
  const bool quick = ctx.options().quick;
  const std::int64_t T = quick ? 256 : 2048;  // tokens
  const std::int64_t s = quick ? 8 : 1;       // --quick divides the widths by 8
  const std::vector<Linear> layers = {
      {"D2048 wq | wkv_a fused: D -> H(dn+dr) + C+dr", 2048 / s, 3648 / s},
      {"D2048 wkv_b: C -> H(dn+dv)", 512 / s, 4096 / s},
      {"D2048 wo: H dv -> D", 2048 / s, 2048 / s},
  };
  // Without AVX512_BF16 the bf16 rows run oneDNN's emulation or the widened
  // fp32 path; their %peak is then against the fp32 FMA peak of the widest ISA.
  const bool bf16_cpu = laga::bench::cpu_has_avx512_bf16();
  const std::string f32_isa = laga::bench::gemm_isa();
  const std::string bf16_isa = bf16_cpu ? "bf16" : f32_isa;
  const int threads = ctx.options().threads;
  ctx.note(laga::cat("T ", T, " tokens; fp32 GEMM ", laga::gemm_kernels(), "; bf16 conversion ",
                     laga::to_string(laga::bf16_convert_isa())));
  if (bf16_cpu)
    ctx.note(laga::cat("peaks on ", threads, " threads: bf16 dot product (VDPBF16PS) ",
                       laga::bench::measure_isa_peak("bf16", threads, 3), " GFLOP/s, ",
                       laga::bench::cpu_has_amx_bf16()
                           ? laga::cat("AMX bf16 tiles (TDPBF16PS) ",
                                       laga::bench::measure_isa_peak("amx", threads, 3),
                                       " GFLOP/s (the rows oneDNN runs on AMX are held to it), ")
                           : std::string(),
                       "fp32 FMA (", f32_isa, ") ",
                       laga::bench::measure_isa_peak(f32_isa, threads, 3), " GFLOP/s"));
  // The bf16 rows measure oneDNN's bf16 matmul, which is what is held to the
  // bf16 peak, whatever path a run's auto takes here (gemm_bf16_path: an
  // Intel CPU without AMX widens to fp32, where this matmul is the slower).
  const laga::GemmBf16Path run_path = laga::gemm_bf16_path();
  std::string forced = "widened to fp32 (oneDNN has no bf16 matmul on this CPU)";
  try {
    laga::set_gemm_bf16_path(laga::GemmBf16Path::onednn_bf16);
    forced = "oneDNN's bf16 matmul";
  } catch (const laga::Error&) {
  }
  ctx.note(laga::cat("bf16 rows: ", forced, "; a run here takes ", laga::to_string(run_path),
                     " (gemm_bf16_path, LAGA_GEMM_BF16)"));
  ctx.header();

  struct Product {
    const char* name;
    bool ta, tb;
    std::int64_t M, N, K;
    int a, b;  // which of x, w, dy are A and B (0 x, 1 w, 2 dy)
    std::int64_t lda, ldb;
    bool b_is_weight;  // packing B is a weight reorder (fwd, dx), not an activation's (dW)
  };
  for (const Linear& layer : layers) {
    if (!laga::bench::case_selected(ctx.options(), layer.what)) continue;
    const std::int64_t in = layer.in, out = layer.out;
    std::vector<std::vector<float>> f32(3);
    f32[0].resize(size_t(T * in));
    f32[1].resize(size_t(out * in));
    f32[2].resize(size_t(T * out));
    for (int t = 0; t < 3; ++t)
      laga::fill_normal(f32[size_t(t)].data(), std::int64_t(f32[size_t(t)].size()), 1,
                        std::uint64_t(t), 0, 1.0);
    std::vector<std::vector<bf16>> b16(3);
    std::vector<std::vector<float>> b16_wide(3);  // the bf16 values, exactly, for the reference
    for (int t = 0; t < 3; ++t) {
      b16[size_t(t)] = rounded(f32[size_t(t)]);
      b16_wide[size_t(t)] = widened(b16[size_t(t)]);
    }
    // x with each row padded by 64 elements: the strided row's A.
    const std::int64_t ld_pad = in + 64;
    std::vector<bf16> x_padded(size_t(T * ld_pad));
    for (std::int64_t r = 0; r < T; ++r)
      std::copy_n(b16[0].data() + r * in, in, x_padded.data() + r * ld_pad);

    ctx.note(layer.what);
    const std::vector<Product> products = {
        {"fwd_nt", false, true, T, out, in, 0, 1, in, in, true},   // y = x W^T
        {"dx_nn", false, false, T, in, out, 2, 1, out, in, true},  // dx = dy W
        {"dw_tn", true, false, out, in, T, 2, 0, out, in, false},  // dW = dy^T x
    };
    for (const Product& p : products) {
      const std::vector<std::int64_t> rows = laga::bench::sampled_rows(p.M);
      const std::vector<double> ref_f32 =
          laga::bench::reference_rows(rows, p.ta, p.tb, p.N, p.K, f32[size_t(p.a)].data(), p.lda,
                                      f32[size_t(p.b)].data(), p.ldb);
      const std::vector<double> ref_b16 =
          laga::bench::reference_rows(rows, p.ta, p.tb, p.N, p.K, b16_wide[size_t(p.a)].data(),
                                      p.lda, b16_wide[size_t(p.b)].data(), p.ldb);
      const std::string shape = laga::cat(p.M, "x", p.N, "x", p.K);
      // The peak a bf16 row is held to: AMX's where oneDNN runs its AMX
      // kernels on this product (brg:avx512_core_amx_bf16), else VDPBF16PS's.
      const auto isa_at = [&](std::int64_t lda) -> std::string {
        const bool amx =
            laga::bench::cpu_has_amx_bf16() &&
            laga::gemm_bf16_implementation(p.ta, p.tb, p.M, p.N, p.K, lda, p.ldb, p.N, false)
                    .find("amx") != std::string::npos;
        return amx ? "amx" : bf16_isa;
      };
      const std::string b_isa = isa_at(p.lda);
      const double gflop = 2e-9 * double(p.M) * double(p.N) * double(p.K);
      const size_t mn = size_t(p.M * p.N);
      std::vector<float> c_f32(mn), c_b16(mn), c_acc(mn, 0.0f), c_strided(mn), c_packed(mn);
      std::vector<bf16> c_out(mn);
      std::vector<bf16> w_copy(size_t(out * in));
      const float* A32 = f32[size_t(p.a)].data();
      const float* B32 = f32[size_t(p.b)].data();
      const bf16* A = b16[size_t(p.a)].data();
      const bf16* B = b16[size_t(p.b)].data();
      auto wrong_in = [&](const float* C, const std::vector<double>& ref, double rel) {
        std::vector<float> got;
        for (std::int64_t i : rows) got.insert(got.end(), C + i * p.N, C + (i + 1) * p.N);
        return laga::bench::count_wrong(got.data(), ref.data(), std::int64_t(ref.size()), rel);
      };
      std::vector<laga::bench::Candidate> cands;
      cands.push_back({laga::cat(p.name, "/f32"), shape, gflop, f32_isa,
                       [&] {
                         laga::gemm<float>(p.ta, p.tb, p.M, p.N, p.K, 1.0f, A32, p.lda, B32, p.ldb,
                                           0.0f, c_f32.data(), p.N);
                       },
                       [&] { return wrong_in(c_f32.data(), ref_f32, 1e-5); }});
      cands.push_back({laga::cat(p.name, "/bf16"), shape, gflop, b_isa,
                       [&] {
                         laga::gemm_bf16<float>(p.ta, p.tb, p.M, p.N, p.K, 1.0f, A, p.lda, B, p.ldb,
                                                0.0f, c_b16.data(), p.N);
                       },
                       [&] { return wrong_in(c_b16.data(), ref_b16, 1e-5); }});
      if (p.b_is_weight) {
        cands.push_back({laga::cat(p.name, "/bf16_out"), shape, gflop, b_isa,
                         [&] {
                           laga::gemm_bf16<bf16>(p.ta, p.tb, p.M, p.N, p.K, 1.0f, A, p.lda, B,
                                                 p.ldb, 0.0f, c_out.data(), p.N);
                         },
                         [&] {
                           const std::vector<float> w = widened(c_out);
                           return wrong_in(w.data(), ref_b16, 0x1.0p-8 + 1e-5);
                         }});
      } else {
        // Accumulated over warm-up and timed calls alike: C holds n ref at the
        // end, so #wrong is not checked (n/a); bf16 checks the same product.
        cands.push_back({laga::cat(p.name, "/bf16_acc"),
                         shape,
                         gflop,
                         b_isa,
                         [&] {
                           laga::gemm_bf16<float>(p.ta, p.tb, p.M, p.N, p.K, 1.0f, A, p.lda, B,
                                                  p.ldb, 1.0f, c_acc.data(), p.N);
                         },
                         {}});
      }
      std::unique_ptr<PackedMatmul> packed;
      if (p.b_is_weight &&
          laga::gemm_bf16_implementation(p.ta, p.tb, p.M, p.N, p.K, p.lda, p.ldb, p.N, false)
                  .find("widened") == std::string::npos) {
        packed =
            std::make_unique<PackedMatmul>(p.ta, p.tb, p.M, p.N, p.K, A, B, B32, c_packed.data());
        cands.push_back({laga::cat(p.name, "/bf16_packed"), shape, gflop, b_isa,
                         [&] { packed->run(); },
                         [&] { return wrong_in(c_packed.data(), ref_b16, 1e-5); }});
        cands.push_back(
            {laga::cat(p.name, "/reorder_w"), shape, 0.0, b_isa, [&] { packed->pack(); }, {}});
        cands.push_back({laga::cat(p.name, "/reorder_w_f32"),
                         shape,
                         0.0,
                         b_isa,
                         [&] { packed->pack_from_f32(); },
                         {}});
      }
      if (p.name == std::string("fwd_nt"))
        cands.push_back({laga::cat(p.name, "/bf16_strided"), laga::cat(shape, " lda ", ld_pad),
                         gflop, isa_at(ld_pad),
                         [&] {
                           laga::gemm_bf16<float>(p.ta, p.tb, p.M, p.N, p.K, 1.0f, x_padded.data(),
                                                  ld_pad, B, p.ldb, 0.0f, c_strided.data(), p.N);
                         },
                         [&] { return wrong_in(c_strided.data(), ref_b16, 1e-5); }});
      if (p.b_is_weight)
        cands.push_back({laga::cat(p.name, "/cvt_w"),
                         laga::cat(out, "x", in, " fp32->bf16"),
                         0.0,
                         b_isa,
                         [&] { laga::convert_to_bf16(f32[1].data(), w_copy.data(), out * in); },
                         {}});
      const std::vector<laga::bench::Row*> got = ctx.run_alternating(cands);
      // Ratios per round, from the rows --op kept.
      auto row_named = [&](const std::string& suffix) -> const laga::bench::Row* {
        for (const laga::bench::Row* r : got)
          if (r->op == laga::cat(p.name, "/", suffix)) return r;
        return nullptr;
      };
      auto per_round = [&](const laga::bench::Row* num, const laga::bench::Row* den) {
        std::vector<double> q;
        for (size_t i = 0; i < num->t.samples_ms.size(); ++i)
          q.push_back(num->t.samples_ms[i] / den->t.samples_ms[i]);
        return laga::bench::median(q);
      };
      const laga::bench::Row* r_f32 = row_named("f32");
      std::string line = laga::cat(
          p.name, " ", shape, ", median over rounds of each round's ms ratio: speedup over f32");
      bool any = false;
      for (const char* other : {"bf16", "bf16_out", "bf16_acc", "bf16_packed", "bf16_strided"}) {
        const laga::bench::Row* r = row_named(other);
        if (!r_f32 || !r) continue;
        line += laga::cat(" ", other, " ", per_round(r_f32, r), "x;");
        any = true;
      }
      const laga::bench::Row* r_b16 = row_named("bf16");
      if (const laga::bench::Row* r = row_named("bf16_packed"); r && r_b16) {
        line += laga::cat(" | ms over bf16's: bf16_packed ", per_round(r, r_b16), " (",
                          packed->implementation(), ");");
        any = true;
      }
      if (const laga::bench::Row* r = row_named("reorder_w"); r && r_b16) {
        line += laga::cat(" reorder_w ", per_round(r, r_b16), ";");
        any = true;
      }
      if (const laga::bench::Row* r = row_named("reorder_w_f32"); r && r_b16) {
        line += laga::cat(" reorder_w_f32 ", per_round(r, r_b16), ";");
        any = true;
      }
      if (const laga::bench::Row* r = row_named("cvt_w"); r && r_b16) {
        line += laga::cat(" cvt_w ", per_round(r, r_b16), " (",
                          6e-6 * double(out * in) / r->t.median_ms, " GB/s);");
        any = true;
      }
      if (any) ctx.note(line);
      if (r_b16)
        ctx.note(laga::cat(
            p.name, " bf16 runs ",
            laga::gemm_bf16_implementation(p.ta, p.tb, p.M, p.N, p.K, p.lda, p.ldb, p.N, false),
            "; strided ",
            p.name == std::string("fwd_nt")
                ? laga::gemm_bf16_implementation(p.ta, p.tb, p.M, p.N, p.K, ld_pad, p.ldb, p.N,
                                                 false)
                : std::string("-")));
    }
  }
  laga::set_gemm_bf16_path(run_path);
}
