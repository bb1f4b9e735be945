// The options of `laga train` before any rank starts (model/train.hpp):
// validate_train_options (each option's own checks and those between them,
// the pipeline, invariant, data-parallel and DSA runs' limits), a resume's
// checks against its checkpoint (recorded_options, the options it enforces
// and --allow-change), the checkpoint directory's policy, prepare_run, and
// the run's layout and DSA stage. The loop itself is train.cpp.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>

#include "core/error.hpp"
#include "mla/form_spec.hpp"
#include "mla/ops.hpp"
#include "model/checkpoint.hpp"
#include "model/data.hpp"
#include "model/train.hpp"

namespace laga {

namespace fs = std::filesystem;

TokenSource train_token_source(const TrainOptions& o) {
  if (o.data == "random") return TokenSource::random(o.model.vocab, o.seed);
  return TokenSource::file(o.data, o.data_dtype, o.model.vocab, o.seq, o.seed);
}

namespace {

// Recorded but free to change on resume: they change how the same math is
// computed (which kernels, how many ranks), so a continuation differs from an
// uninterrupted run only by floating-point rounding; and where the data file
// lives (its content is "data").
const std::set<std::string>& free_options() {
  static const std::set<std::string> s{
      "form",     "attention",       "sp", "data-path", "q-latent",      "overlap",
      "dtype",    "expert-parallel", "ep", "pp",        "micro-batches", "dp",
      "invariant"};
  return s;
}

// The options a checkpoint may record and --allow-change may name.
const std::set<std::string>& enforced_options() {
  static const std::set<std::string> s{
      "seq",          "batch",  "data",  "data-dtype", "lr",          "schedule",
      "warmup",       "min-lr", "steps", "beta1",      "beta2",       "eps",
      "weight-decay", "clip",   "seed",  "pack-eos",   "index-warmup"};
  return s;
}

std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);  // round-trips every double
  return buf;
}

std::string joined(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

struct Change {
  std::string name, old_value, new_value;
  std::string text() const { return name + ": " + old_value + " -> " + new_value; }
};

std::vector<Change> option_changes(const CheckpointOptions& old, const CheckpointOptions& now) {
  std::set<std::string> names;
  for (const auto& [k, v] : old) names.insert(k);
  for (const auto& [k, v] : now) names.insert(k);
  std::vector<Change> out;
  for (const auto& k : names) {
    const auto a = old.find(k), b = now.find(k);
    const std::string va = a == old.end() ? "(not recorded)" : a->second;
    const std::string vb = b == now.end() ? "(not used)" : b->second;
    if (va != vb) out.push_back({k, va, vb});
  }
  return out;
}

bool allowed(const TrainOptions& o, const std::string& name) {
  return std::find(o.allow_change.begin(), o.allow_change.end(), name) != o.allow_change.end();
}

// The directory a --resume argument's checkpoint lives in.
fs::path resume_directory(const std::string& resume) {
  const fs::path p(resume);
  if (fs::is_directory(p)) return p;
  return p.parent_path().empty() ? fs::path(".") : p.parent_path();
}

void check_checkpoint_directory(const TrainOptions& o, bool writer) {
  if (o.checkpoint_dir.empty()) return;
  const fs::path dir(o.checkpoint_dir);
  std::error_code ec;
  LAGA_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "--checkpoint '", o.checkpoint_dir,
             "' exists and is not a directory; give a directory (new or empty, or the one "
             "--resume reads)");
  // Only the process that takes the lock judges it: under MPI the others
  // would find that process's own fresh lock (a live pid on this host) and
  // refuse their own job's directory as in use (issue 54 V).
  if (writer) refuse_checkpoint_directory_in_use(o.checkpoint_dir);
  // Every file of a checkpoint's naming counts, a tensors file without its
  // manifest too: a fresh run would write over it at that step.
  std::vector<std::string> names = checkpoint_files(o.checkpoint_dir);
  if (names.empty()) return;
  if (names.size() > 6) {
    const size_t more = names.size() - 5;
    names.resize(5);
    names.push_back(cat("and ", more, " more"));
  }
  LAGA_CHECK(!o.resume.empty(), "--checkpoint '", o.checkpoint_dir, "' already holds checkpoints (",
             joined(names, ", "),
             "); a new run there would mix its checkpoints with theirs and prune them. Continue "
             "that run with --resume ",
             o.checkpoint_dir, ", or choose another --checkpoint directory");
  LAGA_CHECK(fs::equivalent(resume_directory(o.resume), dir, ec), "--checkpoint '",
             o.checkpoint_dir, "' already holds checkpoints (", joined(names, ", "),
             ") that are not those of the run resumed from '", o.resume,
             "'; write into the directory you resume from, or a new or empty one");
}

