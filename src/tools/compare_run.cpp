// Runs `laga compare`: every form on every rank (or on one rank, dry), steps
// after warm-up, and turns per-rank measurements into per-form results with
// the closed-form predictions beside them.
//
// Each rank measures itself and serialises what it measured into doubles;
// one all-reduce of per-rank slots (zeros elsewhere, so the sums are exact)
// brings every rank's numbers to rank 0 on any backend. That all-reduce is
// bookkeeping, not the block's traffic: the ledger is restored after it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>

#include "comm/dry_run_comm.hpp"
#include "comm/link_model.hpp"
#include "core/error.hpp"
#include "core/threads.hpp"
#include "mla/comm_model.hpp"
#include "mla/device_peak_prediction.hpp"
#include "mla/form_registry.hpp"
#include "mla/runner.hpp"
#include "mla/work_model.hpp"
#include "plan/time_model.hpp"
#include "tools/block_job.hpp"
#include "tools/compare.hpp"
#include "tools/memory_check.hpp"

namespace laga::tools {

namespace {

using Clock = std::chrono::steady_clock;
using Key = std::pair<Phase, std::string>;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Everything one rank measured for one form, flattened into doubles in a
// layout both ends compute from (steps, ledger keys, parameter count): the
// measured steps' times, the last step's report (runner.hpp, pack_report)
// and the agreement with explicit.
struct RankRecord {
  std::vector<double> fwd_ms, bwd_ms, sync_ms, comm_ms;  // measured steps
  RankReport last;                                       // the last step's ledger and memory
  double out = -1, dx = -1, out_ref = 0, dx_ref = 0;     // -1: not computed
  std::vector<double> grad, grad_ref;

