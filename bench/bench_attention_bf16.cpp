// bf16 flash attention (kernels/attention_flash_bf16.hpp, issue 27) against
// the fp32 flash kernels on the same inputs (the bf16 values widened), rows
// timed alternately so that a drift of the shared machine falls on both.
//
// FLOP convention: bench_attention.cpp's (fwd = the causal half's useful
// FLOPs, bwd = 2.5x, fwd+bwd = 3.5x), whatever a kernel executes (at 16
// heads on 2 threads both backwards run one head per thread and execute
// 2.6x forward; with fewer heads than threads they take two passes and
// recompute S and dP, about 40% more).
// %peak of the bf16 rows is against the bf16 dot-product peak (VDPBF16PS,
// harness.hpp: 64 FLOP an instruction), of the fp32 rows against the FMA
// peak of flash_isa(). #wrong: against the fp32 flash kernels on the widened
// bf16 inputs, computed once; fp32 rows at 1e-5 max|ref|, bf16 rows at
// 2^-7 max|ref| (two unit roundoffs: P and dS are rounded to bf16;
// tests/kernels/test_attention_flash_bf16.cpp holds them to a per-element
// bound).
#include <cmath>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "harness.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/attention_flash_bf16.hpp"

namespace {

using laga::AttnShape;
using laga::bf16;

size_t sz(std::int64_t n) {
  return static_cast<size_t>(n);
}

struct Buffers {
  std::vector<bf16> q, k, v, dout;
  std::vector<float> qf, kf, vf, df;  // the same values widened
  std::vector<float> o, lse, dq, dk, dv;
  explicit Buffers(const AttnShape& s)
      : o(sz(s.B * s.Sq * s.Hq * s.dv)),
        lse(sz(s.B * s.Hq * s.Sq)),
        dq(sz(s.B * s.Sq * s.Hq * s.dqk)),
        dk(sz(s.B * s.Sk * s.Hk * s.dqk)),
        dv(sz(s.B * s.Sk * s.Hk * s.dv)) {}
};

void make_input(std::int64_t n, std::uint64_t stream, std::vector<bf16>& b, std::vector<float>& f) {
  f.resize(sz(n));
  laga::fill_normal(f.data(), n, 2, stream, 0, 1.0);
  b.resize(sz(n));
  for (size_t i = 0; i < f.size(); ++i) b[i] = laga::to_bf16(f[i]), f[i] = laga::to_float(b[i]);
}

}  // namespace

