#include "tools/dsa_job.hpp"

#include <cmath>
#include <cstring>
#include <mutex>

#include "comm/dry_run_comm.hpp"
#include "comm/local_comm.hpp"
#include "core/error.hpp"
#include "core/precision.hpp"
#include "core/rng.hpp"
#include "io/safetensors_set.hpp"
#include "mla/dsa_cp.hpp"
#include "mla/dsa_explicit.hpp"
#include "mla/dsa_laga.hpp"
#include "mla/exchange.hpp"
#include "tools/memory_check.hpp"

namespace laga::tools {

namespace {

std::size_t z(std::int64_t i) {
  return static_cast<std::size_t>(i);
}

// Rows [s0, s0 + L) of every batch row of a (B, S, W) tensor.
template <class T>
std::vector<T> rows_of(const T* a, std::int64_t B, std::int64_t S, std::int64_t W, std::int64_t s0,
                       std::int64_t L) {
  std::vector<T> out;
  out.reserve(z(B * L * W));
  for (std::int64_t b = 0; b < B; ++b)
    out.insert(out.end(), a + (b * S + s0) * W, a + (b * S + s0 + L) * W);
  return out;
}

// The form's call on this rank's rows: the registry row's runner.
template <class T>
DsaBlockResult<T> run_form(const MlaConfig& cfg, const MlaParams<T>& w,
                           const DsaIndexerParams<T>& iw, const T* x, const T* dout,
                           const SpLayout& layout, DsaStage stage, DsaForm form, Communicator& comm,
                           const std::int64_t* doc_start) {
  switch (form) {
    case DsaForm::latent_gather:
      return dsa_latent_gather(cfg, w, iw, x, dout, layout, stage, comm, doc_start);
    case DsaForm::laga_indices:
    case DsaForm::laga_recompute:
      return dsa_laga(cfg, w, iw, x, dout, layout, stage, form, comm, doc_start);
    case DsaForm::explicit_form:
      return dsa_explicit(cfg, w, iw, x, dout, layout, stage, comm, doc_start);
    case DsaForm::ring_latent:
      break;
  }
  fail("DSA form ", to_string(form), " has no engine runner; run one of ",
       dsa_runnable_form_names());
}

DsaRankLedger ledger_against(const Ledger& ledger, const CommPrediction& p) {
  DsaRankLedger r;
  for (const auto& [key, e] : ledger.entries()) {
    r.sent += e.bytes_sent, r.received += e.bytes_received, ++r.labels;
    const auto it = p.find(key);
    if (it == p.end() || it->second.sent != e.bytes_sent ||
        it->second.received != e.bytes_received || it->second.calls != e.calls)
      ++r.labels_differing;
  }
  for (const auto& [key, pred] : p) {
    r.predicted_sent += pred.sent, r.predicted_received += pred.received;
    if (ledger.entries().count(key) == 0) ++r.labels_differing;
  }
  return r;
}

}  // namespace

std::string dsa_runnable_form_names() {
  std::string names;
  for (DsaForm f : all_dsa_forms())
    if (dsa_form_runs(f)) names += (names.empty() ? "" : ", ") + std::string(to_string(f));
  return names;
}

DsaStage parse_dsa_stage(const std::string& s) {
  for (DsaStage st : {DsaStage::sparse, DsaStage::dense_warmup})
    if (s == to_string(st)) return st;
  fail("--dsa-stage: '", s,
       "' is not a stage; use sparse (the main attention over the indexer's top-k, its KL over "
       "them) or dense_warmup (every causal key, the KL over them)");
}

void check_dsa_job(const MlaConfig& cfg, const SpLayout& layout, DsaForm form) {
  LAGA_CHECK(cfg.dsa(), "a DSA form (", to_string(form),
             ") needs a config with the index keys (index_n_heads, index_head_dim, index_topk)");
  LAGA_CHECK(dsa_form_runs(form), "--form ", to_string(form),
             ": a DSA form costed from its closed form only (`laga plan --dsa`), which the engine "
             "does not run (docs/forms.md, \"DeepSeek Sparse Attention (DSA)\"); run one of ",
             dsa_runnable_form_names());
  LAGA_CHECK(layout.seq_layout == SeqLayout::contiguous, "--seq-layout ",
             to_string(layout.seq_layout),
             ": the DSA forms run contiguous shards only; drop --seq-layout");
}

void check_dsa_job_memory(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                          DsaForm form, std::int64_t elem_bytes) {
  if (!comm.memory_check) return;
  const DsaConfig dsa = *DsaConfig::of(cfg);
  std::int64_t params = dsa.parameter_count(cfg);
  for (const auto& [name, shape] : mla_param_shapes(cfg)) params += numel(shape);
  const std::int64_t global = 4 * layout.batch * layout.seq * cfg.dim;
  const bool all_here = comm.backend == Backend::local;
  std::int64_t ranks = 0, peak = 0;
  for (int r = 0; r < layout.ranks; ++r) {
    const std::int64_t p =
        dsa_memory(cfg, dsa, layout, form, r, elem_bytes == 8 ? RunDtype::fp64 : RunDtype::fp32)
            .peak;
    peak = std::max(peak, p);
    ranks += all_here || r == 0 ? p : 0;
  }
  JobMemory need;
  need.bytes = ranks + elem_bytes * (params + global);
  need.detail = cat(all_here ? layout.ranks : 1, " rank(s) up to ", peak,
                    " bytes each (dsa_memory, a lower bound) + ", elem_bytes * (params + global),
                    " bytes of weights and global tensors");
  need.lower_with = "Lower --seq or --batch, or raise --sp";
  check_memory_fits(need, cat("this DSA job (", to_string(form), ")"));
}

template <class T>
DsaIndexerParams<T> random_indexer_weights(const MlaConfig& cfg, std::uint64_t seed) {
  DsaIndexerParams<T> p = DsaIndexerParams<T>::zeros(cfg);
  std::uint64_t stream = 100;  // random_weights and random_tensor use lower streams
  for (auto& [name, t] : p.named()) {
    const bool norm = name.find("k_norm") != std::string::npos;
    const double fan_in = name == "indexer.wq_b.weight" ? double(cfg.q_lora_rank) : double(cfg.dim);
    const double a = norm ? 0.2 : std::sqrt(3.0 / fan_in);
    fill_uniform(t->data(), std::int64_t(t->size()), seed, ++stream, 0, -a, a);
    if (name == "indexer.k_norm.weight")
      for (T& e : *t) e += T(1);
  }
  return p;
}

template <class T>
DsaIndexerParams<T> load_indexer_weights(const std::string& path, const MlaConfig& cfg, int layer) {
  const SafetensorsSet f = SafetensorsSet::open(path);
  DsaIndexerParams<T> p = DsaIndexerParams<T>::zeros(cfg);
  const std::string hf = "model.layers." + std::to_string(layer < 0 ? 0 : layer) + ".self_attn.";
  for (auto& [name, v] : p.named()) {
    std::vector<std::string> found;
    for (const std::string& n : {name, hf + name})
      if (f.contains(n)) found.push_back(n);
    LAGA_CHECK(!found.empty(), "weights '", f.path(), "': no tensor '", name, "' or '", hf + name,
               "': the config sets DeepSeek Sparse Attention (index_topk ", cfg.index_topk,
               "), whose indexer needs it; give weights with the indexer, or a config without "
               "the index keys");
    LAGA_CHECK(found.size() == 1, "weights '", f.path(), "': parameter '", name,
               "' is there under 2 names, '", found[0], "' and '", found[1],
               "'; a file must give each parameter once: remove one");
    Tensor<T> t({std::int64_t(v->size())}, MemCategory::parameters);
    const Shape& shape = f.info(found[0]).shape;
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    LAGA_CHECK(n == t.numel(), "weights '", f.path(), "': tensor '", found[0], "' has shape ",
               to_string(shape), ", ", n, " elements, but the config's indexer needs ", t.numel(),
               " (index_n_heads ", cfg.index_n_heads, ", index_head_dim ", cfg.index_head_dim,
               ", q_lora_rank ", cfg.q_lora_rank, ", dim ", cfg.dim, ")");
    Tensor<T> read(shape, MemCategory::parameters);
    f.read_into(found[0], read);
    std::memcpy(v->data(), read.data(), v->size() * sizeof(T));
  }
  return p;
}

DsaRankLedger run_dsa_rank_count_only(const MlaConfig& cfg, const SpLayout& layout, DsaStage stage,
                                      DsaForm form, int rank, WireElementBytes wire) {
  check_dsa_job(cfg, layout, form);  // a form the engine runs: on pool tensors
  MemoryPool pool;
  pool.set_count_only(true);
  const PoolScope scope(pool);
  const MlaParams<float> w = MlaParams<float>::zeros(cfg, MemCategory::parameters);
  const DsaIndexerParams<float> iw = DsaIndexerParams<float>::zeros(cfg);
  DryRunCommunicator comm(rank, layout.ranks);
  const float unread = 0;  // count-only: x is not read, dout says that backward runs
  const std::int64_t base = pool.current(MemCategory::activations);
  pool.reset_peaks();
  run_form<float>(cfg, w, iw, nullptr, &unread, layout, stage, form, comm, nullptr);
  DsaRankLedger mine = ledger_against(
      comm.ledger(), dsa_predict_comm(cfg, *DsaConfig::of(cfg), layout, form, rank, wire, true,
                                      /*grad_sync=*/false, stage));
  mine.pool_peak = pool.peak(MemCategory::activations) - base;
  return mine;
}

template <class T>
DsaJobOf<T> run_dsa_job(const CommOptions& comm_opts, const MlaConfig& cfg, const SpLayout& layout,
                        const MlaParams<T>& w, const DsaIndexerParams<T>& iw, const Tensor<T>& x,
                        const Tensor<T>& dout, DsaStage stage, DsaForm form,
                        const std::int64_t* doc_start) {
  check_dsa_job(cfg, layout, form);
  const std::int64_t B = layout.batch, S = layout.seq, D = cfg.dim, K = cfg.index_topk;
  const bool backward = dout.defined();
  const DsaConfig dsa = *DsaConfig::of(cfg);
  DsaJobOf<T> job;
  MemoryPool& caller_pool = current_pool();
  std::mutex mutex;
  job.ledgers.resize(z(layout.ranks));
  run_group(comm_opts, layout.ranks, [&](Communicator& comm) {
    const int r = comm.rank(), P = comm.size();
    const std::int64_t s0 = layout.shard_begin(r), L = layout.seq_count[z(r)];
    const std::vector<T> xr = rows_of(x.data(), B, S, D, s0, L);
    const std::vector<T> dr = backward ? rows_of(dout.data(), B, S, D, s0, L) : std::vector<T>();
    comm.ledger().clear();
    MemoryPool& pool = current_pool();
    const std::int64_t base = pool.current(MemCategory::activations);
    pool.reset_peaks();
    DsaBlockResult<T> res = run_form(cfg, w, iw, xr.data(), backward ? dr.data() : nullptr, layout,
                                     stage, form, comm, doc_start);
    const std::int64_t pool_peak = pool.peak(MemCategory::activations) - base;
    // The form's ledger against its closed form, before the results move,
    // at the run's wire elements (bf16 activations under --dtype bf16).
    const DsaRankLedger mine = ledger_against(
        comm.ledger(),
        dsa_predict_comm(cfg, dsa, layout, form, r,
                         wire_element_bytes(op_precision, op_grad_reduce, sizeof(T)), backward,
                         /*grad_sync=*/false, stage));
    comm.set_phase(Phase::forward);
    // Every rank's ledger summary, for the reporter.
    constexpr int kSlots = 7;
    std::vector<double> all(z(kSlots * P));
    std::vector<std::int64_t> counts(z(P), kSlots), displs(z(P));
    for (int q = 0; q < P; ++q) displs[z(q)] = std::int64_t(q) * kSlots;
    const double own[kSlots] = {double(mine.sent),
                                double(mine.received),
                                double(mine.predicted_sent),
                                double(mine.predicted_received),
                                double(mine.labels),
                                double(mine.labels_differing),
                                double(pool_peak)};
    comm.all_gather_v(own, kSlots, all.data(), counts.data(), displs.data(), "result_gather");
    // The rows, the selection (as doubles: exact), the gradients and the KL.
    Tensor<T> out({B, S, D}), dx;
    gather_seq(comm, layout, res.out.data(), out.data(), D, "result_gather");
    if (backward) {
      dx = Tensor<T>({B, S, D});
      gather_seq(comm, layout, res.dx.data(), dx.data(), D, "result_gather");
    }
    std::vector<double> idx_mine(res.idx.begin(), res.idx.end()), idx_all(z(B * S * K));
    gather_seq(comm, layout, idx_mine.data(), idx_all.data(), K, "result_gather");
    double kl = res.kl_loss;
    comm.all_reduce(&kl, 1, "result_gather");
    if (backward) {
      res.grads.for_each([&](const std::string&, Tensor<T>& g) {
        comm.all_reduce(g.data(), g.numel(), "result_gather");
      });
      for (auto& [name, g] : res.indexer_grads.named())
        comm.all_reduce(g->data(), std::int64_t(g->size()), "result_gather");
    }
    if (r != 0) return;
    std::lock_guard<std::mutex> lock(mutex);
    for (int q = 0; q < P; ++q) {
      const double* a = all.data() + displs[z(q)];
      job.ledgers[z(q)] = {std::int64_t(a[0]), std::int64_t(a[1]), std::int64_t(a[2]),
                           std::int64_t(a[3]), std::int64_t(a[4]), std::int64_t(a[5]),
                           std::int64_t(a[6])};
    }
    PoolScope scope(caller_pool);
    job.out = out.clone(MemCategory::activations);
    if (backward) {
      job.dx = dx.clone(MemCategory::activations);
      job.grads = res.grads.clone(MemCategory::gradients);
      job.indexer_grads = res.indexer_grads;
    }
    job.idx.assign(idx_all.begin(), idx_all.end());
    job.kl_loss = kl;
  });
  return job;
}

template <class T>
DsaJobOf<T> run_dsa_reference(const MlaConfig& cfg, const MlaParams<T>& w,
                              const DsaIndexerParams<T>& iw, const Tensor<T>& x,
                              const Tensor<T>& dout, DsaStage stage,
                              const std::int64_t* doc_start) {
  const std::int64_t B = x.dim(0), S = x.dim(1), D = cfg.dim;
  const SpLayout one = SpLayout::even(B, S, cfg.n_heads, 1);
  std::vector<std::unique_ptr<Communicator>> comms = make_local_communicators(1);
  DsaBlockResult<T> res = dsa_explicit(cfg, w, iw, x.data(), dout.defined() ? dout.data() : nullptr,
                                       one, stage, *comms[0], doc_start);
  DsaJobOf<T> job;
  job.out = Tensor<T>({B, S, D});
  std::memcpy(job.out.data(), res.out.data(), res.out.size() * sizeof(T));
  if (dout.defined()) {
    job.dx = Tensor<T>({B, S, D});
    std::memcpy(job.dx.data(), res.dx.data(), res.dx.size() * sizeof(T));
    job.grads = res.grads.clone(MemCategory::gradients);
    job.indexer_grads = res.indexer_grads;
  }
  job.idx.assign(res.idx.begin(), res.idx.end());
  job.kl_loss = res.kl_loss;
  return job;
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template DsaIndexerParams<T> random_indexer_weights<T>(const MlaConfig&, std::uint64_t);         \
  template DsaIndexerParams<T> load_indexer_weights<T>(const std::string&, const MlaConfig&, int); \
  template DsaJobOf<T> run_dsa_job<T>(const CommOptions&, const MlaConfig&, const SpLayout&,       \
                                      const MlaParams<T>&, const DsaIndexerParams<T>&,             \
                                      const Tensor<T>&, const Tensor<T>&, DsaStage, DsaForm,       \
                                      const std::int64_t*);                                        \
  template DsaJobOf<T> run_dsa_reference<T>(const MlaConfig&, const MlaParams<T>&,                 \
                                            const DsaIndexerParams<T>&, const Tensor<T>&,          \
                                            const Tensor<T>&, DsaStage, const std::int64_t*);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::tools
