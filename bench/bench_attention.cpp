// Attention forward and backward, eager (materialised probabilities, OpenBLAS)
// and flash (fused, tiled, online softmax), with PyTorch eager beside them
// when --torch is given.
//
// FLOP convention (the same for every kernel, whatever it executes):
//   forward  = AttnShape::useful_flops_forward(): 2 (dqk + dv) per unmasked
//              (query, key) pair, i.e. only the causal half of QK^T and PV;
//   backward = 2.5 x forward (dV, dP, dQ, dK: four products, 2x; the
//              recomputed QK^T, 0.5x, counted as if dqk = dv);
//   fwd+bwd  = 3.5 x forward.
// Eager computes the masked half too, and flash's backward executes
// (3 dqk + 2 dv) / (dqk + dv) = 2.6x forward at dims 192/128: neither extra
// is counted. Reference: the eager kernel in double on the same inputs, once
// per shape; #wrong counts elements farther than 1e-5 max|ref| from it (o for
// forward rows, dq, dk, dv for backward ones).
//
// `packed` (below): flash attention on one batch row of 16 documents of S/16
// tokens against one document of S, the same kernels and shapes; its
// reference runs each document alone, and its speedup is taken per sample.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "harness.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"

namespace {

using laga::AttnShape;
using laga::bench::case_selected;
using laga::bench::count_wrong;

struct Case {
  std::string name;
  AttnShape s;
  bool eager = true;  // eager rows too (its probabilities take B Hq Sq Sk floats)
};

AttnShape make(std::int64_t B, std::int64_t S, std::int64_t Hq, std::int64_t Hk, std::int64_t dqk,
               std::int64_t dv, bool causal) {
  AttnShape s;
  s.B = B, s.Sq = S, s.Sk = S, s.Hq = Hq, s.Hk = Hk, s.dqk = dqk, s.dv = dv, s.causal = causal;
  s.scale = 1.0 / std::sqrt(static_cast<double>(dqk));
  return s;
}

std::string describe(const AttnShape& s) {
  return laga::cat("B", s.B, " S", s.Sq, " H", s.Hq, "/", s.Hk, " d", s.dqk, "/", s.dv,
                   s.causal ? " causal" : " full");
}

size_t sz(std::int64_t n) {
  return static_cast<size_t>(n);
}

std::string fixed2(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", x);
  return text;
}

struct Tensors {
  std::vector<float> q, k, v, dout, o, lse, dq, dk, dv;
  std::vector<double> o_ref, dq_ref, dk_ref, dv_ref;
  bool checked = true;  // false: no reference (too big), #wrong is n/a
};

// The eager kernel in double on float inputs (s's layout), into o, dq, dk, dv.
void eager_double(const AttnShape& s, const float* q32, const float* k32, const float* v32,
                  const float* dout32, double* o, double* dq, double* dk, double* dv) {
  const std::int64_t nq = s.B * s.Sq * s.Hq * s.dqk, nk = s.B * s.Sk * s.Hk * s.dqk,
                     nv = s.B * s.Sk * s.Hk * s.dv, no = s.B * s.Sq * s.Hq * s.dv;
  const std::vector<double> q(q32, q32 + nq), k(k32, k32 + nk), v(v32, v32 + nv),
      dout(dout32, dout32 + no);
  std::vector<double> probs(sz(s.B * s.Hq * s.Sq * s.Sk)), dp(sz(s.Sq * s.Sk));
  laga::attention_eager_forward<double>(s, o, probs.data(), q.data(), k.data(), v.data());
  laga::attention_eager_backward<double>(s, dq, dk, dv, dout.data(), q.data(), k.data(), v.data(),
                                         probs.data(), dp.data());
}

// Inputs and buffers, without a reference.
Tensors inputs(const AttnShape& s) {
  Tensors t;
  const std::int64_t nq = s.B * s.Sq * s.Hq * s.dqk, nk = s.B * s.Sk * s.Hk * s.dqk,
                     nv = s.B * s.Sk * s.Hk * s.dv, no = s.B * s.Sq * s.Hq * s.dv;
  t.q.resize(sz(nq)), t.k.resize(sz(nk)), t.v.resize(sz(nv)), t.dout.resize(sz(no));
  laga::fill_normal(t.q.data(), nq, 2, 0, 0, 1.0);
  laga::fill_normal(t.k.data(), nk, 2, 1, 0, 1.0);
  laga::fill_normal(t.v.data(), nv, 2, 2, 0, 1.0);
  laga::fill_normal(t.dout.data(), no, 2, 3, 0, 1.0);
  t.o.resize(sz(no)), t.lse.resize(sz(s.B * s.Hq * s.Sq));
  t.dq.resize(sz(nq)), t.dk.resize(sz(nk)), t.dv.resize(sz(nv));
  return t;
}

// Room for the reference of every output.
void allocate_reference(Tensors& t) {
  t.o_ref.resize(t.o.size()), t.dq_ref.resize(t.dq.size());
  t.dk_ref.resize(t.dk.size()), t.dv_ref.resize(t.dv.size());
}

// Inputs, and the double-precision eager reference once.
Tensors prepare(const AttnShape& s) {
  Tensors t = inputs(s);
  allocate_reference(t);
  eager_double(s, t.q.data(), t.k.data(), t.v.data(), t.dout.data(), t.o_ref.data(),
               t.dq_ref.data(), t.dk_ref.data(), t.dv_ref.data());
  return t;
}

std::int64_t wrong_fwd(const Tensors& t) {
  return count_wrong(t.o.data(), t.o_ref.data(), static_cast<std::int64_t>(t.o.size()), 1e-5);
}
std::int64_t wrong_bwd(const Tensors& t) {
  return count_wrong(t.dq.data(), t.dq_ref.data(), static_cast<std::int64_t>(t.dq.size()), 1e-5) +
         count_wrong(t.dk.data(), t.dk_ref.data(), static_cast<std::int64_t>(t.dk.size()), 1e-5) +
         count_wrong(t.dv.data(), t.dv_ref.data(), static_cast<std::int64_t>(t.dv.size()), 1e-5);
}

// PyTorch timings of every case: {name: {fwd_ms, bwd_ms, fwdbwd_ms}}.
nlohmann::json run_torch(laga::bench::Context& ctx, const std::vector<Case>& cases) {
  nlohmann::json shapes = nlohmann::json::array();
  for (const Case& c : cases)
    shapes.push_back({{"name", c.name},
                      {"B", c.s.B},
                      {"Sq", c.s.Sq},
                      {"Sk", c.s.Sk},
                      {"Hq", c.s.Hq},
                      {"Hk", c.s.Hk},
                      {"dqk", c.s.dqk},
                      {"dv", c.s.dv},
                      {"causal", c.s.causal},
                      {"scale", c.s.scale}});
  const auto& o = ctx.options();
  const std::string cmd = laga::cat(
      o.python, " ", laga::bench::source_dir(), "/python/bench_torch.py --threads ", o.threads,
      " --repeats ", o.repeats, " --warmup ", o.warmup, " --shapes '", shapes.dump(), "'");
  ctx.note(laga::cat("PyTorch: ", o.python, " python/bench_torch.py (same shapes, threads)"));
  nlohmann::json out = nlohmann::json::parse(laga::bench::Context::capture(cmd));
  nlohmann::json by_name;
  for (const auto& r : out.at("results")) by_name[r.at("name").get<std::string>()] = r;
  ctx.note(laga::cat("PyTorch ", out.value("torch", std::string("?")), ", ",
                     out.value("threads", 0), " threads"));
  return by_name;
}

}  // namespace