  static std::size_t size(int steps, std::size_t keys, std::size_t params) {
    return 4 * static_cast<std::size_t>(steps) + packed_report_size(keys) + 4 + 2 * params;
  }
  void write(double* p, const std::vector<Key>& keys) const {
    for (const auto* v : {&fwd_ms, &bwd_ms, &sync_ms, &comm_ms})
      p = std::copy(v->begin(), v->end(), p);
    pack_report(last, keys, p);
    p += packed_report_size(keys.size());
    for (double x : {out, dx, out_ref, dx_ref}) *p++ = x;
    for (std::size_t i = 0; i < grad.size(); ++i) *p++ = grad[i], *p++ = grad_ref[i];
  }
  static RankRecord read(const double* p, int steps, const std::vector<Key>& keys,
                         std::size_t params) {
    RankRecord r;
    for (auto* v : {&r.fwd_ms, &r.bwd_ms, &r.sync_ms, &r.comm_ms}) {
      v->assign(p, p + steps);
      p += steps;
    }
    r.last = unpack_report(p, keys);
    p += packed_report_size(keys.size());
    for (double* x : {&r.out, &r.dx, &r.out_ref, &r.dx_ref}) *x = *p++;
    r.grad.resize(params), r.grad_ref.resize(params);
    for (std::size_t i = 0; i < params; ++i) r.grad[i] = *p++, r.grad_ref[i] = *p++;
    return r;
  }
};

// Everything every rank needs, fixed before the ranks start.
struct Job {
  const CompareOptions& o;
  std::optional<LinkModel> link;  // --link
  MlaConfig cfg;
  SpLayout layout;
  AttentionKind attention;
  const Documents* documents;      // null: one document per row
  std::vector<FormVariant> order;  // run order: explicit first when present
  std::vector<std::string> param_names;
  int steps, warmup;
  bool diffs;  // agreement with explicit is computed
  bool progress;
  Clock::time_point start;
};

struct Reference {  // this rank's explicit results, for max |diff|
  TensorF out, dx;
  MlaParams<float> grads;
};

void say(const Job& j, const std::string& what, bool always = false) {
  if (!j.progress) return;
  const double t = std::chrono::duration<double>(Clock::now() - j.start).count();
  // Quiet for short runs: a line only once the job has taken a few seconds.
  if (t < 3.0 && !always) return;
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "[%7.1f s] ", t);
  std::cerr << "laga compare: " << stamp << what << "\n" << std::flush;
}

std::string secs(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f s", ms / 1000.0);
  return b;
}

// The forms on this rank, each step through run_rank (the runner every tool
// shares): returns one serialised RankRecord per form of j.order, and the
// (phase, label)s of each form's ledger in the order the block issued them.
std::vector<std::vector<double>> rank_body(Communicator& comm, const Job& j,
                                           const MlaParams<float>& w, const TensorF& x,
                                           const TensorF& dout,
                                           std::vector<std::vector<Key>>& keys) {
  const int r = comm.rank();
  const RopeTable rope = j.o.count_only ? RopeTable::unbacked(j.cfg.rope(), j.layout.seq)
                                        : RopeTable(j.cfg.rope(), j.layout.seq);
  const bool talk = r == 0 || j.o.rank_only >= 0;
  if (j.link) comm.set_link_model(&*j.link);
  MemoryPool ref_pool;  // explicit's results outlive the step that made them
  Reference ref;
  std::vector<std::vector<double>> records;
  keys.assign(j.order.size(), {});
  for (size_t fi = 0; fi < j.order.size(); ++fi) {
    const FormVariant form = j.order[fi];
    RunSpec spec;
    spec.variant = form;
    spec.attention = j.attention;
    spec.documents = j.documents;
    spec.invariant = j.o.invariant;
    spec.device = j.o.device;
    RankRecord rec;
    // One pool for the form's steps: its block cache hands each step the
    // blocks the step before freed (no fresh mapping, no page faults). Each
    // step still measures its own peaks: run_rank resets them at its start,
    // when no tensor of the step before is live. The pool's end releases
    // what its cache kept for this form.
    MemoryPool pool;
    pool.set_count_only(j.o.count_only);
    PoolScope scope(pool);
    const int total = j.warmup + j.steps;
    for (int step = 0; step < total; ++step) {
      const bool measured = step >= j.warmup, last = step == total - 1;
      const std::string name =
          cat(to_string(form), " step ", step + 1, "/", total, measured ? "" : " (warm-up)");
      // Start together, so "the slowest rank's step" is a step, not a skew.
      comm.barrier("compare_step");
      comm.ledger().clear();
      const RankResult<float> res = run_rank(comm, j.cfg, j.layout, rope, w, x, dout, spec);
      const RankReport& rep = res.report;
      if (talk)
        say(j, cat(name, ": forward ", secs(rep.forward_ms), ", backward ", secs(rep.backward_ms),
                   ", gradient all-reduce ", secs(rep.sync_ms)));
      if (measured) {
        rec.fwd_ms.push_back(rep.forward_ms);
        rec.bwd_ms.push_back(rep.backward_ms);
        rec.sync_ms.push_back(rep.sync_ms);
        rec.comm_ms.push_back(rep.comm_ms);
      }
      if (!last) continue;
      rec.last = rep;
      keys[fi] = rep.ledger.order();
      if (j.diffs) {
        if (form.form == reference_form()) {
          PoolScope keep(ref_pool);
          ref.out = res.out.clone(), ref.dx = res.dx.clone();
          ref.grads = res.grads.clone(MemCategory::gradients);
        }
        const Deviation mo = deviation(res.out, ref.out), md = deviation(res.dx, ref.dx);
        rec.out = mo.max_abs, rec.out_ref = mo.ref_max, rec.dx = md.max_abs,
        rec.dx_ref = md.ref_max;
        std::vector<const TensorF*> g;
        ref.grads.for_each([&](const std::string&, const TensorF& t) { g.push_back(&t); });
        std::size_t i = 0;
        res.grads.for_each([&](const std::string&, const TensorF& t) {
          const Deviation d = deviation(t, *g[i++]);
          rec.grad.push_back(d.max_abs);
          rec.grad_ref.push_back(d.ref_max);
        });
      } else {
        rec.grad.assign(j.param_names.size(), -1);
        rec.grad_ref.assign(j.param_names.size(), 0);
      }
    }
    std::vector<double> flat(RankRecord::size(j.steps, keys[fi].size(), j.param_names.size()));
    rec.write(flat.data(), keys[fi]);
    records.push_back(std::move(flat));
  }
  return records;
}

// Every rank of a --count-only job with every rank in this process
// (--comm local): a count-only run's record (its ledger and its pool's peaks,
// no times, no values) depends on the rank only through its class of
// identical ranks (rank_classes, plan/time_model.hpp: what the planner runs
// once per class too), so one DryRunCommunicator run per class stands for
// all its ranks, exactly (a dry rank's ledger and peaks are those of the
// same rank in the group). Running all P as threads instead cost P runs of
// O(P) collectives each, P thread stacks and P ledgers: over 60 s and 3.3 GB
// at P 512 on the tiny preset. The ranks run here are the union over the
// forms of each form's representatives (rank 0 always among them, whose
// ledger keys the report's rows).
struct ClassRecords {
  std::vector<std::vector<double>> records;  // per form: one serialised record per run rank
  std::vector<std::vector<int>> rec_of;      // per form, per rank: its record's index
};
ClassRecords count_by_class(const Job& j, const MlaParams<float>& w, const TensorF& x,
                            const TensorF& dout, std::vector<std::vector<Key>>& keys) {
  const int P = j.layout.ranks;
  // Each rank counted at the OpenMP threads run_group would give it: what a
  // bf16 run's flash workspace holds follows them (the memory model sizes
  // it so too, MemoryModelOptions::threads).
  const OmpThreadsScope threads(threads_per_rank(P));
  std::vector<RankClasses> classes;
  std::vector<int> run;  // the ranks to run, ascending
  for (FormVariant f : j.order) {
    classes.push_back(rank_classes(j.cfg, j.layout, f, j.o.invariant));
    run.insert(run.end(), classes.back().representatives.begin(),
               classes.back().representatives.end());
  }
  std::sort(run.begin(), run.end());
  run.erase(std::unique(run.begin(), run.end()), run.end());
  ClassRecords out;
  out.records.assign(j.order.size(), {});
  out.rec_of.assign(j.order.size(), std::vector<int>(size_t(P)));
  std::map<int, std::vector<std::vector<double>>> mine;  // rank -> its record per form
  for (int r : run) {
    DryRunCommunicator comm(r, P);
    std::vector<std::vector<Key>> k;
    mine[r] = rank_body(comm, j, w, x, dout, k);
    if (r == 0) keys = k;
  }
  for (size_t fi = 0; fi < j.order.size(); ++fi) {
    const RankClasses& c = classes[fi];
    for (int rep : c.representatives) {
      const std::vector<double>& rec = mine.at(rep)[fi];
      out.records[fi].insert(out.records[fi].end(), rec.begin(), rec.end());
    }
    for (int r = 0; r < P; ++r) out.rec_of[fi][size_t(r)] = c.class_of[size_t(r)];
  }
  return out;
}

// Every rank's records on every rank: slot r of a zeroed buffer holds rank
// r's, one all-reduce sums them. Not the block's traffic: the ledger is
// restored afterwards.
std::vector<double> gather_records(Communicator& comm, const std::vector<double>& mine) {
  // Real staging even when the caller's pool is count-only (an MPI rank's
  // main thread under --count-only).
  MemoryPool pool;
  PoolScope scope(pool);
  const Ledger before = comm.ledger();
  const Phase phase = comm.phase();
  const std::size_t n = mine.size();
  std::vector<double> all(n * static_cast<size_t>(comm.size()), 0.0);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(n * comm.rank()));
  comm.set_phase(Phase::grad_sync);
  comm.all_reduce(all.data(), static_cast<std::int64_t>(all.size()), "compare_report");
  comm.ledger() = before;
  comm.set_phase(phase);
  return all;
}

