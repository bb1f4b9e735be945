// laga forward: one forward (and optionally backward) of the block on weights
// and an input read from safetensors files, or seeded random ones, written to
// a safetensors file: `out`, and with --backward `dx` and `grad.<name>`. A
// config with DeepSeek Sparse Attention's index keys runs the DSA forms
// (tools/dsa_job.hpp), writing also the indexer's KL loss, its selection
// and its gradients (grad.indexer.<name>).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.hpp"
#include "core/precision.hpp"
#include "io/atomic_file.hpp"
#include "io/safetensors.hpp"
#include "mla/config.hpp"
#include "model/moe_config.hpp"
#include "tools/block_job.hpp"
#include "tools/cli_common.hpp"
#include "tools/commands.hpp"
#include "tools/device_option.hpp"
#include "tools/dsa_job.hpp"

namespace laga::tools {

namespace {

struct ForwardOptions {
  ModelOptions model;
  Fp8Options fp8;  // --index-fp8, --kv-fp8-round-trip
  CommOptions comm;
  std::string weights, input, output, doc_lens;
  bool backward = false, allow_nonfinite = false, q_latent = false;
  bool invariant = false;  // --invariant (docs/invariance.md)
  std::string overlap = "off";
  Device device = Device::cpu;            // --device
  int head_groups = 0;                    // the grid forms (--head-groups); 0: their default rule
  std::string seq_layout = "contiguous";  // --seq-layout
  std::string form = "explicit", attention = "flash";
  // The DSA stage (DsaStage) of a config with the index keys (--dsa-stage).
  std::string dsa_stage = "sparse";
  // float64: the same forms in double (checks other implementations); bf16:
  // float tensors under bf16 mixed precision (core/precision.hpp)
  RunDtype dtype = RunDtype::fp32;
  int sp = 1, layer = 0;
  bool layer_given = false;  // --layer on the command line (else: the file's one layer)
  std::int64_t batch = 1, seq = 128;
  std::uint64_t seed = 0;
  std::set<std::string> given;  // every option given (register_forward_command's callback)
};

// Options given where they would change nothing are refused saying why
// (issue 54, S: --seq and --batch beside --input were ignored, the input's
// x giving both).
void check_options_act(const ForwardOptions& o) {
  const auto given = [&](const char* name) { return o.given.count(name) > 0; };
  for (const char* name : {"--seq", "--batch"})
    LAGA_CHECK(
        !given(name) || o.input.empty(), name, " sizes the random input, and --input '", o.input,
        "' gives x, whose shape [B, S, D] sets the batch and the sequence length; drop ", name);
  LAGA_CHECK(!given("--seed") || o.weights.empty() || o.input.empty(),
             "--seed draws the random weights and input, and --weights and --input give both; "
             "drop --seed");
  LAGA_CHECK(!given("--layer") || !o.weights.empty(),
             "--layer picks a layer's tensors by their Hugging Face names in --weights, and the "
             "weights are random (no --weights); give --weights, or drop --layer");
}

// A config with DeepSeek Sparse Attention's index keys runs the DSA forms
// (tools/dsa_job.hpp); the options that shape only the dense forms' runs
// are refused naming each, and --dsa-stage on a dense config likewise.
void check_dsa_options(const ForwardOptions& o, bool dsa) {
  const auto given = [&](const char* name) { return o.given.count(name) > 0; };
  if (!dsa) {
    LAGA_CHECK(!given("--dsa-stage"), "--dsa-stage picks the DSA indexer's training stage, and ",
               o.model.source(),
               " has no index keys (index_n_heads, index_head_dim, index_topk): it is dense MLA; "
               "drop --dsa-stage or give a DSA config");
    return;
  }
  const std::string why =
      cat(o.model.source(), " sets DeepSeek Sparse Attention, run by the DSA forms (",
          dsa_runnable_form_names(), "), which ");
  LAGA_CHECK(!o.q_latent, "--q-latent: ", why,
             "take no such switch; --form laga_recompute is the DSA form that moves the query "
             "latent");
  LAGA_CHECK(!given("--overlap") || o.overlap == "off", "--overlap on: ", why,
             "have no overlapped path; drop --overlap");
  LAGA_CHECK(!given("--head-groups"), "--head-groups: ", why,
             "have no head groups (laga2d's); drop --head-groups");
  LAGA_CHECK(!o.invariant, "--invariant: ", why,
             "have no invariant mode (docs/invariance.md); drop --invariant");
  LAGA_CHECK(!given("--attention"), "--attention: ", why,
             "attend each query's selected keys with their own sparse kernel, not the dense "
             "forms' eager or flash; drop --attention");
  LAGA_CHECK(o.device == Device::cpu, "--device ", to_string(o.device), ": ", why,
             "run on the CPU only; use --device cpu");
}

// Non-finite values: refused in what is loaded (weights, x, dout), naming
// the tensor and the count, unless --allow-nonfinite; an error at the first
// non-finite output otherwise (out, dx, then the gradients in order), since a
// NaN that reached the output would be written and summed without a word.
template <class T>
void check_finite(const Tensor<T>& t, const std::string& what, bool loaded, bool allow) {
  if (allow) {
    const NonFinite nf = count_nonfinite(t.data(), t.numel());
    if (nf.count != 0)
      std::cerr << "laga forward: warning: " << describe_nonfinite(what, nf, t.numel())
                << " (--allow-nonfinite)\n";
    return;
  }
  refuse_nonfinite(t, what,
                   loaded ? "; fix the file, or pass --allow-nonfinite to run on it anyway"
                          : " although every input is finite; a value inside the block passed "
                            "the type's range (an overflow: check the scale of the weights and "
                            "of x), nothing was written");
}

// A block's outputs checked finite before any is printed or written: out,
// and with backward dx and every grad.<name> (the dense and the DSA jobs).
template <class T, class Grads>
void check_outputs_finite(const Tensor<T>& out, const Tensor<T>& dx, const Grads& grads,
                          bool backward, bool allow) {
  check_finite(out, "output 'out'", false, allow);
  if (!backward) return;
  check_finite(dx, "output 'dx'", false, allow);
  grads.for_each([&](const std::string& name, const Tensor<T>& g) {
    check_finite(g, "output 'grad." + name + "'", false, allow);
  });
}

template <class T>
double checksum(const Tensor<T>& t) {
  double s = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) s += t[i];
  return s;
}

// A config's MoE keys are read (and so validated), never passed over in
// silence: forward runs the attention block, and says where the MoE runs.
void note_moe(const ForwardOptions& o, bool report) {
  if (!o.model.config_path.empty())
    if (const std::optional<MoeConfig> moe =
            MoeConfig::from_json(read_config_json_file(o.model.config_path), o.model.source());
        moe && report)
      std::cerr << "laga forward: note: the config's MoE (" << moe->summary()
                << ") is not run here: forward runs the attention block; `laga moe` runs one "
                   "MoE layer on given weights\n";
}

// --form on a DSA config: a DSA form's name (DsaFormTraits), a dense form's
// refused saying which forms run DSA.
DsaForm parse_dsa_form_option(const ForwardOptions& o) {
  for (DsaForm f : all_dsa_forms())
    if (o.form == to_string(f)) return f;
  fail("--form ", o.form, ": ", o.model.source(),
       " sets DeepSeek Sparse Attention (index keys), and ", o.form,
       " is not a DSA form: a dense form would attend every key, a different model; use one of ",
       dsa_runnable_form_names(), " (docs/forms.md, \"DeepSeek Sparse Attention (DSA)\")");
}
// --form on a dense config: a DSA form's name that is no dense form's
// (explicit and ring_latent are both) is refused saying why.
Form parse_dense_form_option(const ForwardOptions& o) {
  for (Form f : all_forms())
    if (o.form == to_string(f)) return f;
  for (DsaForm f : all_dsa_forms())
    LAGA_CHECK(o.form != to_string(f), "--form ", o.form,
               " is a DeepSeek Sparse Attention form, and ", o.model.source(),
               " has no index keys (index_n_heads, index_head_dim, index_topk): give a DSA "
               "config, or a dense form (",
               form_names(", "), ")");
  return parse_form(o.form);
}

// The DSA forms' forward (tools/dsa_job.hpp): out, dx and every gradient
// (the MLA's LM gradient, the indexer's KL gradient) as the dense forms'
// files name them, the indexer's KL loss and its selection (idx, I64 (B,
// S, index_topk), -1 unused), and every rank's ledger beside its closed
// form (dsa_predict_comm).
template <class T>
void run_dsa_forward(const ForwardOptions& o, const MlaConfig& cfg, DsaForm form,
                     const SpLayout& layout, const MlaParams<T>& w, const Tensor<T>& x,
                     const Tensor<T>& dout, const std::optional<Documents>& docs) {
  const DsaStage stage = parse_dsa_stage(o.dsa_stage);
  const DsaIndexerParams<T> iw =
      o.weights.empty() ? random_indexer_weights<T>(cfg, o.seed)
                        : load_indexer_weights<T>(o.weights, cfg, o.layer_given ? o.layer : -1);
  {
    DsaIndexerParams<T> named = iw;
    for (auto& [name, v] : named.named()) {
      Tensor<T> t({std::int64_t(v->size())});
      std::copy(v->begin(), v->end(), t.data());
      check_finite(t,
                   o.weights.empty() ? "random weight '" + name + "'"
                                     : "weights '" + o.weights + "': tensor '" + name + "'",
                   true, o.allow_nonfinite);
    }
  }
  const std::vector<std::int64_t> doc_start =
      docs ? docs->doc_starts() : std::vector<std::int64_t>();
  const bool report = is_reporting_process(o.comm);
  if (report)
    std::cerr
        << "laga forward: " << cfg.summary() << ", B=" << x.dim(0) << " S=" << x.dim(1)
        << ", DSA form " << to_string(form) << " (moves " << dsa_form_traits(form).moves
        << "), stage " << to_string(stage) << ", " << float_name(o.dtype)
        << (o.dtype == RunDtype::bf16
                ? " (bf16 on the wire; the int32 indices and the fp32 KL target at 4 bytes, as "
                  "dsa_predict_comm: docs/forms.md, \"DSA in bf16\")"
                : "")
        << ", sp " << o.sp << " (" << layout.describe() << "), comm " << to_string(o.comm.backend)
        << (docs ? ", documents " + docs->describe() : std::string()) << "\n";
  note_moe(o, report);
  const auto t0 = std::chrono::steady_clock::now();
  DsaJobOf<T> job = run_dsa_job(o.comm, cfg, layout, w, iw, x, dout, stage, form,
                                docs ? doc_start.data() : nullptr);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!report) return;
  check_outputs_finite(job.out, job.dx, job.grads, o.backward, o.allow_nonfinite);
  Tensor<T> kl({1});
  kl[0] = T(job.kl_loss);
  check_finite(kl, "output 'kl_loss'", false, o.allow_nonfinite);
  std::vector<std::pair<std::string, Tensor<T>>> indexer_grads;
  if (o.backward) {
    for (auto& [name, v] : job.indexer_grads.named()) {
      Tensor<T> t({std::int64_t(v->size())});
      std::copy(v->begin(), v->end(), t.data());
      check_finite(t, "output 'grad." + name + "'", false, o.allow_nonfinite);
      indexer_grads.emplace_back(name, std::move(t));
    }
  }
  std::cout << "out  " << to_string(job.out.shape()) << "  checksum " << checksum(job.out) << "\n";
  if (o.backward)
    std::cout << "dx   " << to_string(job.dx.shape()) << "  checksum " << checksum(job.dx) << "\n";
  std::cout << "kl_loss " << job.kl_loss << " (the indexer's KL, summed over every query row, "
            << to_string(stage) << ")\n";
  // Each rank's ledger beside the closed form: equal label for label, or
  // the count of labels that differ.
  nlohmann::json ledgers = nlohmann::json::array();
  for (std::size_t r = 0; r < job.ledgers.size(); ++r) {
    const DsaRankLedger& l = job.ledgers[r];
    std::cout << "rank " << r << " sent " << l.sent << " B (closed form " << l.predicted_sent
              << "), received " << l.received << " B (closed form " << l.predicted_received << "), "
              << l.labels << " labels, "
              << (l.labels_differing == 0 ? std::string("each equal to dsa_predict_comm")
                                          : cat(l.labels_differing, " differing"))
              << "\n";
    ledgers.push_back({{"rank", r},
                       {"sent", l.sent},
                       {"received", l.received},
                       {"predicted_sent", l.predicted_sent},
                       {"predicted_received", l.predicted_received},
                       {"labels", l.labels},
                       {"labels_differing", l.labels_differing}});
  }
  std::cout << "time " << ms << " ms (wall, " << (o.backward ? "forward+backward" : "forward")
            << ", incl. result gathering)\n";
  if (!o.output.empty()) {
    SafetensorsWriter wr;
    wr.add("out", job.out);
    wr.add("kl_loss", kl);
    wr.add_indices("idx", {x.dim(0), x.dim(1), cfg.index_topk}, job.idx);
    if (o.backward) {
      wr.add("dx", job.dx);
      job.grads.for_each(
          [&](const std::string& name, const Tensor<T>& g) { wr.add("grad." + name, g); });
      for (const auto& [name, t] : indexer_grads) wr.add("grad." + name, t);
    }
    wr.add_metadata("config", cfg.to_json().dump());
    wr.add_metadata("form", to_string(form));
    wr.add_metadata("dsa_stage", to_string(stage));
    wr.add_metadata("dtype", float_name(o.dtype));
    wr.add_metadata("ledger", ledgers.dump());
    if (docs) wr.add_metadata("doc_lens", docs->describe());
    wr.write(o.output);
    std::cout << "wrote " << o.output << "\n";
  }
}