LAGA_BENCH(attention, "attention fwd/bwd: eager vs flash (vs PyTorch with --torch)") {
  const bool quick = ctx.options().quick;
  std::vector<Case> cases;
  if (quick) {
    cases = {{"mha_causal", make(1, 256, 4, 4, 192, 128, true)},
             {"latent_causal", make(1, 128, 4, 1, 576, 512, true)}};
  } else {
    cases = {
        // The target shape: DeepSeek-V3 head dims, 16 heads of a shard.
        {"v3_mha_causal_4k", make(1, 4096, 16, 16, 192, 128, true)},
        {"v3_mha_causal_1k", make(1, 1024, 16, 16, 192, 128, true)},
        {"v3_mha_full_1k", make(1, 1024, 16, 16, 192, 128, false)},
        // Absorbed form: 16 heads against one shared [c | k_pe] (576), values c (512).
        {"v3_latent_causal_1k", make(1, 1024, 16, 1, 576, 512, true)},
    };
  }
  std::erase_if(cases, [&](const Case& c) { return !case_selected(ctx.options(), c.name); });
  nlohmann::json torch;
  if (ctx.options().torch) torch = run_torch(ctx, cases);
  ctx.note(
      "GFLOP: fwd = causal-half useful FLOPs (AttnShape::useful_flops_forward), bwd = 2.5x fwd,");
  ctx.note(
      "fwd+bwd = 3.5x fwd, for every kernel; reference = eager in double, #wrong at 1e-5 max|ref|");
  ctx.header();
  for (const Case& c : cases) {
    const AttnShape& s = c.s;
    Tensors t = prepare(s);
    const double f = s.useful_flops_forward() * 1e-9;
    const std::string shape = describe(s);
    ctx.note(c.name);
    const std::string flash_isa = laga::to_string(laga::flash_isa());
    const std::string gemm_isa = laga::bench::gemm_isa();
    auto torch_ms = [&](const char* key) {
      return torch.contains(c.name) ? torch[c.name].value(key, std::nan("")) : std::nan("");
    };
    // Flash first: OpenBLAS' worker threads spin for a while after the eager
    // kernels' GEMMs and would steal the cores from a kernel timed right after.
    auto fwd = [&] {
      laga::attention_flash_forward<float>(s, t.o.data(), t.lse.data(), t.q.data(), t.k.data(),
                                           t.v.data());
    };
    auto bwd = [&] {
      laga::attention_flash_backward<float>(s, t.dq.data(), t.dk.data(), t.dv.data(), t.dout.data(),
                                            t.q.data(), t.k.data(), t.v.data(), t.o.data(),
                                            t.lse.data());
    };
    ctx.run("attn_flash_fwd", shape, f, flash_isa, fwd, [&] { return wrong_fwd(t); }).torch_ms =
        torch_ms("fwd_ms");
    ctx.run("attn_flash_bwd", shape, 2.5 * f, flash_isa, bwd, [&] { return wrong_bwd(t); })
        .torch_ms = torch_ms("bwd_ms");
    ctx.run(
           "attn_flash_fwd+bwd", shape, 3.5 * f, flash_isa,
           [&] {
             fwd();
             bwd();
           },
           [&] { return wrong_fwd(t) + wrong_bwd(t); })
        .torch_ms = torch_ms("fwdbwd_ms");
    if (c.eager && ctx.selected("attn_eager")) {
      std::vector<float> probs(sz(s.B * s.Hq * s.Sq * s.Sk)), dp(sz(s.Sq * s.Sk));
      auto efwd = [&] {
        laga::attention_eager_forward<float>(s, t.o.data(), probs.data(), t.q.data(), t.k.data(),
                                             t.v.data());
      };
      ctx.run("attn_eager_fwd", shape, f, gemm_isa, efwd, [&] { return wrong_fwd(t); }).torch_ms =
          torch_ms("fwd_ms");
      auto ebwd = [&] {
        laga::attention_eager_backward<float>(s, t.dq.data(), t.dk.data(), t.dv.data(),
                                              t.dout.data(), t.q.data(), t.k.data(), t.v.data(),
                                              probs.data(), dp.data());
      };
      ctx.run("attn_eager_bwd", shape, 2.5 * f, gemm_isa, ebwd, [&] { return wrong_bwd(t); })
          .torch_ms = torch_ms("bwd_ms");
    }
  }
}