void check_resume(const TrainOptions& o) {
  for (const auto& name : o.allow_change)
    LAGA_CHECK(
        enforced_options().count(name), "--allow-change: '", name,
        "' is not an option a checkpoint enforces; name some of: ",
        joined(std::vector<std::string>(enforced_options().begin(), enforced_options().end()), ","),
        " (form, attention and sp may change freely)");
  LAGA_CHECK(o.allow_change.empty() || !o.resume.empty(),
             "--allow-change applies only to a run that continues a checkpoint; add --resume DIR "
             "or drop --allow-change");
  if (o.resume.empty()) return;
  const CheckpointManifest m = read_checkpoint_manifest(o.resume);
  LAGA_CHECK(o.steps > m.step, "--steps ", o.steps, " is at or below step ", m.step,
             " of the checkpoint '", m.path,
             "', so there is nothing to train; --steps is the total, so pass a number above ",
             m.step);
  std::vector<std::string> refused = model_changes(m, o.model);
  for (const Change& c : option_changes(m.options, recorded_options(o)))
    if (!free_options().count(c.name) && !allowed(o, c.name)) refused.push_back(c.text());
  LAGA_CHECK(refused.empty(), "--resume '", o.resume,
             "': this run's settings differ from those of the checkpoint '", m.path,
             "', so it would not continue the same training: ", joined(refused, "; "),
             ". Pass the checkpoint's values, or name the options you mean to change in "
             "--allow-change (a comma-separated list; the model's dimensions cannot change)");
}
}  // namespace

CheckpointOptions recorded_options(const TrainOptions& o) {
  CheckpointOptions r;
  r["seq"] = std::to_string(o.seq);
  r["batch"] = std::to_string(o.batch);
  if (o.data == "random") {
    r["data"] = "random";
  } else {
    r["data"] = cat("file of ", fs::file_size(o.data), " bytes with FNV-1a 64 ", std::hex,
                    file_fnv1a64(o.data));
    r["data-dtype"] = o.data_dtype;
    r["data-path"] = o.data;
  }
  r["lr"] = exact(o.adam.lr);
  r["schedule"] = o.cosine ? "cosine" : "constant";
  r["warmup"] = std::to_string(o.warmup);
  if (o.cosine) {  // only the cosine schedule depends on these
    r["min-lr"] = exact(o.min_lr);
    r["steps"] = std::to_string(o.steps);
  }
  r["beta1"] = exact(o.adam.beta1);
  r["beta2"] = exact(o.adam.beta2);
  r["eps"] = exact(o.adam.eps);
  r["weight-decay"] = exact(o.adam.weight_decay);
  r["clip"] = exact(o.clip);
  r["seed"] = std::to_string(o.seed);
  // Recorded only when used, so that checkpoints written before the option
  // existed still compare equal on resume.
  if (o.pack_eos) r["pack-eos"] = std::to_string(*o.pack_eos);
  if (o.model.mla.dsa()) r["index-warmup"] = std::to_string(o.index_warmup);
  r["form"] = to_string(o.variant.form);
  if (o.variant.queries == QueryExchange::latent) r["q-latent"] = "on";
  if (o.variant.overlap == Overlap::on) r["overlap"] = "on";
  if (o.experts == ExpertPlacement::folded) r["expert-parallel"] = "on";
  if (o.expert_degree > 0) r["ep"] = std::to_string(o.expert_degree);
  r["attention"] = to_string(o.attention);
  if (o.precision == Precision::bf16) r["dtype"] = to_string(o.precision);
  if (o.grad_reduce == GradReduce::bf16) r["grad_reduce"] = to_string(o.grad_reduce);
  if (o.invariant) r["invariant"] = "on";
  r["sp"] = std::to_string(o.sp);
  if (o.pp > 1) r["pp"] = std::to_string(o.pp);
  if (o.dp > 1) r["dp"] = std::to_string(o.dp);
  if (o.micro_batches > 1) r["micro-batches"] = std::to_string(o.micro_batches);
  return r;
}

