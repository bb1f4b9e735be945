#include "mla/layout.hpp"

#include <sstream>

#include "core/error.hpp"

namespace laga {

namespace {
std::vector<std::int64_t> split(std::int64_t n, int parts) {
  std::vector<std::int64_t> v(static_cast<size_t>(parts), n / parts);
  for (std::int64_t i = 0; i < n % parts; ++i) v[static_cast<size_t>(i)] += 1;
  return v;
}
std::vector<std::int64_t> offsets(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> o(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) o[i] = o[i - 1] + counts[i - 1];
  return o;
}
std::int64_t sum(const std::vector<std::int64_t>& v) {
  std::int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}
}  // namespace

SpLayout SpLayout::even(std::int64_t batch, std::int64_t seq, std::int64_t heads, int ranks) {
  LAGA_CHECK(ranks >= 1, "sequence parallelism needs at least 1 rank, got --sp ", ranks);
  LAGA_CHECK(seq >= ranks, "--seq ", seq, " is shorter than --sp ", ranks,
             ": every rank must hold at least one token; use a longer sequence or fewer ranks");
  return custom(batch, split(seq, ranks), split(heads, ranks));
}

SpLayout SpLayout::custom(std::int64_t batch, std::vector<std::int64_t> seq_counts,
                          std::vector<std::int64_t> head_counts) {
  SpLayout l;
  l.batch = batch;
  l.ranks = static_cast<int>(seq_counts.size());
  l.seq = sum(seq_counts);
  l.heads = sum(head_counts);
  l.seq_offset = offsets(seq_counts);
  l.head_offset = offsets(head_counts);
  l.seq_count = std::move(seq_counts);
  l.head_count = std::move(head_counts);
  l.validate();
  return l;
}

void SpLayout::validate() const {
  LAGA_CHECK(ranks >= 1 && seq_count.size() == static_cast<size_t>(ranks) &&
                 head_count.size() == static_cast<size_t>(ranks),
             "layout: need one seq count and one head count per rank (", ranks, " ranks)");
  LAGA_CHECK(batch >= 1, "layout: batch must be >= 1, got ", batch);
  for (int r = 0; r < ranks; ++r) {
    LAGA_CHECK(
        seq_count[static_cast<size_t>(r)] >= 1, "layout: rank ", r,
        " holds no tokens; every rank needs at least one (use a longer --seq or fewer ranks)");
    LAGA_CHECK(head_count[static_cast<size_t>(r)] >= 0, "layout: rank ", r,
               " has a negative head count");
  }
}

std::string SpLayout::describe() const {
  std::ostringstream os;
  os << "seq ";
  for (int r = 0; r < ranks; ++r) os << (r ? "+" : "") << seq_count[static_cast<size_t>(r)];
  os << ", heads ";
  for (int r = 0; r < ranks; ++r) os << (r ? "+" : "") << head_count[static_cast<size_t>(r)];
  return os.str();
}

}  // namespace laga
