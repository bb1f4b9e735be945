// laga train: train the small MLA language model (src/model) sequence-parallel
// over --sp ranks in any registered form (--form), logging one JSON line per step.
// docs/convergence.md has the paper's run and the dimension mapping.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "io/atomic_file.hpp"
#include "mla/form_spec.hpp"
#include "model/checkpoint.hpp"
#include "model/train.hpp"
#include "plan/pipeline.hpp"
#include "tools/cli_common.hpp"
#include "tools/commands.hpp"
#include "tools/memory_check.hpp"

namespace laga::tools {

namespace {

struct TrainCli {
  CommOptions comm;
  std::string form = "laga", attention = "flash", schedule = "constant";
  Precision dtype = Precision::fp32;          // --dtype: fp32 | bf16 (TrainOptions::precision)
  GradReduce grad_reduce = GradReduce::fp32;  // --grad-reduce (TrainOptions::grad_reduce)
  int sp = 1;
  int dp = 1;  // --dp: data-parallel replicas (TrainOptions::dp)
  // --pp, --micro-batches, --schedule: pipeline stages (TrainOptions::pp).
  int pp = 1;
  std::int64_t micro_batches = 1;
  std::string pipe_schedule = "1f1b";
  std::int64_t layers = 4, d_model = 512, heads = 16, seq = 512, steps = 60, vocab = 2048,
               batch = 1;
  // MLA dims: 0 = derived from d_model / heads (LmConfig::derive).
  std::int64_t nope_dim = 0, rope_dim = 0, v_dim = 0, kv_lora_rank = 0, ffn_hidden = 0;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, clip = 0.0,
         min_lr = 0.0;
  std::int64_t warmup = 0, save_every = 0;
  std::uint64_t seed = 0;
  std::string data = "random", data_dtype = "auto", log, checkpoint, resume, val_data;
  std::int64_t val_every = 0, val_batches = 4;
  bool quiet = false, allow_nonfinite = false;
  // Debugging: the reduction-order switch (set_reduction_order_seed) and the
  // expert load in --log, for reproducibility experiments.
  std::optional<std::uint64_t> perturb_reductions;
  bool log_expert_load = false;
  bool expert_parallel = false;
  bool invariant = false;  // --invariant (TrainOptions::invariant)
  int ep = 0;
  std::string allow_change;  // comma-separated option names
  // The query path: q_lora_rank 0 is one wq (LmConfig::derive's default).
  std::int64_t q_lora_rank = 0;
  bool q_latent = false;
  std::int64_t pack_eos = -1;  // -1: not given
  std::string overlap = "off";
  int head_groups = 0;                    // the grid forms (--head-groups); 0: their default rule
  std::string seq_layout = "contiguous";  // --seq-layout
  // --config FILE: the whole model (dims, layers, vocab, MoE) from a DeepSeek
  // config (LmConfig::from_json), in place of the model options below.
  std::string config;
  // DeepSeek Sparse Attention (model/dsa_layer.hpp): --index-heads,
  // --index-head-dim, --index-topk (0: dense MLA), --index-warmup.
  std::int64_t index_heads = 0, index_head_dim = 0, index_topk = 0, index_warmup = 0;
  Fp8Options fp8;  // --index-fp8 (and --kv-fp8-round-trip, refused: training has a backward)
  std::vector<std::string> model_options_given;  // of kModelOptions, filled by the callback
  std::set<std::string> given;                   // every option given, filled by the callback
};

// The options that shape the model, which --config gives instead.
const char* const kModelOptions[] = {
    "--layers",      "--d-model",        "--heads",       "--nope-dim",   "--rope-dim",
    "--v-dim",       "--kv-lora-rank",   "--q-lora-rank", "--ffn-hidden", "--vocab",
    "--index-heads", "--index-head-dim", "--index-topk"};

// ---- signals: the first SIGINT/SIGTERM asks the loop to stop after the
// current step (train_rank polls stop_signal, saves, returns); a second one
// exits at once. Only async-signal-safe calls in the handler.
std::atomic<int> stop_signal{0};

void on_stop_signal(int sig) {
  int expected = 0;
  if (stop_signal.compare_exchange_strong(expected, sig)) {
    static const char msg[] =
        "\nlaga train: signal received: finishing the current step (and writing a checkpoint "
        "when --checkpoint is set); send it again to stop at once\n";
    [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    return;
  }
  static const char msg[] = "\nlaga train: second signal: stopping at once, nothing saved\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
  ::_exit(128 + sig);
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a signal mid-write must not fail the write
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

// The --log file, vetted like every output. A fresh run starts it empty; a
// resumed one keeps only the lines of steps up to the checkpoint's, so a step
// after it (logged before a crash or signal, then trained again) appears
// once. Both rewrite it atomically; the run then appends to it.
std::string prepare_log(const std::string& path, const std::string& resume) {
  const std::string target = resolve_output_path(path, "--log");
  std::string kept;
  if (!resume.empty()) {
    const std::int64_t last = read_checkpoint_manifest(resume).step;
    std::ifstream in(target);
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      // A line torn by a crash is not JSON; it goes too.
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<std::int64_t>() <= last)
        kept += line + "\n";
    }
  }
  write_file_atomic(target, kept);
  return target;
}

// The model: from --config, or derived from the model options.
LmConfig model_of(const TrainCli& c) {
  if (!c.config.empty()) {
    protect_input(c.config, "--config");
    // A DSA config's indexer (index_n_heads, index_head_dim, index_topk) is
    // trained with the model (model/dsa_layer.hpp).
    const LmConfig m = LmConfig::from_json_file(c.config);
    // The resolved values: one path can hold different files on different nodes.
    note_run_identity("the model config", m.to_json().dump());
    return m;
  }
  LmConfig m = LmConfig::derive(c.d_model, c.heads, c.layers, c.vocab, c.seq);
  if (c.nope_dim) m.mla.qk_nope_head_dim = c.nope_dim;
  if (c.rope_dim) m.mla.qk_rope_head_dim = c.rope_dim;
  if (c.v_dim) m.mla.v_head_dim = c.v_dim;
  if (c.kv_lora_rank) m.mla.kv_lora_rank = c.kv_lora_rank;
  m.mla.q_lora_rank = c.q_lora_rank;
  m.ffn_hidden = c.ffn_hidden;
  m.mla.index_n_heads = c.index_heads;
  m.mla.index_head_dim = c.index_head_dim;
  m.mla.index_topk = c.index_topk;
  return m;
}

// ---- DeepSeek Sparse Attention (model/dsa_layer.hpp): its options, and the
// form options its layers do not read, refused by name when given.
void add_dsa_options(CLI::App& sub, TrainCli& c) {
  sub.add_option("--index-heads", c.index_heads,
                 "DSA: the lightning indexer's heads (index_n_heads); with --index-head-dim and "
                 "--index-topk, and --q-lora-rank > 0 (docs/forms.md, \"DeepSeek Sparse "
                 "Attention\")")
      ->check(whole_for(1, c.index_heads));
  sub.add_option("--index-head-dim", c.index_head_dim,
                 "DSA: the indexer's head width (index_head_dim, >= --rope-dim)")
      ->check(whole_for(1, c.index_head_dim));
  sub.add_option("--index-topk", c.index_topk,
                 "DSA: the keys each query attends in the sparse stage (index_topk, <= --seq)")
      ->check(whole_for(1, c.index_topk));
  sub.add_option("--index-warmup", c.index_warmup,
                 "DSA: the first N steps are the dense warm-up (every causal key attended, the "
                 "indexer's KL over them), the rest sparse; the main model trains in both "
                 "(model/dsa_layer.hpp)")
      ->check(whole_for(0, c.index_warmup));
  c.fp8.add_to(sub);
}

void check_dsa_cli(const TrainCli& c, const TrainOptions& o) {
  if (!o.model.mla.dsa()) return;
  for (const char* opt : {"--form", "--attention", "--q-latent", "--head-groups", "--overlap"})
    LAGA_CHECK(!c.given.count(opt), opt,
               " chooses among the dense MLA block's forms and kernels, and the model has "
               "DeepSeek Sparse Attention (index_topk ",
               o.model.mla.index_topk,
               "), whose layers run the DSA block at --sp 1 and the query-local latent gather at "
               "--sp > 1 (model/dsa_layer.hpp); drop ",
               opt);
}

TrainOptions to_options(const TrainCli& c) {
  TrainOptions o;
  o.model = model_of(c);
  c.fp8.apply(o.model.mla, c.config.empty() ? "the model of the options" : "config " + c.config,
              "laga train (every step's backward)");
  o.variant.queries = c.q_latent ? QueryExchange::latent : QueryExchange::heads;
  o.variant.overlap = parse_overlap(c.overlap);
  o.variant.head_groups = c.head_groups;
  o.variant.form = parse_form(c.form);
  o.seq_layout = parse_seq_layout(c.seq_layout);
  o.attention = parse_attention(c.attention);
  o.precision = c.dtype;
  o.grad_reduce = c.grad_reduce;
  o.invariant = c.invariant;
  o.experts = c.expert_parallel ? ExpertPlacement::folded : ExpertPlacement::every_rank;
  o.expert_degree = c.ep;
  o.sp = c.sp;
  o.dp = c.dp;
  o.pp = c.pp;
  o.micro_batches = c.micro_batches;
  LAGA_CHECK(parse_pipe_schedule(c.pipe_schedule) == PipeSchedule::one_f_one_b, "--pp-schedule ",
             c.pipe_schedule,
             ": laga train runs the 1F1B schedule only (model/pipeline.hpp); the others are "
             "laga plan's; give --pp-schedule 1f1b");
  if (c.pp > 1) {
    // The plan's placement of the layers (plan/pipeline.hpp), one for both.
    PipelineChoice choice;
    choice.stages = c.pp;
    o.stages = lm_stages(pipeline_stages(o.model, choice));
  }
  o.batch = c.batch;
  o.seq = c.seq;
  o.steps = c.steps;
  o.seed = c.seed;
  o.adam = AdamWHyper{c.lr, c.beta1, c.beta2, c.eps, c.weight_decay};
  o.warmup = c.warmup;
  o.cosine = c.schedule == "cosine";
  o.min_lr = c.min_lr;
  o.clip = c.clip;
  o.data = c.data;
  o.data_dtype = c.data_dtype;
  o.val_data = c.val_data;
  o.val_every = c.val_every;
  o.val_batches = c.val_batches;
  if (c.pack_eos >= 0) o.pack_eos = c.pack_eos;
  o.save_every = c.save_every;
  o.checkpoint_dir = c.checkpoint;
  o.resume = c.resume;
  if (!c.allow_change.empty())
    o.allow_change = split_list(c.allow_change, "--allow-change", "lr,steps");
  o.allow_nonfinite = c.allow_nonfinite;
  o.index_warmup = c.index_warmup;
  return o;
}

// Checks between options (each option's own range is checked as it is
// parsed, register_train).
void check_option_pairs(const TrainCli& c) {
  std::string given;
  for (const std::string& f : c.model_options_given) given += (given.empty() ? "" : ", ") + f;
  LAGA_CHECK(c.config.empty() || given.empty(), "--config '", c.config,
             "' gives the whole model; drop ", given,
             " (or drop --config and give the model by options)");
  LAGA_CHECK(c.min_lr <= c.lr, "--min-lr ", c.min_lr, " is above --lr ", c.lr,
             "; the schedule decays from --lr down to --min-lr, so give --min-lr <= --lr");
}

// No file of the run may take a name a checkpoint directory owns (its lock,
// latest.json, step-N files, temporaries, superseded folders; issue 54 G):
// --log neither in the --checkpoint directory nor in the one --resume reads
// (whose older checkpoints are the user's), and no input in the directory
// this run writes, moves and prunes. Checked before anything is written.
void refuse_checkpoint_directory_names(const TrainCli& c, const TrainOptions& o) {
  namespace fs = std::filesystem;
  // A --log that is the very manifest resumed from is named as that first.
  std::string manifest = o.resume;
  std::error_code ec;
  if (!manifest.empty() && fs::is_directory(manifest, ec))
    manifest = (fs::path(manifest) / "latest.json").string();
  const ProtectedInputs manifest_guard({{manifest, "--resume manifest"}});
  if (!c.log.empty()) (void)resolve_output_path(c.log, "--log");
  if (!o.checkpoint_dir.empty()) {
    refuse_checkpoint_directory_file(c.log, "--log", o.checkpoint_dir, "--checkpoint", true);
    if (o.data != "random")
      refuse_checkpoint_directory_file(o.data, "--data", o.checkpoint_dir, "--checkpoint", false);
    refuse_checkpoint_directory_file(o.val_data, "--val-data", o.checkpoint_dir, "--checkpoint",
                                     false);
    refuse_checkpoint_directory_file(c.config, "--config", o.checkpoint_dir, "--checkpoint", false);
  }
  if (!o.resume.empty()) {
    const fs::path r(o.resume);
    const fs::path dir = fs::is_directory(r, ec)   ? r
                         : r.parent_path().empty() ? fs::path(".")
                                                   : r.parent_path();
    refuse_checkpoint_directory_file(c.log, "--log", dir.string(), "--resume", true);
  }
}

// A test hook (issue 54 V): every MPI process but the reporting one waits
// this many milliseconds before its checks, as a rank of a loaded machine
// may, so the suite can make rank 0 take the checkpoint lock first.
void stagger_for_tests(bool report) {
  const char* ms = std::getenv("LAGA_TEST_STAGGER_MS");
  if (report || !ms) return;
  char* end = nullptr;
  const long v = std::strtol(ms, &end, 10);
  if (end != ms && *end == '\0' && v > 0 && v <= 60000)
    std::this_thread::sleep_for(std::chrono::milliseconds(v));
}

// Options given where they would change nothing: each is refused saying
// why, since a user who gives one expects it to act (issue 54, S: --log-
// expert-load on a dense model ran and logged nothing). Those needing the
// resolved model run after it is built.
void check_options_act(const TrainCli& c, const TrainOptions& o) {
  const auto given = [&](const char* name) { return c.given.count(name) > 0; };
  if (given("--log-expert-load")) {
    LAGA_CHECK(!c.log.empty(),
               "--log-expert-load adds each step's expert load to the --log file's lines; give "
               "--log FILE, or drop --log-expert-load");
    LAGA_CHECK(o.model.moe,
               "--log-expert-load logs the tokens each MoE expert receives, but the model is "
               "dense (no n_routed_experts); give --config with an MoE, or drop "
               "--log-expert-load");
    LAGA_CHECK(o.model.bias_update_speed > 0,
               "--log-expert-load logs the expert load the bias balancing counts, and the "
               "config's bias_update_speed is 0 (no balancing, nothing counted); set "
               "bias_update_speed > 0 in the config, or drop --log-expert-load");
  }
  LAGA_CHECK(!given("--min-lr") || c.schedule == "cosine", "--min-lr ", c.min_lr,
             " is the end of the cosine decay, and --schedule is ", c.schedule,
             " (the lr stays at --lr after warm-up); give --schedule cosine, or drop --min-lr");
  LAGA_CHECK(!given("--data-dtype") || c.data != "random" || !c.val_data.empty(),
             "--data-dtype says how a token file is stored, and there is none (--data random, "
             "no --val-data); give --data FILE, or drop --data-dtype");
  LAGA_CHECK(!given("--val-batches") || !c.val_data.empty(),
             "--val-batches sets how many batches of --val-data each validation reads, and "
             "there is no --val-data; give --val-data FILE and --val-every N, or drop "
             "--val-batches");
  LAGA_CHECK(!given("--allow-change") || !c.allow_change.empty(),
             "an empty --allow-change allows nothing; name the options that may change (e.g. "
             "lr,steps) or drop it");
  // The last step's checkpoint and validation run whatever N is: an N past
  // --steps never comes.
  LAGA_CHECK(c.save_every <= c.steps, "--save-every ", c.save_every, " never comes within --steps ",
             c.steps, " (the last step's checkpoint is written anyway); give N <= ", c.steps,
             " or drop --save-every");
  LAGA_CHECK(c.val_every <= c.steps, "--val-every ", c.val_every, " never comes within --steps ",
             c.steps, " (the last step is validated anyway); give N <= ", c.steps,
             " or drop --val-every");
  LAGA_CHECK(!c.perturb_reductions || c.sp * c.dp >= 3,
             "--perturb-reductions permutes the order in "
             "which the ranks' contributions to each reduction are added, and at --sp ",
             c.sp, c.dp > 1 ? cat(" x --dp ", c.dp) : std::string(),
             " every order gives the same bits (it changes bits only at 3 ranks or more); give "
             "--sp >= 3 (or --sp x --dp >= 3), or drop it");
}

void run_train(const TrainCli& c) {
  check_option_pairs(c);
  TrainOptions o = to_options(c);
  const bool report = is_reporting_process(c.comm);
  stagger_for_tests(report);
  refuse_checkpoint_directory_names(c, o);
  // Only the process that takes the checkpoint lock judges it (MPI: the
  // others could find its fresh lock and call their own job's directory in
  // use, issue 54 V).
  validate_train_options(o, report);
  check_options_act(c, o);  // after the options' own errors, which say more
  check_dsa_cli(c, o);
  const bool dsa = o.model.mla.dsa();
  if (!dsa) check_variant(o.model.mla, train_layout(o, o.sp * o.dp), o.variant);
  // Refuse before allocating the model when the job cannot fit: the state's
  // lower bound first (cheap), then the step's count-only run (a DSA model's
  // too: one step of each stage it runs, model/dsa_layer.hpp).
  if (c.comm.memory_check) {
    check_memory_fits(train_state_lower_bound(o, c.comm.backend), "laga train");
    check_memory_fits(predict_train_job_memory(o, c.comm.backend), "laga train");
  }
  // One writer per --checkpoint directory, taken before anything is moved
  // or written there (prepare_run may set checkpoints aside); creating the
  // lock is also the up-front check that the directory can be written.
  std::optional<CheckpointDirectoryLock> checkpoint_lock;
  if (report && !o.checkpoint_dir.empty()) checkpoint_lock.emplace(o.checkpoint_dir);
  // Inputs no writer of this run may replace: the token file and the
  // checkpoint's tensors. The resume manifest is protected only from --log:
  // when it is DIR/latest.json, the next save rewrites it by design.
  if (o.data != "random") protect_input(o.data, "--data");
  protect_input(o.val_data, "--val-data");
  std::string resume_manifest;
  if (!o.resume.empty()) {
    const CheckpointManifest m = read_checkpoint_manifest(o.resume);
    resume_manifest = m.path;
    note_input_file("--resume", m.path);  // ranks compare the manifest, not its spelling
    protect_input(m.tensors, "--resume checkpoint");
  }
  std::ofstream log;
  if (report && !c.log.empty()) {
    const ProtectedInputs manifest_guard({{resume_manifest, "--resume manifest"}});
    const std::string target = prepare_log(c.log, o.resume);
    log.open(target, std::ios::app);
    LAGA_CHECK(log, "--log '", c.log, "': cannot open it for writing; choose a writable path");
  }
  if (report) {
    std::cerr << "laga train: " << o.model.summary() << ", B=" << o.batch << " S=" << o.seq
              << (dsa ? cat(", DSA (", o.sp == 1 ? "single-rank block" : "latent gather",
                            ", index warm-up ", o.index_warmup, " steps)")
                      : ", form " + describe_variant(o.variant, train_layout(o, o.sp * o.dp)))
              << (o.seq_layout == SeqLayout::contiguous
                      ? std::string()
                      : cat(", seq layout ", to_string(o.seq_layout)))
              << (dsa ? std::string() : ", attention " + c.attention)
              << (o.precision == Precision::bf16 ? ", dtype bf16 (mixed precision)" : "")
              << (o.invariant ? ", invariant mode" : "") << ", sp " << o.sp
              << (o.dp > 1 ? cat(", dp ", o.dp, " (", o.batch / o.dp, " rows each)") : "")
              << (o.pp > 1 ? cat(", pp ", o.pp, " (1f1b, ", o.micro_batches, " micro-batches)")
                           : std::string())
              << ", comm " << to_string(c.comm.backend) << ", data " << c.data
              << (o.pack_eos ? cat(" packed at end-of-document id ", *o.pack_eos) : "")
              << ", steps " << o.steps << (o.resume.empty() ? "" : ", resuming from " + o.resume)
              << "\n";
    for (const std::string& note : prepare_run(o)) std::cerr << "laga train: " << note << "\n";
  }
  // Process-wide, before any rank starts; every MPI process parses the same
  // options, so all ranks add in the same order.
  set_reduction_order_seed(c.perturb_reductions);
  if (report && c.perturb_reductions)
    std::cerr << "laga train: --perturb-reductions " << *c.perturb_reductions
              << ": reductions add in a seed-permuted order, not rank order"
              << (o.ranks() < 3 ? " (no effect below 3 ranks: a + b == b + a)" : "") << "\n";
  install_stop_handlers();
  o.stop_signal = &stop_signal;
  if (report)
    o.warn = [](const std::string& w) { std::cerr << "laga train: warning: " << w << "\n"; };
  TrainEnd end;
  bool log_failed = false;
  run_group(c.comm, o.ranks(), [&](Communicator& comm) {
    // train_rank stops at a non-finite loss or gradient before that step's
    // update (unless --allow-nonfinite), so no step reported here is one.
    const TrainEnd e = train_rank(comm, o, [&](const StepRecord& s) {
      if (!report) return;
      nlohmann::json j;
      j["step"] = s.step;
      j["loss"] = s.loss;
      j["grad_norm"] = s.grad_norm;
      j["lr"] = s.lr;
      j["tokens_per_s"] = s.tokens_per_s;
      j["targets"] = s.targets;
      if (c.log_expert_load && !s.expert_load.empty()) j["expert_load"] = s.expert_load;
      if (s.index_kl) j["index_kl"] = *s.index_kl;
      if (s.dsa_stage) j["dsa_stage"] = to_string(*s.dsa_stage);
      if (s.val_loss) {
        j["val_loss"] = *s.val_loss;
        j["val_bits_per_token"] = *s.val_loss / std::log(2.0);  // per byte with --vocab 256 bytes
      }
      if (log.is_open()) {
        log << j.dump() << "\n" << std::flush;
        // A full disk or a file-size limit: say so once, naming the file,
        // and stop logging (the log would be cut mid-line); training goes on
        // and exits 1 at the end, so a script sees it (issue 26).
        if (!log) {
          std::cerr << "laga train: warning: --log '" << c.log << "': writing step " << s.step
                    << " failed (" << std::strerror(errno)
                    << "); the log stops here, the run goes on and will exit 1\n";
          log.close();
          log_failed = true;
        }
      }
      if (!c.quiet)
        std::cerr << "step " << s.step << "/" << o.steps << "  loss " << std::fixed
                  << std::setprecision(4) << s.loss << "  grad_norm " << s.grad_norm << "  lr "
                  << std::scientific << std::setprecision(2) << s.lr << std::fixed << "  "
                  << std::setprecision(0) << s.tokens_per_s << " tok/s  (" << std::setprecision(2)
                  << s.seconds << " s)" << std::defaultfloat
                  << (s.val_loss ? cat("  val_loss ", *s.val_loss) : std::string())
                  << (s.index_kl ? cat("  index_kl ", *s.index_kl) : std::string()) << "\n";
    });
    // Every rank agreed on how the run ended; MPI has one rank per process.
    if (comm.rank() == 0 || c.comm.backend == Backend::mpi) end = e;
  });
  if (log.is_open()) {
    log.close();
    if (log.fail()) {
      std::cerr << "laga train: warning: --log '" << c.log << "': closing it failed ("
                << std::strerror(errno) << "); its last lines may be lost\n";
      log_failed = true;
    }
  }
  checkpoint_lock.reset();  // std::exit below runs no destructors of locals
  if (end.stop_signal == 0) {
    if (log_failed) std::exit(1);
    return;
  }
  // Stopped by a signal after a whole step: say where things stand, exit
  // 128 + signal as a shell expects of an interrupted program.
  if (report) {
    std::cerr << "laga train: stopped by " << (end.stop_signal == SIGTERM ? "SIGTERM" : "SIGINT")
              << " after step " << end.step << " of " << o.steps;
    if (!end.checkpoint.empty())
      std::cerr << "; checkpoint " << end.checkpoint << " written; continue with --resume "
                << o.checkpoint_dir << " (and the same options)\n";
    else
      std::cerr << "; no --checkpoint was given, so nothing was saved\n";
  }
  log.close();
  std::cerr << std::flush;
  std::exit(128 + end.stop_signal);
}

void register_train(CLI::App& app) {
  auto c = std::make_shared<TrainCli>();
  CLI::App* sub = app.add_subcommand(
      "train", "train a small MLA language model sequence-parallel (the paper's §4.5 run)");
  c->comm.add_to(*sub);
  sub->add_option("--form", c->form, form_names(" | "))->capture_default_str();
  add_head_groups_option(*sub, c->head_groups);
  add_seq_layout_option(*sub, c->seq_layout);
  add_attention_option(*sub, c->attention);
  add_dtype_option(
      *sub, [c](RunDtype d) { c->dtype = d == RunDtype::bf16 ? Precision::bf16 : Precision::fp32; },
      {RunDtype::fp32, RunDtype::bf16},
      "precision of the step: fp32, or bf16 mixed precision (every GEMM and "
      "attention operand rounded to bf16, fp32 sums; fp32 master weights, gradients "
      "and AdamW state; flash attention only; docs/performance.md, \"bf16 mixed "
      "precision\")")
      ->default_str("fp32");
  add_grad_reduce_option(*sub, c->grad_reduce);
  add_q_latent_flag(*sub, c->q_latent, FormsRun::one);
  add_overlap_option(*sub, c->overlap, FormsRun::one);
  sub->add_option("--sp", c->sp, "sequence-parallel ranks")
      ->check(whole_for(1, c->sp))
      ->capture_default_str();
  sub->add_option("--dp", c->dp,
                  "data-parallel replicas: the ranks are --sp x --dp, replica d taking rows "
                  "[d B/D, (d+1) B/D) of every --batch (D must divide it); the loss is the mean "
                  "over every replica's targets, the gradients all-reduced over every rank, and "
                  "--expert-parallel's EP groups span the replicas (EP over DP, as laga plan "
                  "--model --dp --ep plans it; docs/planning.md, \"EP over the data-parallel "
                  "replicas against a measured step\"); --sp 1, no --pp, no --pack-eos")
      ->check(whole_for(1, c->dp))
      ->capture_default_str();
  sub->add_option("--pp", c->pp,
                  "pipeline stages: the ranks are stages, each running its layers (the plan's "
                  "placement, as laga plan --model --pp places them) on every micro-batch in "
                  "1F1B order, the activations passed over the communicator (docs/planning.md, "
                  "\"Pipeline stages\"); --sp 1")
      ->check(whole_for(1, c->pp))
      ->capture_default_str();
  sub->add_option("--micro-batches", c->micro_batches,
                  "with --pp: micro-batches a step, each --batch / N rows")
      ->check(whole_for(1, c->micro_batches))
      ->capture_default_str();
  sub->add_option("--pp-schedule", c->pipe_schedule,
                  "with --pp: the pipeline schedule (1f1b; laga plan's interleaved and dualpipe "
                  "are not run)")
      ->check(CLI::IsMember({"1f1b", "interleaved", "dualpipe"}))
      ->capture_default_str();
  sub->add_option("--layers", c->layers, "transformer layers")
      ->check(whole_for(1, c->layers))
      ->capture_default_str();
  sub->add_option("--d-model", c->d_model, "model width D")
      ->check(whole_for(1, c->d_model))
      ->capture_default_str();
  sub->add_option("--heads", c->heads, "attention heads H")
      ->check(whole_for(1, c->heads))
      ->capture_default_str();
  sub->add_option("--nope-dim", c->nope_dim, "qk_nope_head_dim (default D/H)")
      ->check(whole_for(1, c->nope_dim));
  sub->add_option("--rope-dim", c->rope_dim, "qk_rope_head_dim (default D/H/2, even)")
      ->check(whole_for(1, c->rope_dim));
  sub->add_option("--v-dim", c->v_dim, "v_head_dim (default D/H)")->check(whole_for(1, c->v_dim));
  sub->add_option("--kv-lora-rank", c->kv_lora_rank, "kv_lora_rank C (default 4 D/H)")
      ->check(whole_for(1, c->kv_lora_rank));
  sub->add_option("--q-lora-rank", c->q_lora_rank,
                  "q_lora_rank rq: queries through wq_a, q_norm, wq_b (0: one wq)")
      ->check(whole_for(0, c->q_lora_rank))
      ->capture_default_str();
  sub->add_option("--ffn-hidden", c->ffn_hidden, "SwiGLU width (default 8D/3 rounded up to 64)")
      ->check(whole_for(1, c->ffn_hidden));
  sub->add_option("--config", c->config,
                  "the model from a DeepSeek-V3 config JSON (Hugging Face config.json or "
                  "ModelArgs): attention, layers, vocab, dense FFN width and the MoE "
                  "(n_routed_experts, ..., first_k_dense_replace; laga's bias_update_speed), "
                  "in place of --layers, --d-model, --heads, ... (docs/moe.md, \"In the model\")");
  add_dsa_options(*sub, *c);
  sub->add_option("--vocab", c->vocab, "vocabulary size")
      ->check(whole_for(1, c->vocab))
      ->capture_default_str();
  sub->add_option("--seq", c->seq, "sequence length S")
      ->check(whole_for(1, c->seq))
      ->capture_default_str();
  sub->add_option("--batch", c->batch, "sequences per step")
      ->check(whole_for(1, c->batch))
      ->capture_default_str();
  sub->add_option("--steps", c->steps, "total optimizer steps")
      ->check(whole_for(1, c->steps))
      ->capture_default_str();
  sub->add_option("--lr", c->lr, "peak learning rate")->check(real_above(0))->capture_default_str();
  sub->add_option("--beta1", c->beta1, "AdamW beta1")
      ->check(real(0, 1, "[)"))
      ->capture_default_str();
  sub->add_option("--beta2", c->beta2, "AdamW beta2")
      ->check(real(0, 1, "[)"))
      ->capture_default_str();
  sub->add_option("--eps", c->eps, "AdamW eps")->check(real_above(0))->capture_default_str();
  sub->add_option("--weight-decay", c->weight_decay,
                  "decoupled weight decay on linear weights (not norms, not the embedding)")
      ->check(real_at_least(0))
      ->capture_default_str();
  sub->add_option("--clip", c->clip, "clip gradients to this global norm (0: off)")
      ->check(real_at_least(0))
      ->capture_default_str();
  sub->add_option("--warmup", c->warmup, "linear warm-up steps")
      ->check(whole_for(0, c->warmup))
      ->capture_default_str();
  sub->add_option("--schedule", c->schedule, "lr after warm-up: constant | cosine")
      ->check(CLI::IsMember({"constant", "cosine"}))
      ->capture_default_str();
  sub->add_option("--min-lr", c->min_lr, "final lr of the cosine schedule (<= --lr)")
      ->check(real_at_least(0))
      ->capture_default_str();
  sub->add_option("--seed", c->seed, "seed of weights and data")
      ->check(whole_for(0, c->seed))
      ->capture_default_str();
  sub->add_option("--data", c->data,
                  "random (a fixed seeded sequence to memorise) or FILE (flat uint16/uint32 token "
                  "ids, nanoGPT/llm.c .bin)")
      ->capture_default_str();
  sub->add_option("--val-data", c->val_data,
                  "held-out token file (as --data) to evaluate on every --val-every steps: the "
                  "mean forward loss of --val-batches fixed batches, logged as val_loss");
  sub->add_option("--val-every", c->val_every, "validate every N steps and after the last")
      ->check(whole_for(1, c->val_every));
  sub->add_option("--val-batches", c->val_batches, "batches of --batch windows per validation")
      ->check(whole_for(1, c->val_batches))
      ->capture_default_str();
  sub->add_option("--data-dtype", c->data_dtype,
                  "auto | u16 | u32 (auto: llm.c header if present, *.u32 names u32, else u16)")
      ->check(CLI::IsMember({"auto", "u16", "u32"}))
      ->capture_default_str();
  sub->add_option("--pack-eos", c->pack_eos,
                  "ID: the data is documents each ending with token ID; attention and RoPE "
                  "positions stay inside each document of a row, and the target after ID is not "
                  "trained on (docs/forms.md, \"Packed sequences\")")
      ->check(whole_for(0, c->pack_eos));
  sub->add_option("--log", c->log,
                  "JSONL file: one line per step (step, loss, grad_norm, lr, tokens_per_s, "
                  "targets: how many the loss is the mean over)");
  sub->add_option("--save-every", c->save_every,
                  "write a checkpoint every N steps (needs --checkpoint)")
      ->check(whole_for(0, c->save_every));
  sub->add_option("--checkpoint", c->checkpoint,
                  "checkpoint directory: written every --save-every steps, after the last step "
                  "and on SIGINT/SIGTERM; must be new, empty, or the one --resume reads");
  sub->add_option("--resume", c->resume, "continue from a checkpoint directory or its step-*.json");
  sub->add_option("--allow-change", c->allow_change,
                  "with --resume: comma-separated options that may differ from the checkpoint's "
                  "(e.g. lr,steps); any other change is refused");
  sub->add_flag("--allow-nonfinite", c->allow_nonfinite,
                "resume from a checkpoint holding NaN/inf and train on through a step whose loss "
                "or gradient is not finite, with a warning naming each (default: refuse the "
                "checkpoint, or stop before that step's update, naming the tensor and count)");
  sub->add_option("--perturb-reductions", c->perturb_reductions,
                  "SEED: debugging; the gradient all-reduce, the latent reduce-scatter and every "
                  "other reduction add the ranks' contributions in an order permuted by SEED "
                  "instead of rank order (deterministic per SEED, local == MPI; changes bits "
                  "only at --sp >= 3; docs/convergence.md, \"Reproducibility under perturbed "
                  "reductions\")")
      ->check(whole_for(0, c->perturb_reductions));
  sub->add_flag("--expert-parallel", c->expert_parallel,
                "MoE models: fold expert parallelism onto the --sp ranks (with --dp, every "
                "replica's: EP over DP; each rank runs "
                "E / P consecutive experts, the first E % P ranks one more, on every rank's "
                "copies routed to them: all_to_all_v dispatch and combine, ledgered as moe_counts, "
                "moe_dispatch, moe_combine and their backward dmoe_*; docs/moe.md, \"Expert "
                "parallelism\"). The same math as without it, rounded differently");
  sub->add_option(
         "--ep", c->ep,
         "with --expert-parallel: the EP degree N, a divisor of --sp (x --dp): groups of N "
         "consecutive ranks, each holding every expert (E / N per rank), the copies "
         "exchanged within a group, each expert's gradients summed over the groups by "
         "the gradient all-reduce (default: every rank, --sp x --dp, one group)")
      ->check(whole_for(1, c->ep));
  sub->add_flag("--invariant", c->invariant,
                cat("the invariant mode (docs/invariance.md, \"In training\"): the losses and "
                    "the weights after every step the same bits at every --sp and --comm; forms ",
                    names_of_forms_with(&FormTraits::invariant),
                    ", --attention flash, contiguous shards, no --pp or --dp; an MoE model with "
                    "--expert-parallel over every rank"));
  sub->add_flag("--log-expert-load", c->log_expert_load,
                "with --log and an MoE balancing its bias: each line also holds expert_load, "
                "the step's global token count per expert of every MoE layer");
  sub->add_flag("--quiet", c->quiet, "no per-step progress on stderr");
  sub->callback([c, sub] {
    c->given.clear();
    for (const CLI::Option* opt : sub->get_options())
      if (opt->count() > 0 && !opt->get_lnames().empty())
        c->given.insert("--" + opt->get_lnames().front());
    c->model_options_given.clear();
    for (const char* name : kModelOptions)
      if (sub->count(name) > 0) c->model_options_given.push_back(name);
    run_train(*c);
  });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_train);

}  // namespace laga::tools
