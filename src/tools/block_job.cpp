#include "tools/block_job.hpp"

#include <cstring>
#include <mutex>
#include <set>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_set.hpp"
#include "mla/exchange.hpp"
#include "tools/memory_check.hpp"

namespace laga::tools {

namespace {
// Copies a tensor made on a rank thread into `pool`, which outlives the rank.
template <class T>
Tensor<T> copy_into(MemoryPool& pool, const Tensor<T>& t) {
  PoolScope scope(pool);
  return t.clone(t.category());
}
}  // namespace

template <class T>
BlockJobOf<T> run_block_job(const CommOptions& comm_opts, const MlaConfig& cfg,
                            const SpLayout& layout, const MlaParams<T>& w, const Tensor<T>& x,
                            const Tensor<T>& dout, const RunSpec& spec) {
  // A DSA config never reaches here: forward and compare run its DSA forms
  // (tools/dsa_job.hpp), ModelOptions::load refuses it elsewhere (accepts_dsa).
  LAGA_CHECK(!cfg.dsa(), "run_block_job: a DSA config reached the dense forms");
  BlockJobOf<T> job;
  MemoryPool& caller_pool = current_pool();
  const RopeTable rope(cfg.rope(), layout.seq);
  std::mutex reports_mutex;
  std::vector<RankReport> reports(static_cast<size_t>(layout.ranks));
  run_group(comm_opts, layout.ranks, [&](Communicator& comm) {
    RankResult<T> res = run_rank(comm, cfg, layout, rope, w, x, dout, spec);
    // Results travel to rank 0 after the measured step (the ledger is a copy).
    const std::int64_t D = cfg.dim;
    Tensor<T> out({layout.batch, layout.seq, D}), dx;
    comm.set_phase(Phase::forward);
    gather_seq(comm, layout, res.out.data(), out.data(), D, "result_gather");
    if (spec.backward) {
      dx = Tensor<T>({layout.batch, layout.seq, D});
      gather_seq(comm, layout, res.dx.data(), dx.data(), D, "result_gather");
    }
    // Every rank's report, so the reporter can show the max over ranks; under
    // MPI the peers' reports exist only on their processes and travel packed.
    const std::vector<LedgerKey> keys = res.report.ledger.order();
    const std::size_t n = packed_report_size(keys.size());
    const int P = comm.size();
    std::vector<double> all(n * static_cast<std::size_t>(P));
    std::vector<std::int64_t> counts(static_cast<std::size_t>(P), static_cast<std::int64_t>(n)),
        displs(static_cast<std::size_t>(P));
    for (int r = 0; r < P; ++r)
      displs[static_cast<std::size_t>(r)] = r * static_cast<std::int64_t>(n);
    pack_report(res.report, keys, all.data() + displs[static_cast<std::size_t>(comm.rank())]);
    comm.all_gather_v(all.data() + displs[static_cast<std::size_t>(comm.rank())],
                      static_cast<std::int64_t>(n), all.data(), counts.data(), displs.data(),
                      "result_gather");
    {
      std::lock_guard<std::mutex> lock(reports_mutex);
      reports[static_cast<std::size_t>(comm.rank())] = res.report;
      if (process_per_rank(comm.backend()))
        for (int r = 0; r < P; ++r)
          if (r != comm.rank())
            reports[static_cast<std::size_t>(r)] =
                unpack_report(all.data() + displs[static_cast<std::size_t>(r)], keys);
    }
    if (comm.rank() == 0) {
      job.out = copy_into(caller_pool, out);
      if (spec.backward) job.dx = copy_into(caller_pool, dx);
      PoolScope scope(caller_pool);
      job.grads = res.grads.clone(MemCategory::gradients);
    }
  });
  job.ranks = std::move(reports);
  return job;
}

void check_block_job_memory(const CommOptions& comm, const MlaConfig& cfg, const SpLayout& layout,
                            const std::vector<FormVariant>& forms, AttentionKind attention,
                            std::int64_t elem_bytes, bool invariant) {
  if (!comm.memory_check) return;
  // Held by the job: the weights, x and dout (B, S, D), and on every rank the
  // gathered global out and dx (B, S, D) for the report.
  const std::int64_t global = elem_bytes * layout.batch * layout.seq * cfg.dim;
  std::int64_t params = 0;
  for (const auto& [name, shape] : mla_param_shapes(cfg)) params += elem_bytes * numel(shape);
  check_memory_fits(predict_job_memory(cfg, layout, forms, attention, comm.backend, -1,
                                       params + 2 * global, 2 * global, elem_bytes, invariant),
                    "this block job");
}

std::optional<Documents> load_documents(const std::string& doc_lens, const SafetensorsFile* in,
                                        const std::string& input_path, std::int64_t batch,
                                        std::int64_t seq) {
  const bool shared = in && in->contains("cu_seqlens");
  const bool per_row = in && in->contains("cu_seqlens.0");
  if (!doc_lens.empty()) {
    LAGA_CHECK(!shared && !per_row, "--doc-lens and the input '", input_path,
               "' both give documents (its cu_seqlens); give them once");
    return Documents::parse_lengths(doc_lens, batch, seq);
  }
  if (!shared && !per_row) return std::nullopt;
  const std::string where = "input '" + input_path + "'";
  LAGA_CHECK(!(shared && per_row), where,
             " holds both 'cu_seqlens' (shared by every row) and 'cu_seqlens.0' (one per row); "
             "keep one spelling");
  std::vector<std::vector<std::int64_t>> rows;
  const auto read_1d = [&](const std::string& name) {
    LAGA_CHECK(in->info(name).shape.size() == 1, where, ": tensor '", name, "' has shape ",
               to_string(in->info(name).shape), "; cu_seqlens is one dimension, [n_docs + 1]");
    return in->read_indices(name);
  };
  if (shared) {
    rows.push_back(read_1d("cu_seqlens"));
    return Documents::from_cu_seqlens(where + ": tensor 'cu_seqlens'", batch, seq, rows);
  }
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::string name = "cu_seqlens." + std::to_string(b);
    LAGA_CHECK(in->contains(name), where, " gives documents per row but has no tensor '", name,
               "'; give cu_seqlens.0 .. cu_seqlens.", batch - 1, " for a batch of ", batch);
    rows.push_back(read_1d(name));
  }
  LAGA_CHECK(!in->contains("cu_seqlens." + std::to_string(batch)), where,
             " has a tensor 'cu_seqlens.", batch, "' but the batch has ", batch,
             " rows; remove the extra rows' documents");
  return Documents::from_cu_seqlens(where + ": tensors 'cu_seqlens.<row>'", batch, seq, rows);
}

