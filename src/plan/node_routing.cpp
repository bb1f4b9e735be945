#include "plan/node_routing.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "comm/dry_run_comm.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "model/moe_routing.hpp"

namespace laga {

MoeConfig node_limited_gate(const MoeConfig& m, const NodeTopology& t) {
  const std::int64_t E = m.n_routed_experts;
  LAGA_CHECK(t.ep >= 1 && t.devices_per_node >= 1 && t.node_limit >= 1, "node-limited routing: EP ",
             t.ep, ", ", t.devices_per_node, " devices a node, node limit ", t.node_limit,
             ": each must be >= 1");
  LAGA_CHECK(t.ep % t.devices_per_node == 0, "node-limited routing: EP ", t.ep,
             " is not whole nodes of ", t.devices_per_node,
             " devices; give an EP that is a multiple of the devices a node");
  LAGA_CHECK(E % t.ep == 0, "node-limited routing: EP ", t.ep, " does not divide the ", E,
             " experts; give an EP dividing them");
  LAGA_CHECK(t.node_limit <= t.nodes(), "--node-limit ", t.node_limit, " exceeds the EP group's ",
             t.nodes(), " nodes; give at most ", t.nodes());
  MoeConfig g = m;
  g.n_group = t.nodes();
  g.topk_group = t.node_limit;
  if (g.topk_method == TopkMethod::greedy) g.topk_method = TopkMethod::group_limited_greedy;
  LAGA_CHECK(m.num_experts_per_tok <= std::int64_t(t.node_limit) * (E / t.nodes()),
             "node-limited routing: k ", m.num_experts_per_tok, " experts cannot fit in ",
             t.node_limit, " nodes of ", E / t.nodes(), " experts");
  g.validate();
  return g;
}

std::int64_t NodeDispatchRows::inter_total() const {
  std::int64_t s = 0;
  for (std::int64_t v : inter) s += v;
  return s;
}

std::int64_t NodeDispatchRows::intra_total() const {
  std::int64_t s = 0;
  for (std::int64_t v : intra) s += v;
  return s;
}

NodeDispatchRows node_dispatch_rows(const std::vector<std::int32_t>& expert, std::int64_t k,
                                    std::int64_t experts, std::int64_t tokens_per_rank,
                                    const NodeTopology& t) {
  const int ep = t.ep, g = t.devices_per_node;
  LAGA_CHECK(std::int64_t(expert.size()) == ep * tokens_per_rank * k,
             "node_dispatch_rows: ", expert.size(), " expert ids for EP ", ep, " x ",
             tokens_per_rank, " tokens x k ", k);
  const std::int64_t per_device = experts / ep;
  NodeDispatchRows r;
  r.ep = ep;
  r.tokens_per_rank = tokens_per_rank;
  r.inter.assign(size_t(ep) * size_t(ep), 0);
  r.intra.assign(size_t(ep) * size_t(ep), 0);
  std::vector<char> device(static_cast<size_t>(ep)), node(static_cast<size_t>(t.nodes()));
  for (int src = 0; src < ep; ++src) {
    const int home = src / g, index = src % g;
    for (std::int64_t n = 0; n < tokens_per_rank; ++n) {
      const std::int64_t tok = src * tokens_per_rank + n;
      std::fill(device.begin(), device.end(), char(0));
      std::fill(node.begin(), node.end(), char(0));
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t e = expert[size_t(tok * k + j)];
        LAGA_CHECK(e >= 0 && e < experts, "node_dispatch_rows: expert id ", e, " of token ", tok,
                   " is outside [0, ", experts, ")");
        device[size_t(e / per_device)] = 1;
        node[size_t(e / per_device / g)] = 1;
      }
      int used = 0;
      for (int m = 0; m < t.nodes(); ++m) {
        if (!node[size_t(m)]) continue;
        ++used;
        // The device of node m the token lands on: its own in-node index
        // across nodes (hop 1), the source itself at home.
        const int land = m == home ? src : m * g + index;
        if (m != home) ++r.inter[size_t(src) * size_t(ep) + size_t(land)];
        for (int v = m * g; v < (m + 1) * g; ++v)
          if (device[size_t(v)] && v != land) ++r.intra[size_t(land) * size_t(ep) + size_t(v)];
      }
      r.most_nodes = std::max(r.most_nodes, used);
    }
  }
  return r;
}

