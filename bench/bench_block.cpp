// The whole MLA block, forward+backward on one rank, per form: explicit,
// absorbed and laga, flash attention, against PyTorch eager running the same
// block (python/bench_torch_block.py, explicit form, same threads) with
// --torch. Shape: D 2048, H 16, C 512, dn 128, dr 64, dv 128, rq 0, B 1,
// S 2048 (--quick: D 512, H 4, S 256). With --torch, PyTorch's steps
// alternate with laga's (bench/torch_peer.hpp).
//
// GFLOP = useful work of one forward+backward: 3 x the four projections'
// 2 N (D H dqk + D (C+dr) + C H (dn+dv) + H dv D) (forward, dx, dW), plus
// 3.5 x the causal half of attention's forward (bench_attention.cpp's
// convention). Absorbed does more work than this (its latent-space attention
// is C+dr wide); the row counts the same useful work for every form, so
// GFLOP/s compares time. #wrong: out, dx and every parameter gradient of one
// step against tests/common/naive_mla.hpp, an independent naive double block
// (plain loops, sharing no code with the forms or the kernels), run once on
// the same inputs; an element is wrong when farther than 1e-5 * max |ref| of
// its tensor. The naive block is far slower than a timed step (scalar loops;
// only its attention and forward projections use threads), so it runs once.
#include <sys/resource.h>

#include <algorithm>
#include <memory>
#include <string>

#include "comm/communicator.hpp"
#include "common/naive_mla.hpp"
#include "core/error.hpp"
#include "core/precision.hpp"
#include "core/rng.hpp"
#include "harness.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/attention_flash_bf16.hpp"
#include "kernels/gemm_bf16.hpp"
#include "mla/block.hpp"
#include "mla/ops_bf16.hpp"
#include "torch_peer.hpp"

