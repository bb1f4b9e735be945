// Options every `laga` subcommand shares, and the helpers that turn them into
// library objects. Each subcommand lives in its own cmd_*.cpp and registers
// itself in main.cpp.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/nonfinite.hpp"
#include "core/tensor.hpp"
#include "mla/block.hpp"
#include "mla/config.hpp"
#include "mla/dsa_model.hpp"

namespace laga::tools {

// --preset NAME | --config FILE (ModelArgs or Hugging Face config.json).
struct ModelOptions {
  std::string preset = "small";
  std::string config_path;
  void add_to(CLI::App& app);
  // Whether the command runs a DSA config's indexer (DsaConfig): `laga
  // plan` costs it (plan/dsa_plan.hpp); a command that runs the dense
  // block only refuses a DSA preset or config rather than drop its indexer.
  bool accepts_dsa = false;
  MlaConfig load() const;      // validated
  std::string source() const;  // "preset small" or "config path"
  // The preset's or config's indexer (DsaConfig::preset / from_json),
  // validated against `cfg`; nullopt for a dense MLA.
  std::optional<DsaConfig> load_dsa(const MlaConfig& cfg) const;
};

// --index-fp8 and --kv-fp8-round-trip: the config keys index_fp8 and
// kv_fp8_round_trip (MlaConfig; docs/forms.md, "The fp8 indexer") as
// options, one definition for every command that runs a DSA block (forward,
// compare, train). apply() turns the given ones on in `cfg`, the resolved
// model with its DSA keys, and validates them as the keys are
// (MlaConfig::validate_dsa), the error naming the option: on a dense config
// (`source`, e.g. "preset small"), index_head_dim not 128, kv_lora_rank not a
// multiple of 128. `backward` says why the command's run has a backward
// ("--backward", "laga train trains"), empty when it has none:
// --kv-fp8-round-trip, forward only, is refused beside one.
struct Fp8Options {
  bool index_fp8 = false;
  bool kv_fp8_round_trip = false;
  void add_to(CLI::App& app);
  void apply(MlaConfig& cfg, const std::string& source, const std::string& backward) const;
};

// --comm local|mpi and --comm-timeout.
struct CommOptions {
  Backend backend = Backend::local;
  int timeout_ms = 300000;
  bool memory_check = true;  // --no-memory-check turns it off (tools/memory_check.hpp)
  // takes_nccl: the command offers --comm nccl (compare and forward: their
  // blocks on GPUs, one process per GPU; docs/build.md, "The CUDA backend").
  void add_to(CLI::App& app, bool takes_nccl = false);
};

// --comm's value: "local" or "mpi", and "nccl" where the command takes it;
// anything else is an error naming them.
Backend parse_comm_backend(const std::string& s, bool takes_nccl = false);
// Whether each rank of `b` is its own process (mpi, nccl: under mpirun).
inline bool process_per_rank(Backend b) {
  return b == Backend::mpi || b == Backend::nccl;
}

// --comm nccl, before any block runs (tools/device_option.cpp): this process's
// GPU is its rank among the job's processes on its host (their host names
// gathered over MPI), made current through the CUDA backend's module; more
// processes on a host than GPUs is refused (NCCL puts one rank on each GPU;
// ranks sharing one GPU are --comm local's, the device-local transport).
void pick_nccl_device(const CommOptions& comm);

// Checks of an option's value, run by CLI11 on the text the user gave (so a
// default is never checked, and absence keeps its meaning). A failure reads
// "--seq: '0' is not a whole number >= 1 and <= 9223372036854775807", which
// main prints in the one error format, "laga: error: ...", with exit status
// 2.
//   whole(lo, hi):   a decimal integer in [lo, hi] (no 1e3, no 0x10, no 010:
//                    one rule, core/whole_number.hpp); hi the option's type's
//                    largest value: whole_for(lo, variable) picks it, so a
//                    value past the type is refused naming the range, never
//                    by CLI11's "Could not convert"
//   real(lo, hi, bounds): a decimal number (parse_decimal_real) in the
//                    interval; `bounds` says which ends are included, e.g.
//                    "[)" for [lo, hi)
//   real_at_least(lo) / real_above(lo): [lo, inf) / (lo, inf), finite
CLI::Validator whole(std::int64_t lo,
                     std::uint64_t hi = std::uint64_t(std::numeric_limits<std::int64_t>::max()));
template <class T>
CLI::Validator whole_for(std::int64_t lo, const T&) {
  static_assert(std::is_integral_v<T>);
  return whole(lo, std::uint64_t(std::numeric_limits<T>::max()));
}
template <class T>
CLI::Validator whole_for(std::int64_t lo, const std::optional<T>&) {
  return whole_for(lo, T{});
}
// Refuses an empty value ("--doc-lens ''" silently meant no documents):
// "'' is empty; <fix>".
CLI::Validator non_empty(const char* option, const char* fix);
// --doc-lens' check (compare, forward, verify).
inline const CLI::Validator kDocLensGiven =
    non_empty("--doc-lens", "give document lengths like 5,7 or leave --doc-lens out");
// whole()'s message for `text`, for the parsers of comma lists: "'010' is
// not a whole number >= 1 and <= 2147483647 (decimal digits only, no leading
// zeros)".
std::string whole_number_refusal(
    const std::string& text, std::int64_t lo,
    std::uint64_t hi = std::uint64_t(std::numeric_limits<std::int64_t>::max()));
// One rule for every real number laga reads from an option: decimal digits
// with an optional '-', '.' and exponent (0.001, 1e-3, .5), finite and
// within double's range; nullopt for anything else (hex floats such as 0x10,
// inf, nan, spaces, 1e999, 1e-999).
std::optional<double> parse_decimal_real(const std::string& text);
CLI::Validator real(double lo, double hi, const char* bounds);
CLI::Validator real_at_least(double lo);
CLI::Validator real_above(double lo);

// --link BW[,LAT]: every link at BW GB/s (10^9 bytes/s) per direction, LAT
// microseconds per message (comm/link_model.hpp). LAT is optional: absent,
// the caller decides (laga compare: 0; laga plan: the profile's latencies).
// parse_link throws laga::Error "--link: ..." unless BW is a positive finite
// number and LAT a finite number >= 0; link_spec() runs it when CLI11 parses.
struct LinkSpec {
  double bytes_per_s = 0;
  std::optional<double> latency_s;
};
LinkSpec parse_link(const std::string& text);
CLI::Validator link_spec();

// A comma list's items, by one rule for every list option: no empty item
// anywhere ("2," and "1,,2" alike), no item twice; errors name the option
// and show `example`.
std::vector<std::string> split_list(const std::string& s, const std::string& option,
                                    const std::string& example);
// "1,2,4" -> {1, 2, 4}: split_list's items, each a whole number in [1, max]
// by the one rule (core/whole_number.hpp); errors name the option and the
// bad token and show `example`. parse_int_list: the same for ints (rank
// counts).
std::vector<std::int64_t> parse_whole_list(
    const std::string& s, const std::string& option, const std::string& example,
    std::int64_t max = std::numeric_limits<std::int64_t>::max());
std::vector<int> parse_int_list(const std::string& s, const std::string& option);
std::vector<Form> parse_form_list(const std::string& s);  // "laga,explicit" or "all"

// What `laga verify` and `laga compare` run side by side: each form of
// --forms, and with --q-latent FORM+q-latent right after each FORM with
// FormTraits::query_latent; the grid forms with --head-groups (0: default).
// --q-latent needs such a form and q_lora_rank > 0, --head-groups a form with
// FormTraits::head_groups; otherwise a laga::Error says which is missing.
// With `overlap` on, every variant of a form with an overlapped path
// (FormTraits::overlap) runs overlapped; with both, overlapped after it as
// "<variant>+overlap" (`--overlap off|on|both`).
enum class OverlapRuns { off, on, both };
OverlapRuns parse_overlap_runs(const std::string& s);
std::vector<FormVariant> form_variants(const std::vector<Form>& forms, bool q_latent,
                                       int head_groups, const MlaConfig& cfg,
                                       OverlapRuns overlap = OverlapRuns::off);

// --head-groups on a command: the option, its help and its check (>= 1).
void add_head_groups_option(CLI::App& app, int& head_groups);

// What one invocation of a command runs, which sets what --overlap and
// --q-latent mean there: one form (forward, train: the switch turns the path
// on) or each of a list of forms (compare, verify, plan: the switch adds the
// variant FORM+overlap or FORM+q-latent right after FORM).
enum class FormsRun { one, each };
// --overlap: off|on for one form, off|on|both for each form (both: FORM and
// FORM+overlap); the forms it applies to are FormTraits::overlap's rows.
void add_overlap_option(CLI::App& app, std::string& overlap, FormsRun runs);
// --q-latent: the query latent moved instead of per-head Q (FormTraits::
// query_latent's rows, q_lora_rank > 0), or FORM+q-latent after each of them.
void add_q_latent_flag(CLI::App& app, bool& q_latent, FormsRun runs);
// --attention eager|flash, checked where it is parsed, on every command.
void add_attention_option(CLI::App& app, std::string& attention);
// --seq-layout contiguous|zigzag (SpLayout's SeqLayout), into a string the
// command parses with parse_seq_layout.
void add_seq_layout_option(CLI::App& app, std::string& seq_layout);
// --grad-reduce fp32|bf16 (core/precision.hpp's GradReduce): compare, train
// and plan hold and all-reduce gradients the same way, so one option and
// one help text.
void add_grad_reduce_option(CLI::App& app, GradReduce& grad_reduce);

// --dtype on every command, in one vocabulary (core/precision.hpp's
// RunDtype: fp32, also float32; bf16; fp64, also float64). Each command
// admits the ones it runs (`runs`, in the order its help lists them);
// another word of the vocabulary is refused naming the commands that run
// it, so a spelling that works on one command works on all. `set` receives
// the choice.
CLI::Option* add_dtype_option(CLI::App& app, std::function<void(RunDtype)> set,
                              std::vector<RunDtype> runs, const std::string& help);

// What every MPI rank of a job must agree on, noted as (what, value) pairs:
// the command line's options (note_command_line, from main) and the resolved
// model config (ModelOptions::load). run_group's MPI path compares them
// across ranks before the body runs and refuses, naming the option and the
// ranks that differ: `mpirun -np 2 laga train --seed 1 : -np 2 laga train
// --seed 2` is a mistake, not two replicas.
// Every rank computes the same verdict from every rank's entries (all
// gathered), so all refuse at once with one message naming the entry and
// each rank's value. An input file (note_input_file; protect_input notes
// each) is compared by its contents, not its path: size and FNV-1a 64 of
// the bytes (a directory: its listing, index and shard headers).
void note_command_line(int argc, char** argv, const CLI::App& app);
void note_run_identity(const std::string& what, const std::string& value);
void note_input_file(const std::string& option, const std::string& path);

// What main prints for `error`, an error this process hit before its job
// began. Under `--comm mpi` with several launched ranks, before the ranks
// compared their options (run_group), this rank joins that comparison with
// its failure as one more entry, so every rank stops at once with the same
// verdict (an option given on one rank only is named; otherwise the failing
// rank and its error) instead of its peers waiting out --comm-timeout.
// Anywhere else: `error` itself.
std::string agree_on_failure(const std::string& error, const std::vector<std::string>& args);

// Runs body once per rank of a P-rank group on the chosen backend and returns
// on every participating process. Local: P threads in this process, each with
// threads_per_rank(P) OpenMP/BLAS threads. MPI: this process is one rank of
// MPI_COMM_WORLD, whose size must equal P (the error says how to launch).
// `body` gets the communicator; exactly one rank of the job reports (local
// rank 0's thread, or MPI world rank 0: is_reporting_process()). NCCL: as
// MPI, the communicator NCCL's (cuda/nccl_comm.hpp, made by the CUDA
// backend's module; pick_nccl_device has chosen each process's GPU), its id
// handed from rank 0 over MPI after the ranks compared their options.
void run_group(const CommOptions& comm, int P, const std::function<void(Communicator&)>& body);

// True on the process that should print the job's reports: always for local
// runs, world rank 0 under MPI (and NCCL).
bool is_reporting_process(const CommOptions& comm);

// Writes `text` to `path` atomically (temp + rename), or to stdout for "-".
// Like every writer it goes through resolve_output_path (src/io/atomic_file):
// a symlink's target is written, a non-regular file or an input of this
// command (protect_input) is refused.
void write_output(const std::string& path, const std::string& text);

// Vets a command's outputs before any work (docs/reliability.md, "Outputs
// refused up front"): each given one (empty: not asked for; "-": stdout) is
// resolved as its writer would (resolve_output_path) and its directory
// probed by creating and removing a file there, so a read-only or missing
// directory is named now, not after minutes of work; and no two of them may
// be one file (the same path after symlinks, or both stdout), which would
// keep only the last. Each entry: the option and its path.
void vet_outputs(const std::vector<std::pair<std::string, std::string>>& outputs);

// Protects an input file this command reads (--config, --weights, --input,
// --data, ...) from every writer of this process until it exits: an output
// that is the same file is refused. `option` names it in the message. Empty
// or missing paths are ignored.
void protect_input(const std::string& path, const std::string& option);

// Refuses a tensor holding a NaN or inf: laga::Error with
// describe_nonfinite's sentence ("<what> holds N non-finite values ...")
// followed by `fix` (what to do about it). What every command that reads or
// writes tensors (forward, moe) calls for its weights, inputs and outputs.
template <class T>
void refuse_nonfinite(const Tensor<T>& t, const std::string& what, const std::string& fix) {
  const NonFinite nf = count_nonfinite(t.data(), t.numel());
  if (nf.count != 0) fail(describe_nonfinite(what, nf, t.numel()), fix);
}
// protect_input for a weights path (SafetensorsSet: a file, an index or a
// directory), and every file of the set besides: the index and each shard it
// names, so an output may be none of them (issue 54 A). Their contents are
// not compared across MPI ranks beyond what protect_input notes.
void protect_weights(const std::string& path, const std::string& option);
// The running laga executable is read too (by the kernel, and by each MPI
// rank that starts from it): no output may replace it. main calls it.
void protect_own_executable();

}  // namespace laga::tools
