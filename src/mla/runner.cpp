#include "mla/runner.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "comm/local_comm.hpp"
#include "core/error.hpp"
#include "mla/form_registry.hpp"
#include "mla/op_table.hpp"
#include "mla/ops.hpp"

namespace laga {

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

namespace {

// Every scalar field of a report, in one order, for packing and unpacking.
template <class Report, class F>
void report_fields(Report& r, F&& f) {
  f(r.forward_ms), f(r.backward_ms), f(r.sync_ms), f(r.comm_ms);
  auto& m = r.memory;
  f(m.peak_activations), f(m.peak_comm_buffers), f(m.peak_working), f(m.peak_forward_backward);
  f(m.peak_grad_sync), f(m.after_forward), f(m.gradients), f(m.parameters);
}
template <class Entry, class F>
void entry_fields(Entry& e, F&& f) {
  f(e.calls), f(e.bytes_sent), f(e.bytes_received), f(e.measured_sent), f(e.measured_received);
}
// A byte count travels as two doubles (its high and low 32 bits), so it stays
// exact beyond 2^53 (eager probabilities at S = 10^8 are ~10^17 bytes).
template <class V>
constexpr std::size_t doubles_of() {
  return std::is_same_v<V, double> ? 1 : 2;
}
// The doubles a packed report's scalars (the rank, then report_fields) and
// one ledger entry take, counted from the field lists themselves.
std::size_t report_doubles() {
  static const std::size_t n = [] {
    RankReport r;
    std::size_t c = 1;
    report_fields(r, [&](const auto& v) { c += doubles_of<std::decay_t<decltype(v)>>(); });
    return c;
  }();
  return n;
}
std::size_t entry_doubles() {
  LedgerEntry e;
  std::size_t c = 0;
  entry_fields(e, [&](const auto& v) { c += doubles_of<std::decay_t<decltype(v)>>(); });
  return c;
}
void put(double*& out, double v) {
  *out++ = v;
}
void put(double*& out, std::int64_t v) {
  *out++ = static_cast<double>(v >> 32);
  *out++ = static_cast<double>(v & 0xffffffff);
}
void get(const double*& in, double& v) {
  v = *in++;
}
void get(const double*& in, std::int64_t& v) {
  const auto hi = static_cast<std::int64_t>(in[0]), lo = static_cast<std::int64_t>(in[1]);
  in += 2;
  v = static_cast<std::int64_t>(static_cast<std::uint64_t>(hi) << 32) + lo;
}

}  // namespace

std::size_t packed_report_size(std::size_t keys) {
  return report_doubles() + entry_doubles() * keys;
}

void pack_report(const RankReport& report, const std::vector<LedgerKey>& keys, double* out) {
  *out++ = report.rank;
  report_fields(report, [&](const auto& v) { put(out, v); });
  for (const LedgerKey& k : keys) {
    const auto it = report.ledger.entries().find(k);
    LAGA_CHECK(it != report.ledger.entries().end(), "pack_report: rank ", report.rank,
               " issued no collective '", k.second, "' in phase ", to_string(k.first),
               " but the reporting rank did; the ranks ran different sequences");
    entry_fields(it->second, [&](const auto& v) { put(out, v); });
  }
}

RankReport unpack_report(const double* in, const std::vector<LedgerKey>& keys) {
  RankReport r;
  r.rank = static_cast<int>(*in++);
  report_fields(r, [&](auto& v) { get(in, v); });
  for (const LedgerKey& k : keys) {
    LedgerEntry e;
    entry_fields(e, [&](auto& v) { get(in, v); });
    r.ledger.record_entry(k.first, k.second, e);
  }
  return r;
}

template <class T>
Deviation deviation(const Tensor<T>& a, const Tensor<T>& ref) {
  LAGA_CHECK(a.shape() == ref.shape(), "deviation: shapes ", to_string(a.shape()), " and ",
             to_string(ref.shape()), " differ");
  Deviation d;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double diff = std::abs(double(a[i]) - double(ref[i]));
    d.max_abs = std::isfinite(diff) ? std::max(d.max_abs, diff) : INFINITY;
    d.ref_max = std::max(d.ref_max, std::abs(double(ref[i])));
  }
  return d;
}

