#include "comm/link_model.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace laga {

const char* to_string(Topology t) {
  switch (t) {
    case Topology::switched:
      return "switch";
    case Topology::full_mesh:
      return "full-mesh";
    case Topology::ring:
      return "ring";
  }
  return "?";
}

Topology parse_topology(const std::string& s, const std::string& what) {
  for (Topology t : {Topology::switched, Topology::full_mesh, Topology::ring})
    if (s == to_string(t)) return t;
  fail(what, ": unknown topology '", s, "'; the topologies are switch, full-mesh and ring");
}

void validate(const LinkModel& link, const std::string& what) {
  LAGA_CHECK(std::isfinite(link.bytes_per_s) && link.bytes_per_s > 0, what, ": bandwidth ",
             link.bytes_per_s,
             " bytes/s is not a positive finite number; give the bandwidth per "
             "direction, e.g. 25e9 for 25 GB/s");
  LAGA_CHECK(std::isfinite(link.latency_s) && link.latency_s >= 0, what, ": latency ",
             link.latency_s, " s is not a finite number >= 0");
}

Fabric single_level(const LinkModel& link) {
  // ranks_per_node larger than any group: never two levels.
  return {link, link, 1 << 30};
}

namespace {

// One level: P ranks behind `link`, m = max(sent, received) bytes of the rank.
double level_seconds(CollectiveKind kind, int P, double m, const LinkModel& link) {
  if (P <= 1) return 0;
  const double a = link.latency_s, b = link.bytes_per_s, peers = P - 1;
  const bool mesh = link.topology == Topology::full_mesh;
  switch (kind) {
    case CollectiveKind::all_to_all:
      if (mesh) return a + m / (peers * b);
      if (link.topology == Topology::ring) {
        // A block for the peer d hops away crosses d links; both directions
        // of the ring carry the load, but never less than the rank's own link.
        double hops = 0;
        for (int d = 1; d < P; ++d) hops += std::min(d, P - d);
        return (P / 2) * a + m * std::max(1.0, hops / peers / 2) / b;
      }
      return peers * a + m / b;
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter:
      return mesh ? a + m / (peers * b) : peers * a + m / b;
    case CollectiveKind::all_reduce:
      return mesh ? 2 * a + m / (peers * b) : 2 * peers * a + m / b;
    case CollectiveKind::barrier:
      return std::ceil(std::log2(double(P))) * a;
    case CollectiveKind::ring_shift:
      return a + m / b;  // one message to one neighbour, whatever the wiring
  }
  return 0;
}

int nodes_of(int P, int g) {
  return (P + g - 1) / g;
}

}  // namespace

double node_crossing_share(CollectiveKind kind, int P, int g) {
  LAGA_CHECK(g >= 1, "node_crossing_share: ranks per node ", g, " must be >= 1");
  if (P <= g || P <= 1) return 0;
  switch (kind) {
    case CollectiveKind::all_to_all:
      return double(P - g) / double(P - 1);
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::all_reduce:
      return double(nodes_of(P, g) - 1) / double(P - 1);
    case CollectiveKind::barrier:
      return 0;
    case CollectiveKind::ring_shift:
      return double(nodes_of(P, g)) / double(P);
  }
  return 0;
}

double collective_seconds(CollectiveKind kind, int P, WireBytes bytes, const Fabric& fabric) {
  LAGA_CHECK(P >= 1, "collective_seconds: P = ", P, " must be >= 1");
  const double m = double(std::max(bytes.sent, bytes.received));
  const int g = fabric.ranks_per_node;
  if (P <= g) return level_seconds(kind, P, m, fabric.intra);
  const int N = nodes_of(P, g);
  const double f = node_crossing_share(kind, P, g);
  const double intra = level_seconds(kind, g, (1 - f) * m, fabric.intra);
  const double a = fabric.inter.latency_s, b = fabric.inter.bytes_per_s;
  switch (kind) {
    case CollectiveKind::all_to_all:
      return std::max(intra, (P - g) * a + f * m / b);
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter:
      return (N - 1) * a + f * m / b + intra;
    case CollectiveKind::all_reduce:
      return 2 * (N - 1) * a + f * m / b + intra;
    case CollectiveKind::barrier:
      return level_seconds(kind, g, 0, fabric.intra) + level_seconds(kind, N, 0, fabric.inter);
    case CollectiveKind::ring_shift:
      // The step waits for its slowest message, one that crosses nodes.
      return std::max(level_seconds(kind, g, m, fabric.intra), a + m / b);
  }
  return 0;
}

}  // namespace laga
