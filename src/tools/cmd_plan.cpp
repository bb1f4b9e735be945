// laga plan: which form, how much memory and how fast, for a model, sequence
// lengths and ranks on a hardware profile -- predicted (docs/planning.md).
// Bytes and peak memory are exact (the closed form and the memory model, as
// `laga compare --count-only` reports them); the step time is the time model
// of src/plan/time_model.hpp on the profile's links, or on --link.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/error.hpp"
#include "core/whole_number.hpp"
#include "mla/form_registry.hpp"
#include "mla/work_model.hpp"
#include "plan/measure.hpp"
#include "plan/model_plan.hpp"
#include "plan/plan_search.hpp"
#include "plan/planner.hpp"
#include "tools/cli_common.hpp"
#include "tools/commands.hpp"
#include "tools/plan_block_report.hpp"
#include "tools/plan_dsa_report.hpp"
#include "tools/plan_model_report.hpp"

namespace laga::tools {

namespace {

using Clock = std::chrono::steady_clock;

struct PlanOptions {
  ModelOptions model_options;
  std::int64_t batch = 1;
  std::string seq = "4096", sp = "8";
  std::string profile, measure, list_shapes;
  int nodes = 0;
  // dtype: none given means bf16, or fp32 with --profile this (its figures
  // are laga's fp32 kernels).
  std::optional<PlanDType> dtype;
  std::string link, json, forms = "all", attention = "flash", overlap = "off";
  GradReduce grad_reduce = GradReduce::fp32;  // --grad-reduce
  bool q_latent = false, quiet = false;
  int head_groups = 0;  // the grid forms (--head-groups); 0: their default rule at each P
  std::string seq_layout = "contiguous";  // --seq-layout
  // A whole model's step (--model NAME|FILE; model_plan.hpp): --layers N
  // overrides its depth (0: the model's), --dp its data-parallel replicas.
  std::string model, dp = "1", ep = "sp";
  std::int64_t layers = 0, micro_batches = 1;
  bool zero1 = false, recompute = false;
  // Pipeline stages, DeepSeek's placement and FP8 (plan/pipeline.hpp):
  // --pp, --schedule, --chunks, --stage-layers, --mtp, --node-limit, --fp8;
  // --recipe fills every option the user left out from a published setup.
  std::string pp = "1", schedule = "1f1b", stage_layers, recipe;
  int chunks = 2, node_limit = 0;
  std::string comm_sms = "20/132";
  bool mtp = false, fp8 = false;
  // --search: the team grid (plan/plan_search.hpp) for every grid option
  // not given; --global-batch TOKENS: a fixed batch a step over the replicas.
  bool search = false;
  std::int64_t global_batch = 0;
  // Given options that only --model reads, and whether --preset/--config was.
  std::vector<std::string> model_only_given;
  bool attention_config_given = false;
  // The options given that only a plan reads (--measure and --list-shapes
  // plan nothing).
  std::vector<std::string> plan_only_given;
};

// --model NAME|FILE: a preset (LmConfig::preset) or a DeepSeek-V3 config.
LmConfig load_model(const PlanOptions& o) {
  const std::vector<std::string> names = LmConfig::preset_names();
  LmConfig m;
  if (std::find(names.begin(), names.end(), o.model) != names.end()) {
    m = LmConfig::preset(o.model);
  } else {
    protect_input(o.model, "--model");
    m = LmConfig::from_json_file(o.model);
    // The model plan's layers run dense MLA; a DSA model's would be another
    // model's step, so it is refused rather than planned without its indexer.
    LAGA_CHECK(!m.mla.dsa(), "--model ", o.model,
               " is a DSA model (index_n_heads, index_head_dim, index_topk), and --model plans "
               "dense MLA layers; plan its attention block's DSA forms with --config ",
               o.model, " (docs/planning.md, \"DSA\")");
  }
  // A stage of more layers than the model has is no stage of it (issue 54,
  // S: --layers 1000 planned a 3-layer model as 1000 layers).
  LAGA_CHECK(o.layers <= m.layers, "--layers ", o.layers, " is more than the ", m.layers,
             " layers of --model ", o.model,
             "; --layers plans a pipeline stage of that many of its layers: give at most ",
             m.layers, ", or leave it out for the whole model");
  if (o.layers > 0) m.layers = o.layers;
  m.validate();
  LAGA_CHECK(m.moe || std::find(o.model_only_given.begin(), o.model_only_given.end(), "--ep") ==
                          o.model_only_given.end(),
             "--ep spreads the MoE experts over the ranks, and --model ", o.model,
             " is dense (no routed experts); drop --ep");
  return m;
}

// --ep sp|max|N.
EpChoice parse_ep(const std::string& s) {
  if (s == "sp") return {EpRule::sp, 0};
  if (s == "max") return {EpRule::max, 0};
  const std::optional<std::int64_t> n = parse_whole_number(s);
  LAGA_CHECK(n && *n >= 1 && *n <= std::numeric_limits<int>::max(), "--ep '", s,
             "' is none of sp (EP = P), max (EP = gcd(P x DP, E)) or a whole number N >= 1");
  return {EpRule::fixed, int(*n)};
}

// --stage-layers N,N,..: each stage's layers, in order (a count may repeat,
// unlike parse_int_list's sets of values).
std::vector<int> parse_stage_layers(const std::string& s) {
  std::vector<int> counts;
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? comma : comma - start);
    const std::optional<std::int64_t> n = parse_whole_number(item);
    LAGA_CHECK(n && *n >= 0 && *n <= 1000000, "--stage-layers: '", item, "' in '", s,
               "' is not a whole number of layers (0 or more)");
    counts.push_back(int(*n));
    if (comma == std::string::npos) return counts;
    start = comma + 1;
  }
}

