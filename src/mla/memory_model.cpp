#include "mla/memory_model.hpp"

#include <optional>

#include "comm/dry_run_comm.hpp"
#include "core/error.hpp"
#include "core/threads.hpp"
#include "mla/runner.hpp"

namespace laga {

namespace {

MemoryPeak to_peak(const MemoryPool::PeakSnapshot& s, std::int64_t num, std::int64_t den) {
  MemoryPeak p;
  p.bytes = s.bytes * num / den;
  p.where = s.where;
  for (const MemoryPool::LiveAlloc& a : s.live)
    p.live.push_back({a.name, a.category, a.bytes * num / den});
  return p;
}

// The counted run's figures and its pool's cache allowance
// (MemoryPrediction::cache_allowance).
struct CountedRank {
  RankMemory memory;
  std::int64_t cache_allowance = 0;
};

template <class T>
CountedRank count_rank(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                       AttentionKind attention, int rank, const MemoryModelOptions& options) {
  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  const OmpThreadsScope threads(options.threads > 0 ? options.threads
                                                    : threads_per_rank(layout.ranks));
  DryRunCommunicator comm(rank, layout.ranks, options.staging);
  const RopeTable rope = RopeTable::unbacked(cfg.rope(), layout.seq);
  const MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  const Tensor<T> x({layout.batch, layout.seq, cfg.dim}), dout({layout.batch, layout.seq, cfg.dim});
  pool.set_live_tracking(true);
  // Only when asked: counting attention walks its rows, which a count-only
  // run at S = 10^14 must not do for nothing.
  std::optional<ops::CountOps> counting;
  if (options.op_counts) counting.emplace(*options.op_counts);
  if (options.timeline) {
    LAGA_CHECK(options.op_counts, "internal: a timeline needs op_counts");
    comm.set_observer([&options](const CollectiveEvent& e) {
      options.timeline->push_back({e, *options.op_counts});
    });
  }
  RunSpec spec;
  spec.variant = variant;
  spec.attention = attention;
  spec.backward = options.backward;
  spec.grad_sync = options.grad_sync;
  spec.invariant = options.invariant;
  const RankMemory m = run_rank(comm, cfg, layout, rope, w, x, dout, spec).report.memory;
  return {m, pool.cache_allowance()};
}

}  // namespace

MemoryPrediction predict_memory(const MlaConfig& cfg, const SpLayout& layout, FormVariant variant,
                                AttentionKind attention, int rank, std::int64_t elem_bytes,
                                const MemoryModelOptions& options) {
  LAGA_CHECK(rank >= 0 && rank < layout.ranks, "predict_memory: rank ", rank,
             " is outside a layout of ", layout.ranks, " ranks");
  LAGA_CHECK(layout.heads == cfg.n_heads, "predict_memory: the layout splits ", layout.heads,
             " heads but the config has n_heads = ", cfg.n_heads);
  LAGA_CHECK(elem_bytes == 2 || elem_bytes == 4 || elem_bytes == 8,
             "predict_memory: elem_bytes must be 2 (bf16), 4 (fp32) or 8 (fp64), got ", elem_bytes);
  // Counted in the element type the run would use; bf16 as half of fp32.
  const CountedRank counted =
      elem_bytes == 8 ? count_rank<double>(cfg, layout, variant, attention, rank, options)
                      : count_rank<float>(cfg, layout, variant, attention, rank, options);
  const RankMemory& m = counted.memory;
  const std::int64_t num = elem_bytes, den = elem_bytes == 8 ? 8 : 4;
  MemoryPrediction p;
  p.peak_activations = m.peak_activations * num / den;
  p.peak_comm_buffers = m.peak_comm_buffers * num / den;
  p.peak_working = m.peak_working * num / den;
  p.forward_backward = to_peak(m.forward_backward_live, num, den);
  p.forward_backward.bytes = m.peak_forward_backward * num / den;
  if (options.backward && options.grad_sync) {
    p.grad_sync = to_peak(m.grad_sync_live, num, den);
    p.grad_sync.bytes = m.peak_grad_sync * num / den;
  }
  p.after_forward = m.after_forward * num / den;
  p.parameters = m.parameters * num / den;
  p.gradients = m.gradients * num / den;
  p.cache_allowance = counted.cache_allowance * num / den;
  return p;
}

SavedShape::SavedShape(const MlaConfig& c, const SpLayout& lay, FormVariant v, AttentionKind a,
                       int r)
    : cfg(c),
      layout(lay),
      variant(v),
      rank(r),
      eager(a == AttentionKind::eager),
      placement(attention_placement(lay, v)) {
  const auto i = static_cast<std::size_t>(r);
  B = lay.batch, L = lay.seq_count[i], S = lay.seq;
  Hr = placement.head_count[i];
  Sq = placement.rows(r);
  Sk = placement.tokens[i].empty() ? 0 : placement.tokens[i].back().end;
  dqk = c.qk_head_dim(), dv = c.v_head_dim, C = c.kv_lora_rank, W = C + c.qk_rope_head_dim;
}

std::int64_t SavedShape::attention_stats() const {
  if (!eager) return B * Hr * Sq;
  std::int64_t n = 0;
  for (const TokenRange& q : placement.tokens[static_cast<std::size_t>(rank)])
    n += B * Hr * q.size() * q.end;
  return n;
}

std::int64_t SavedShape::head_attention() const {
  const std::int64_t n = B * Sq * Hr * dqk + B * Sk * Hr * (dqk + dv) + attention_stats();
  return eager ? n : n + B * Sq * Hr * dv;
}

std::int64_t saved_for_backward_elements(const MlaConfig& c, const SpLayout& lay,
                                         FormVariant variant, AttentionKind attention, int rank) {
  check_variant(c, lay, variant);
  const SavedShape sh(c, lay, variant, attention, rank);
  const std::int64_t B = sh.B, L = sh.L, D = c.dim, H = c.n_heads, rq = c.q_lora_rank;
  // Every form: the output, the input projections' kv_a = [c | k_pe] and
  // the norms' rstd (and with rq > 0, q's latent before and after its norm),
  // o_loc for wo's gradient.
  std::int64_t n = B * L * D + B * L * sh.W + B * L + B * L * H * sh.dv;
  if (rq > 0) n += 2 * B * L * rq + B * L;
  // Kimi K3's output gate: its logits x wg^T (B, L, H dv), for the gate's
  // backward (the gated output is made again there, not saved).
  if (c.mla_use_output_gate) n += B * L * H * sh.dv;
  // --q-latent: the exchanged qn of the attention's query rows (B, Sq, rq),
  // which wq_b's gradient reads, replaces the local tokens' qn (B, L, rq).
  if (variant.queries == QueryExchange::latent) n += B * sh.Sq * rq - B * L * rq;
  return n + form_spec(variant.form).saved_elements(sh);
}

}  // namespace laga