LAGA_BENCH(flash_bf16, "flash attention fwd/bwd: bf16 Q/K/V (fp32 accumulation) vs fp32") {
  const bool quick = ctx.options().quick;
  struct Case {
    std::string name;
    AttnShape s;
  };
  auto make = [](std::int64_t S, std::int64_t Hq, std::int64_t Hk, std::int64_t dqk,
                 std::int64_t dv) {
    AttnShape s;
    s.B = 1, s.Sq = S, s.Sk = S, s.Hq = Hq, s.Hk = Hk, s.dqk = dqk, s.dv = dv, s.causal = true;
    s.scale = 1.0 / std::sqrt(static_cast<double>(dqk));
    return s;
  };
  // The explicit MLA form's attention: DeepSeek-V3 head dims, 16 heads; and
  // the absorbed form's, 16 heads against one shared [c | k_pe] (576),
  // values c (512): one key/value head, so the two-pass backward.
  std::vector<Case> cases = {{"v3_mha_causal_2k", make(quick ? 256 : 2048, 16, 16, 192, 128)},
                             {"v3_latent_causal_1k", make(quick ? 128 : 1024, 16, 1, 576, 512)}};
  const laga::FlashBf16Isa bisa = laga::flash_bf16_isa();
  const std::string f32_isa = laga::to_string(laga::flash_isa());
  const std::string bf16_row_isa = bisa == laga::FlashBf16Isa::avx512_bf16 ? "bf16" : f32_isa;
  const int threads = ctx.options().threads;
  // Why the fallback runs: the machine, else the variable chose it.
  const char* why_fp32 = laga::flash_bf16_why_no_avx512_bf16();
  ctx.note(laga::cat("bf16 flash kernels: ", laga::to_string(bisa),
                     bisa == laga::FlashBf16Isa::fp32
                         ? laga::cat(" (",
                                     why_fp32 ? why_fp32
                                     : laga::flash_bf16_dot_products_pay()
                                         ? "LAGA_FLASH_BF16_ISA=fp32"
                                         : "auto on Intel, where VDPBF16PS runs at half FMA's "
                                           "rate; LAGA_FLASH_BF16_ISA=avx512_bf16 runs it",
                                     "): widened to fp32, the fp32 kernels run")
                         : std::string(" (VDPBF16PS)"),
                     "; fp32 flash kernels: ", f32_isa));
  if (laga::bench::cpu_has_avx512_bf16())
    ctx.note(laga::cat("peaks on ", threads, " threads: bf16 dot product (VDPBF16PS) ",
                       laga::bench::measure_isa_peak("bf16", threads, 3), " GFLOP/s, fp32 FMA (",
                       f32_isa, ") ", laga::bench::measure_isa_peak(f32_isa, threads, 3),
                       " GFLOP/s"));
  ctx.note("GFLOP: fwd = causal-half useful FLOPs, bwd = 2.5x, fwd+bwd = 3.5x (bench_attention)");
  ctx.note(
      "#wrong vs fp32 flash on the widened bf16 inputs: f32 rows 1e-5, bf16 rows 2^-7 max|ref|");
  ctx.header();
  for (const Case& c : cases) {
    if (!laga::bench::case_selected(ctx.options(), c.name)) continue;
    const AttnShape& s = c.s;
    Buffers t(s);
    make_input(s.B * s.Sq * s.Hq * s.dqk, 0, t.q, t.qf);
    make_input(s.B * s.Sk * s.Hk * s.dqk, 1, t.k, t.kf);
    make_input(s.B * s.Sk * s.Hk * s.dv, 2, t.v, t.vf);
    make_input(s.B * s.Sq * s.Hq * s.dv, 3, t.dout, t.df);
    // The reference: fp32 flash once, into its own buffers.
    Buffers ref(s);
    laga::attention_flash_forward<float>(s, ref.o.data(), ref.lse.data(), t.qf.data(), t.kf.data(),
                                         t.vf.data());
    laga::attention_flash_backward<float>(s, ref.dq.data(), ref.dk.data(), ref.dv.data(),
                                          t.df.data(), t.qf.data(), t.kf.data(), t.vf.data(),
                                          ref.o.data(), ref.lse.data());
    // Each candidate writes its own outputs: alternating rows must not read
    // another's o and lse in backward.
    Buffers out32(s), out16(s);
    auto f32_fwd = [&] {
      laga::attention_flash_forward<float>(s, out32.o.data(), out32.lse.data(), t.qf.data(),
                                           t.kf.data(), t.vf.data());
    };
    auto f32_bwd = [&] {
      laga::attention_flash_backward<float>(s, out32.dq.data(), out32.dk.data(), out32.dv.data(),
                                            t.df.data(), t.qf.data(), t.kf.data(), t.vf.data(),
                                            out32.o.data(), out32.lse.data());
    };
    auto b16_fwd = [&] {
      laga::attention_flash_forward_bf16(s, out16.o.data(), out16.lse.data(), t.q.data(),
                                         t.k.data(), t.v.data());
    };
    auto b16_bwd = [&] {
      laga::attention_flash_backward_bf16(s, out16.dq.data(), out16.dk.data(), out16.dv.data(),
                                          t.dout.data(), t.q.data(), t.k.data(), t.v.data(),
                                          out16.o.data(), out16.lse.data());
    };
    f32_fwd();  // backward rows read forward's outputs
    b16_fwd();
    auto wrong = [&](const std::vector<float>& got, const std::vector<float>& r, double rel) {
      return laga::bench::count_wrong(got.data(), r.data(), static_cast<std::int64_t>(r.size()),
                                      rel);
    };
    auto wrong_fwd = [&](const Buffers& b, double rel) { return wrong(b.o, ref.o, rel); };
    auto wrong_bwd = [&](const Buffers& b, double rel) {
      return wrong(b.dq, ref.dq, rel) + wrong(b.dk, ref.dk, rel) + wrong(b.dv, ref.dv, rel);
    };
    const double f = s.useful_flops_forward() * 1e-9, r16 = 0x1.0p-7;
    const std::string shape =
        laga::cat("B", s.B, " S", s.Sq, " H", s.Hq, "/", s.Hk, " d", s.dqk, "/", s.dv, " causal");
    ctx.note(c.name);
    ctx.run_alternating(
        {{"attn_flash_fwd/f32", shape, f, f32_isa, f32_fwd, [&] { return wrong_fwd(out32, 1e-5); }},
         {"attn_flash_fwd/bf16", shape, f, bf16_row_isa, b16_fwd,
          [&] { return wrong_fwd(out16, r16); }}});
    ctx.run_alternating({{"attn_flash_bwd/f32", shape, 2.5 * f, f32_isa, f32_bwd,
                          [&] { return wrong_bwd(out32, 1e-5); }},
                         {"attn_flash_bwd/bf16", shape, 2.5 * f, bf16_row_isa, b16_bwd,
                          [&] { return wrong_bwd(out16, r16); }}});
    ctx.run_alternating({{"attn_flash_fwd+bwd/f32", shape, 3.5 * f, f32_isa,
                          [&] {
                            f32_fwd();
                            f32_bwd();
                          },
                          [&] { return wrong_fwd(out32, 1e-5) + wrong_bwd(out32, 1e-5); }},
                         {"attn_flash_fwd+bwd/bf16", shape, 3.5 * f, bf16_row_isa,
                          [&] {
                            b16_fwd();
                            b16_bwd();
                          },
                          [&] { return wrong_fwd(out16, r16) + wrong_bwd(out16, r16); }}});
  }
}
