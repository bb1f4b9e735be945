// DeepSeek-V3's node-limited expert dispatch counted on a real routing
// (docs/planning.md, "Node-limited routing: the routed count"): the bytes
// `laga plan --node-limit` charges are the ledger of a count-only run of
// laga's own router, not a closed form of an assumed distribution.
//
// The run, one description for the planner and its test alike:
//   logits   (EP x N, E) i.i.d. standard normal (core/rng.hpp's Philox,
//            seed kNodeRoutingSeed): a gate on random weights and inputs,
//            zero bias (no balancing has run)
//   gate     the model's own gate (route(), model/moe_routing.hpp) with its
//            expert groups made the EP group's nodes (n_group = nodes,
//            topk_group = node_limit): DeepSeek-V3's at EP 64 over 8 nodes
//            is exactly its own config (8 groups of 32, 4 kept)
//   placement the experts contiguous, E / EP a device (ExpertParallel::folded)
//   dispatch a token of rank r (node a, in-node index i) goes ONCE to each
//            remote target node m, to device (m, i) (hop 1, across nodes),
//            which forwards it to every other device of m holding one of its
//            experts (hop 2, within m); its own node's expert holders get it
//            from r directly (hop 2). One row a (token, device), however
//            many of its experts the device holds (report section 3.2.2).
//   combine  the same rows back: hop 2 reversed, then hop 1 reversed.
// Each hop is one all_to_all_v of null buffers (count-only) on a
// DryRunCommunicator per rank, so the bytes are the Communicator ledger's.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "model/moe_config.hpp"

namespace laga {

inline constexpr std::uint64_t kNodeRoutingSeed = 57;

// The EP group: ep devices, devices_per_node a node (consecutive), each
// token's experts on at most node_limit of its nodes.
struct NodeTopology {
  int ep = 1, devices_per_node = 1, node_limit = 1;
  int nodes() const { return ep / devices_per_node; }
};

// The gate the routing runs: `m` with its groups the topology's nodes. A
// laga::Error names what does not fit (EP not whole nodes, E not a multiple
// of EP, node_limit above the nodes, k above the kept nodes' experts).
MoeConfig node_limited_gate(const MoeConfig& m, const NodeTopology& t);

// Rows (one per token and device) each rank sends in each dispatch hop, from
// every token's k experts (rank r's tokens [r N, (r + 1) N), expert ids
// (EP N, k)): inter[i * ep + j] rank i to j across nodes, intra within one.
// The combine sends the transposes.
struct NodeDispatchRows {
  int ep = 0;
  std::int64_t tokens_per_rank = 0;
  std::vector<std::int64_t> inter, intra;  // (ep x ep)
  std::int64_t inter_total() const;
  std::int64_t intra_total() const;
  // The most remote nodes any token was sent to, and the most nodes it used.
  int most_nodes = 0;
};
NodeDispatchRows node_dispatch_rows(const std::vector<std::int32_t>& expert, std::int64_t k,
                                    std::int64_t experts, std::int64_t tokens_per_rank,
                                    const NodeTopology& t);

// The routed run's rows: route() on the logits above, N tokens a rank.
NodeDispatchRows routed_node_dispatch_rows(const MoeConfig& m, const NodeTopology& t,
                                           std::int64_t tokens_per_rank);

// Each rank's ledger of one MoE layer's forward under the rows: labels
// moe_dispatch_inter, moe_dispatch_intra, moe_combine_intra,
// moe_combine_inter, rows of D bf16 elements.
std::vector<Ledger> node_dispatch_ledgers(const NodeDispatchRows& rows, std::int64_t D);

// The planner's figure (model_plan.cpp's moe_exchange): the bytes one rank
// sends in ONE exchange (a dispatch, or a combine: the same total) over
// each link, the mean over the EP ranks, at N tokens a rank and row_bytes a
// row. From a routed run of min(N, kNodeRoutingSample) tokens a rank
// (cached per shape), scaled by N / its tokens where N is larger: at
// N <= kNodeRoutingSample the bytes are the run's at N exactly.
inline constexpr std::int64_t kNodeRoutingSample = 256;
struct NodeExchangeBytes {
  double inter = 0, intra = 0;
};
NodeExchangeBytes node_limited_exchange_bytes(const MoeConfig& m, const NodeTopology& t,
                                              std::int64_t N, double row_bytes);

}  // namespace laga