namespace {
// --pp and --micro-batches: what the pipeline execution (model/pipeline.hpp)
// runs today, and a stage list that covers the model once, in order.
void check_pipeline_options(const TrainOptions& o) {
  LAGA_CHECK(o.pp >= 1, "--pp must be >= 1 (got ", o.pp, ")");
  LAGA_CHECK(o.micro_batches >= 1 && o.batch % o.micro_batches == 0, "--micro-batches ",
             o.micro_batches, " must divide --batch ", o.batch,
             " (each micro-batch is batch / micro-batches rows); give a divisor of ", o.batch);
  LAGA_CHECK(o.micro_batches == 1 || o.pp > 1, "--micro-batches ", o.micro_batches,
             " splits the batch over pipeline stages; add --pp N (N >= 2), or drop it");
  if (o.pp == 1) return;
  const auto without = [&](bool ok, const std::string& what) {
    LAGA_CHECK(ok, "--pp ", o.pp, " runs one rank a stage; ", what,
               " within a stage is not supported yet: drop it, or run without --pp");
  };
  without(o.sp == 1, cat("--sp ", o.sp, " (sequence parallelism)"));
  without(o.experts == ExpertPlacement::every_rank, "--expert-parallel");
  without(!o.pack_eos, "--pack-eos (packed documents)");
  without(o.val_data.empty(), "--val-data (validation runs the model unpipelined)");
  LAGA_CHECK(int(o.stages.size()) == o.pp, "train: ", o.stages.size(), " pipeline stages for --pp ",
             o.pp, "; the stages come from the plan's placement (plan/pipeline.hpp, lm_stages)");
  std::int64_t next = 0;
  for (size_t s = 0; s < o.stages.size(); ++s) {
    const LmStage& st = o.stages[s];
    LAGA_CHECK(st.first == next && st.last >= st.first && st.embedding == (s == 0) &&
                   st.head == (s + 1 == o.stages.size()),
               "train: pipeline stage ", s, " holds layers [", st.first, ", ", st.last,
               "); the stages must cover the model's layers in order, the embedding on the "
               "first and the head on the last");
    next = st.last;
  }
  LAGA_CHECK(next == o.model.layers, "train: the pipeline stages hold ", next,
             " layers and the model has ", o.model.layers, "; give stages covering every layer");
}

// --invariant: what the mode covers (docs/invariance.md, "In training"), each
// thing it does not refused by name. Checked before any rank starts, from
// the options alone, so every rank (every MPI process) says the same.
void check_train_invariant(const TrainOptions& o) {
  if (!o.invariant) return;
  const FormSpec& f = form_spec(o.variant.form);
  LAGA_CHECK(f.traits.invariant, "--invariant: form ", f.name,
             " does not offer the invariant mode (docs/invariance.md, \"Which forms\" says why); "
             "use --form ",
             names_of_forms_with(&FormTraits::invariant), ", or drop --invariant");
  LAGA_CHECK(o.variant.queries == QueryExchange::heads,
             "--invariant: --q-latent's query latent "
             "reduce-scatter is not canonical yet; drop --q-latent with --invariant");
  LAGA_CHECK(o.variant.overlap == Overlap::off,
             "--invariant: --overlap on has no invariant path; "
             "drop --overlap (or give --overlap off) with --invariant");
  LAGA_CHECK(o.attention == AttentionKind::flash,
             "--invariant needs --attention flash (the eager kernel's GEMMs are not the "
             "invariant mode's)");
  LAGA_CHECK(o.grad_reduce == GradReduce::fp32,
             "--invariant sums the gradients in fp32: drop --grad-reduce bf16");
  LAGA_CHECK(o.seq_layout == SeqLayout::contiguous,
             "--invariant needs contiguous sequence shards "
             "(its sums over tokens follow the global token order); drop --seq-layout ",
             to_string(o.seq_layout));
  LAGA_CHECK(o.pp == 1, "--invariant: --pp ", o.pp,
             " has no invariant path (a stage's sums over its micro-batches follow the "
             "schedule); drop --pp with --invariant");
  LAGA_CHECK(o.dp == 1, "--invariant: --dp ", o.dp,
             " has no invariant path yet (its sums over tokens are the --sp group's); drop --dp "
             "with --invariant");
  if (!o.model.moe) return;
  LAGA_CHECK(
      o.experts == ExpertPlacement::folded && (o.expert_degree == 0 || o.expert_degree == o.sp),
      "--invariant with an MoE model needs --expert-parallel over every rank (no --ep "
      "below --sp): an expert's gradient is summed over its tokens on its one owner, in "
      "global token order; with every rank running every expert (or EP groups) it is "
      "a sum of per-rank partials, whose grouping follows --sp");
}

// --dp: what the data-parallel run (TrainOptions::dp) is built for today.
void check_data_parallel_options(const TrainOptions& o) {
  LAGA_CHECK(o.dp >= 1, "--dp must be >= 1 (got ", o.dp, ")");
  if (o.dp == 1) return;
  LAGA_CHECK(o.batch % o.dp == 0, "--batch ", o.batch, " does not split over --dp ", o.dp,
             " replicas (each takes batch / dp whole rows); give a --batch that is a multiple "
             "of ",
             o.dp);
  LAGA_CHECK(o.sp == 1, "--dp with --sp > 1 is not built yet (--sp ", o.sp,
             "): each replica's attention runs on one rank; give --sp 1, or drop --dp");
  LAGA_CHECK(o.pp == 1, "--dp with --pp is not built yet (--pp ", o.pp, "); give one of them");
  LAGA_CHECK(!o.pack_eos,
             "--dp with --pack-eos is not built yet (each replica would need its "
             "rows' documents); drop one of them");
  LAGA_CHECK(o.expert_degree == 0 || o.ranks() % o.expert_degree == 0, "--ep ", o.expert_degree,
             " must divide the ", o.ranks(), " ranks of --sp ", o.sp, " x --dp ", o.dp,
             " (each EP group is EP consecutive ranks, over the replicas); give a divisor of ",
             o.ranks());
}

// DSA models (model/dsa_layer.hpp): what their layers run today. Each
// refusal names the option and what to do.
void check_dsa_options(const TrainOptions& o) {
  const MlaConfig& m = o.model.mla;
  LAGA_CHECK(o.index_warmup >= 0, "--index-warmup must be >= 0 (got ", o.index_warmup, ")");
  if (!m.dsa()) {
    LAGA_CHECK(o.index_warmup == 0, "--index-warmup ", o.index_warmup,
               " sets the DSA indexer's dense warm-up, and the model has no indexer; give "
               "--index-topk/--index-heads/--index-head-dim (or a DSA --config), or drop it");
    return;
  }
  const auto refuse = [&](bool ok, const std::string& what) {
    LAGA_CHECK(ok, "a DeepSeek Sparse Attention model (index_topk ", m.index_topk, "): ", what);
  };
  refuse(o.index_warmup <= o.steps,
         cat("--index-warmup ", o.index_warmup, " is beyond --steps ", o.steps,
             ": the sparse stage would never run; give N <= ", o.steps));
  refuse(m.index_topk <= o.seq,
         cat("index_topk ", m.index_topk, " is above --seq ", o.seq,
             ": a query has at most --seq keys; give index_topk <= ", o.seq));
  refuse(!o.invariant,
         "--invariant is not offered (the DSA block's sums over tokens and heads follow P: "
         "docs/invariance.md); drop --invariant");
  refuse(o.dp == 1,
         cat("--dp ", o.dp,
             " is not supported yet (the indexer's KL and its gradient's scale are summed over "
             "one replica's ranks, not the replicas'); drop --dp"));
  refuse(o.pp == 1,
         cat("--pp ", o.pp, " is not supported (the pipeline runs dense MLA stages); drop --pp"));
  refuse(o.seq_layout == SeqLayout::contiguous,
         cat("--seq-layout ", to_string(o.seq_layout),
             " is not supported (the latent gather of --sp > 1 is contiguous only, "
             "mla/dsa_cp.hpp); drop --seq-layout"));
  refuse(!o.pack_eos,
         "--pack-eos is not supported yet (the single-rank DSA block attends one document per "
         "row); drop --pack-eos");
  refuse(!m.mla_use_output_gate && !m.mla_use_nope,
         "Kimi's output gate and NoPE (mla_use_output_gate, mla_use_nope) are not in the DSA "
         "block; give a config without them");
}
}  // namespace