// --comm-sms USED/ALL: DualPipe's communication kernels' share of the SMs.
double parse_comm_sms(const std::string& s) {
  const size_t slash = s.find('/');
  const std::optional<std::int64_t> used =
      slash == std::string::npos ? std::nullopt : parse_whole_number(s.substr(0, slash));
  const std::optional<std::int64_t> all =
      slash == std::string::npos ? std::nullopt : parse_whole_number(s.substr(slash + 1));
  LAGA_CHECK(used && all && *used >= 0 && *all >= 1 && *used < *all, "--comm-sms '", s,
             "' is not USED/ALL with 0 <= USED < ALL (DeepSeek-V3 on H800: 20/132)");
  return double(*used) / double(*all);
}

// The whole model's request: `model` (load_model's, read once) and `block`.
ModelPlanRequest model_request(const PlanOptions& o, const LmConfig& model, PlanRequest block) {
  ModelPlanRequest q;
  q.model = model;
  block.cfg = q.model.mla;
  q.block = std::move(block);
  q.dps = parse_int_list(o.dp, "--dp");
  q.micro_batches = o.micro_batches;
  q.ep = parse_ep(o.ep);
  q.zero1 = o.zero1;
  q.recompute = o.recompute;
  q.pps = parse_int_list(o.pp, "--pp");
  q.pipeline.schedule = parse_pipe_schedule(o.schedule);
  q.pipeline.chunks = o.chunks;
  q.pipeline.mtp = o.mtp;
  q.pipeline.comm_unit_share = parse_comm_sms(o.comm_sms);
  if (!o.stage_layers.empty()) q.pipeline.stage_layers = parse_stage_layers(o.stage_layers);
  q.fp8 = o.fp8;
  q.node_limit = o.node_limit;
  LAGA_CHECK(o.global_batch == 0 || std::find(o.model_only_given.begin(), o.model_only_given.end(),
                                              "--micro-batches") == o.model_only_given.end(),
             "--global-batch sets each DP's micro-batches (TOKENS / (S x batch x DP)) and "
             "--micro-batches sets them for every DP; give one of them");
  q.global_batch_tokens = o.global_batch;
  return q;
}

