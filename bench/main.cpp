// laga_bench [NAME...] [--case C] [--op O] [--threads N] [--repeats N] [--torch] [--quick]
// Runs the registered benchmarks whose name contains one of NAME (all when
// none is given) and prints one table per benchmark.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "core/threads.hpp"
#include "harness.hpp"
#include "kernels/attention_flash.hpp"
#include "kernels/gemm.hpp"

namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

// Other processes on the cores make every wall-clock number here a lie; the
// load average printed with the table says how much to trust it.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five;
  in >> one >> five;
  return one.empty() ? "unknown" : one + " (1 min), " + five + " (5 min)";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace laga::bench;
  Options opt;
  bool list = false;
  CLI::App app{"laga_bench: kernel benchmarks in one table (see docs/performance.md)"};
  app.add_option(
      "names", opt.filters,
      "benchmarks to run: a whole name selects that one, else every name it is a substring "
      "of; all when omitted");
  app.add_option("--case", opt.cases, "only the cases whose name contains this (repeatable)")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--op", opt.ops, "only the rows whose op contains this (repeatable)")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--threads", opt.threads, "threads (OpenMP: oneDNN, the flash kernels; OpenBLAS)")
      ->check(CLI::PositiveNumber);
  app.add_option("--repeats", opt.repeats, "timed runs per row; the median is reported")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", opt.warmup, "untimed runs before timing")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--torch", opt.torch,
               "also time the same shapes in PyTorch (python/bench_torch.py)");
  app.add_option("--python", opt.python, "interpreter with torch for --torch");
  app.add_flag("--quick", opt.quick, "small shapes: a smoke test of the harness");
  app.add_flag("--list", list, "list the benchmarks and exit");
  CLI11_PARSE(app, argc, argv);

  if (list) {
    for (const Benchmark& b : registry()) std::printf("%-12s %s\n", b.name.c_str(), b.help.c_str());
    return 0;
  }
  try {
    laga::set_rank_threads(opt.threads);
    const char* flash_isa = laga::to_string(laga::flash_isa());  // a bad LAGA_FLASH_ISA fails here
    const Peak peak = measure_fma_peak(opt.threads, 3);
    std::printf("# laga_bench on %s, %d of %d cores, threads %d\n", cpu_model().c_str(),
                opt.threads, laga::hardware_cores(), opt.threads);
    std::printf("# load average at start: %s\n", load_average().c_str());
    std::printf("# timing: median of %d runs after %d warm-up run(s); ms is wall time per call\n",
                opt.repeats, opt.warmup);
    std::printf(
        "# FMA peak at start on %d threads (register-only FMA loop, best of 3): avx2 %.1f GFLOP/s",
        opt.threads, peak.avx2);
    if (peak.avx512 > 0) std::printf(", avx512 %.1f GFLOP/s", peak.avx512);
    const char* flash_env = std::getenv("LAGA_FLASH_ISA");
    const std::string flash_choice =
        flash_env ? laga::cat("LAGA_FLASH_ISA=", flash_env) : "LAGA_FLASH_ISA unset: auto";
    std::printf("\n# kernels: flash %s (%s), GEMM %s (%s)\n", flash_isa, flash_choice.c_str(),
                laga::gemm_kernels().c_str(), gemm_isa().c_str());
    std::printf(
        "# %%peak is against the peak of the row's isa (the ISA its kernels ran, the wider one "
        "for a row that runs both),\n# measured again just before and just after the row (the "
        "higher of the two): the machine's speed drifts\n");
    Context ctx(opt);
    int ran = 0;
    // A name that is a benchmark's whole name selects that one (`block`, not
    // also block_bf16); any other is a substring of the names it selects.
    auto selects = [](const std::string& f, const std::string& name) {
      for (const Benchmark& other : registry())
        if (other.name == f) return name == f;
      return name.find(f) != std::string::npos;
    };
    for (const Benchmark& b : registry()) {
      bool match = opt.filters.empty();
      for (const std::string& f : opt.filters) match = match || selects(f, b.name);
      if (!match) continue;
      std::printf("#\n# ---- %s: %s\n", b.name.c_str(), b.help.c_str());
      b.fn(ctx);
      ++ran;
    }
    ctx.print_torch_comparison();
    if (ran == 0) {
      std::fprintf(stderr, "laga_bench: no benchmark matches; --list shows them\n");
      return 2;
    }
  } catch (const laga::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