template <class T>
Tensor<T> shard_of(const Tensor<T>& g, const SpLayout& lay, int r) {
  const std::int64_t B = g.dim(0), S = g.dim(1), W = g.dim(2);
  LAGA_CHECK(S == lay.seq && B == lay.batch, "shard_of: a (", B, ", ", S,
             ", .) tensor for a layout of (B ", lay.batch, ", S ", lay.seq, ")");
  const std::int64_t count = lay.seq_count[static_cast<size_t>(r)];
  Tensor<T> s({B, count, W});
  if (s.data() && g.data())
    for (std::int64_t b = 0; b < B; ++b) {
      std::int64_t row = 0;
      for (const TokenRange& t : lay.seq_ranges[static_cast<size_t>(r)]) {
        std::memcpy(s.data() + (b * count + row) * W, g.data() + (b * S + t.begin) * W,
                    sizeof(T) * static_cast<size_t>(t.size() * W));
        row += t.size();
      }
    }
  return s;
}

template <class T>
void place_shard(Tensor<T>& g, const Tensor<T>& s, const SpLayout& lay, int r) {
  const std::int64_t B = g.dim(0), S = g.dim(1), W = g.dim(2), count = s.dim(1);
  if (s.data() && g.data())
    for (std::int64_t b = 0; b < B; ++b) {
      std::int64_t row = 0;
      for (const TokenRange& t : lay.seq_ranges[static_cast<size_t>(r)]) {
        std::memcpy(g.data() + (b * S + t.begin) * W, s.data() + (b * count + row) * W,
                    sizeof(T) * static_cast<size_t>(t.size() * W));
        row += t.size();
      }
    }
}

static void check_invariant(const RunSpec& spec, const SpLayout& layout) {
  const FormSpec& f = form_spec(spec.variant.form);
  std::string offering;
  for (Form g : all_forms())
    if (form_spec(g).traits.invariant)
      offering += std::string(offering.empty() ? "" : ", ") + form_spec(g).name;
  LAGA_CHECK(f.traits.invariant, "--invariant: form ", f.name,
             " does not offer the invariant mode (docs/invariance.md, \"Which forms\" says why); "
             "use --form ",
             offering, ", or drop --invariant");
  LAGA_CHECK(spec.variant.queries == QueryExchange::heads && spec.variant.overlap == Overlap::off,
             "--invariant: form ", to_string(spec.variant),
             " has no invariant path for --q-latent or --overlap on; drop them with --invariant");
  LAGA_CHECK(spec.attention == AttentionKind::flash,
             "--invariant needs --attention flash (the eager kernel's GEMMs are not the "
             "invariant mode's)");
  LAGA_CHECK(op_grad_reduce == GradReduce::fp32,
             "--invariant sums the gradients in fp32: drop --grad-reduce bf16");
  LAGA_CHECK(
      spec.device == Device::cpu, "--invariant runs on the CPU: the ", to_string(spec.device),
      " backend has no invariant kernels (docs/invariance.md); drop --invariant or --device");
  LAGA_CHECK(layout.rank_major_is_sequence(),
             "--invariant needs contiguous sequence shards (each rank one range of the sequence)");
}

namespace {

// The block on one rank from its shards (x_loc, dout_loc), under the current
// pool (the host's, or the rank's device pool) and on op_device.
template <class T>
RankResult<T> run_block(Communicator& comm, const MlaConfig& cfg, const SpLayout& layout,
                        const RopeTable& rope, const MlaParams<T>& w, Tensor<T>& x_loc,
                        Tensor<T>& dout_loc, const RunSpec& spec) {
  const BlockContext ctx{cfg, layout, comm, rope, spec.variant, spec.attention, spec.documents};
  RankResult<T> res;
  res.report.rank = comm.rank();
  MemoryPool& pool = current_pool();
  res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);