void run_model_plan(const PlanOptions& o, const LmConfig& model, PlanRequest block) {
  const ModelPlanRequest q = model_request(o, model, std::move(block));
  const ModelPlanResult r = make_model_plans(q);
  const bool table_to_stdout = o.json != "-";
  (table_to_stdout ? std::cout : std::cerr) << model_table(q, r) << std::flush;
  if (!o.json.empty()) write_output(o.json, model_json(q, r));
  for (const MinDevices& d : r.min_devices) {
    if (d.found) continue;
    double least = -1;
    for (const ModelPlanCase& c : r.cases)
      if (c.seq == d.seq)
        for (const ModelPlan& f : c.forms)
          if (least < 0 || f.memory_bytes() < least) least = f.memory_bytes();
    fail("--seq ", d.seq, " fits no form at any --sp, --dp and --pp on ", q.block.profile.name,
         ": the smallest need is ", plan_gb(least), " GB per device against ",
         plan_gb(q.block.profile.device.memory_bytes),
         " GB; give a larger --sp (more expert and sequence shards) or --dp with --zero1 (the "
         "optimizer sharded), --recompute, ",
         q.block.dtype == PlanDType::bf16 && q.block.grad_reduce == GradReduce::fp32
             ? "--grad-reduce bf16 (bf16 gradients: 2 bytes a parameter less), "
             : "",
         "or more --pp stages",
         o.recipe.empty()
             ? ""
             : cat("; --recipe ", o.recipe,
                   " trains with selective recompute and FP8-cached activations, which the "
                   "plan does not model (docs/planning.md): --recompute is the closest plan "
                   "that fits"));
  }
}

void run_dsa_plan(const PlanOptions& o, const MlaConfig& cfg, const DsaConfig& dsa,
                  PlanDType dtype);