namespace {

// An eager reference in double of a document of n tokens holds its
// probabilities, Hq n^2 doubles: past this, the reference is not computed and
// #wrong reads n/a (one document of 16384 tokens and 16 heads would need
// 34 GB).
constexpr double kReferenceBytesMax = 4.0 * (1 << 30);

// One batch row of `docs` documents of equal length: its mask, inputs and,
// when each document's reference fits, the eager kernel in double on each
// document alone (its own Sq = Sk, no mask), concatenated: what the masked
// kernel must equal.
struct Packed {
  std::int64_t docs;
  std::vector<std::int64_t> doc_start;  // (1, S)
  AttnShape s;                          // with doc_start
  Tensors t;
  std::string shape;  // for the table
};

Packed prepare_packed(const AttnShape& s, std::int64_t docs) {
  Packed p{docs, {}, s, inputs(s), ""};
  const std::int64_t n = s.Sk / docs;
  p.doc_start.resize(sz(s.Sk));
  for (std::int64_t j = 0; j < s.Sk; ++j) p.doc_start[sz(j)] = j / n * n;
  p.s.doc_start = p.doc_start.data();
  p.shape = laga::cat("B", s.B, " S", s.Sk, " H", s.Hq, "/", s.Hk, " d", s.dqk, "/", s.dv, " ",
                      docs, docs == 1 ? " doc" : " docs");
  Tensors& t = p.t;
  t.checked = 8.0 * static_cast<double>(s.Hq * n * n) <= kReferenceBytesMax;
  if (!t.checked) return p;
  allocate_reference(t);
  AttnShape one = s;
  one.Sq = one.Sk = n;
  for (std::int64_t d = 0; d < docs; ++d) {
    const std::int64_t t0 = d * n;  // B = 1: a document's tokens are contiguous in every tensor
    eager_double(one, t.q.data() + t0 * s.Hq * s.dqk, t.k.data() + t0 * s.Hk * s.dqk,
                 t.v.data() + t0 * s.Hk * s.dv, t.dout.data() + t0 * s.Hq * s.dv,
                 t.o_ref.data() + t0 * s.Hq * s.dv, t.dq_ref.data() + t0 * s.Hq * s.dqk,
                 t.dk_ref.data() + t0 * s.Hk * s.dqk, t.dv_ref.data() + t0 * s.Hk * s.dv);
  }
  return p;
}

void flash_forward(Packed& p) {
  laga::attention_flash_forward<float>(p.s, p.t.o.data(), p.t.lse.data(), p.t.q.data(),
                                       p.t.k.data(), p.t.v.data());
}
void flash_backward(Packed& p) {
  Tensors& t = p.t;
  laga::attention_flash_backward<float>(p.s, t.dq.data(), t.dk.data(), t.dv.data(), t.dout.data(),
                                        t.q.data(), t.k.data(), t.v.data(), t.o.data(),
                                        t.lse.data());
}

}  // namespace

