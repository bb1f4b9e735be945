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
// reference runs each document alone.
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
  t.o_ref.resize(sz(no)), t.dq_ref.resize(sz(nq)), t.dk_ref.resize(sz(nk)), t.dv_ref.resize(sz(nv));
  return t;
}

// Inputs, and the double-precision eager reference once.
Tensors prepare(const AttnShape& s) {
  Tensors t = inputs(s);
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
    const std::string blas_isa = laga::bench::blas_isa();
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
      ctx.run("attn_eager_fwd", shape, f, blas_isa, efwd, [&] { return wrong_fwd(t); }).torch_ms =
          torch_ms("fwd_ms");
      auto ebwd = [&] {
        laga::attention_eager_backward<float>(s, t.dq.data(), t.dk.data(), t.dv.data(),
                                              t.dout.data(), t.q.data(), t.k.data(), t.v.data(),
                                              probs.data(), dp.data());
      };
      ctx.run("attn_eager_bwd", shape, 2.5 * f, blas_isa, ebwd, [&] { return wrong_bwd(t); })
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

// Inputs of one batch row of `docs` documents of equal length, and, when each
// document's reference fits, the eager kernel in double on each document alone
// (its own Sq = Sk, no mask), concatenated: what the masked kernel must equal.
Tensors prepare_packed(const AttnShape& s, std::int64_t docs,
                       std::vector<std::int64_t>& doc_start) {
  Tensors t = inputs(s);
  const std::int64_t n = s.Sk / docs;
  doc_start.resize(sz(s.Sk));
  for (std::int64_t j = 0; j < s.Sk; ++j) doc_start[sz(j)] = j / n * n;
  t.checked = 8.0 * static_cast<double>(s.Hq * n * n) <= kReferenceBytesMax;
  if (!t.checked) return t;
  AttnShape one = s;
  one.Sq = one.Sk = n;
  one.doc_start = nullptr;
  for (std::int64_t d = 0; d < docs; ++d) {
    const std::int64_t t0 = d * n;  // B = 1: a document's tokens are contiguous in every tensor
    eager_double(one, t.q.data() + t0 * s.Hq * s.dqk, t.k.data() + t0 * s.Hk * s.dqk,
                 t.v.data() + t0 * s.Hk * s.dv, t.dout.data() + t0 * s.Hq * s.dv,
                 t.o_ref.data() + t0 * s.Hq * s.dv, t.dq_ref.data() + t0 * s.Hq * s.dqk,
                 t.dk_ref.data() + t0 * s.Hk * s.dqk, t.dv_ref.data() + t0 * s.Hk * s.dv);
  }
  return t;
}

}  // namespace

// Packed sequences: the same flash kernels and shapes, one batch row holding
// one document of S tokens or 16 of S/16 (AttnShape::doc_start, both given as
// a mask). The 16 documents have 1/16 of the unmasked pairs (useful FLOPs,
// the GFLOP column), so the ideal speedup is their FLOP ratio, about 16x.
LAGA_BENCH(packed, "flash attention on packed documents: 16 of S/16 tokens vs one of S") {
  const bool quick = ctx.options().quick;
  const AttnShape s =
      quick ? make(1, 512, 4, 4, 192, 128, true) : make(1, 16384, 16, 16, 192, 128, true);
  ctx.note("GFLOP: useful FLOPs of the documents' causal halves (fwd; bwd 2.5x, fwd+bwd 3.5x);");
  ctx.note(
      "reference = eager in double on each document alone, where its probabilities fit in 4 GiB");
  ctx.header();
  const std::string flash_isa = laga::to_string(laga::flash_isa());
  struct Timed {
    double fwd = 0, bwd = 0, fwdbwd = 0, gflop_fwd = 0;
  };
  std::vector<Timed> timed;
  for (const std::int64_t docs : {std::int64_t{1}, std::int64_t{16}}) {
    const std::string name = laga::cat(docs, docs == 1 ? "_doc" : "_docs");
    if (!case_selected(ctx.options(), name)) continue;
    std::vector<std::int64_t> doc_start;
    Tensors t = prepare_packed(s, docs, doc_start);
    AttnShape m = s;
    m.doc_start = doc_start.data();
    const double f = m.useful_flops_forward() * 1e-9;
    const std::string shape = laga::cat("B", m.B, " S", m.Sk, " H", m.Hq, "/", m.Hk, " d", m.dqk,
                                        "/", m.dv, " ", docs, docs == 1 ? " doc" : " docs");
    ctx.note(laga::cat(name, ": ", docs, " x ", s.Sk / docs, " tokens"));
    auto fwd = [&] {
      laga::attention_flash_forward<float>(m, t.o.data(), t.lse.data(), t.q.data(), t.k.data(),
                                           t.v.data());
    };
    auto bwd = [&] {
      laga::attention_flash_backward<float>(m, t.dq.data(), t.dk.data(), t.dv.data(), t.dout.data(),
                                            t.q.data(), t.k.data(), t.v.data(), t.o.data(),
                                            t.lse.data());
    };
    std::function<std::int64_t()> check_fwd, check_bwd, check_both;
    if (t.checked) {
      check_fwd = [&] { return wrong_fwd(t); };
      check_bwd = [&] { return wrong_bwd(t); };
      check_both = [&] { return wrong_fwd(t) + wrong_bwd(t); };
    }
    Timed r;
    r.gflop_fwd = f;
    r.fwd = ctx.run("attn_flash_fwd", shape, f, flash_isa, fwd, check_fwd).t.median_ms;
    // The backward reads forward's o and lse: the last forward timed above,
    // or one run here when --op left the forward out.
    if (!ctx.selected("attn_flash_fwd")) fwd();
    r.bwd = ctx.run("attn_flash_bwd", shape, 2.5 * f, flash_isa, bwd, check_bwd).t.median_ms;
    r.fwdbwd = ctx.run(
                      "attn_flash_fwd+bwd", shape, 3.5 * f, flash_isa,
                      [&] {
                        fwd();
                        bwd();
                      },
                      check_both)
                   .t.median_ms;
    timed.push_back(r);
  }
  if (timed.size() != 2) return;  // --case kept one of the two
  const Timed &one = timed[0], &many = timed[1];
  auto ratio = [](double a, double b) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2fx", a / b);
    return b > 0 ? std::string(text) : std::string("-");
  };
  ctx.note(laga::cat("speedup 1 doc / 16 docs (ms ratio): fwd ", ratio(one.fwd, many.fwd), ", bwd ",
                     ratio(one.bwd, many.bwd), ", fwd+bwd ", ratio(one.fwdbwd, many.fwdbwd),
                     "; ideal (useful FLOP ratio) ", ratio(one.gflop_fwd, many.gflop_fwd)));
}
