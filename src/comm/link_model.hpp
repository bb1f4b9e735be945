// The alpha-beta cost of one collective on modelled links: the one formula
// both the communicator's link model (a collective completes no earlier than
// its modelled time, `laga compare --link`) and the planner (`laga plan`)
// use, so a prediction and a shaped measurement differ only by what the
// model leaves out (compute, overlap), never by a second formula.
//
// A link has a bandwidth beta per direction (bytes/s, full duplex) and a
// latency alpha per message (s). A collective is costed for rank r from the
// ledger's bytes of r alone (sent s, received v, docs/accounting.md) and the
// group size P; m = max(s, v): a full-duplex link carries both directions at
// once, so the larger one bounds the transfer. Per algorithm, one level (all
// P ranks behind links of one kind):
//
//   all_to_all      switch:    pairwise exchange, P-1 rounds:   (P-1) a + m / b
//                   full mesh: every peer at once, own link:    a + m / ((P-1) b)
//                   ring:      forwarded both ways round a ring: floor(P/2) a
//                              + m max(1, hbar / 2) / b, hbar = the mean hop
//                              count sum_{d=1}^{P-1} min(d, P-d) / (P-1)
//   all_gather,     switch, ring: the ring algorithm, P-1 steps: (P-1) a + m / b
//   reduce_scatter  full mesh: direct, every link at once:      a + m / ((P-1) b)
//   all_reduce      switch, ring: ring reduce-scatter + all-gather: 2 (P-1) a + m / b
//                   full mesh: 2 a + m / ((P-1) b)
//   barrier         ceil(log2 P) a (dissemination; no bytes)
//   ring_shift      one message to a neighbour, on every topology (one hop
//                   on a ring, the direct link on a mesh, one switch
//                   port):                                  a + m / b
//                   (a ring pass of P-1 steps is P-1 calls, each charged so;
//                   where the ranks form several rings, Ring, P is the
//                   consecutive ranks one ring spans, (size-1) stride + 1:
//                   the call's CollectiveEvent::ranks; a strided ring whose
//                   span passes a node crosses it)
//
// With the ledger's bytes these are the textbook costs: a ring all-gather's
// rank sends and receives (P-1)/P of the whole, which is what the ledger
// records for an even split.
//
// Two levels (ranks span nodes, g ranks per node, N = ceil(P / g) > 1 nodes):
// a rank's bytes are taken as spread evenly over its peers (exact for an
// even layout), so the share crossing nodes is
//   all_to_all                  f = (P - g) / (P - 1)   direct to every
//                               off-node peer over the node link while the
//                               on-node share goes over the intra link:
//                               max(intra(g, (1-f) m), (P-g) a_e + f m / b_e)
//   all_gather, reduce_scatter  hierarchical (2D): a ring among the N ranks
//                               of the same local index across nodes, then
//                               one inside the node; f = (N - 1) / (P - 1):
//                               (N-1) a_e + f m / b_e + intra(g, (1-f) m)
//   all_reduce                  intra reduce-scatter, inter all-reduce,
//                               intra all-gather; f = (N - 1) / (P - 1):
//                               2 (N-1) a_e + f m / b_e + intra(g, (1-f) m)
//   ring_shift                  ranks fill nodes in order, so N of the P
//                               neighbour messages cross nodes (the node
//                               boundaries and the ring's wrap): f = N / P,
//                               the mean over ranks. Every rank's next step
//                               needs the block it just received, so a step
//                               takes its slowest message:
//                               max(a + m / b, a_e + m / b_e)
// where intra(g, x) is the one-level cost above at P = g for x bytes.
// Sums of these shares are the ledger's bytes exactly; the model does not
// add or drop a byte. (ring_shift alone charges a rank more than its own
// share: the crossing message, which bounds the whole ring's step.)
#pragma once

#include <string>

#include "comm/communicator.hpp"

namespace laga {

// How the devices behind one link level are wired.
enum class Topology { switched, full_mesh, ring };
const char* to_string(Topology t);  // "switch", "full-mesh", "ring"
// The inverse of to_string; an unknown name is a laga::Error listing the names.
Topology parse_topology(const std::string& s, const std::string& what);

struct LinkModel {
  double bytes_per_s = 0;  // per direction, per link
  double latency_s = 0;    // per message
  Topology topology = Topology::switched;
};
// Throws laga::Error naming `what` unless bytes_per_s is positive and finite
// and latency_s is non-negative and finite.
void validate(const LinkModel& link, const std::string& what);

// The links of a group: one level when P <= ranks_per_node.
struct Fabric {
  LinkModel intra;  // between ranks of one node
  LinkModel inter;  // between nodes (per rank: its share of the node's NICs)
  int ranks_per_node = 1;
};
// A fabric of one level: every rank of any group behind `link`.
Fabric single_level(const LinkModel& link);

// Seconds rank r's part of one collective takes on `fabric`, from its ledger
// bytes (sent, received) and the group size P; 0 for P == 1.
double collective_seconds(CollectiveKind kind, int P, WireBytes bytes, const Fabric& fabric);

// The share of a rank's bytes in one collective that crosses nodes (the f
// above; 0 on one node).
double node_crossing_share(CollectiveKind kind, int P, int ranks_per_node);

}  // namespace laga