template <class T>
void run_forward(const ForwardOptions& o) {
  check_options_act(o);
  // Inputs are protected from every writer, and the output is vetted now,
  // before the run, rather than found unwritable after it.
  protect_input(o.input, "--input");
  MlaConfig cfg = o.model.load();
  // A DSA preset's indexer is its DsaConfig::preset; a config's, its keys.
  const std::optional<DsaConfig> dsa_keys = o.model.load_dsa(cfg);
  if (dsa_keys) cfg = dsa_keys->with(cfg);
  o.fp8.apply(cfg, o.model.source(), o.backward ? "--backward" : "");
  check_dsa_options(o, cfg.dsa());
  const bool dsa = cfg.dsa();
  const DsaForm dsa_form = dsa ? parse_dsa_form_option(o) : DsaForm::explicit_form;
  protect_weights(o.weights, "--weights");  // the set's index and shards too
  vet_outputs({{"--output", o.output}});
  // The batch's extents, from the input's x when there is one: the documents
  // are checked against them, and the job is refused before allocating
  // anything when it cannot fit.
  // --input is opened once: its extents, documents and tensors all come from
  // the one file.
  std::optional<SafetensorsFile> in;
  if (!o.input.empty()) in = SafetensorsFile::open(o.input);
  std::int64_t B = o.batch, S = o.seq;
  if (in) {
    // x's own extents, checked here so that each message names the file
    // (not --seq or --batch, which an input overrides).
    LAGA_CHECK(in->contains("x"), "input '", o.input, "' has no tensor 'x' (shape [B, S, ", cfg.dim,
               "])");
    const Shape xs = in->info("x").shape;
    LAGA_CHECK(xs.size() == 3 && xs[2] == cfg.dim, "input '", o.input, "': 'x' has shape ",
               to_string(xs), " but the config needs [B, S, ", cfg.dim, "]");
    LAGA_CHECK(xs[0] >= 1, "input '", o.input, "': 'x' has shape ", to_string(xs),
               ": no rows (B = 0); give x at least one sequence");
    LAGA_CHECK(xs[1] >= o.sp, "input '", o.input, "': 'x' has shape ", to_string(xs), ": ", xs[1],
               " tokens per row, fewer than --sp ", o.sp,
               " (every rank needs at least one token); give a longer x or a smaller --sp");
    if (o.backward && in->contains("dout"))
      LAGA_CHECK(in->info("dout").shape == xs, "input '", o.input, "': 'dout' has shape ",
                 to_string(in->info("dout").shape), " but --backward needs x's ", to_string(xs),
                 " (dout is the gradient of a loss with respect to out, which has x's shape)");
    B = xs[0], S = xs[1];
  }
  const std::optional<Documents> docs =
      load_documents(o.doc_lens, in ? &*in : nullptr, o.input, B, S);
  const SeqLayout seq_layout = parse_seq_layout(o.seq_layout);
  FormVariant variant;
  if (dsa) {
    check_dsa_job(cfg, SpLayout::even(B, S, cfg.n_heads, o.sp, seq_layout), dsa_form);
    check_dsa_job_memory(o.comm, cfg, SpLayout::even(B, S, cfg.n_heads, o.sp, seq_layout), dsa_form,
                         sizeof(T));
  } else {
    variant = {parse_dense_form_option(o),
               o.q_latent ? QueryExchange::latent : QueryExchange::heads, o.head_groups,
               parse_overlap(o.overlap)};
    check_variant(cfg, SpLayout::even(B, S, cfg.n_heads, o.sp, seq_layout), variant);
    check_block_job_memory(o.comm, cfg, SpLayout::even(B, S, cfg.n_heads, o.sp, seq_layout),
                           {variant}, parse_attention(o.attention), sizeof(T), o.invariant);
  }
  MlaParams<T> w = o.weights.empty()
                       ? random_weights<T>(cfg, o.seed)
                       : load_weights<T>(o.weights, cfg, o.layer_given ? o.layer : -1);
  Tensor<T> x, dout;
  if (in) {
    const Shape xs = in->info("x").shape;  // checked above
    x = in->read<T>("x", MemCategory::activations);
    if (o.backward && in->contains("dout"))
      dout = in->read<T>("dout", xs, MemCategory::activations);
  } else {
    x = random_tensor<T>({o.batch, o.seq, cfg.dim}, o.seed, 1);
  }
  // Refuse non-finite inputs before running (see check_finite).
  w.for_each([&](const std::string& name, const Tensor<T>& t) {
    check_finite(t,
                 o.weights.empty() ? "random weight '" + name + "'"
                                   : "weights '" + o.weights + "': tensor '" + name + "'",
                 true, o.allow_nonfinite);
  });
  if (!o.input.empty()) {
    check_finite(x, "input '" + o.input + "': tensor 'x'", true, o.allow_nonfinite);
    if (dout.defined())
      check_finite(dout, "input '" + o.input + "': tensor 'dout'", true, o.allow_nonfinite);
  }
  if (o.backward && !dout.defined()) {
    dout = Tensor<T>(x.shape());
    dout.fill(T(1));  // d(sum of out)/d(.)
  }
  const SpLayout layout = SpLayout::even(x.dim(0), x.dim(1), cfg.n_heads, o.sp, seq_layout);
  if (dsa) {
    run_dsa_forward(o, cfg, dsa_form, layout, w, x, dout, docs);
    return;
  }
  RunSpec spec;
  spec.documents = docs ? &*docs : nullptr;
  spec.variant = variant;
  spec.attention = parse_attention(o.attention);
  spec.backward = o.backward;
  spec.invariant = o.invariant;
  spec.device = o.device;
  const bool report = is_reporting_process(o.comm);
  if (report)
    std::cerr << "laga forward: " << cfg.summary() << ", B=" << x.dim(0) << " S=" << x.dim(1)
              << ", form " << describe_variant(variant, layout) << ", attention " << o.attention
              << ", " << float_name(o.dtype) << ", sp " << o.sp << " (" << layout.describe()
              << "), comm " << to_string(o.comm.backend)
              << (docs ? ", documents " + docs->describe() : std::string()) << "\n";
  note_moe(o, report);
  const auto t0 = std::chrono::steady_clock::now();
  BlockJobOf<T> job = run_block_job(o.comm, cfg, layout, w, x, dout, spec);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!report) return;
  // Check what was produced before printing or writing any of it.
  check_outputs_finite(job.out, job.dx, job.grads, o.backward, o.allow_nonfinite);

  std::int64_t peak = 0;
  for (auto& r : job.ranks) peak = std::max(peak, r.memory.peak_working);
  std::cout << "out  " << to_string(job.out.shape()) << "  checksum " << checksum(job.out) << "\n";
  if (o.backward)
    std::cout << "dx   " << to_string(job.dx.shape()) << "  checksum " << checksum(job.dx) << "\n";
  std::cout << "time " << ms << " ms (wall, " << (o.backward ? "forward+backward" : "forward")
            << ", incl. result gathering)\n"
            << "peak activation+comm memory " << peak
            << " bytes per rank (max over ranks, from the pool)\n";
  if (!o.output.empty()) {
    SafetensorsWriter wr;
    wr.add("out", job.out);
    if (o.backward) {
      wr.add("dx", job.dx);
      job.grads.for_each(
          [&](const std::string& name, const Tensor<T>& g) { wr.add("grad." + name, g); });
    }
    wr.add_metadata("config", cfg.to_json().dump());
    wr.add_metadata("form", to_string(variant));
    wr.add_metadata("dtype", float_name(o.dtype));
    if (docs) wr.add_metadata("doc_lens", docs->describe());
    wr.write(o.output);
    std::cout << "wrote " << o.output << "\n";
  }
}