void run_plan(const PlanOptions& o) {
  const auto start = Clock::now();
  auto say = [&](const std::string& s) {
    if (o.quiet) return;
    const double t = std::chrono::duration<double>(Clock::now() - start).count();
    if (t >= 2.0)
      std::cerr << "laga plan: " << plan_number("[%6.1f s] ", t) << s << "\n" << std::flush;
  };
  // Input files may not be outputs; known before the outputs are vetted, so
  // an output that is one is refused before the work (issue 54 A).
  protect_input(o.profile, "--profile");
  protect_input(o.model_options.config_path, "--config");
  {
    const std::vector<std::string> presets = LmConfig::preset_names();
    if (std::find(presets.begin(), presets.end(), o.model) == presets.end())
      protect_input(o.model, "--model");
  }
  vet_outputs({{"--json", o.json}, {"--measure", o.measure}, {"--list-shapes", o.list_shapes}});
  const bool measuring = !o.measure.empty();
  const bool listing = !o.list_shapes.empty();
  LAGA_CHECK(!(measuring && listing),
             "--measure times this machine's shapes and --list-shapes lists them for another "
             "device to time; give one of them");
  // --measure and --list-shapes plan nothing: an option only a plan reads
  // would be ignored without a word (issue 26).
  const std::string plan_only = [&] {
    std::string s;
    for (const std::string& n : o.plan_only_given) s += (s.empty() ? "" : ", ") + n;
    return s;
  }();
  LAGA_CHECK(!listing || plan_only.empty(),
             "--list-shapes FILE lists the plan's GEMM and attention shapes and plans nothing, "
             "so ",
             plan_only,
             " would be ignored; time the shapes (scripts/time_shapes_torch.py), then plan with "
             "--profile and those options");
  LAGA_CHECK(
      measuring || listing || !o.profile.empty(), "laga plan needs --profile NAME|FILE (",
      [] {
        std::string n;
        for (const std::string& s : builtin_profile_names()) n += s + ", ";
        return n;
      }(),
      "or this), --measure FILE or --list-shapes FILE");
  LAGA_CHECK(!measuring || plan_only.empty(),
             "--measure FILE measures this machine and plans nothing, so ", plan_only,
             " would be ignored; measure first, then plan with --profile ", o.measure,
             " and those options");
  // This machine's figures (--profile this, --measure) are laga's fp32
  // kernels': measure times no bf16 shape, so there is no bf16 rate to plan
  // with (the bf16 path's own speed: laga_bench gemm_bf16, flash_bf16).
  const bool this_machine = measuring || o.profile == "this";
  const PlanDType dtype = o.dtype ? *o.dtype : this_machine ? PlanDType::fp32 : PlanDType::bf16;
  LAGA_CHECK(!this_machine || dtype == PlanDType::fp32, measuring ? "--measure" : "--profile this",
             " times laga's fp32 kernels on this machine (not its bf16 path), so it has no "
             "bf16 figures; use --dtype fp32 (the default with ",
             measuring ? "--measure" : "--profile this", ")");
  LAGA_CHECK(
      !o.model.empty() || o.model_only_given.empty(),
      o.model_only_given.empty() ? "" : o.model_only_given.front(),
      " plans a whole model's step; give --model NAME|FILE (",
      [] {
        std::string n;
        for (const std::string& s : LmConfig::preset_names()) n += (n.empty() ? "" : ", ") + s;
        return n;
      }(),
      " or a DeepSeek-V3 config.json) or leave it out");
  LAGA_CHECK(o.model.empty() || !o.attention_config_given,
             "--model sets the attention block too (its MLA config); leave out --preset and "
             "--config, or leave out --model to plan one block");
  if (o.profile == "this" && !o.dtype && !o.quiet)
    std::cerr << "laga plan --profile this: planning in fp32, the precision this machine's "
                 "figures are measured in (laga's kernels run fp32)\n";
  PlanRequest q;
  // --model: read once, for the block's config, the measured shapes and the plan.
  const std::optional<LmConfig> model =
      o.model.empty() ? std::nullopt : std::optional<LmConfig>(load_model(o));
  q.cfg = model ? model->mla : o.model_options.load();
  if (const std::optional<DsaConfig> dsa = model ? std::nullopt : o.model_options.load_dsa(q.cfg)) {
    run_dsa_plan(o, q.cfg, *dsa, dtype);
    return;
  }
  LAGA_CHECK(o.batch >= 1, "--batch ", o.batch, ": need at least 1 sequence");
  q.batch = o.batch;
  q.seqs = parse_whole_list(o.seq, "--seq", "4096,32768");
  q.sps = parse_int_list(o.sp, "--sp");
  q.forms = form_variants(parse_form_list(o.forms), o.q_latent, o.head_groups, q.cfg,
                          parse_overlap_runs(o.overlap));
  q.seq_layout = parse_seq_layout(o.seq_layout);
  q.attention = parse_attention(o.attention);
  q.dtype = dtype;
  q.grad_reduce = o.grad_reduce;
  check_grad_reduce(precision_of(q.dtype), q.grad_reduce);
  // Every GEMM and attention call of the plans the options describe; with
  // --model, the layers' FFN and head GEMMs too (what --list-shapes lists
  // for a device to time, and --measure times here).
  const auto calls = [&] {
    return model ? model_plan_calls(model_request(o, *model, q)) : plan_calls(q);
  };
  if (listing) {
    write_output(o.list_shapes, shape_list_json(calls()));
    return;
  }
  if (measuring || o.profile == "this") {
    // This machine, and the time of every GEMM and attention shape the plans
    // described by the other options cost.
    const auto tell = [&](const std::string& s) {
      if (!o.quiet)
        std::cerr << (measuring ? "laga plan --measure: " : "laga plan --profile this: measuring ")
                  << s << "\n";
    };
    q.profile = measure_this_machine(tell);
    measure_shapes(calls(), q.profile.measured_shapes, tell);
    if (measuring) {
      write_output(o.measure, profile_json(q.profile));
      return;
    }
  } else {
    protect_input(o.profile, "--profile");
    q.profile = load_profile(o.profile);
  }
  q.profile.peak_flops(q.dtype);  // refuse an unpublished peak before planning
  q.nodes = o.nodes;
  if (!o.link.empty()) {
    const LinkSpec l = parse_link(o.link);
    q.link_bytes_per_s = l.bytes_per_s;
    q.link_latency_s = l.latency_s;
  }
  q.progress = say;
  if (model) {
    run_model_plan(o, *model, std::move(q));
    return;
  }
  const std::vector<PlanCase> cases = make_plans(q);
  const bool table_to_stdout = o.json != "-";
  (table_to_stdout ? std::cout : std::cerr) << plan_table(q, cases) << std::flush;
  if (!o.json.empty()) write_output(o.json, plan_json(q, cases));
  // A sequence that fits no form at any P is a mistake the user must hear
  // about, not only a "NO" in the table.
  for (std::int64_t S : q.seqs) {
    std::int64_t least = -1;
    for (const PlanCase& c : cases)
      if (c.seq == S)
        for (const FormPlan& f : c.forms) {
          if (f.fits) least = -2;
          if (least != -2 && (least < 0 || f.peak_activation_bytes + f.resident_bytes < least))
            least = f.peak_activation_bytes + f.resident_bytes;
        }
    LAGA_CHECK(least == -2, "--seq ", S, " fits no form at any --sp on ", q.profile.name,
               ": the smallest need is ", plan_gb(double(least)), " GB per device against ",
               plan_gb(q.profile.device.memory_bytes),
               " GB; give a larger --sp (more ranks share the sequence) or a shorter --seq");
  }
}