// keys: the (phase, label)s of the form's ledger in issue order (every rank
// issues the same collectives, so every rank's ledger has these keys).
// ranks[i]'s record is recs[rec_of[i]]: one per rank, or one per class of
// identical ranks under --count-only (count_by_class).
FormResult summarise(const Job& j, size_t fi, const std::vector<Key>& keys,
                     const std::vector<RankRecord>& recs, const std::vector<int>& rec_of,
                     const std::vector<int>& ranks) {
  const FormVariant form = j.order[fi];
  FormResult f;
  f.form = form;
  for (int r = 0; r < j.layout.ranks; ++r) {
    const double flops = attention_work(j.cfg, j.layout, form, r, j.documents).flops;
    f.attention_flops_max = r == 0 ? flops : std::max(f.attention_flops_max, flops);
    f.attention_flops_min = r == 0 ? flops : std::min(f.attention_flops_min, flops);
  }
  f.by_label.resize(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    f.by_label[k].phase = keys[k].first;
    f.by_label[k].label = keys[k].second;
  }
  MemoryModelOptions mopt{true, true,
                          process_per_rank(j.o.comm.backend) && j.o.rank_only < 0
                              ? StagingRule::mpi
                              : StagingRule::in_process};
  // The threads the measured ranks ran on (run_records: --rank-only runs its
  // rank alone on every core).
  mopt.threads = j.o.rank_only >= 0 ? hardware_cores() : threads_per_rank(j.o.sp);
  mopt.invariant = j.o.invariant;
  // The closed forms depend on the rank only through its class
  // (rank_classes): computed once per class, not once per rank (each
  // predict_memory is a count-only run of the rank, at P 4096 the bulk of the
  // work).
  const RankClasses classes = rank_classes(j.cfg, j.layout, form, j.o.invariant);
  std::map<int, std::pair<CommPrediction, MemoryPrediction>> by_class;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    const RankRecord& rec = recs[size_t(rec_of[i])];
    const int cls = classes.class_of[size_t(r)];
    if (!by_class.count(cls)) {
      const int rep = classes.representatives[size_t(cls)];
      by_class.emplace(
          cls, std::pair{predict_comm(j.cfg, j.layout, form, rep,
                                      wire_element_bytes(j.o.precision, j.o.grad_reduce, 4), true,
                                      true, j.o.invariant),
                         predict_memory(j.cfg, j.layout, form, j.attention, rep, 4, mopt)});
    }
    const CommPrediction& pred = by_class.at(cls).first;
    std::int64_t sent[3] = {0, 0, 0}, model[3] = {0, 0, 0}, recv = 0;
    for (size_t k = 0; k < keys.size(); ++k) {
      const LedgerEntry& e = rec.last.ledger.entries().at(keys[k]);
      const auto it = pred.find(keys[k]);
      const PredictedBytes p = it == pred.end() ? PredictedBytes{} : it->second;
      LabelRow& row = f.by_label[k];
      row.calls = std::max(row.calls, e.calls);
      row.bytes_sent = std::max(row.bytes_sent, e.bytes_sent);
      row.bytes_received = std::max(row.bytes_received, e.bytes_received);
      row.predicted_sent = std::max(row.predicted_sent, p.sent);
      row.predicted_received = std::max(row.predicted_received, p.received);
      const bool ok = e.calls > 0 && e.bytes_sent == p.sent && e.bytes_received == p.received;
      row.match = row.match && ok;
      f.bytes_match = f.bytes_match && ok;
      const int ph = static_cast<int>(keys[k].first);
      sent[ph] += e.bytes_sent;
      model[ph] += p.sent;
      recv += e.bytes_received;
    }
    // A collective the closed form predicts but the block never issued.
    for (const auto& [k, p] : pred)
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) {
        f.bytes_match = false;
        if (i == 0) f.by_label.push_back({k.first, k.second, 0, 0, 0, p.sent, p.received, false});
      }
    f.sent_forward = std::max(f.sent_forward, sent[0]);
    f.sent_backward = std::max(f.sent_backward, sent[1]);
    f.sent_grad_sync = std::max(f.sent_grad_sync, sent[2]);
    f.sent_total = std::max(f.sent_total, sent[0] + sent[1] + sent[2]);
    f.predicted_forward = std::max(f.predicted_forward, model[0]);
    f.predicted_backward = std::max(f.predicted_backward, model[1]);
    f.predicted_grad_sync = std::max(f.predicted_grad_sync, model[2]);
    f.predicted_total = std::max(f.predicted_total, model[0] + model[1] + model[2]);
    f.received_total = std::max(f.received_total, recv);

    const MemoryPrediction& mp = by_class.at(cls).second;
    if (i == 0 || rec.last.memory.peak_forward_backward > f.peak) {
      f.peak = rec.last.memory.peak_forward_backward;
      f.peak_rank = r;
      f.model_peak = mp.forward_backward;
      f.saved_after_forward = mp.after_forward;
    }
    f.predicted_peak = std::max(f.predicted_peak, mp.forward_backward.bytes);
    const DevicePeakPrediction on_device =
        device_peak_prediction(j.o.device, rec.last.memory.peak_working);
    const DevicePeakPrediction modelled = device_peak_prediction(j.o.device, mp.peak_working);
    f.device_peak = std::max(f.device_peak, on_device.predicted());
    f.predicted_device_peak = std::max(f.predicted_device_peak, modelled.predicted());
    f.device_kept_predicted = modelled.cublaslt_workspace;
    f.peak_activations = std::max(f.peak_activations, rec.last.memory.peak_activations);
    f.predicted_peak_activations = std::max(f.predicted_peak_activations, mp.peak_activations);
    f.peak_comm_buffers = std::max(f.peak_comm_buffers, rec.last.memory.peak_comm_buffers);
    f.predicted_peak_comm_buffers = std::max(f.predicted_peak_comm_buffers, mp.peak_comm_buffers);
    f.peak_grad_sync = std::max(f.peak_grad_sync, rec.last.memory.peak_grad_sync);
    f.predicted_peak_grad_sync = std::max(f.predicted_peak_grad_sync, mp.grad_sync.bytes);
    f.parameters = std::max(f.parameters, rec.last.memory.parameters);
    f.gradients = std::max(f.gradients, rec.last.memory.gradients);
    f.memory_match = f.memory_match &&
                     rec.last.memory.peak_forward_backward == mp.forward_backward.bytes &&
                     rec.last.memory.peak_activations == mp.peak_activations &&
                     rec.last.memory.peak_comm_buffers == mp.peak_comm_buffers &&
                     rec.last.memory.peak_grad_sync == mp.grad_sync.bytes;
    if (mp.forward_backward.bytes > 0)
      f.memory_rel_error = std::max(
          f.memory_rel_error,
          std::abs(double(rec.last.memory.peak_forward_backward - mp.forward_backward.bytes)) /
              double(mp.forward_backward.bytes));
  }

  // Time: the slowest rank of each step, then the median over steps. Its
  // time in collectives is the step's exposed communication: the others
  // also wait there for it, which is skew, not communication.
  std::vector<double> fwd, bwd, sync, step, comm_of_slowest;
  for (int s = 0; s < j.steps; ++s) {
    double a = 0, b = 0, c = 0, t = -1, in_comm = 0;
    for (const RankRecord& rec : recs) {
      a = std::max(a, rec.fwd_ms[s]);
      b = std::max(b, rec.bwd_ms[s]);
      c = std::max(c, rec.sync_ms[s]);
      const double rank_step = rec.fwd_ms[s] + rec.bwd_ms[s] + rec.sync_ms[s];
      if (rank_step > t) t = rank_step, in_comm = rec.comm_ms[s];
    }
    fwd.push_back(a), bwd.push_back(b), sync.push_back(c), step.push_back(t);
    comm_of_slowest.push_back(in_comm);
  }
  f.forward_ms = median(fwd), f.backward_ms = median(bwd), f.sync_ms = median(sync);
  f.comm_ms = median(comm_of_slowest);
  f.step_ms = median(step);
  f.step_ms_all = step;
  if (!j.o.count_only && j.o.rank_only < 0 && f.step_ms > 0)
    f.tokens_per_s = double(j.layout.batch * j.layout.seq) / (f.step_ms / 1000.0);

  if (j.diffs) {
    Agreement a;
    for (const RankRecord& rec : recs) {
      a.out = std::max(a.out, rec.out), a.out_ref = std::max(a.out_ref, rec.out_ref);
      a.dx = std::max(a.dx, rec.dx), a.dx_ref = std::max(a.dx_ref, rec.dx_ref);
    }
    // The worst parameter gradient by |diff| relative to its own scale
    // (synced gradients are the same on every rank; max over ranks anyway).
    double worst = -1;
    for (size_t p = 0; p < j.param_names.size(); ++p) {
      double d = 0, ref = 0;
      for (const RankRecord& rec : recs)
        d = std::max(d, rec.grad[p]), ref = std::max(ref, rec.grad_ref[p]);
      const double rel = ref > 0 ? d / ref : d;
      if (rel > worst) worst = rel, a.grads = d, a.grads_ref = ref, a.worst_grad = j.param_names[p];
    }
    f.agreement = a;
  }
  return f;
}

