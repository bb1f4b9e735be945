// laga_cuda_forms: the attention block's forms on a GPU (issue 52, step 4;
// scripts/gpu_check.sh's cuda mode runs it after laga_cuda_check):
//
//   laga_cuda_forms --json OUT.json --table OUT.md [--seqs 4096,8192,16384,32768]
//                   [--budget-s 240] [--dry-run]
//
// It registers the CUDA backend's rows and memory in this process
// (register_kernel_rows, cuda::register_cuda_memory) and runs the forms
// through mla/runner.cpp with RunSpec::device = cuda: the same device path
// CI runs on the emulated device (mla_test_device_emulated), here on the GPU.
//  1. Every form variant at P 1 and at P 2-4 as ranks sharing the GPU (the
//     device-local transport), fp32, flash: out, dx and every gradient
//     against the CPU's float64 explicit at P 1 (relative to the tensor's
//     largest reference value, within kFp32Tol); every rank's ledger equal
//     to the CPU fp32 run's; every rank's device peak (its device pool's)
//     equal to the memory model's prediction.
//  2. bf16 mixed precision at P 1 and 2: against the CPU's float64 within
//     bf16_bound_vs_exact, and against CUDA explicit at P 1 in bf16 and the
//     CPU's bf16 run of the same form and P within bf16_bound_between_runs
//     (mla/ops_bf16.hpp).
//  3. Step times (forward + backward, median of the timed steps after a
//     warm-up) per form at DeepSeek-V3's block dims (the deepseek-v3 preset:
//     H 128, 192/128, C 512), bf16 (laga_fused too: its kernel's bf16 variant),
//     S in --seqs at P 1 and as rank 0 of P 8 would run it (alone, on a
//     dry-run communicator), each row on a thread of its own, with the
//     device pool's peak beside the model's and the library workspaces the
//     thread kept beside the prediction's (cuda/device_peak.hpp: the
//     cuBLASLt workspace predicted, cuDNN's per graph measured only;
//     scripts/plan_vs_gpu.py puts `laga plan`'s time beside each row);
//     explicit, laga and laga_fused side by side are the fused kernel's peak
//     and time against unfused laga and explicit. A run the model says will
//     not fit in 85% of the device's memory is skipped and said so.
// --dry-run needs no device (the ctest host test): it lists what would run.
// Nothing of this has run on a GPU yet (docs/performance.md, "What has not
// run on a GPU").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "comm/dry_run_comm.hpp"
#include "core/rng.hpp"
#include "cuda/device.hpp"
#include "cuda/device_memory_cuda.hpp"
#include "cuda/device_peak.hpp"
#include "mla/form_spec.hpp"
#include "mla/memory_model.hpp"
#include "mla/op_table.hpp"
#include "mla/ops_bf16.hpp"
#include "mla/runner.hpp"

