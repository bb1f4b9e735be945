// laga verify: every form at every P against the single-rank explicit form on
// the same weights and input: max |diff| of the output, dx and every parameter
// gradient, relative to the reference's largest value. Exits 1 if any is above
// tolerance, or if LAGA at P = 1 is not bit-identical to explicit. With
// --q-latent, laga+q-latent runs beside laga under the same checks.
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "core/precision.hpp"
#include "mla/form_registry.hpp"
#include "mla/ops_bf16.hpp"
#include "tools/block_job.hpp"
#include "tools/commands.hpp"
#include "tools/device_option.hpp"

namespace laga::tools {

namespace {

struct VerifyOptions {
  ModelOptions model;
  CommOptions comm;
  std::string sp = "1,2,3,4,8", forms = "all", attention = "flash", json, doc_lens;
  std::int64_t batch = 2, seq = 61;
  std::uint64_t seed = 0;
  double tol = 1e-5;                // float64 without --tol: 1e-12; bf16: bf16_bound_between_runs
  RunDtype dtype = RunDtype::fp32;  // fp64: every run in double; bf16: mixed precision
  bool q_latent = false;
  bool invariant =
      false;  // --invariant: the mode, and bit-identity across --sp (docs/invariance.md)
  std::string overlap = "off";
  int head_groups = 0;                    // the grid forms (--head-groups); 0: their default rule
  std::string seq_layout = "contiguous";  // --seq-layout: the P-rank runs' shards
  // --device: where the forms run; the reference stays on the CPU.
  Device device = Device::cpu;
};

struct Row {
  std::string form;
  int P;
  std::string layout, worst;
  Deviation out, dx, worst_grad;
  bool ok;
};

template <class T>
void run_verify(const VerifyOptions& o) {
  const MlaConfig cfg = o.model.load();  // protects --config: --json may not be it
  vet_outputs({{"--json", o.json}});
  const std::vector<int> sps = parse_int_list(o.sp, "--sp");
  // The P-rank runs' shards (the reference at P 1 is one range either way).
  const SeqLayout seq_layout = parse_seq_layout(o.seq_layout);
  std::vector<FormVariant> forms = form_variants(parse_form_list(o.forms), o.q_latent,
                                                 o.head_groups, cfg, parse_overlap_runs(o.overlap));
  if (o.invariant && o.forms == "all")  // all: every form offering the mode
    std::erase_if(forms, [](const FormVariant& f) { return !form_spec(f.form).traits.invariant; });
  const std::optional<Documents> docs = load_documents(o.doc_lens, nullptr, "", o.batch, o.seq);
  // The reference form (FormTraits::reference: explicit) on one in-process
  // rank, against which every form is held.
  const Form reference = reference_form();
  // Refuse before allocating anything when a run cannot fit: the reference
  // and every P.
  CommOptions one_rank = o.comm;
  one_rank.backend = Backend::local;
  check_block_job_memory(one_rank, cfg, SpLayout::even(o.batch, o.seq, cfg.n_heads, 1), {reference},
                         parse_attention(o.attention), sizeof(T), o.invariant);
  for (int P : sps)
    check_block_job_memory(o.comm, cfg, SpLayout::even(o.batch, o.seq, cfg.n_heads, P, seq_layout),
                           forms, parse_attention(o.attention), sizeof(T), o.invariant);
  const MlaParams<T> w = random_weights<T>(cfg, o.seed);
  const Tensor<T> x = random_tensor<T>({o.batch, o.seq, cfg.dim}, o.seed, 1);
  const Tensor<T> dout = random_tensor<T>({o.batch, o.seq, cfg.dim}, o.seed, 2);
  RunSpec spec;
  spec.attention = parse_attention(o.attention);
  spec.invariant = o.invariant;
  const bool report = is_reporting_process(o.comm);
  const bool bf16 = o.dtype == RunDtype::bf16;

  // The reference runs on one in-process rank on every process: explicit on
  // the whole batch, or with documents each document alone (unpacked), so
  // that the masks and positions are checked too, not only assumed.
  spec.variant = reference;
  BlockJobOf<T> ref;
  if (docs) {
    BlockRun<T> alone = run_documents_alone(cfg, w, x, dout, *docs, spec);
    ref.out = std::move(alone.out), ref.dx = std::move(alone.dx);
    ref.grads = std::move(alone.grads);
    spec.documents = &*docs;
  } else {
    CommOptions local = o.comm;
    local.backend = Backend::local;
    ref =
        run_block_job(local, cfg, SpLayout::even(o.batch, o.seq, cfg.n_heads, 1), w, x, dout, spec);
  }

  std::vector<Row> rows;
  bool all_ok = true;
  // --invariant: each form's out, dx and gradients at the first P, byte for
  // byte the bar of its later P.
  std::map<std::string, std::vector<unsigned char>> first_bytes;
  const auto bytes_of = [](const BlockJobOf<T>& job) {
    std::vector<unsigned char> b;
    const auto add = [&](const Tensor<T>& t) {
      const auto* p = reinterpret_cast<const unsigned char*>(t.data());
      b.insert(b.end(), p, p + t.numel() * std::int64_t(sizeof(T)));
    };
    add(job.out), add(job.dx);
    job.grads.for_each([&](const std::string&, const Tensor<T>& t) { add(t); });
    return b;
  };
  for (int P : sps) {
    if (o.comm.backend == Backend::mpi && sps.size() > 1)
      fail("--comm mpi runs one P per launch (the MPI world size); pass a single --sp");
    const SpLayout layout = SpLayout::even(o.batch, o.seq, cfg.n_heads, P, seq_layout);
    for (FormVariant f : forms) {
      spec.variant = f;
      spec.device = o.device;
      BlockJobOf<T> job = run_block_job(o.comm, cfg, layout, w, x, dout, spec);
      if (!report) continue;
      Row row{to_string(f),
              P,
              form_spec(f.form).geometry
                  ? cat(layout.describe(), "; ", form_spec(f.form).geometry(layout, f))
                  : layout.describe(),
              "",
              deviation(job.out, ref.out),
              deviation(job.dx, ref.dx),
              {},
              true};
      std::vector<std::pair<std::string, const Tensor<T>*>> mine, theirs;
      job.grads.for_each([&](const std::string& n, const Tensor<T>& t) {
        mine.push_back({n, &t});
      });
      ref.grads.for_each([&](const std::string& n, const Tensor<T>& t) {
        theirs.push_back({n, &t});
      });
      for (size_t i = 0; i < mine.size(); ++i) {
        const Deviation d = deviation(*mine[i].second, *theirs[i].second);
        if (row.worst.empty() || d.relative() > row.worst_grad.relative())
          row.worst = mine[i].first, row.worst_grad = d;
      }
      // Bit-identity (FormTraits::exact_at_one_rank: laga, whose q-latent
      // runs the same GEMMs at P 1, and laga2d, which is laga there;
      // docs/forms.md) holds against the reference on the same batch, not
      // against documents run alone; nor under bf16, which rounds a fresh
      // product and keeps a sum added into its output in fp32, so a form that
      // sums what explicit computes at once (ring_latent's dlat over key
      // blocks) rounds at another place (mla/ops.hpp, "Precision").
      // Nor in the invariant mode: each form sums in its own canonical order
      // there (laga's latent gradient over its heads' columns, explicit's per
      // token), the same bits at every P but not explicit's (docs/invariance.md).
      const bool exact_needed =
          form_spec(f.form).traits.exact_at_one_rank && P == 1 && !docs && !bf16 && !o.invariant;
      const double worst =
          std::max({row.out.relative(), row.dx.relative(), row.worst_grad.relative()});
      row.ok = exact_needed
                   ? (row.out.max_abs == 0 && row.dx.max_abs == 0 && row.worst_grad.max_abs == 0)
                   : worst <= o.tol;
      if (o.invariant) {  // the same bytes as at the first P
        const auto [it, first] = first_bytes.try_emplace(row.form, bytes_of(job));
        if (!first && it->second != bytes_of(job)) {
          row.ok = false;
          row.worst += " (--invariant: bits differ from --sp " + std::to_string(sps[0]) + ")";
        }
      }
      all_ok = all_ok && row.ok;
      rows.push_back(row);
    }
  }
  if (!report) return;

  std::ostringstream t;
  t << "# laga verify: " << cfg.summary() << ", B=" << o.batch << " S=" << o.seq << ", attention "
    << o.attention << ", comm " << to_string(o.comm.backend)
    << (docs ? ", documents " + docs->describe() : std::string()) << "\n"
    << "# reference: " << to_string(reference) << " form on 1 rank"
    << (docs ? ", each document alone" : "")
    << "; |diff| = max over elements, rel = |diff| / max|ref|\n"
    << "# tolerance: rel <= " << o.tol << " (" << float_name(o.dtype) << ")"
    << (docs || bf16 ? ""
                     : ", and " + names_of_forms_with(&FormTraits::exact_at_one_rank) +
                           " at P=1 must be bit-identical (|diff| = 0)")
    << "\n";
  // Columns as wide as their widest entry (laga2d+q-latent+overlap, a P 8
  // grid's shards), one space after.
  std::size_t form_w = 5, shards_w = 7;
  for (const Row& r : rows)
    form_w = std::max(form_w, r.form.size() + 1),
    shards_w = std::max(shards_w, r.layout.size() + 1);
  const int fw = int(form_w), sw = int(shards_w);
  t << std::left << std::setw(fw) << "form" << std::setw(4) << "P" << std::setw(sw) << "shards"
    << std::right << std::setw(11) << "out |diff|" << std::setw(11) << "dx |diff|" << std::setw(12)
    << "grad |diff|" << std::setw(10) << "grad rel"
    << "  " << std::left << std::setw(16) << "worst grad"
    << "status\n";
  for (const Row& r : rows)
    t << std::left << std::setw(fw) << r.form << std::setw(4) << r.P << std::setw(sw) << r.layout
      << std::right << std::scientific << std::setprecision(2) << std::setw(11) << r.out.max_abs
      << std::setw(11) << r.dx.max_abs << std::setw(12) << r.worst_grad.max_abs << std::setw(10)
      << r.worst_grad.relative() << "  " << std::left << std::setw(16) << r.worst
      << (r.ok ? "ok" : "FAIL") << std::defaultfloat << "\n";
  std::cout << t.str() << (all_ok ? "all forms agree\n" : "DISAGREEMENT above tolerance\n");
  if (!o.json.empty()) {
    nlohmann::json j;
    j["config"] = cfg.to_json();
    j["batch"] = o.batch, j["seq"] = o.seq, j["attention"] = o.attention, j["tolerance"] = o.tol;
    j["dtype"] = float_name(o.dtype);
    if (docs) j["doc_lens"] = docs->describe();
    for (const Row& r : rows)
      j["runs"].push_back({{"form", r.form},
                           {"sp", r.P},
                           {"shards", r.layout},
                           {"out_max_abs_diff", r.out.max_abs},
                           {"dx_max_abs_diff", r.dx.max_abs},
                           {"grad_max_abs_diff", r.worst_grad.max_abs},
                           {"worst_grad", r.worst},
                           {"grad_rel_diff", r.worst_grad.relative()},
                           {"ok", r.ok}});
    j["ok"] = all_ok;
    write_output(o.json, j.dump(2) + "\n");
  }
  if (!all_ok) throw CLI::RuntimeError(1);
}

void register_verify_command(CLI::App& app) {
  auto opts = std::make_shared<VerifyOptions>();
  CLI::App* sub = app.add_subcommand(
      "verify",
      "check every form at every P against single-rank explicit (outputs, dx, all gradients)");
  opts->model.add_to(*sub);
  opts->comm.add_to(*sub);
  sub->add_option("--sp", opts->sp, "comma-separated rank counts")->capture_default_str();
  sub->add_option("--forms", opts->forms,
                  cat("comma-separated forms (", form_names(", "), "), or all"))
      ->capture_default_str();
  add_overlap_option(*sub, opts->overlap, FormsRun::each);
  sub->add_flag("--invariant", opts->invariant,
                cat("run in the invariant mode (", names_of_forms_with(&FormTraits::invariant),
                    "; --forms all: those) and require each form's out, dx and gradients to be "
                    "the same bytes at every --sp (docs/invariance.md)"));
  add_q_latent_flag(*sub, opts->q_latent, FormsRun::each);
  add_head_groups_option(*sub, opts->head_groups);
  add_seq_layout_option(*sub, opts->seq_layout);
  add_attention_option(*sub, opts->attention);
  sub->add_option("--batch", opts->batch, "batch")
      ->check(whole_for(1, opts->batch))
      ->capture_default_str();
  sub->add_option("--seq", opts->seq, "sequence length (odd by default: uneven shards)")
      ->check(whole_for(1, opts->seq))
      ->capture_default_str();
  sub->add_option("--doc-lens", opts->doc_lens,
                  "packed sequences: document lengths, rows split by / (5,7/12; one list = every "
                  "row); the reference is then each document alone")
      ->check(kDocLensGiven);
  sub->add_option("--seed", opts->seed, "seed of weights and inputs")
      ->check(whole_for(0, opts->seed))
      ->capture_default_str();
  add_dtype_option(
      *sub, [opts](RunDtype d) { opts->dtype = d; },
      {RunDtype::fp32, RunDtype::bf16, RunDtype::fp64},
      "precision of every run: float32 (the tool's), bf16 (mixed precision: every "
      "GEMM and attention operand rounded to bf16, fp32 sums, in fp32 tensors; flash "
      "only; the reference runs in bf16 too) or float64 (the same kernels in double)")
      ->default_str("fp32");
  sub->add_option("--tol", opts->tol,
                  "relative tolerance (float64 without --tol: 1e-12; bf16: the derived bound of "
                  "two bf16 runs of the block, docs/performance.md)")
      ->check(real_at_least(0))
      ->capture_default_str();
  sub->add_option("--json", opts->json,
                  "also write the results as JSON to this file ('-' for stdout)");
  auto device = std::make_shared<ops::Device>(ops::Device::cpu);
  add_device_option(*sub, device);
  sub->callback([device, opts, sub] {
    require_device(*device, "verify", opts->comm);
    opts->device = *device;
    if (opts->dtype == RunDtype::fp64) {
      // Double rounding, not fp32's, unless the caller chose a tolerance.
      if (sub->count("--tol") == 0) opts->tol = 1e-12;
      run_verify<double>(*opts);
    } else if (opts->dtype == RunDtype::bf16) {
      check_precision_supports(Precision::bf16, parse_attention(opts->attention));
      if (sub->count("--tol") == 0) opts->tol = bf16_bound_between_runs(BlockTensor::gradient);
      const UsePrecision bf16(Precision::bf16);
      run_verify<float>(*opts);
    } else {
      run_verify<float>(*opts);
    }
  });
}

}  // namespace

LAGA_REGISTER_COMMAND(register_verify_command);

}  // namespace laga::tools
