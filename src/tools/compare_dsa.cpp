// laga compare on a DSA config (a config with the index keys; docs/forms.md,
// "DeepSeek Sparse Attention (DSA)"): each DSA form (DsaFormTraits,
// mla/dsa_model.hpp) run on the same seeded weights, input and upstream
// gradient (tools/dsa_job.hpp), per form: the max error of out, dx, every
// gradient (the MLA's and the indexer's), the KL and the selection against
// the single-rank explicit DSA run; bytes per rank from the ledger beside
// the closed form (dsa_predict_comm); and dsa_memory beside the pool's
// measured activation peak, "exact" when every rank's equal (every form the
// engine runs is on pool tensors; "-" for one it does not run). --count-only runs each such form's
// ranks alone under a count-only pool (run_dsa_rank_count_only), at any
// size, without computing: dsa_memory beside the pool's peak, and the
// ledger beside dsa_predict_comm. A form the engine does not run
// (ring_latent) gets its closed forms only, said so on its row.
#include "tools/compare_dsa.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "core/error.hpp"
#include "core/precision.hpp"
#include "tools/block_job.hpp"
#include "tools/dsa_job.hpp"

namespace laga::tools {

namespace {

struct Diff {
  double err = 0, scale = 0;
  void add(const double* a, const double* b, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      err = std::max(err, std::abs(a[i] - b[i]));
      scale = std::max(scale, std::abs(b[i]));
    }
  }
  template <class T>
  void add(const T* a, const T* b, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      err = std::max(err, std::abs(double(a[i]) - double(b[i])));
      scale = std::max(scale, std::abs(double(b[i])));
    }
  }
};

struct DsaFormRow {
  DsaForm form = DsaForm::explicit_form;
  bool ran = false;
  Diff out, dx, grads, kl;
  std::string worst_grad;
  bool idx_equal = false;
  std::int64_t sent = 0, predicted_sent = 0;  // max over ranks
  bool ledger_match = true;                   // every rank, every label
  std::int64_t saved = 0, peak = 0;           // dsa_memory, max over ranks
  std::vector<std::int64_t> rank_peaks;       // dsa_memory's, every rank
  std::int64_t pool_peak = 0;                 // measured, max over ranks
  bool pool_exact = true;                     // every rank's pool peak is dsa_memory's
};

std::string sci(double v) {
  std::ostringstream s;
  s << std::scientific << std::setprecision(1) << v;
  return s.str();
}

// The table on stdout (on stderr when --json - takes stdout) and, with
// --json, the document: the run's shape, whether it computed, and one row
// per form (the count-only run's and the computing run's rows differ).
void emit_dsa_report(const CompareOptions& o, const MlaConfig& cfg, DsaStage stage,
                     const std::string& table, nlohmann::json forms, bool count_only) {
  (o.json != "-" ? std::cout : std::cerr) << table << std::flush;
  if (o.json.empty()) return;
  write_output(o.json, nlohmann::json{{"config", cfg.to_json()},
                                      {"batch", o.batch},
                                      {"seq", o.seq},
                                      {"sp", o.sp},
                                      {"stage", to_string(stage)},
                                      {"count_only", count_only},
                                      {"dsa_forms", std::move(forms)}}
                               .dump(2) +
                           "\n");
}