void register_forward_command(CLI::App& app) {
  auto opts = std::make_shared<ForwardOptions>();
  CLI::App* sub = app.add_subcommand(
      "forward",
      "run the block once on given or seeded-random weights and input; write out (and dx, grads)");
  opts->model.add_to(*sub);
  opts->model.accepts_dsa = true;  // a DSA config runs the DSA forms (tools/dsa_job.hpp)
  opts->fp8.add_to(*sub);
  opts->comm.add_to(*sub, /*takes_nccl=*/true);
  sub->add_option("--weights", opts->weights,
                  "the block's weights (DeepSeek or HF names): a .safetensors file, a sharded "
                  "checkpoint's model.safetensors.index.json or its directory; BF16/F16/F32/F64 "
                  "or F8_E4M3 with 128x128 weight_scale_inv");
  sub->add_option("--layer", opts->layer,
                  "layer index for Hugging Face names (model.layers.<i>.self_attn.*); needed "
                  "when the weights hold several layers' attention")
      ->check(whole_for(0, opts->layer))
      ->capture_default_str();
  sub->add_option("--input", opts->input,
                  "safetensors with 'x' [B, S, D] (and 'dout' for --backward)");
  sub->add_option("--output", opts->output, "safetensors to write 'out' (and 'dx', 'grad.<name>')");
  sub->add_option("--doc-lens", opts->doc_lens,
                  "packed sequences: document lengths, rows split by / (5,7/12; one list = every "
                  "row); or cu_seqlens in --input")
      ->check(kDocLensGiven);
  sub->add_flag("--backward", opts->backward, "also run backward (dout from --input, else ones)");
  sub->add_flag("--allow-nonfinite", opts->allow_nonfinite,
                "run on weights or input holding NaN/inf and write non-finite outputs, with a "
                "warning naming each tensor (default: refuse them, naming the tensor and count)");
  sub->add_option("--form", opts->form,
                  cat(form_names(" | "), "; on a DSA config (index keys): ",
                      dsa_runnable_form_names(), " (docs/forms.md, DSA)"))
      ->capture_default_str();
  sub->add_option("--dsa-stage", opts->dsa_stage,
                  "a DSA config's indexer stage: sparse (the main attention over the indexer's "
                  "top-k keys, its KL over them) or dense_warmup (every causal key)")
      ->check(CLI::IsMember({"sparse", "dense_warmup"}))
      ->capture_default_str();
  add_head_groups_option(*sub, opts->head_groups);
  add_seq_layout_option(*sub, opts->seq_layout);
  add_q_latent_flag(*sub, opts->q_latent, FormsRun::one);
  add_overlap_option(*sub, opts->overlap, FormsRun::one);
  add_attention_option(*sub, opts->attention);
  sub->add_flag("--invariant", opts->invariant,
                cat(names_of_forms_with(&FormTraits::invariant),
                    ", flash: the invariant mode -- out, dx and every gradient bit-identical at "
                    "every --sp, uneven and packed, fp32 and bf16 (docs/invariance.md)"));
  add_dtype_option(
      *sub, [opts](RunDtype d) { opts->dtype = d; },
      {RunDtype::fp32, RunDtype::bf16, RunDtype::fp64},
      "precision of the run: float32 (the tool's), bf16 (mixed precision: every GEMM "
      "and attention operand rounded to bf16, fp32 sums; flash only; the file stays "
      "F32, holding bf16 values where a bf16 run stores them, and its metadata says "
      "bf16) or float64 (the same kernels in double; the output file is then F64), to "
      "hold another implementation to the forms exactly")
      ->default_str("fp32");
  sub->add_option("--sp", opts->sp, "sequence-parallel ranks")
      ->check(whole_for(1, opts->sp))
      ->capture_default_str();
  sub->add_option("--batch", opts->batch, "batch when the input is random")
      ->check(whole_for(1, opts->batch))
      ->capture_default_str();
  sub->add_option("--seq", opts->seq, "sequence length when the input is random")
      ->check(whole_for(1, opts->seq))
      ->capture_default_str();
  sub->add_option("--seed", opts->seed, "seed of random weights and input")
      ->check(whole_for(0, opts->seed))
      ->capture_default_str();
  auto device = std::make_shared<ops::Device>(ops::Device::cpu);
  add_device_option(*sub, device);
  sub->callback([device, opts, sub] {
    require_device(*device, "forward", opts->comm);
    opts->device = *device;
    opts->layer_given = sub->count("--layer") > 0;
    opts->given.clear();
    for (const CLI::Option* opt : sub->get_options())
      if (opt->count() > 0 && !opt->get_lnames().empty())
        opts->given.insert("--" + opt->get_lnames().front());
    if (opts->dtype == RunDtype::fp64) {
      run_forward<double>(*opts);
    } else if (opts->dtype == RunDtype::bf16) {
      check_precision_supports(Precision::bf16, parse_attention(opts->attention));
      const UsePrecision bf16(Precision::bf16);
      run_forward<float>(*opts);
    } else {
      run_forward<float>(*opts);
    }
  });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_forward_command);

}  // namespace laga::tools