// A DSA config (plan/dsa_plan.hpp): its forms' closed forms on the
// profile. The options that choose among the dense forms' variants, and
// --measure / --list-shapes (which time the dense forms' calls), are
// refused rather than ignored.
void run_dsa_plan(const PlanOptions& o, const MlaConfig& cfg, const DsaConfig& dsa,
                  PlanDType dtype) {
  LAGA_CHECK(o.measure.empty() && o.list_shapes.empty() && o.profile != "this",
             "--measure, --list-shapes and --profile this time the dense forms' calls; a DSA "
             "config is planned from its closed forms (docs/planning.md, \"DSA\") on a shipped "
             "or given --profile");
  LAGA_CHECK(
      !o.q_latent && o.head_groups == 0 && o.overlap == "off" && o.attention == "flash",
      "--q-latent, --head-groups, --overlap and --attention choose among the dense forms' "
      "variants; the DSA forms (--forms ",
      [] {
        std::string n;
        for (DsaForm f : all_dsa_forms()) n += (n.empty() ? "" : ", ") + std::string(to_string(f));
        return n;
      }(),
      ") fix their own (laga_recompute moves the query latent; attention is flash)");
  DsaPlanRequest d;
  d.cfg = cfg;
  d.dsa = dsa;
  d.batch = o.batch;
  d.seqs = parse_whole_list(o.seq, "--seq", "4096,32768");
  d.sps = parse_int_list(o.sp, "--sp");
  if (o.forms == "all") {
    d.forms = all_dsa_forms();
  } else {
    std::stringstream in(o.forms);
    for (std::string name; std::getline(in, name, ',');) d.forms.push_back(parse_dsa_form(name));
  }
  d.seq_layout = parse_seq_layout(o.seq_layout);
  d.dtype = dtype;
  d.grad_reduce = o.grad_reduce;
  d.profile = load_profile(o.profile);
  d.profile.peak_flops(dtype);  // refuse an unpublished peak before planning
  d.nodes = o.nodes;
  if (!o.link.empty()) {
    const LinkSpec l = parse_link(o.link);
    d.link_bytes_per_s = l.bytes_per_s;
    d.link_latency_s = l.latency_s;
  }
  const std::vector<DsaPlanCase> cases = make_dsa_plans(d);
  (o.json != "-" ? std::cout : std::cerr) << dsa_table(d, cases) << std::flush;
  if (!o.json.empty()) write_output(o.json, dsa_json(d, cases));
}