namespace {

using laga::MlaConfig;

template <class T>
struct BlockState {
  laga::MlaParams<T> w, grads;
  laga::Tensor<T> x, dout, out, dx;
};

template <class T>
void run_block(const MlaConfig& cfg, const laga::SpLayout& lay, const laga::RopeTable& rope,
               laga::Form form, BlockState<T>& st) {
  auto comm = laga::make_self_communicator();
  const laga::BlockContext ctx{cfg, lay, *comm, rope, form, laga::AttentionKind::flash};
  laga::MlaSaved<T> saved;
  laga::mla_forward(ctx, st.w, st.x, st.out, saved);
  laga::mla_backward(ctx, st.w, st.x, st.dout, saved, st.dx, st.grads);
}

// Minor page faults of this process so far: a step that reuses its buffers
// takes almost none; one that maps fresh memory takes one per 4 KiB touched.
long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

template <class T>
BlockState<T> make_state(const MlaConfig& cfg, std::int64_t S) {
  BlockState<T> st;
  st.w = laga::MlaParams<T>::zeros(cfg, laga::MemCategory::parameters);
  laga::init_params(st.w, 0, 0.1);
  st.grads = laga::MlaParams<T>::zeros(cfg, laga::MemCategory::gradients);
  st.x = laga::Tensor<T>({1, S, cfg.dim});
  st.dout = laga::Tensor<T>({1, S, cfg.dim});
  laga::fill_normal(st.x.data(), st.x.numel(), 0, 1, 0, 1.0);
  laga::fill_normal(st.dout.data(), st.dout.numel(), 0, 2, 0, 1.0);
  return st;
}

// The benchmarked block: D 2048, H 16, C 512, dn 128, dr 64, dv 128, rq 0,
// B 1, S 2048 (--quick: D 512, H 4, S 256), and its GFLOP (the header's
// convention).
struct BenchBlock {
  MlaConfig cfg;
  std::int64_t S = 0;
  double gflop = 0;
  std::string shape;
};

BenchBlock bench_block_shape(bool quick) {
  BenchBlock b;
  MlaConfig& cfg = b.cfg;
  cfg.dim = quick ? 512 : 2048, cfg.n_heads = quick ? 4 : 16, cfg.kv_lora_rank = 512;
  cfg.qk_nope_head_dim = 128, cfg.qk_rope_head_dim = 64, cfg.v_head_dim = 128;
  cfg.max_seq_len = cfg.original_seq_len = 4096;
  const std::int64_t S = quick ? 256 : 2048, N = S;
  const std::int64_t D = cfg.dim, H = cfg.n_heads, C = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim;
  const std::int64_t dqk = cfg.qk_head_dim(), dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
  const double linear =
      2.0 * double(N) * double(D * H * dqk + D * (C + dr) + C * H * (dn + dv) + H * dv * D);
  const laga::AttnShape attn{1, S, S, H, H, dqk, dv, cfg.softmax_scale(), true};
  b.S = S;
  b.gflop = 1e-9 * (3.0 * linear + 3.5 * attn.useful_flops_forward());
  b.shape = laga::cat("D", D, " H", H, " C", C, " S", S);
  return b;
}

// One step of the naive double block on make_state's inputs.
laga::test::NaiveMlaResult naive_reference(const MlaConfig& cfg, std::int64_t S) {
  const BlockState<float> in = make_state<float>(cfg, S);
  laga::test::NaiveTensors w;
  in.w.for_each([&](const std::string& name, const laga::Tensor<float>& t) {
    w[name].assign(t.data(), t.data() + t.numel());
  });
  return laga::test::naive_mla(cfg, w, {in.x.data(), in.x.data() + in.x.numel()},
                               {in.dout.data(), in.dout.data() + in.dout.numel()}, 1, S);
}

// #wrong of one step from zero gradients against the naive block: out at
// rel_out * max|ref| of it, dx and every gradient at rel_grad.
std::int64_t wrong_against(const MlaConfig& cfg, const laga::SpLayout& lay,
                           const laga::RopeTable& rope, laga::Form form, BlockState<float>& st,
                           const laga::test::NaiveMlaResult& ref, double rel_out, double rel_grad) {
  st.grads.for_each([](const std::string&, laga::Tensor<float>& t) { t.fill(0.0f); });
  run_block(cfg, lay, rope, form, st);
  std::int64_t wrong =
      laga::bench::count_wrong(st.out.data(), ref.out.data(), st.out.numel(), rel_out) +
      laga::bench::count_wrong(st.dx.data(), ref.dx.data(), st.dx.numel(), rel_grad);
  st.grads.for_each([&](const std::string& name, const laga::Tensor<float>& g) {
    wrong += laga::bench::count_wrong(g.data(), ref.grads.at(name).data(), g.numel(), rel_grad);
  });
  return wrong;
}

}  // namespace