  const std::int64_t base_act = pool.current(MemCategory::activations);
  const std::int64_t base_comm = pool.current(MemCategory::comm_buffers);
  RankMemory& m = res.report.memory;
  pool.reset_peaks();
  pool.set_stage("forward");
  MlaSaved<T> saved;
  const double comm_before = comm.seconds_in_collectives();
  auto t0 = std::chrono::steady_clock::now();
  mla_forward(ctx, w, x_loc, res.out, saved);
  res.report.forward_ms = ms_since(t0);
  m.after_forward = pool.current(MemCategory::activations) - base_act;
  if (spec.backward) {
    pool.set_stage("backward");
    t0 = std::chrono::steady_clock::now();
    mla_backward(ctx, w, x_loc, dout_loc, saved, res.dx, res.grads);
    res.report.backward_ms = ms_since(t0);
  }
  // Forward+backward peaks first; the gradient all-reduce is its own stretch.
  m.peak_activations = pool.peak(MemCategory::activations) - base_act;
  m.peak_comm_buffers = pool.peak(MemCategory::comm_buffers) - base_comm;
  m.peak_forward_backward = pool.peak_working() - base_act - base_comm;
  m.forward_backward_live = pool.working_peak_snapshot();
  if (spec.backward && spec.grad_sync) {
    pool.reset_peaks();
    pool.set_stage("grad_sync");
    t0 = std::chrono::steady_clock::now();
    mla_sync_gradients(comm, res.grads);
    res.report.sync_ms = ms_since(t0);
    m.peak_activations =
        std::max(m.peak_activations, pool.peak(MemCategory::activations) - base_act);
    m.peak_comm_buffers =
        std::max(m.peak_comm_buffers, pool.peak(MemCategory::comm_buffers) - base_comm);
    m.peak_grad_sync = pool.peak_working() - base_act - base_comm;
    m.grad_sync_live = pool.working_peak_snapshot();
  }
  pool.set_stage("");
  res.report.comm_ms = (comm.seconds_in_collectives() - comm_before) * 1e3;
  m.peak_working = std::max(m.peak_forward_backward, m.peak_grad_sync);
  m.gradients = pool.current(MemCategory::gradients);
  w.for_each([&](const std::string&, const Tensor<T>& t) { m.parameters += t.bytes(); });
  res.report.ledger = comm.ledger();
  return res;
}

// The block's boundary with a device: host tensors copied into tensors of
// the current (device) pool, and back into the host pool `host`.
template <class T>
Tensor<T> upload(DeviceMemory& mem, const Tensor<T>& t, const char* name, MemCategory cat) {
  if (!t.defined()) return {};
  Tensor<T> d(t.shape(), name, cat);
  if (d.data() && t.data()) mem.to_device(d.data(), t.data(), t.bytes());
  return d;
}
template <class T>
Tensor<T> download(DeviceMemory& mem, MemoryPool& host, const Tensor<T>& d) {
  if (!d.defined()) return {};
  const PoolScope on_host(host);
  Tensor<T> t(d.shape(), d.category());
  if (d.data() && t.data()) mem.to_host(t.data(), d.data(), d.bytes());
  return t;
}
template <class T>
void copy_params(MlaParams<T>& dst, const MlaParams<T>& src,
                 void (DeviceMemory::*copy)(void*, const void*, std::int64_t), DeviceMemory& mem) {
  std::vector<Tensor<T>*> to;
  dst.for_each([&](const std::string&, Tensor<T>& t) { to.push_back(&t); });
  std::size_t i = 0;
  src.for_each([&](const std::string&, const Tensor<T>& t) {
    Tensor<T>& d = *to[i++];
    if (d.data() && t.data()) (mem.*copy)(d.data(), t.data(), t.bytes());
  });
}

}  // namespace