// --recipe deepseek-v3: the DeepSeek-V3 technical report's pre-training
// setup (arXiv 2412.19437), each option the user did not give:
//   --model deepseek-v3 --mtp       the 671B model and its one MTP module (sec. 2.2)
//   --profile h800                  2048 NVIDIA H800 in nodes of 8 (sec. 3.1)
//   --pp 16 --schedule dualpipe     16-way PP with DualPipe (sec. 3.2)
//   --ep 64 --node-limit 4          EP 64 over 8 nodes, each token to at most 4 (sec. 3.2.2, 2.1.2)
//   --dp 128 --zero1 --sp 1         ZeRO-1 DP, no TP: 2048 / 16 stages = 128 a stage
//   --fp8                           the FP8 framework (sec. 3.3)
//   --seq 4096 --batch 1 --micro-batches 120
//                                   4K sequences, the final batch of 15360 sequences
//                                   (sec. 4.2) over 128 replicas; a micro-batch of one
//                                   sequence is an assumption (the report gives none)
void apply_recipe(PlanOptions& o, CLI::App& c) {
  const auto unset = [&](const char* name) { return c.count(name) == 0; };
  LAGA_CHECK(unset("--preset") && unset("--config"),
             "--recipe deepseek-v3 plans DeepSeek-V3 (--model deepseek-v3); leave out --preset "
             "and --config");
  if (unset("--model")) o.model = "deepseek-v3";
  if (unset("--mtp")) o.mtp = true;
  if (unset("--profile")) o.profile = "h800";
  if (unset("--pp")) o.pp = "16";
  if (unset("--schedule")) o.schedule = "dualpipe";
  if (unset("--ep")) o.ep = "64";
  if (unset("--node-limit")) o.node_limit = 4;
  if (unset("--dp")) o.dp = "128";
  if (unset("--zero1")) o.zero1 = true;
  if (unset("--sp")) o.sp = "1";
  if (unset("--fp8")) o.fp8 = true;
  if (unset("--seq")) o.seq = "4096";
  if (unset("--micro-batches")) o.micro_batches = 120;
  if (unset("--forms")) o.forms = "explicit";
}

// --search: plan/plan_search.hpp's team grid, each grid option not given.
void apply_search(PlanOptions& o, CLI::App& c) {
  const auto unset = [&](const char* name) { return c.count(name) == 0; };
  const auto list = [](const std::vector<int>& v) {
    std::string s;
    for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
    return s;
  };
  const TeamGrid& g = kTeamGrid;
  if (unset("--sp")) o.sp = list(g.sps);
  if (unset("--dp")) o.dp = list(g.dps);
  if (unset("--pp")) o.pp = list(g.pps);
  if (unset("--ep")) o.ep = "max";
  if (unset("--zero1")) o.zero1 = g.zero1;
  if (unset("--global-batch") && unset("--micro-batches")) o.global_batch = g.global_batch_tokens;
}