template <class T>
MlaParams<T> load_weights(const std::string& path, const MlaConfig& cfg, int layer) {
  // A file, an index or a checkpoint directory; only this layer's tensors
  // are read, from the shards that hold them.
  const SafetensorsSet f = SafetensorsSet::open(path);
  auto w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  static const std::string kPrefix = "model.layers.";
  static const std::string kAttn = ".self_attn.";
  // Every name a parameter may go by, bare (DeepSeek's, HF's).
  std::set<std::string> bare;
  for (const char* name :
       {"wq.weight", "wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv_a.weight",
        "kv_norm.weight", "wkv_b.weight", "wo.weight", "wg.weight"}) {
    bare.insert(name);
    bare.insert(hf_param_name(name, 0).substr(kPrefix.size() + 1 + kAttn.size()));
  }
  if (layer < 0) {  // the layers the file's prefixed attention names hold
    std::set<long long> layers;
    for (const std::string& n : f.names()) {
      if (n.compare(0, kPrefix.size(), kPrefix) != 0) continue;
      const std::size_t dot = n.find(kAttn, kPrefix.size());
      const std::string digits = n.substr(kPrefix.size(), dot - kPrefix.size());
      if (dot == std::string::npos || digits.empty() || digits.size() > 9 ||
          digits.find_first_not_of("0123456789") != std::string::npos ||
          (digits[0] == '0' && digits.size() > 1) || bare.count(n.substr(dot + kAttn.size())) == 0)
        continue;
      layers.insert(std::stoll(digits));
    }
    if (layers.size() > 1) {
      std::string list;
      for (long long l : layers) list += (list.empty() ? "" : ", ") + std::to_string(l);
      fail("weights '", f.path(), "': holds the attention weights of ", layers.size(), " layers (",
           list, ") under model.layers.<i>.self_attn.; pick one with --layer");
    }
    layer = layers.empty() ? 0 : static_cast<int>(*layers.begin());
  }
  // An attention parameter the config has no place for (q_proj beside a
  // query latent, or q_a_proj without one) is another model's: refused, as
  // strict loading refuses it in laga_torch.
  std::set<std::string> used;
  w.for_each([&](const std::string& name, Tensor<T>&) { used.insert(name); });
  for (const std::string& name :
       {std::string("wq.weight"), std::string("wq_a.weight"), std::string("q_norm.weight"),
        std::string("wq_b.weight"), std::string("wg.weight")}) {
    if (used.count(name)) continue;
    const std::string hf = hf_param_name(name, layer);
    const std::string at = kPrefix + std::to_string(layer) + kAttn;
    const std::string why = name == "wg.weight"
                                ? std::string(
                                      "mla_use_output_gate is false: the weights have "
                                      "Kimi K3's output gate; set it true in the config")
                                : cat("q_lora_rank ", cfg.q_lora_rank);
    for (const std::string& n : {name, hf.substr(hf.rfind(kAttn) + kAttn.size()), hf, at + name})
      LAGA_CHECK(!f.contains(n), "weights '", f.path(), "': hold '", n, "' (", name,
                 "), which this config has no place for (", why,
                 "): the weights are another model's; check --config/--preset");
  }
  w.for_each([&](const std::string& name, Tensor<T>& t) {
    const std::string hf = hf_param_name(name, layer);
    const std::string hf_bare = hf.substr(hf.rfind(kAttn) + kAttn.size());
    const std::string at = kPrefix + std::to_string(layer) + kAttn;
    std::vector<std::string> found;
    for (const std::string& n : {name, hf_bare, hf, at + name})
      if (f.contains(n)) found.push_back(n);
    LAGA_CHECK(!found.empty(), "weights '", f.path(), "': no tensor '", name,
               "' (DeepSeek inference name) or '", hf,
               "' (Hugging Face name); the config needs it — check --config/--preset and --layer");
    if (found.size() > 1) {
      std::string list;
      for (std::size_t i = 0; i < found.size(); ++i)
        list += (i == 0 ? "'" : i + 1 == found.size() ? "' and '" : "', '") + found[i];
      fail("weights '", f.path(), "': parameter '", name, "' is there under ", found.size(),
           " names, ", list,
           "'; a file must give each parameter once (two copies may be two "
           "models): remove all but one");
    }
    f.read_into(found[0], t);
  });
  return w;
}

template <class T>
MlaParams<T> random_weights(const MlaConfig& cfg, std::uint64_t seed) {
  auto w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  init_params(w, seed, 0.1);
  return w;
}

template <class T>
Tensor<T> random_tensor(const Shape& shape, std::uint64_t seed, std::uint64_t stream) {
  Tensor<T> t(shape);
  if (t.data()) fill_normal(t.data(), t.numel(), seed, stream, 0, 1.0);
  return t;
}

#define LAGA_INSTANTIATE(T)                                                                        \
  template BlockJobOf<T> run_block_job<T>(const CommOptions&, const MlaConfig&, const SpLayout&,   \
                                          const MlaParams<T>&, const Tensor<T>&, const Tensor<T>&, \
                                          const RunSpec&);                                         \
  template MlaParams<T> load_weights<T>(const std::string&, const MlaConfig&, int);                \
  template MlaParams<T> random_weights<T>(const MlaConfig&, std::uint64_t);                        \
  template Tensor<T> random_tensor<T>(const Shape&, std::uint64_t, std::uint64_t);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga::tools