template <class T>
RankResult<T> run_rank(Communicator& comm, const MlaConfig& cfg, const SpLayout& layout,
                       const RopeTable& rope, const MlaParams<T>& w, const Tensor<T>& x,
                       const Tensor<T>& dout, const RunSpec& spec) {
  const int r = comm.rank();
  if (spec.timeout.count() > 0) comm.set_timeout(spec.timeout);
  if (spec.invariant) check_invariant(spec, layout);
  const ops::UseInvariant invariant(spec.invariant);
  Tensor<T> x_loc = shard_of(x, layout, r);
  Tensor<T> dout_loc;
  if (spec.backward) dout_loc = shard_of(dout, layout, r);
  if (spec.device == Device::cpu)
    return run_block(comm, cfg, layout, rope, w, x_loc, dout_loc, spec);

  // On a device: its pool, counting (or, count-only, only counting) as the
  // host's does, with the host pool's settings.
  DeviceMemory* mem = device_memory(spec.device);
  LAGA_CHECK(mem, "run_rank on ", to_string(spec.device),
             ": this process has no memory for that device (a CUDA run registers it: "
             "cuda::register_cuda_memory)");
  MemoryPool& host = current_pool();
  MemoryPool device_pool;
  device_pool.set_device_memory(mem);
  device_pool.set_count_only(host.count_only());
  device_pool.set_live_tracking(host.live_tracking());
  device_pool.set_storage_tracking(host.storage_tracking());
  RankResult<T> res;
  {
    const PoolScope on_device(device_pool);
    const ops::UseDevice kernels_on(spec.device);
    MlaParams<T> w_dev = MlaParams<T>::zeros(cfg, MemCategory::parameters);
    copy_params(w_dev, w, &DeviceMemory::to_device, *mem);
    Tensor<T> x_dev = upload(*mem, x_loc, "x (rank shard)", MemCategory::activations);
    Tensor<T> dout_dev = upload(*mem, dout_loc, "dout (rank shard)", MemCategory::activations);
    RankResult<T> on_dev = run_block(comm, cfg, layout, rope, w_dev, x_dev, dout_dev, spec);
    res.report = on_dev.report;
    res.out = download(*mem, host, on_dev.out);
    res.dx = download(*mem, host, on_dev.dx);
    {
      const PoolScope on_host(host);
      res.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
    }
    copy_params(res.grads, on_dev.grads, &DeviceMemory::to_host, *mem);
  }
  return res;
}

template <class T>
BlockRun<T> run_local(const MlaConfig& cfg, const SpLayout& layout, const MlaParams<T>& w,
                      const Tensor<T>& x, const Tensor<T>& dout, const RunSpec& spec) {
  const int P = layout.ranks;
  const RopeTable rope(cfg.rope(), layout.seq);
  std::vector<MemoryPool> pools(static_cast<size_t>(P));
  std::vector<RankResult<T>> results(static_cast<size_t>(P));
  LocalRunOptions opts;
  opts.pools = &pools;
  opts.timeout = spec.timeout;
  opts.deferred_delivery_for_testing = spec.deferred_delivery_for_testing;
  // Ranks on one device exchange its buffers (the device-local transport).
  opts.device = device_memory(spec.device);
  run_local_ranks(
      P,
      [&](Communicator& comm) {
        results[static_cast<size_t>(comm.rank())] =
            run_rank(comm, cfg, layout, rope, w, x, dout, spec);
      },
      opts);
  BlockRun<T> run;
  run.out = Tensor<T>(x.shape());
  if (spec.backward) run.dx = Tensor<T>(x.shape());
  for (int r = 0; r < P; ++r) {
    auto& res = results[static_cast<size_t>(r)];
    place_shard(run.out, res.out, layout, r);
    if (spec.backward) place_shard(run.dx, res.dx, layout, r);
    run.ranks.push_back(res.report);
  }
  // Rank 0's tensors belong to its pool, which ends here: copy them out.
  run.grads = results[0].grads.clone(MemCategory::gradients);
  return run;
}