// The crossover of the query-latent gather (mla/comm_model.hpp) at this
// layout, in words: per local token, what each query exchange sends.
std::string query_latent_note(const MlaConfig& cfg, const SpLayout& lay) {
  const std::int64_t crossover = query_latent_crossover(cfg);
  const std::string rule =
      cat("With heads split evenly the latent gather sends fewer bytes while P rq < H dqk, i.e. "
          "for P < ",
          crossover, " with this config (ceil(", cfg.n_heads, " x ", cfg.qk_head_dim(), " / ",
          cfg.q_lora_rank, ")); from P = ", crossover, " on it stops paying");
  if (lay.ranks == 1)
    return cat("--q-latent: at P = 1 neither query exchange sends a byte. ", rule);
  // The rank where the gather compares worst: the most heads, the fewest
  // per-head rows leaving it.
  int fewer = 0, worst = 0;
  for (int r = 0; r < lay.ranks; ++r) {
    fewer += query_exchange_cost(cfg, lay, r).latent_sends_less() ? 1 : 0;
    if (lay.head_count[std::size_t(r)] > lay.head_count[std::size_t(worst)]) worst = r;
  }
  const QueryExchangeCost c = query_exchange_cost(cfg, lay, worst);
  return cat("--q-latent: laga+q-latent all-gathers the normalised query latent, (P-1) rq = ",
             c.latent_per_token,
             " elements per local token, where laga all-to-alls per-head Q, "
             "(H - H_r) dqk = ",
             c.heads_per_token, " on rank ", worst, " (H_r = ", lay.head_count[std::size_t(worst)],
             "): the latent gather sends ",
             fewer == lay.ranks ? std::string("fewer bytes on every rank")
                                : cat("fewer bytes on ", fewer, " of ", lay.ranks, " ranks"),
             " at this P. ", rule);
}

}  // namespace