DsaStage dsa_stage_at(const TrainOptions& o, std::int64_t step) {
  return step <= o.index_warmup ? DsaStage::dense_warmup : DsaStage::sparse;
}

void validate_train_options(const TrainOptions& o, bool checkpoint_writer) {
  o.model.validate();
  check_dsa_options(o);
  check_precision_supports(o.precision, o.attention);
  check_grad_reduce(o.precision, o.grad_reduce);
  LAGA_CHECK(o.sp >= 1, "--sp must be >= 1 (got ", o.sp, ")");
  LAGA_CHECK(o.seq >= o.sp, "--seq ", o.seq, " is shorter than --sp ", o.sp,
             ": every rank needs at least one token");
  LAGA_CHECK(o.batch >= 1, "--batch must be >= 1 (got ", o.batch, ")");
  LAGA_CHECK(o.steps >= 1, "--steps must be >= 1 (got ", o.steps, ")");
  LAGA_CHECK(o.adam.lr > 0, "--lr must be > 0 (got ", o.adam.lr, ")");
  LAGA_CHECK(o.save_every >= 0, "--save-every must be >= 0 (got ", o.save_every, ")");
  LAGA_CHECK(o.save_every == 0 || !o.checkpoint_dir.empty(),
             "--save-every needs --checkpoint DIR to write into");
  LAGA_CHECK(o.val_every >= 0 && o.val_batches >= 1,
             "--val-every must be >= 0 and --val-batches >= 1 (got ", o.val_every, ", ",
             o.val_batches, ")");
  LAGA_CHECK(o.val_every == 0 || !o.val_data.empty(),
             "--val-every needs --val-data FILE, the held-out tokens to evaluate on");
  if (!o.val_data.empty()) {
    LAGA_CHECK(o.val_every > 0, "--val-data needs --val-every N: how often to evaluate");
    (void)TokenSource::file(o.val_data, o.data_dtype, o.model.vocab, o.seq, o.seed, "--val-data");
  }
  check_overlap(o.variant);
  check_train_invariant(o);
  LAGA_CHECK(o.experts == ExpertPlacement::every_rank || o.model.moe,
             "--expert-parallel needs an MoE model: give --config a file with routed experts "
             "(n_routed_experts), e.g. docs/assets/moe_tiny.json");
  LAGA_CHECK(!o.model.moe || o.model.moe->n_routed_experts <= kMaxRoutedExperts, "the model has ",
             o.model.moe ? o.model.moe->n_routed_experts : 0,
             " routed experts per MoE layer (n_routed_experts in --config); laga train takes at "
             "most ",
             kMaxRoutedExperts,
             ": each expert is tensors of its own, so their count alone sets the run's time and "
             "memory (DeepSeek-V3 has 256); give a config with fewer experts");
  LAGA_CHECK(o.expert_degree >= 0, "--ep must be >= 1 (got ", o.expert_degree, ")");
  LAGA_CHECK(o.expert_degree == 0 || o.experts == ExpertPlacement::folded, "--ep ", o.expert_degree,
             " sets the expert-parallel degree; add --expert-parallel");
  check_data_parallel_options(o);
  LAGA_CHECK(o.dp > 1 || o.expert_degree == 0 || o.sp % o.expert_degree == 0, "--ep ",
             o.expert_degree, " must divide --sp ", o.sp,
             " (each EP group is EP consecutive ranks); give --ep a divisor of ", o.sp);
  check_pipeline_options(o);
  const TokenSource source = train_token_source(o);  // data errors before any rank starts
  if (o.pack_eos) {
    const std::int64_t eos = *o.pack_eos;
    LAGA_CHECK(eos >= 0 && eos < o.model.vocab, "--pack-eos ", eos,
               " is not a token id of the vocabulary [0, ", o.model.vocab,
               "); give the tokenizer's end-of-document id (e.g. 50256 for GPT-2) and a --vocab "
               "above it");
    // An id that never occurs packs nothing: every row would be one document,
    // which is the run without --pack-eos. Most likely the wrong id.
    LAGA_CHECK(source.occurrences(static_cast<std::int32_t>(eos)) != 0, "--pack-eos ", eos,
               ": the id never occurs in --data '", o.data,
               "', so no document would end; give the end-of-document id the file was written "
               "with, or drop --pack-eos");
  }
  check_resume(o);
  check_checkpoint_directory(o, checkpoint_writer);
}