// --count-only: each form with a count-only run, every rank alone
// (run_dsa_rank_count_only); `all`: the forms without one are listed as
// such, a form named without one is refused (there, by name).
bool run_dsa_count_only(const CompareOptions& o, const MlaConfig& cfg, const SpLayout& layout,
                        const std::vector<DsaForm>& forms, bool all) {
  LAGA_CHECK(o.comm.backend == Backend::local, "--count-only --comm ", to_string(o.comm.backend),
             ": a DSA count-only compare runs every rank alone in this one process (a dry-run "
             "communicator each); drop --comm or use --comm local");
  LAGA_CHECK(o.doc_lens.empty(),
             "--count-only --doc-lens: a DSA count-only compare counts "
             "unpacked rows only; drop --doc-lens");
  const DsaConfig dsa = *DsaConfig::of(cfg);
  const DsaStage stage = DsaStage::sparse;
  const UsePrecision precision(o.precision);
  const RunDtype dtype = o.precision == Precision::bf16 ? RunDtype::bf16 : RunDtype::fp32;
  const WireElementBytes wire = wire_element_bytes(o.precision, GradReduce::fp32, 4);
  std::ostringstream t;
  t << "laga compare (DSA, count-only): " << cfg.summary() << ", B=" << o.batch << " S=" << o.seq
    << ", sp " << o.sp << " (" << layout.describe() << "), " << to_string(o.precision) << ", stage "
    << to_string(stage) << "\n"
    << "each rank alone under a count-only pool on a dry-run communicator, nothing computed: "
       "dsa_memory's activation peak beside the pool's, max over ranks (\"exact\" when equal "
       "on every rank; where the largest is reached), and bytes sent per rank, forward + "
       "backward, the ledger beside dsa_predict_comm\n";
  t << std::left << std::setw(16) << "form" << std::setw(16) << "peak B" << std::setw(16)
    << "pool peak B" << std::setw(8) << "memory" << std::setw(14) << "sent B" << std::setw(14)
    << "closed form" << std::setw(8) << "ledger"
    << "peak at\n";
  nlohmann::json j = nlohmann::json::array();
  for (DsaForm f : forms) {
    if (!dsa_form_runs(f) && all) {
      t << std::setw(16) << to_string(f) << "closed form only (the engine does not run it)\n";
      continue;
    }
    std::int64_t peak = 0, pool_peak = 0, sent = 0, predicted = 0;
    bool exact = true, ledger = true;
    std::string where;
    for (int r = 0; r < layout.ranks; ++r) {
      const DsaMemory m = dsa_memory(cfg, dsa, layout, f, r, dtype, stage);
      const DsaRankLedger l = run_dsa_rank_count_only(cfg, layout, stage, f, r, wire);
      if (m.peak > peak) peak = m.peak, where = m.peak_where;
      pool_peak = std::max(pool_peak, l.pool_peak);
      exact = exact && l.pool_peak == m.peak;
      sent = std::max(sent, l.sent), predicted = std::max(predicted, l.predicted_sent);
      ledger = ledger && l.labels_differing == 0 && l.sent == l.predicted_sent &&
               l.received == l.predicted_received;
    }
    t << std::setw(16) << to_string(f) << std::setw(16) << peak << std::setw(16) << pool_peak
      << std::setw(8) << (exact ? "exact" : "DIFFERS") << std::setw(14) << sent << std::setw(14)
      << predicted << std::setw(8) << (ledger ? "exact" : "DIFFERS") << where << "\n";
    j.push_back({{"form", to_string(f)},
                 {"memory_peak_closed_form", peak},
                 {"memory_peak_pool", pool_peak},
                 {"memory_peak_exact", exact},
                 {"memory_peak_where", where},
                 {"sent_per_rank", sent},
                 {"predicted_sent_per_rank", predicted},
                 {"ledger_equals_closed_form", ledger}});
  }
  emit_dsa_report(o, cfg, stage, t.str(), std::move(j), true);
  return true;
}

}  // namespace