std::optional<CompareResult> run_compare(const CompareOptions& o) {
  const auto start = Clock::now();
  CompareResult res;
  res.options = o;
  res.cfg = o.model.load();
  LAGA_CHECK(o.batch >= 1, "--batch ", o.batch, ": need at least 1 sequence");
  LAGA_CHECK(o.sp >= 1, "--sp ", o.sp, ": need at least 1 rank");
  LAGA_CHECK(o.steps >= 1, "--steps ", o.steps, ": need at least 1 measured step");
  LAGA_CHECK(o.warmup >= 0, "--warmup ", o.warmup, ": must be >= 0");
  LAGA_CHECK(o.rank_only < o.sp, "--rank-only ", o.rank_only, " is not a rank of --sp ", o.sp,
             "; ranks are 0 .. ", o.sp - 1);
  LAGA_CHECK(o.rank_only < 0 || o.comm.backend == Backend::local,
             "--rank-only runs one rank alone in "
             "this process on a dry-run communicator; drop --comm mpi (and mpirun)");
  res.layout =
      SpLayout::even(o.batch, o.seq, res.cfg.n_heads, o.sp, parse_seq_layout(o.seq_layout));
  res.forms = form_variants(parse_form_list(o.forms), o.q_latent, o.head_groups, res.cfg,
                            parse_overlap_runs(o.overlap));
  res.attention = parse_attention(o.attention);
  check_precision_supports(o.precision, res.attention);
  check_grad_reduce(o.precision, o.grad_reduce);
  // Every run below, on this thread and on the rank threads it starts.
  const UsePrecision precision(o.precision, o.grad_reduce);
  if (!o.doc_lens.empty()) res.documents = Documents::parse_lengths(o.doc_lens, o.batch, o.seq);
  for (size_t i = 0; i < res.forms.size(); ++i)
    for (size_t k = 0; k < i; ++k)
      LAGA_CHECK(res.forms[i] != res.forms[k], "--forms lists '", to_string(res.forms[i]),
                 "' twice; name each form once");

  Job j{.o = o,
        .link = {},
        .cfg = res.cfg,
        .layout = res.layout,
        .attention = res.attention,
        .documents = res.documents ? &*res.documents : nullptr,
        .order = {},
        .param_names = {},
        .steps = o.steps,
        .warmup = o.warmup,
        .diffs = false,
        .progress = !o.quiet,
        .start = start};
  if (o.count_only) {
    // No kernels run: a step costs nothing and times nothing.
    j.steps = 1, j.warmup = 0;
    res.notes.push_back(
        "--count-only: tensors are accounted but have no storage and no kernel "
        "runs; bytes and memory are exact, values and times are not measured");
  }
  if (o.rank_only >= 0) {
    res.notes.push_back(
        cat("--rank-only ", o.rank_only, ": only rank ", o.rank_only, " of ", o.sp,
            " runs, on a dry-run communicator that records the exact ledger but has no peers: "
            "received blocks are copies of the rank's own data, reductions return its own "
            "contribution. Bytes and memory are exact; outputs are not numerically meaningful, and "
            "the time is this rank alone on all cores, not the group's step (no tokens/s)"));
  }
  if (!o.link.empty()) {
    LAGA_CHECK(!o.count_only && o.rank_only < 0,
               "--link shapes the measured collectives of a real run; drop --count-only and "
               "--rank-only (their bytes do not depend on the link)");
    const LinkSpec spec = parse_link(o.link);
    j.link = LinkModel{spec.bytes_per_s, spec.latency_s.value_or(0.0), Topology::switched};
    res.notes.push_back(cat("--link ", o.link,
                            ": every collective completes no earlier than its "
                            "alpha-beta time at ",
                            spec.bytes_per_s / 1e9, " GB/s per direction and ",
                            j.link->latency_s * 1e6,
                            " us per message (docs/planning.md, the link model)"));
  }
  res.values_meaningful = !o.count_only && (o.rank_only < 0 || o.sp == 1);
  // The reference (FormTraits::reference: explicit) runs first, so the
  // others' max |diff| is against it.
  const Form reference = reference_form();
  for (FormVariant f : res.forms)
    if (f == reference) j.order.push_back(f);
  for (FormVariant f : res.forms)
    if (f != reference) j.order.push_back(f);
  if (o.q_latent) res.notes.push_back(query_latent_note(res.cfg, res.layout));
  for (FormVariant f : res.forms)
    if (const FormSpec& s = form_spec(f.form); s.note)
      res.notes.push_back(s.note(res.cfg, res.layout, f));
  const bool has_explicit = j.order.front() == reference;
  j.diffs = res.values_meaningful && o.rank_only < 0 && has_explicit;
  if (res.values_meaningful && !has_explicit)
    res.notes.push_back(
        cat(to_string(reference), " is not among --forms: no max |diff| against it"));
  for (const auto& [name, shape] : mla_param_shapes(res.cfg)) j.param_names.push_back(name);

  // Count-only holds bookkeeping only, but of every rank: checked too.
  if (o.count_only && o.comm.memory_check) {
    const std::size_t params = j.param_names.size();
    const bool all_here = o.comm.backend == Backend::local && o.rank_only < 0;
    check_memory_fits(predict_count_only_job_memory(
                          res.cfg, res.layout, res.forms, all_here ? o.sp : 1,
                          [&](std::size_t keys) {
                            return std::int64_t(sizeof(double) * RankRecord::size(1, keys, params));
                          },
                          o.invariant),
                      "laga compare");
  }
  // Refuse now, not after an OOM kill, when the run cannot fit.
  std::int64_t param_bytes = 0;
  for (const auto& [name, shape] : mla_param_shapes(res.cfg)) param_bytes += 4 * numel(shape);
  if (!o.count_only && o.comm.memory_check) {
    const std::int64_t io_bytes = 2 * 4 * o.batch * o.seq * res.cfg.dim;  // x, dout
    // Per rank, when agreement is computed: explicit's out, dx and gradients kept.
    const std::int64_t ref_bytes =
        j.diffs ? param_bytes + 2 * 4 * o.batch * res.layout.seq_count[0] * res.cfg.dim : 0;
    check_memory_fits(
        predict_job_memory(res.cfg, res.layout, res.forms, res.attention, o.comm.backend,
                           o.rank_only, param_bytes + io_bytes, ref_bytes, 4, o.invariant),
        "laga compare");
  }

  // Weights, input and upstream gradient: seeded, the same for every form
  // and every backend (and `laga verify`'s for the same --seed).
  MemoryPool data_pool;
  data_pool.set_count_only(o.count_only);
  PoolScope data_scope(data_pool);
  if (!o.count_only && param_bytes > (std::int64_t(1) << 28) && is_reporting_process(o.comm))
    say(j, cat("initialising ", param_bytes / 1000000, " MB of parameters"), true);
  const MlaParams<float> w = random_weights(res.cfg, o.seed);
  const TensorF x = random_tensor({o.batch, o.seq, res.cfg.dim}, o.seed, 1);
  const TensorF dout = random_tensor({o.batch, o.seq, res.cfg.dim}, o.seed, 2);

  std::vector<std::vector<double>> gathered(j.order.size());
  std::vector<std::vector<Key>> keys;  // the reporting rank's ledger keys per form
  // Per form, per measured rank: the index of its record in gathered.
  std::vector<std::vector<int>> rec_of;
  if (o.count_only && o.rank_only < 0 && o.comm.backend == Backend::local) {
    res.threads_per_rank = threads_per_rank(o.sp);  // what run_group would give each rank
    ClassRecords c = count_by_class(j, w, x, dout, keys);
    gathered = std::move(c.records);
    rec_of = std::move(c.rec_of);
    for (int r = 0; r < o.sp; ++r) res.measured_ranks.push_back(r);
  } else if (o.rank_only >= 0) {
    res.threads_per_rank = hardware_cores();
    set_rank_threads(res.threads_per_rank);
    DryRunCommunicator comm(o.rank_only, o.sp);
    gathered = rank_body(comm, j, w, x, dout, keys);
    res.measured_ranks = {o.rank_only};
  } else {
    res.threads_per_rank = threads_per_rank(o.sp);  // what run_group gives each rank
    run_group(o.comm, o.sp, [&](Communicator& comm) {
      std::vector<std::vector<Key>> my_keys;
      std::vector<std::vector<double>> mine = rank_body(comm, j, w, x, dout, my_keys);
      if (comm.rank() == 0) keys = my_keys;
      for (size_t fi = 0; fi < mine.size(); ++fi) {
        std::vector<double> all = gather_records(comm, mine[fi]);
        if (comm.rank() == 0) gathered[fi] = std::move(all);
      }
    });
    for (int r = 0; r < o.sp; ++r) res.measured_ranks.push_back(r);
  }
  if (!is_reporting_process(o.comm)) return std::nullopt;

  for (size_t fi = 0; fi < j.order.size(); ++fi) {
    const std::size_t n = RankRecord::size(j.steps, keys[fi].size(), j.param_names.size());
    std::vector<RankRecord> recs;
    for (size_t i = 0; i < gathered[fi].size() / n; ++i)
      recs.push_back(
          RankRecord::read(gathered[fi].data() + i * n, j.steps, keys[fi], j.param_names.size()));
    std::vector<int> identity(res.measured_ranks.size());
    for (size_t i = 0; i < identity.size(); ++i) identity[i] = int(i);
    res.results.push_back(summarise(j, fi, keys[fi], recs, rec_of.empty() ? identity : rec_of[fi],
                                    res.measured_ranks));
  }
  res.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  return res;
}

}  // namespace laga::tools