LAGA_BENCH(block, "whole MLA block fwd+bwd per form, one rank (vs PyTorch eager with --torch)") {
  const BenchBlock b = bench_block_shape(ctx.options().quick);
  const MlaConfig& cfg = b.cfg;
  const std::int64_t S = b.S, D = cfg.dim, H = cfg.n_heads;
  const double gflop = b.gflop;
  const std::string& shape = b.shape;
  const laga::SpLayout lay = laga::SpLayout::even(1, S, cfg.n_heads, 1);
  const laga::RopeTable rope(cfg.rope(), S);

  ctx.note("reference: tests/common/naive_mla.hpp, naive double loops, once (out, dx, every grad)");
  const laga::test::NaiveMlaResult ref = naive_reference(cfg, S);

  // --torch: a PyTorch peer process running the same block; its steps
  // alternate with laga's (bench/torch_peer.hpp), and each row's ratio is
  // taken between the steps interleaved with that row.
  std::unique_ptr<laga::bench::TorchPeer> torch;
  if (ctx.options().torch) {
    const auto& o = ctx.options();
    const std::string cmd =
        laga::cat(o.python, " ", laga::bench::source_dir(), "/python/bench_torch_block.py --dim ",
                  D, " --heads ", H, " --seq ", S, " --threads ", o.threads, " --warmup ",
                  std::max(1, o.warmup), " --serve");
    ctx.note("PyTorch: " + cmd.substr(cmd.find("python/")) +
             " (one PyTorch step before each timed laga step)");
    torch = std::make_unique<laga::bench::TorchPeer>(cmd);
    // bench_torch_block.py attends with F.scaled_dot_product_attention where
    // PyTorch has it (>= 2), else with matmul + softmax.
    const bool sdpa = !torch->torch_version().empty() && torch->torch_version()[0] >= '2';
    ctx.note("PyTorch " + torch->torch_version() + ", explicit block, eager autograd" +
             (sdpa ? ", attention by F.scaled_dot_product_attention(is_causal=True)"
                   : ", attention by matmul + softmax"));
  }
  // GEMMs in oneDNN, attention in the flash kernels: %peak against the
  // wider ISA of the two, so as not to flatter the row.
  const std::string isa =
      laga::bench::wider_isa(laga::bench::gemm_isa(), laga::to_string(laga::flash_isa()));
  ctx.header();
  for (laga::Form form : {laga::Form::explicit_form, laga::Form::absorbed, laga::Form::laga}) {
    const std::string op = laga::cat("block_", laga::to_string(form));
    // --case and --op both select forms here: a form not run prints nothing.
    if (!laga::bench::case_selected(ctx.options(), laga::to_string(form)) || !ctx.selected(op))
      continue;
    // Each form starts from an empty block cache: what the reference or the
    // previous form kept is released (the pool's held peak is this form's).
    laga::MemoryPool& pool = laga::current_pool();
    pool.cache().trim();
    pool.reset_peaks();
    BlockState<float> st = make_state<float>(cfg, S);
    std::vector<double> torch_ms;
    // Per step, warm-up included: minor page faults, and blocks the pool had
    // to map afresh or resize (its block cache had none of their size).
    std::vector<double> faults, fresh;
    auto& row = ctx.run(
        op, shape, gflop, isa,
        [&] {
          const long before = minor_faults();
          const std::int64_t not_reused = pool.cache().stats().not_reused();
          run_block(cfg, lay, rope, form, st);
          faults.push_back(double(minor_faults() - before));
          fresh.push_back(double(pool.cache().stats().not_reused() - not_reused));
        },
        [&] {
          // backward adds into grads: one step from zero for the check.
          return wrong_against(cfg, lay, rope, form, st, ref, 1e-5, 1e-5);
        },
        [&] {
          if (torch) torch_ms.push_back(torch->step());
        });
    // The timed steps only (the warm-up ones map the allocator's memory).
    const auto timed_median = [&](std::vector<double> v) {
      v.erase(v.begin(), v.begin() + std::min<std::ptrdiff_t>(ctx.options().warmup, v.size()));
      return v.empty() ? 0.0 : laga::bench::median(v);
    };
    const double bytes_per_mib = 1024.0 * 1024.0;
    std::string line =
        laga::cat(laga::to_string(form), ": ", double(S) / row.t.median_ms * 1e3,
                  " tokens/s; minor page faults per timed step: median ", timed_median(faults),
                  "; blocks mapped afresh or resized per timed step: median ", timed_median(fresh),
                  "; the pool's peak: live ", double(pool.peak_total()) / bytes_per_mib,
                  " MiB, held (live + page rounding + block cache) ",
                  double(pool.peak_held()) / bytes_per_mib, " MiB");
    if (!torch_ms.empty()) {
      row.torch_ms = laga::bench::median(torch_ms);
      // Each PyTorch step ran just before one laga step: the ratio within a
      // pair is the least exposed to the machine's drift.
      std::vector<double> pair;
      for (size_t i = 0; i < torch_ms.size() && i < row.t.samples_ms.size(); ++i)
        pair.push_back(torch_ms[i] / row.t.samples_ms[i]);
      const auto [lo, hi] = std::minmax_element(pair.begin(), pair.end());
      line += laga::cat("; PyTorch in the same interval: ", double(S) / row.torch_ms * 1e3,
                        " tokens/s; speedup per adjacent pair: median ", laga::bench::median(pair),
                        "x, range ", *lo, "x..", *hi, "x");
    }
    ctx.note(line);
  }
  laga::current_pool().cache().trim();
}