namespace laga::cuda {
namespace {

using json = nlohmann::json;

// fp32 on the GPU against float64: other summation orders (and cuBLASLt's
// fp32 GEMMs) over the small block's reductions.
constexpr double kFp32Tol = 1e-4;

MlaConfig check_config() {
  MlaConfig c;
  c.dim = 64, c.n_heads = 6, c.q_lora_rank = 16, c.kv_lora_rank = 32, c.qk_nope_head_dim = 16,
  c.qk_rope_head_dim = 8, c.v_head_dim = 12;
  c.rope_theta = 500, c.original_seq_len = 16, c.max_seq_len = 128, c.rope_factor = 4;
  c.validate();
  return c;
}

template <class T>
struct Inputs {
  MlaParams<T> w;
  Tensor<T> x, dout;
};
template <class T>
Inputs<T> make_inputs(const MlaConfig& cfg, std::int64_t B, std::int64_t S) {
  Inputs<T> in;
  in.w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  init_params(in.w, 3, 0.1);
  in.x = Tensor<T>({B, S, cfg.dim});
  in.dout = Tensor<T>({B, S, cfg.dim});
  fill_normal(in.x.data(), in.x.numel(), 5, 1, 0, 1.0);
  fill_normal(in.dout.data(), in.dout.numel(), 5, 2, 0, 1.0);
  return in;
}
template <class T>
TensorD widened(const Tensor<T>& t) {
  TensorD d(t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) d[i] = double(t[i]);
  return d;
}

// The largest relative deviation of out, dx and every gradient, and where.
struct Worst {
  double rel = 0;
  std::string where;
};
template <class A, class B>
Worst worst_of(const BlockRun<A>& run, const BlockRun<B>& ref) {
  Worst w;
  auto take = [&](const std::string& name, const Tensor<A>& a, const Tensor<B>& b) {
    const Deviation d = deviation(widened(a), widened(b));
    if (!(d.relative() <= w.rel)) w.rel = d.relative(), w.where = name;
  };
  take("out", run.out, ref.out);
  take("dx", run.dx, ref.dx);
  std::vector<const Tensor<B>*> refs;
  ref.grads.for_each([&](const std::string&, const Tensor<B>& g) { refs.push_back(&g); });
  std::size_t i = 0;
  run.grads.for_each(
      [&](const std::string& n, const Tensor<A>& g) { take("grad." + n, g, *refs[i++]); });
  return w;
}

bool same_ledgers(const std::vector<RankReport>& a, const std::vector<RankReport>& b,
                  std::string& why) {
  for (std::size_t r = 0; r < a.size() && r < b.size(); ++r) {
    const auto &ea = a[r].ledger.entries(), &eb = b[r].ledger.entries();
    if (ea.size() != eb.size())
      return why = cat("rank ", r, ": ", ea.size(), " vs ", eb.size(), " labels"), false;
    for (auto i = ea.begin(), j = eb.begin(); i != ea.end(); ++i, ++j)
      if (i->first != j->first || i->second.calls != j->second.calls ||
          i->second.bytes_sent != j->second.bytes_sent ||
          i->second.measured_received != j->second.measured_received)
        return why = cat("rank ", r, ": ", i->first.second), false;
  }
  return a.size() == b.size();
}

struct Row {
  std::string form, dtype, check;
  int P = 0;
  double error = 0, tol = 0;
  bool pass = false;
  std::string note;
};

void check_forms(std::vector<Row>& rows) {
  const MlaConfig cfg = check_config();
  const std::int64_t B = 2, S = 61;
  const Inputs<double> in64 = make_inputs<double>(cfg, B, S);
  const Inputs<float> in32 = make_inputs<float>(cfg, B, S);
  RunSpec ref_spec;
  ref_spec.variant = Form::explicit_form;
  ref_spec.attention = AttentionKind::flash;
  const BlockRun<double> ref =
      run_local(cfg, SpLayout::even(B, S, cfg.n_heads, 1), in64.w, in64.x, in64.dout, ref_spec);
  std::vector<FormVariant> variants;
  for (Form f : all_forms()) variants.push_back(f);
  for (Form f : forms_with(&FormTraits::query_latent))
    variants.push_back({f, QueryExchange::latent});
  for (FormVariant v : variants)
    for (int P : {1, 2, 3, 4}) {
      const std::string name = to_string(v);
      try {
        const SpLayout lay = SpLayout::even(B, S, cfg.n_heads, P);
        RunSpec spec;
        spec.variant = v, spec.attention = AttentionKind::flash;
        const BlockRun<float> cpu = run_local(cfg, lay, in32.w, in32.x, in32.dout, spec);
        spec.device = Device::cuda;
        const BlockRun<float> dev = run_local(cfg, lay, in32.w, in32.x, in32.dout, spec);
        const Worst w = worst_of(dev, ref);
        rows.push_back(
            {name, "fp32", "vs CPU float64", P, w.rel, kFp32Tol, w.rel <= kFp32Tol, w.where});
        std::string why;
        const bool ledgers = same_ledgers(dev.ranks, cpu.ranks, why);
        rows.push_back({name, "fp32", "ledger = CPU's", P, 0, 0, ledgers, why});
        double worst_gap = 0;
        for (const RankReport& rep : dev.ranks) {
          const MemoryPrediction p =
              predict_memory(cfg, lay, v, AttentionKind::flash, rep.rank, sizeof(float));
          worst_gap =
              std::max(worst_gap, std::abs(double(rep.memory.peak_working - p.peak_working)));
        }
        rows.push_back(
            {name, "fp32", "device peak = model (bytes off)", P, worst_gap, 0, worst_gap == 0, ""});
      } catch (const std::exception& e) {
        rows.push_back({name, "fp32", "run", P, INFINITY, 0, false, e.what()});
      }
    }
  // bf16 mixed precision: against float64, and against CUDA explicit at P 1.
  const UsePrecision bf16(Precision::bf16);
  RunSpec ex;
  ex.variant = Form::explicit_form, ex.attention = AttentionKind::flash, ex.device = Device::cuda;
  BlockRun<float> ex_dev;
  try {
    ex_dev = run_local(cfg, SpLayout::even(B, S, cfg.n_heads, 1), in32.w, in32.x, in32.dout, ex);
  } catch (const std::exception& e) {
    rows.push_back({"explicit", "bf16", "run", 1, INFINITY, 0, false, e.what()});
    return;
  }
  const double vs_exact = bf16_bound_vs_exact(BlockTensor::gradient),
               between = bf16_bound_between_runs(BlockTensor::gradient);
  for (FormVariant v : variants)
    for (int P : {1, 2}) {
      const std::string name = to_string(v);
      try {
        RunSpec spec;
        spec.variant = v, spec.attention = AttentionKind::flash, spec.device = Device::cuda;
        const BlockRun<float> dev =
            run_local(cfg, SpLayout::even(B, S, cfg.n_heads, P), in32.w, in32.x, in32.dout, spec);
        const Worst w = worst_of(dev, ref), e = worst_of(dev, ex_dev);
        rows.push_back(
            {name, "bf16", "vs CPU float64", P, w.rel, vs_exact, w.rel <= vs_exact, w.where});
        rows.push_back(
            {name, "bf16", "vs CUDA explicit P 1", P, e.rel, between, e.rel <= between, e.where});
        // The CPU's bf16 run of the same form and P (laga_fused: its bf16
        // fused path, whose rounding points the CUDA kernel's bf16 variant
        // keeps: cuda/attention.hpp).
        try {
          RunSpec cpu_spec = spec;
          cpu_spec.device = Device::cpu;
          const BlockRun<float> cpu = run_local(cfg, SpLayout::even(B, S, cfg.n_heads, P), in32.w,
                                                in32.x, in32.dout, cpu_spec);
          const Worst c = worst_of(dev, cpu);
          rows.push_back(
              {name, "bf16", "vs CPU bf16", P, c.rel, between, c.rel <= between, c.where});
        } catch (const std::exception& x) {
          rows.push_back({name, "bf16", "vs CPU bf16", P, INFINITY, 0, false, x.what()});
        }
      } catch (const std::exception& e) {
        rows.push_back({name, "bf16", "run", P, INFINITY, 0, false, e.what()});
      }
    }
}

struct Timing {
  std::string form, dtype;
  std::int64_t S = 0;
  int P = 1;     // 8: rank `rank` of 8 alone (time_rank)
  int rank = 0;  // the rank timed
  double step_ms = 0;
  std::int64_t device_peak = 0, model_peak = 0;
  // The device peak's other parts (cuda/device_peak.hpp): the cuBLASLt
  // workspace predicted, and what the row's thread kept (measured).
  std::int64_t cublaslt_predicted = kCublasLtWorkspaceBytes;
  KeptDeviceBytes kept;
  std::string note;
};

// One rank's step, on the calling thread (a fresh one per row: what the
// CUDA rows keep per thread, the cuBLASLt context and cuDNN's graphs, is
// then this row's alone, made in the warm-up, not in the timed steps): at P
// 1 the whole block, at P 8 rank `t.rank` alone, each on a dry-run
// communicator (comm/dry_run_comm.hpp: its collectives deliver stand-ins of
// the right size, so the rank runs a P 8 rank's shapes and allocations; its
// values are not checked; at P 1 there is nothing to deliver). Median of
// two timed steps after one warm-up; the device pool's working peak.
void time_rank(Timing& t, const MlaConfig& cfg, const SpLayout& lay, const RunSpec& spec,
               const Inputs<float>& in) {
  const RopeTable rope(cfg.rope(), lay.seq);
  std::vector<double> ms;
  for (int step = 0; step < 3; ++step) {
    DryRunCommunicator dry(t.rank, lay.ranks);
    const RankReport rep = run_rank(dry, cfg, lay, rope, in.w, in.x, in.dout, spec).report;
    if (step > 0) ms.push_back(rep.forward_ms + rep.backward_ms);
    t.device_peak = rep.memory.peak_working;
  }
  std::sort(ms.begin(), ms.end());
  t.step_ms = ms[ms.size() / 2];
  t.kept = kept_device_bytes();
  // The predicted part of what the thread kept must be what it holds.
  if (t.kept.cublaslt_workspace != t.cublaslt_predicted)
    t.note = cat("cuBLASLt workspace held ", t.kept.cublaslt_workspace, " bytes, predicted ",
                 t.cublaslt_predicted, " (cuda/device_peak.hpp)");
}

void time_forms(std::vector<Timing>& out, const std::vector<std::int64_t>& seqs, double budget_s,
                std::int64_t memory_bytes) {
  const MlaConfig cfg = MlaConfig::preset("deepseek-v3");
  const auto start = std::chrono::steady_clock::now();
  auto spent = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::int64_t params = 0;
  for (const auto& [name, shape] : mla_param_shapes(cfg)) params += numel(shape);
  for (std::int64_t S : seqs)
    for (int P : {1, 8})
      for (Form f : {Form::explicit_form, Form::laga, Form::laga_fused}) {
        Timing t;
        t.form = to_string(FormVariant(f)), t.S = S, t.P = P;
        t.dtype = "bf16";
        const SpLayout lay = SpLayout::even(1, S, cfg.n_heads, P);
        t.model_peak = predict_memory(cfg, lay, f, AttentionKind::flash, t.rank, 4).peak_working;
        // The device pool's parameters and gradients, x, dout, out and dx
        // (the rank's shard), and the working peak.
        const std::int64_t need = t.model_peak + 2 * 4 * params + 4 * 4 * (S / P + 1) * cfg.dim;
        if (double(need) > 0.85 * double(memory_bytes)) {
          t.note = cat("skipped: the model's ", need / 1e9, " GB > 85% of the device's");
        } else if (spent() > budget_s) {
          t.note = "skipped: over the time budget";
        } else {
          std::thread row([&] {
            try {
              const UsePrecision prec(Precision::bf16);
              const Inputs<float> in = make_inputs<float>(cfg, 1, S);
              RunSpec spec;
              spec.variant = f, spec.attention = AttentionKind::flash, spec.device = Device::cuda;
              spec.grad_sync = false;
              time_rank(t, cfg, lay, spec, in);
            } catch (const std::exception& e) {
              t.note = e.what();
            }
          });
          row.join();
        }
        out.push_back(t);
      }
}

// What the row's thread kept on the device (cuda/device_peak.hpp): the
// cuBLASLt workspace, cuDNN's workspace per graph pair, and the pool's total.
json kept_json(const KeptDeviceBytes& k) {
  json graphs = json::array();
  for (const CudnnGraphWorkspace& g : k.cudnn_graphs)
    graphs.push_back({{"shape", g.shape}, {"forward", g.forward}, {"backward", g.backward}});
  return {{"cublaslt_workspace", k.cublaslt_workspace},
          {"cudnn_workspace", k.cudnn_workspace},
          {"cudnn_graphs", graphs},
          {"total", k.total}};
}

int run(int argc, char** argv) {
  CLI::App app("laga_cuda_forms: the attention block's forms on a GPU against the CPU");
  std::string json_path = "cuda_forms.json", table_path;
  std::vector<std::int64_t> seqs{4096, 8192, 16384, 32768};
  double budget = 240;
  bool dry = false;
  app.add_option("--json", json_path, "where the JSON goes");
  app.add_option("--table", table_path, "where the markdown table goes");
  app.add_option("--seqs", seqs, "sequence lengths timed at V3 dims")->delimiter(',');
  app.add_option("--budget-s", budget, "seconds the timings may take, about");
  app.add_flag("--dry-run", dry, "list what would run; no device needed");
  CLI11_PARSE(app, argc, argv);
  json j;
  j["seqs"] = seqs;
  j["checks"] = {
      "every form variant, fp32, P 1-4 sharing the GPU: vs CPU float64, ledger, "
      "device peak vs model",
      "every form variant, bf16, P 1-2: vs CPU float64, vs CUDA explicit P 1 and vs CPU bf16",
      "step times at deepseek-v3 dims, bf16: explicit, laga, laga_fused"};
  if (dry) {
    j["ran"] = false;
    std::ofstream(json_path) << j.dump(2) << "\n";
    std::cout << "laga_cuda_forms --dry-run: " << j["checks"].size() << " parts, "
              << all_forms().size() << " forms; wrote " << json_path << "\n";
    return 0;
  }
  register_cuda_memory();  // throws naming what is missing without a device
  ops::register_kernel_rows(Device::cuda, ops::cuda_kernel_rows());
  const DeviceInfo d = current_device();
  j["device"] = {{"name", d.name},
                 {"sm", d.sm_major * 10 + d.sm_minor},
                 {"memory_bytes", d.memory_bytes},
                 {"driver", d.driver_version},
                 {"runtime", d.runtime_version}};
  std::vector<Row> rows;
  check_forms(rows);
  std::vector<Timing> times;
  time_forms(times, seqs, budget, d.memory_bytes);
  int failed = 0;
  std::ostringstream md;
  md << "device: " << d.name << " (sm_" << d.sm_major << d.sm_minor << "), driver "
     << d.driver_version << ", CUDA runtime " << d.runtime_version
     << "\n\n| form | dtype | P | check | error | tol | | where "
        "|\n|---|---|---|---|---|---|---|---|\n";
  for (const Row& r : rows) {
    failed += !r.pass;
    j["forms"].push_back({{"form", r.form},
                          {"dtype", r.dtype},
                          {"P", r.P},
                          {"check", r.check},
                          {"error", std::isfinite(r.error) ? json(r.error) : json("inf")},
                          {"tol", r.tol},
                          {"pass", r.pass},
                          {"note", r.note}});
    md << "| " << r.form << " | " << r.dtype << " | " << r.P << " | " << r.check << " | " << r.error
       << " | " << r.tol << " | " << (r.pass ? "pass" : "FAIL") << " | " << r.note << " |\n";
  }
  md << "\n| form | dtype | S | P (rank) | step ms | device pool peak GB | model GB | cuBLASLt "
        "MB held (predicted) | cuDNN workspace MB | kept MB | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const Timing& t : times) {
    // A timed row whose held cuBLASLt workspace is not the prediction's
    // fails (time_rank's note says so); a skipped row (a note, no time) not.
    failed += t.step_ms > 0 && t.kept.cublaslt_workspace != t.cublaslt_predicted;
    j["timings"].push_back({{"form", t.form},
                            {"dtype", t.dtype},
                            {"S", t.S},
                            {"P", t.P},
                            {"step_ms", t.step_ms},
                            {"rank", t.rank},
                            {"device_peak", t.device_peak},
                            {"model_peak", t.model_peak},
                            {"cublaslt_workspace_predicted", t.cublaslt_predicted},
                            {"kept", kept_json(t.kept)},
                            {"note", t.note}});
    md << "| " << t.form << " | " << t.dtype << " | " << t.S << " | " << t.P << " (" << t.rank
       << ") | " << t.step_ms << " | " << t.device_peak / 1e9 << " | " << t.model_peak / 1e9
       << " | " << t.kept.cublaslt_workspace / 1048576.0 << " (" << t.cublaslt_predicted / 1048576.0
       << ") | " << t.kept.cudnn_workspace / 1048576.0 << " | " << t.kept.total / 1048576.0 << " | "
       << t.note << " |\n";
  }
  j["ran"] = true, j["failed"] = failed;
  std::ofstream(json_path) << j.dump(2) << "\n";
  std::cout << md.str();
  if (!table_path.empty()) std::ofstream(table_path) << md.str();
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace laga::cuda

int main(int argc, char** argv) {
  try {
    return laga::cuda::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "laga_cuda_forms: " << e.what() << "\n";
    return 2;
  }
}