void register_plan(CLI::App& app) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* c = app.add_subcommand(
      "plan",
      "Predict, per form, bytes sent per rank and peak activation memory (exact, as laga "
      "compare --count-only) and the step time, tokens/s and communication share on a hardware "
      "profile, for each --seq and --sp; name the winner and the link bandwidth where laga "
      "starts to beat explicit (docs/planning.md)");
  o->model_options.add_to(*c);
  o->model_options.accepts_dsa = true;  // a DSA config's forms are planned (plan/dsa_plan.hpp)
  c->add_option("--batch", o->batch, "sequences per batch (B)")
      ->check(whole_for(1, o->batch))
      ->capture_default_str();
  c->add_option("--seq", o->seq, "sequence lengths, comma-separated (S)")->capture_default_str();
  c->add_option("--sp", o->sp, "sequence-parallel ranks, comma-separated (P)")
      ->capture_default_str();
  c->add_option(
      "--profile", o->profile,
      "hardware profile: a100, h100, h200, h800, 910b (built in), a JSON file, or 'this' to "
      "measure this machine first");
  c->add_option("--measure", o->measure,
                "measure this machine (FMA peak, GEMM and flash rates, memory bandwidth, the "
                "in-process communicator, and the time of every GEMM and attention shape of the "
                "plan the other options describe, with --model its layers' FFN and head GEMMs "
                "too) and write its profile to FILE; plans nothing");
  c->add_option("--list-shapes", o->list_shapes,
                "write the GEMM and attention call shapes of the plan the other options describe "
                "(with --model its layers' FFN and head GEMMs too), each with its calls and "
                "FLOPs, as JSON to FILE, for a device to time (scripts/time_shapes_torch.py "
                "writes a profile with their measured_shapes); plans nothing");
  c->add_option("--nodes", o->nodes,
                "nodes the ranks spread over (default: as few as the profile's devices per node "
                "allow)")
      ->check(whole_for(1, o->nodes));
  add_dtype_option(
      *c, [o](RunDtype d) { o->dtype = d == RunDtype::bf16 ? PlanDType::bf16 : PlanDType::fp32; },
      {RunDtype::bf16, RunDtype::fp32},
      "element type of the plan: bf16 or fp32 (default bf16; fp32 with --profile this, "
      "whose figures are fp32)");
  add_grad_reduce_option(*c, o->grad_reduce);
  c->add_option("--link", o->link,
                "override every link of the profile: BW GB/s (10^9 bytes/s) per direction, and "
                "LAT microseconds when given")
      ->check(link_spec());
  c->add_option("--json", o->json, "write the plans as JSON to this file ('-' for stdout)");
  c->add_option("--forms", o->forms,
                cat(
                    "comma-separated forms (", form_names(", "),
                    "; for a DSA preset or config the DSA forms: ",
                    [] {
                      std::string n;
                      for (DsaForm f : all_dsa_forms())
                        n += (n.empty() ? "" : ", ") + std::string(to_string(f));
                      return n;
                    }(),
                    "), or all"))
      ->capture_default_str();
  add_q_latent_flag(*c, o->q_latent, FormsRun::each);
  add_head_groups_option(*c, o->head_groups);
  add_seq_layout_option(*c, o->seq_layout);
  add_overlap_option(*c, o->overlap, FormsRun::each);
  add_attention_option(*c, o->attention);
  c->add_option("--model", o->model,
                "plan a whole model's training step: a preset (deepseek-v3) or a DeepSeek-V3 "
                "config.json with its MoE and layers; in place of --preset/--config");
  c->add_option("--layers", o->layers, "with --model: plan this many layers (a pipeline stage)")
      ->check(whole_for(1, o->layers));
  c->add_option("--dp", o->dp,
                "with --model: data-parallel replicas of the SP group, comma-separated")
      ->capture_default_str();
  c->add_option("--micro-batches", o->micro_batches,
                "with --model: forward + backward passes of --batch sequences per optimizer step "
                "(gradient accumulation; the gradient sync and AdamW once per step)")
      ->check(whole_for(1, o->micro_batches))
      ->capture_default_str();
  c->add_option(
       "--ep", o->ep,
       "with --model: the expert-parallel degree: sp (EP = P, the experts over the SP "
       "ranks), max (EP = gcd(P x DP, E): the experts over the DP replicas too) or N (dividing "
       "E and every P x DP)")
      ->capture_default_str();
  c->add_flag("--zero1", o->zero1,
              "with --model: shard AdamW's state over the replicas of each parameter (ZeRO-1)");
  c->add_flag("--recompute", o->recompute,
              "with --model: keep only each layer's input and re-run its forward in backward");
  c->add_option("--pp", o->pp,
                "with --model: pipeline stages over the layers, comma-separated (a grid beside "
                "--sp and --dp)")
      ->capture_default_str();
  c->add_option("--schedule", o->schedule,
                "with --model: the pipeline schedule: 1f1b, interleaved (--chunks per device), "
                "dualpipe (DeepSeek-V3's) or 1f1b-lockstep (laga train --pp's own: 1F1B in "
                "lockstep ticks)")
      ->check(CLI::IsMember({"1f1b", "interleaved", "dualpipe", "1f1b-lockstep"}))
      ->capture_default_str();
  c->add_option("--chunks", o->chunks, "with --schedule interleaved: layer chunks per device")
      ->check(whole_for(1, o->chunks))
      ->capture_default_str();
  c->add_option("--stage-layers", o->stage_layers,
                "with --model and one --pp: the layers of each stage, comma-separated (default: "
                "as even as counts allow, the MTP module counted as a layer of the last)");
  c->add_flag("--mtp", o->mtp,
              "with --model: plan DeepSeek-V3's multi-token-prediction module (one MoE layer, "
              "its projection and the shared head again) on the last stage");
  c->add_flag("--fp8", o->fp8,
              "with --model: the layers' GEMMs in FP8 at the profile's fp8 peak, as DeepSeek-V3 "
              "trained (attention core, head, gate, norms in the dtype)");
  c->add_option("--node-limit", o->node_limit,
                "with --model: DeepSeek-V3's node-limited routing: a token's experts on at most "
                "N of its EP group's nodes, sent once a node (0: every copy to its owner)")
      ->check(whole_for(0, o->node_limit))
      ->capture_default_str();
  c->add_option("--comm-sms", o->comm_sms,
                "with --schedule dualpipe: USED/ALL, the SMs its all-to-all kernels take from "
                "the overlapped compute (DeepSeek-V3's report: 20 of the H800's 132)")
      ->capture_default_str();
  c->add_option("--recipe", o->recipe,
                "fill every option not given from a published training setup: deepseek-v3 (the "
                "V3 report's pre-training: 2048 H800, PP 16 DualPipe, EP 64 over 8 nodes, "
                "ZeRO-1 DP 128, no TP, FP8, S 4096; docs/planning.md)")
      ->check(CLI::IsMember({"deepseek-v3"}));
  c->add_flag("--search", o->search,
              "with --model: plan the grid a team chooses among (docs/planning.md): --sp and --dp "
              "1..128, --pp 1,2,4,8,16, --ep max, --zero1 and DeepSeek-V3's global batch of "
              "62914560 tokens, each where not given");
  c->add_option("--global-batch", o->global_batch,
                "with --model: a fixed batch of this many tokens a step over the replicas; each "
                "DP then runs TOKENS / (S x batch x DP) micro-batches (a DP leaving no whole "
                "number is not planned)")
      ->check(whole_for(1, o->global_batch));
  c->add_flag("--quiet", o->quiet, "no progress lines on stderr");
  c->callback([o, c] {
    if (!o->recipe.empty()) apply_recipe(*o, *c);
    if (o->search) apply_search(*o, *c);
    for (const char* name : {"--profile", "--json", "--nodes", "--link", "--grad-reduce"})
      if (c->count(name) > 0) o->plan_only_given.push_back(name);
    for (const char* name :
         {"--layers", "--dp", "--micro-batches", "--ep", "--zero1", "--recompute", "--pp",
          "--schedule", "--chunks", "--stage-layers", "--mtp", "--fp8", "--node-limit",
          "--comm-sms", "--search", "--global-batch"})
      if (c->count(name) > 0) o->model_only_given.push_back(name);
    o->attention_config_given = c->count("--preset") > 0 || c->count("--config") > 0;
    run_plan(*o);
  });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_plan);

}  // namespace laga::tools