// The same block in bf16 mixed precision (--dtype bf16: every GEMM and
// attention operand rounded to bf16 into scratch, fp32 sums; mla/ops.hpp,
// "Precision") against fp32, per form, the two timed alternately (every
// round runs fp32 then bf16), and the speedup taken per round. %peak: fp32
// rows against the fp32 FMA peak, bf16 rows against the bf16 dot-product
// peak (VDPBF16PS) where its GEMMs run oneDNN's bf16 matmul on a CPU with
// AVX512_BF16, else against fp32's (the operands widened to fp32, or oneDNN
// emulating bf16: the note says which; gemm_bf16_path).
// #wrong: fp32 at 1e-5, bf16 at its derived bounds (mla/ops_bf16.hpp: 10 u
// for out, 20 u for dx and the gradients), both against the naive double
// block.
LAGA_BENCH(block_bf16,
           "whole MLA block fwd+bwd, bf16 mixed precision vs fp32, alternating (vs PyTorch "
           "under bf16 autocast with --torch)") {
  const BenchBlock b = bench_block_shape(ctx.options().quick);
  const MlaConfig& cfg = b.cfg;
  const laga::SpLayout lay = laga::SpLayout::even(1, b.S, cfg.n_heads, 1);
  const laga::RopeTable rope(cfg.rope(), b.S);
  const bool bf16_cpu = laga::bench::cpu_has_avx512_bf16();
  const bool bf16_dots = bf16_cpu && laga::gemm_bf16_path() == laga::GemmBf16Path::onednn_bf16;
  const std::string f32_isa =
      laga::bench::wider_isa(laga::bench::gemm_isa(), laga::to_string(laga::flash_isa()));
  const std::string bf16_isa = bf16_dots ? "bf16" : f32_isa;
  // What the bf16 step runs on here, in oneDNN's and the flash kernels' words.
  const std::int64_t D = cfg.dim, H = cfg.n_heads;
  ctx.note(laga::cat(
      "bf16 GEMMs: oneDNN ",
      laga::gemm_bf16_implementation(false, true, b.S, H * cfg.v_head_dim * 2, cfg.kv_lora_rank,
                                     cfg.kv_lora_rank, cfg.kv_lora_rank, H * cfg.v_head_dim * 2,
                                     false),
      " (wkv_b's shape; D ", D, "); bf16 flash: ", laga::to_string(laga::flash_bf16_isa()),
      bf16_cpu ? "" : "; this CPU has no AVX512_BF16: oneDNN emulates bf16 or widens to fp32"));
  if (bf16_dots)
    ctx.note(
        "bf16 %peak is against the VDPBF16PS register loop; oneDNN's AMX kernels (brg:"
        "avx512_core_amx_bf16, where the CPU has AMX) run above it, so %peak can pass 100%");
  ctx.note("reference: tests/common/naive_mla.hpp, naive double loops, once (out, dx, every grad)");
  const laga::test::NaiveMlaResult ref = naive_reference(cfg, b.S);
  // --torch: the same block in PyTorch under CPU bf16 autocast (fp32
  // parameters), one step before each round; its ratio is against the bf16
  // row of the same round.
  std::unique_ptr<laga::bench::TorchPeer> torch;
  if (ctx.options().torch) {
    const auto& o = ctx.options();
    const std::string cmd =
        laga::cat(o.python, " ", laga::bench::source_dir(), "/python/bench_torch_block.py --dim ",
                  D, " --heads ", H, " --seq ", b.S, " --threads ", o.threads, " --warmup ",
                  std::max(1, o.warmup), " --autocast bf16 --serve");
    torch = std::make_unique<laga::bench::TorchPeer>(cmd);
    const bool sdpa = !torch->torch_version().empty() && torch->torch_version()[0] >= '2';
    ctx.note("PyTorch " + torch->torch_version() +
             ", explicit block under torch.autocast(\"cpu\", " +
             "dtype=torch.bfloat16), eager autograd" +
             (sdpa ? ", attention by F.scaled_dot_product_attention(is_causal=True)"
                   : ", attention by matmul + softmax") +
             " (" + cmd.substr(cmd.find("python/")) + ", one step before each round)");
  }
  const double out_bound = laga::bf16_bound_vs_exact(laga::BlockTensor::output);
  const double grad_bound = laga::bf16_bound_vs_exact(laga::BlockTensor::gradient);
  ctx.header();
  for (laga::Form form : {laga::Form::explicit_form, laga::Form::absorbed, laga::Form::laga}) {
    const std::string name = laga::to_string(form);
    if (!laga::bench::case_selected(ctx.options(), name)) continue;
    laga::current_pool().cache().trim();
    BlockState<float> f32 = make_state<float>(cfg, b.S), b16 = make_state<float>(cfg, b.S);
    const auto step_bf16 = [&] {
      const laga::UsePrecision bf16(laga::Precision::bf16);
      run_block(cfg, lay, rope, form, b16);
    };
    std::vector<double> torch_ms;
    int between_calls = 0;  // `between` runs before each timed call: PyTorch before bf16's
    const std::vector<laga::bench::Row*> got = ctx.run_alternating(
        {
            {laga::cat("block_", name, "/f32"), b.shape, b.gflop, f32_isa,
             [&] { run_block(cfg, lay, rope, form, f32); },
             [&] { return wrong_against(cfg, lay, rope, form, f32, ref, 1e-5, 1e-5); }},
            {laga::cat("block_", name, "/bf16"), b.shape, b.gflop, bf16_isa, step_bf16,
             [&] {
               const laga::UsePrecision bf16(laga::Precision::bf16);
               return wrong_against(cfg, lay, rope, form, b16, ref, out_bound, grad_bound);
             }},
        },
        [&] {
          if (torch && between_calls++ % 2 == 1) torch_ms.push_back(torch->step());
        });
    if (got.size() != 2) continue;  // --op kept one row: no ratio
    std::vector<double> ratio;
    for (size_t i = 0; i < got[0]->t.samples_ms.size(); ++i)
      ratio.push_back(got[0]->t.samples_ms[i] / got[1]->t.samples_ms[i]);
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    std::string line = laga::cat(name, ": fp32 ", double(b.S) / got[0]->t.median_ms * 1e3,
                                 " tokens/s, bf16 ", double(b.S) / got[1]->t.median_ms * 1e3,
                                 " tokens/s; bf16 speedup per round (fp32 ms / bf16 ms): median ",
                                 laga::bench::median(ratio), "x, range ", *lo, "x..", *hi, "x");
    if (!torch_ms.empty()) {  // one PyTorch step just before each timed bf16 step
      got[1]->torch_ms = laga::bench::median(torch_ms);
      std::vector<double> pair;
      for (size_t i = 0; i < torch_ms.size(); ++i)
        pair.push_back(torch_ms[i] / got[1]->t.samples_ms[i]);
      const auto [tlo, thi] = std::minmax_element(pair.begin(), pair.end());
      line += laga::cat("; PyTorch bf16 autocast: ", double(b.S) / got[1]->torch_ms * 1e3,
                        " tokens/s; laga bf16 over it per round: median ",
                        laga::bench::median(pair), "x, range ", *tlo, "x..", *thi, "x");
    }
    ctx.note(line);
  }
  laga::current_pool().cache().trim();
}