NodeDispatchRows routed_node_dispatch_rows(const MoeConfig& m, const NodeTopology& t,
                                           std::int64_t tokens_per_rank) {
  LAGA_CHECK(tokens_per_rank >= 1, "node-limited routing: ", tokens_per_rank,
             " tokens a rank; need at least 1");
  const MoeConfig gate = node_limited_gate(m, t);
  const std::int64_t N = t.ep * tokens_per_rank, E = gate.n_routed_experts;
  std::vector<double> logits(size_t(N * E));
  fill_normal(logits.data(), N * E, kNodeRoutingSeed, 0, 0, 1.0);
  const Routing<double> r = route<double>(gate, logits.data(), nullptr, N);
  return node_dispatch_rows(r.expert, gate.num_experts_per_tok, E, tokens_per_rank, t);
}

std::vector<Ledger> node_dispatch_ledgers(const NodeDispatchRows& rows, std::int64_t D) {
  const int P = rows.ep;
  const size_t n = size_t(P);
  std::vector<Ledger> out;
  for (int r = 0; r < P; ++r) {
    DryRunCommunicator comm(r, P);
    comm.set_phase(Phase::forward);
    // One all_to_all_v of a (P x P) row matrix: rank r sends row r, receives
    // column r (transposed: the combine's way back).
    const auto exchange = [&](const std::vector<std::int64_t>& m, bool back,
                              const std::string& label) {
      std::vector<std::int64_t> sc(n), sd(n, 0), rc(n), rd(n, 0);
      for (int j = 0; j < P; ++j) {
        const size_t out_ij = size_t(r) * n + size_t(j), in_ji = size_t(j) * n + size_t(r);
        sc[size_t(j)] = m[back ? in_ji : out_ij] * D;
        rc[size_t(j)] = m[back ? out_ij : in_ji] * D;
      }
      for (size_t j = 1; j < n; ++j) sd[j] = sd[j - 1] + sc[j - 1], rd[j] = rd[j - 1] + rc[j - 1];
      comm.all_to_all_v(static_cast<const void*>(nullptr), sc.data(), sd.data(), nullptr, rc.data(),
                        rd.data(), DType::bf16, label);
    };
    exchange(rows.inter, false, "moe_dispatch_inter");
    exchange(rows.intra, false, "moe_dispatch_intra");
    exchange(rows.intra, true, "moe_combine_intra");
    exchange(rows.inter, true, "moe_combine_inter");
    out.push_back(comm.ledger());
  }
  return out;
}

NodeExchangeBytes node_limited_exchange_bytes(const MoeConfig& m, const NodeTopology& t,
                                              std::int64_t N, double row_bytes) {
  const std::int64_t sample = std::min(N, kNodeRoutingSample);
  if (sample <= 0) return {};
  // The run depends on the gate and the topology only: one per shape.
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, int, int, int, int,
                         int, std::int64_t>;
  static std::mutex mutex;
  static std::map<Key, std::pair<std::int64_t, std::int64_t>> cache;
  const Key key{m.n_routed_experts,
                m.num_experts_per_tok,
                m.n_group,
                m.topk_group,
                int(m.scoring_func),
                int(m.topk_method),
                t.ep,
                t.devices_per_node,
                t.node_limit,
                sample};
  std::pair<std::int64_t, std::int64_t> totals;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) totals = it->second, cached = true;
  }
  if (!cached) {
    const NodeDispatchRows rows = routed_node_dispatch_rows(m, t, sample);
    totals = {rows.inter_total(), rows.intra_total()};
    std::lock_guard<std::mutex> lock(mutex);
    cache[key] = totals;
  }
  // The mean rank's bytes: every rank's rows over EP, scaled to N tokens.
  const double scale = double(N) / double(sample);
  return {double(totals.first) * row_bytes / double(t.ep) * scale,
          double(totals.second) * row_bytes / double(t.ep) * scale};
}

}  // namespace laga