std::vector<std::string> prepare_run(const TrainOptions& o) {
  std::vector<std::string> notes;
  if (o.resume.empty()) return notes;
  const CheckpointManifest m = read_checkpoint_manifest(o.resume);
  for (const Change& c : option_changes(m.options, recorded_options(o))) {
    if (c.name == "data-path")
      notes.push_back(c.text() + " (the data's content is the same)");
    else if (free_options().count(c.name))
      notes.push_back(c.text() +
                      " (free to change: the same math, so the run continues up to "
                      "floating-point rounding, not bit for bit)");
    else if (allowed(o, c.name))
      notes.push_back(c.text() + " (allowed by --allow-change)");
  }
  if (!o.checkpoint_dir.empty()) {
    std::string folder;
    const auto moved = set_aside_checkpoints_after(o.checkpoint_dir, m.step, &folder);
    if (!moved.empty())
      notes.push_back(cat("--checkpoint '", o.checkpoint_dir, "' held checkpoints after step ",
                          m.step, " (", joined(moved, ", "),
                          "): they belong to the run this one replaces from that step and were "
                          "moved, not deleted, to '",
                          folder, "'"));
  }
  return notes;
}

SpLayout train_layout(const TrainOptions& o, int ranks) {
  // Pipeline stages each see the whole sequence (sp 1 within a stage); a
  // data-parallel replica its own rows over its ranks / dp.
  const int dp = std::max(1, o.dp);
  return SpLayout::even(o.batch / dp, o.seq, o.model.mla.n_heads, o.pp > 1 ? 1 : ranks / dp,
                        o.seq_layout);
}
}  // namespace laga
