#include "mla/memory_model.hpp"

#include <optional>

#include "comm/dry_run_comm.hpp"
#include "core/error.hpp"
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
  spec.set_variant(variant);
  spec.attention = attention;
  spec.backward = options.backward;
  spec.grad_sync = options.grad_sync;
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

std::int64_t saved_for_backward_elements(const MlaConfig& c, const SpLayout& lay,
                                         FormVariant variant, AttentionKind attention, int rank) {
  check_query_exchange(c, variant);
  check_head_groups(lay, variant);
  const Form form = variant.form;
  const auto r = static_cast<std::size_t>(rank);
  const std::int64_t B = lay.batch, L = lay.seq_count[r], S = lay.seq, Hr = lay.head_count[r];
  const std::int64_t D = c.dim, H = c.n_heads, C = c.kv_lora_rank, rq = c.q_lora_rank;
  const std::int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const std::int64_t dqk = dn + dr, W = C + dr;
  const bool eager = attention == AttentionKind::eager;
  // Every form: the output, the input projections' kv_a = [c | k_pe] and
  // the norms' rstd (and with rq > 0, q's latent before and after its norm),
  // o_loc for wo's gradient.
  std::int64_t n = B * L * D + B * L * W + B * L + B * L * H * dv;
  if (rq > 0) n += 2 * B * L * rq + B * L;
  // --q-latent: the exchanged qn of the attention's query rows (B, Sq, rq),
  // which wq_b's gradient reads, replaces the local tokens' qn (B, L, rq);
  // Sq = S but in laga2d.
  if (variant.queries == QueryExchange::latent) {
    const std::int64_t Sq = form == Form::laga2d ? laga2d_grid(lay, variant).query_rows(rank) : S;
    n += B * Sq * rq - B * L * rq;
  }
  switch (form) {
    case Form::explicit_form:
    case Form::laga: {
      // The head attention's q, k, v over the full sequence; eager's
      // probabilities or flash's lse and output.
      n += B * S * Hr * (2 * dqk + dv);
      n += eager ? B * Hr * S * S : B * Hr * S + B * S * Hr * dv;
      // explicit keeps c_hat of local tokens; laga the gathered latent.
      n += form == Form::explicit_form ? B * L * C : B * S * W;
      break;
    }
    case Form::laga2d: {
      // laga's tensors over the rank's Sq query rows and Sk key rows for its
      // head group's H_g heads (HeadContextGrid): q_h (B, Sq, H_g, dqk), k_h
      // and v_h (B, Sk, H_g, .), the gathered latent; eager's probabilities
      // of each query range of n tokens ending at e are (B, H_g, n, e).
      const HeadContextGrid g = laga2d_grid(lay, variant);
      const std::int64_t Hg = g.head_count[r], Sq = g.query_rows(rank), Sk = g.key_end(rank);
      n += B * Sq * Hg * dqk + B * Sk * Hg * (dqk + dv) + B * S * W;
      if (eager)
        for (const TokenRange& q : g.queries[r]) n += B * Hg * q.size() * q.end;
      else
        n += B * Hg * Sq + B * Sq * Hg * dv;
      break;
    }
    case Form::absorbed:
      // q_h, the gathered latent, its values c_hat, q_abs = [q_nope W_UK | q_pe]
      // and o_lat, both H_r x latent wide, and the attention statistics.
      n += B * S * Hr * dqk + B * S * W + B * S * C + B * S * Hr * W + B * S * Hr * C;
      n += eager ? B * Hr * S * S : B * Hr * S;
      break;
  }
  return n;
}

}  // namespace laga