bool run_dsa_compare(const CompareOptions& o, const std::function<bool(const char*)>& given) {
  MlaConfig cfg = o.model.load();
  const std::optional<DsaConfig> dsa = o.model.load_dsa(cfg);
  if (dsa) cfg = dsa->with(cfg);
  // Refused on a dense config here too, before the dense forms run.
  o.fp8.apply(cfg, o.model.source(), "laga compare (every form's backward)");
  if (!dsa) return false;
  const std::string why = cat(o.model.source(),
                              " sets DeepSeek Sparse Attention, whose forms compare runs for "
                              "their agreement, bytes and memory closed form only, and ");
  for (const char* name :
       {"--q-latent", "--head-groups", "--attention", "--invariant", "--rank-only", "--link",
        "--steps", "--warmup", "--csv", "--grad-reduce"})
    LAGA_CHECK(!given(name), name, ": ", why,
               "the DSA forms take no such option (no timing, no dense variants yet); drop ", name);
  LAGA_CHECK(o.overlap == "off", "--overlap ", o.overlap, ": ", why,
             "the DSA forms have no overlapped path; drop --overlap");
  LAGA_CHECK(o.device == Device::cpu, "--device ", to_string(o.device), ": ", why,
             "the DSA forms run on the CPU only; use --device cpu");
  std::vector<DsaForm> forms;
  if (o.forms == "all") {
    forms = all_dsa_forms();
  } else {
    std::istringstream in(o.forms);
    for (std::string name; std::getline(in, name, ',');) forms.push_back(parse_dsa_form(name));
  }
  const SeqLayout seq_layout = parse_seq_layout(o.seq_layout);
  const SpLayout layout = SpLayout::even(o.batch, o.seq, cfg.n_heads, o.sp, seq_layout);
  if (o.count_only) return run_dsa_count_only(o, cfg, layout, forms, o.forms == "all");
  for (DsaForm f : forms)
    if (dsa_form_runs(f)) {
      check_dsa_job(cfg, layout, f);
      check_dsa_job_memory(o.comm, cfg, layout, f, sizeof(float));
    }
  const std::optional<Documents> docs =
      load_documents(o.doc_lens, nullptr, std::string(), o.batch, o.seq);
  const std::vector<std::int64_t> doc_start =
      docs ? docs->doc_starts() : std::vector<std::int64_t>();
  const std::int64_t* ds = docs ? doc_start.data() : nullptr;

  // --dtype bf16: the DSA forms' bf16 mixed precision (docs/forms.md, "DSA
  // in bf16"), the reference too.
  const UsePrecision precision(o.precision);
  const MlaParams<float> w = random_weights<float>(cfg, o.seed);
  const DsaIndexerParams<float> iw = random_indexer_weights<float>(cfg, o.seed);
  const Tensor<float> x = random_tensor<float>({o.batch, o.seq, cfg.dim}, o.seed, 1);
  const Tensor<float> dout = random_tensor<float>({o.batch, o.seq, cfg.dim}, o.seed, 2);
  const bool report = is_reporting_process(o.comm);
  const DsaStage stage = DsaStage::sparse;
  DsaJobOf<float> ref;
  if (report) ref = run_dsa_reference(cfg, w, iw, x, dout, stage, ds);

  std::vector<DsaFormRow> rows;
  for (DsaForm f : forms) {
    DsaFormRow row;
    row.form = f;
    for (int r = 0; r < layout.ranks; ++r) {
      const DsaMemory m =
          dsa_memory(cfg, *dsa, layout, f, r,
                     o.precision == Precision::bf16 ? RunDtype::bf16 : RunDtype::fp32, stage);
      row.saved = std::max(row.saved, m.saved), row.peak = std::max(row.peak, m.peak);
      row.rank_peaks.push_back(m.peak);
      CommPrediction p = dsa_predict_comm(cfg, *dsa, layout, f, r,
                                          wire_element_bytes(o.precision, GradReduce::fp32, 4),
                                          true, false, stage);
      std::int64_t sent = 0;
      for (const auto& [key, b] : p) sent += b.sent;
      row.predicted_sent = std::max(row.predicted_sent, sent);
    }
    if (dsa_form_runs(f)) {
      if (report && !o.quiet)
        std::cerr << "laga compare: running DSA form " << to_string(f) << "\n";
      DsaJobOf<float> job = run_dsa_job(o.comm, cfg, layout, w, iw, x, dout, stage, f, ds);
      if (report) {
        row.ran = true;
        row.out.add(job.out.data(), ref.out.data(), job.out.numel());
        row.dx.add(job.dx.data(), ref.dx.data(), job.dx.numel());
        double worst = -1;
        job.grads.for_each([&](const std::string& name, const Tensor<float>& g) {
          ref.grads.for_each([&](const std::string& n2, const Tensor<float>& want) {
            if (n2 != name) return;
            Diff d;
            d.add(g.data(), want.data(), g.numel());
            if (d.err > worst) worst = d.err, row.worst_grad = name;
            row.grads.add(g.data(), want.data(), g.numel());
          });
        });
        auto mine = job.indexer_grads.named();
        auto theirs = ref.indexer_grads.named();
        for (std::size_t k = 0; k < mine.size(); ++k) {
          Diff d;
          d.add(mine[k].second->data(), theirs[k].second->data(),
                std::int64_t(mine[k].second->size()));
          if (d.err > worst) worst = d.err, row.worst_grad = mine[k].first;
          row.grads.add(mine[k].second->data(), theirs[k].second->data(),
                        std::int64_t(mine[k].second->size()));
        }
        row.kl.add(&job.kl_loss, &ref.kl_loss, 1);
        row.idx_equal = job.idx == ref.idx;
        row.sent = 0;
        for (std::size_t q = 0; q < job.ledgers.size(); ++q) {
          const DsaRankLedger& l = job.ledgers[q];
          row.pool_peak = std::max(row.pool_peak, l.pool_peak);
          row.pool_exact = row.pool_exact && l.pool_peak == row.rank_peaks[q];
          row.sent = std::max(row.sent, l.sent);
          row.ledger_match = row.ledger_match && l.labels_differing == 0 &&
                             l.sent == l.predicted_sent && l.received == l.predicted_received;
        }
      }
    }
    rows.push_back(row);
  }
  if (!report) return true;

  std::ostringstream t;
  t << "laga compare (DSA): " << cfg.summary() << ", B=" << o.batch << " S=" << o.seq << ", sp "
    << o.sp << " (" << layout.describe() << "), " << to_string(o.precision)
    << (o.precision == Precision::bf16
            ? " (bf16 on the wire; the int32 indices and the fp32 KL target at 4 bytes, as "
              "dsa_predict_comm: docs/forms.md, \"DSA in bf16\")"
            : "")
    << ", stage " << to_string(stage) << (docs ? ", documents " + docs->describe() : std::string())
    << ", comm " << to_string(o.comm.backend) << "\n"
    << "agreement: max |diff| against single-rank explicit DSA (--sp 1, the same precision), "
       "with the reference's "
       "max |value|; bytes: sent per rank, forward + backward, max over ranks, the ledger "
       "beside dsa_predict_comm; memory: dsa_memory (saved for backward, peak) and the pool's "
       "measured activation peak, max over ranks, \"exact\" when equal on every rank (\"-\": "
       "a form the engine does not run, dsa_memory its closed form)\n";
  t << std::left << std::setw(16) << "form" << std::setw(20) << "out" << std::setw(20) << "dx"
    << std::setw(34) << "grads (worst)" << std::setw(10) << "KL" << std::setw(5) << "idx"
    << std::setw(12) << "sent B" << std::setw(12) << "closed form" << std::setw(8) << "ledger"
    << std::setw(12) << "saved B" << std::setw(14) << "peak B" << std::setw(14) << "pool peak B"
    << "memory\n";
  nlohmann::json j = nlohmann::json::array();
  for (const DsaFormRow& r : rows) {
    t << std::setw(16) << to_string(r.form);
    if (r.ran) {
      t << std::setw(20) << (sci(r.out.err) + " of " + sci(r.out.scale)) << std::setw(20)
        << (sci(r.dx.err) + " of " + sci(r.dx.scale)) << std::setw(34)
        << (sci(r.grads.err) + " of " + sci(r.grads.scale) + " (" + r.worst_grad + ")")
        << std::setw(10) << sci(r.kl.err) << std::setw(5) << (r.idx_equal ? "=" : "DIFF")
        << std::setw(12) << r.sent;
    } else {
      t << std::setw(20 + 20 + 34 + 10 + 5 + 12) << "closed form only (the engine does not run it)";
    }
    t << std::setw(12) << r.predicted_sent << std::setw(8)
      << (r.ran ? (r.ledger_match ? "exact" : "DIFFERS") : "-") << std::setw(12) << r.saved
      << std::setw(14) << r.peak;
    t << std::setw(14) << (r.ran ? std::to_string(r.pool_peak) : std::string("-"))
      << (r.ran ? (r.pool_exact ? "exact" : "DIFFERS") : "-") << "\n";
    nlohmann::json row = {{"form", to_string(r.form)},
                          {"moves", dsa_form_traits(r.form).moves},
                          {"ran", r.ran},
                          {"predicted_sent_per_rank", r.predicted_sent},
                          {"memory_saved_closed_form", r.saved},
                          {"memory_peak_closed_form", r.peak}};
    if (r.ran) {
      row["max_abs_diff"] = {{"out", r.out.err},     {"dx", r.dx.err},
                             {"grads", r.grads.err}, {"worst_grad", r.worst_grad},
                             {"kl_loss", r.kl.err},  {"idx_equal", r.idx_equal}};
      row["reference_max_abs"] = {{"out", r.out.scale},
                                  {"dx", r.dx.scale},
                                  {"grads", r.grads.scale},
                                  {"kl_loss", r.kl.scale}};
      row["sent_per_rank"] = r.sent;
      row["memory_peak_pool"] = r.pool_peak;
      row["memory_peak_exact"] = r.pool_exact;
      row["ledger_equals_closed_form"] = r.ledger_match;
    }
    j.push_back(row);
  }
  emit_dsa_report(o, cfg, stage, t.str(), std::move(j), false);
  return true;
}

}  // namespace laga::tools