// Packed sequences: the same flash kernels and shapes, one batch row holding
// one document of S tokens or 16 of S/16 (both given as AttnShape::doc_start).
// The 16 documents have 1/16 of the unmasked pairs (the GFLOP column counts
// only those), so the ideal speedup is that FLOP ratio, about 16x. A row of
// one document takes up to a minute while the shared machine's speed drifts,
// so the speedup is taken per sample: each timed call on one document is
// bracketed by calls on the 16 (timed too, outside the row), and divided by
// their mean.
LAGA_BENCH(packed, "flash attention on packed documents: 16 of S/16 tokens vs one of S") {
  const bool quick = ctx.options().quick;
  const AttnShape s =
      quick ? make(1, 512, 4, 4, 192, 128, true) : make(1, 16384, 16, 16, 192, 128, true);
  ctx.note("GFLOP: useful FLOPs of the documents' causal halves (fwd; bwd 2.5x, fwd+bwd 3.5x);");
  ctx.note(
      "reference = eager in double on each document alone, where its probabilities fit in 4 GiB");
  Packed many = prepare_packed(s, 16), one = prepare_packed(s, 1);
  // Every backward reads its own forward's o and lse.
  flash_forward(many);
  flash_forward(one);
  ctx.header();
  const std::string flash_isa = laga::to_string(laga::flash_isa());
  struct Op {
    const char* name;
    double flops;  // x the forward's
    void (*run)(Packed&);
  };
  const Op ops[] = {{"attn_flash_fwd", 1.0, &flash_forward},
                    {"attn_flash_bwd", 2.5, &flash_backward},
                    {"attn_flash_fwd+bwd", 3.5, [](Packed& p) {
                       flash_forward(p);
                       flash_backward(p);
                     }}};
  for (const Op& op : ops) {
    if (!ctx.selected(op.name)) continue;
    auto row = [&](Packed& p, const std::function<void()>& between) {
      std::function<std::int64_t()> check;
      if (p.t.checked)
        check = [&] {
          return (op.flops != 2.5 ? wrong_fwd(p.t) : 0) + (op.flops != 1.0 ? wrong_bwd(p.t) : 0);
        };
      return ctx.run(
          op.name, p.shape, op.flops * p.s.useful_flops_forward() * 1e-9, flash_isa,
          [&] { op.run(p); }, check, between);
    };
    row(many, {});
    std::vector<double> many_ms;  // the calls on 16 documents around the samples on one
    auto timed_many = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      op.run(many);
      many_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    };
    const std::vector<double> one_ms = row(one, timed_many).t.samples_ms;
    timed_many();  // closes the bracket of the last sample
    std::vector<double> ratio;
    for (size_t i = 0; i < one_ms.size(); ++i)
      ratio.push_back(one_ms[i] / (0.5 * (many_ms[i] + many_ms[i + 1])));
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    ctx.note(laga::cat(op.name, ": speedup 1 doc / 16 docs per bracketed sample: median ",
                       fixed2(laga::bench::median(ratio)), "x, range ", fixed2(*lo), "x..",
                       fixed2(*hi), "x (", ratio.size(), " samples); ideal (useful FLOP ratio) ",
                       fixed2(one.s.useful_flops_forward() / many.s.useful_flops_forward()), "x"));
  }
}