namespace {
// Row b's tokens [t0, t0 + n) of a (B, S, W) tensor as (1, n, W), and back.
template <class T>
Tensor<T> row_tokens(const Tensor<T>& g, std::int64_t b, std::int64_t t0, std::int64_t n) {
  const std::int64_t S = g.dim(1), W = g.dim(2);
  Tensor<T> part({1, n, W}, g.category());
  std::memcpy(part.data(), g.data() + (b * S + t0) * W, sizeof(T) * static_cast<size_t>(n * W));
  return part;
}
template <class T>
void place_row_tokens(Tensor<T>& g, const Tensor<T>& part, std::int64_t b, std::int64_t t0) {
  const std::int64_t S = g.dim(1), W = g.dim(2);
  std::memcpy(g.data() + (b * S + t0) * W, part.data(),
              sizeof(T) * static_cast<size_t>(part.numel()));
}
}  // namespace

template <class T>
BlockRun<T> run_documents_alone(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& x,
                                const Tensor<T>& dout, const Documents& docs, RunSpec spec) {
  const std::int64_t B = x.dim(0), S = x.dim(1);
  LAGA_CHECK(docs.batch() == B && docs.seq() == S, "documents for (B ", docs.batch(), ", S ",
             docs.seq(), ") given with an input of (B ", B, ", S ", S, ")");
  spec.documents = nullptr;
  BlockRun<T> ref;
  ref.out = Tensor<T>(x.shape());
  if (spec.backward) ref.dx = Tensor<T>(x.shape());
  ref.grads = MlaParams<T>::zeros(cfg, MemCategory::gradients);
  std::vector<Tensor<T>*> sums;
  ref.grads.for_each([&](const std::string&, Tensor<T>& g) { sums.push_back(&g); });
  for (std::int64_t b = 0; b < B; ++b) {
    const std::vector<std::int64_t>& cu = docs.cu_seqlens(b);
    for (std::size_t k = 0; k + 1 < cu.size(); ++k) {
      const std::int64_t t0 = cu[k], n = cu[k + 1] - cu[k];
      const BlockRun<T> one =
          run_local(cfg, SpLayout::even(1, n, cfg.n_heads, 1), w, row_tokens(x, b, t0, n),
                    spec.backward ? row_tokens(dout, b, t0, n) : Tensor<T>(), spec);
      place_row_tokens(ref.out, one.out, b, t0);
      if (!spec.backward) continue;
      place_row_tokens(ref.dx, one.dx, b, t0);
      std::size_t i = 0;
      one.grads.for_each([&](const std::string&, const Tensor<T>& g) {
        Tensor<T>& sum = *sums[i++];
        for (std::int64_t e = 0; e < g.numel(); ++e) sum[e] += g[e];
      });
    }
  }
  return ref;
}

#define LAGA_INSTANTIATE(T)                                                                   \
  template Deviation deviation<T>(const Tensor<T>&, const Tensor<T>&);                        \
  template Tensor<T> shard_of<T>(const Tensor<T>&, const SpLayout&, int);                     \
  template void place_shard<T>(Tensor<T>&, const Tensor<T>&, const SpLayout&, int);           \
  template RankResult<T> run_rank<T>(Communicator&, const MlaConfig&, const SpLayout&,        \
                                     const RopeTable&, const MlaParams<T>&, const Tensor<T>&, \
                                     const Tensor<T>&, const RunSpec&);                       \
  template BlockRun<T> run_local<T>(const MlaConfig&, const SpLayout&, const MlaParams<T>&,   \
                                    const Tensor<T>&, const Tensor<T>&, const RunSpec&);      \
  template BlockRun<T> run_documents_alone<T>(const MlaConfig&, const MlaParams<T>&,          \
                                              const Tensor<T>&, const Tensor<T>&,             \
                                              const Documents&, RunSpec);
LAGA_INSTANTIATE(float)
LAGA_INSTANTIATE(double)
#undef LAGA_INSTANTIATE

}  // namespace laga
