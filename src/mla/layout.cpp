#include "mla/layout.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "core/error.hpp"

namespace laga {

namespace {
std::vector<std::int64_t> split(std::int64_t n, int parts) {
  std::vector<std::int64_t> v(static_cast<size_t>(parts), n / parts);
  for (std::int64_t i = 0; i < n % parts; ++i) v[static_cast<size_t>(i)] += 1;
  return v;
}
}  // namespace

std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> o(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) o[i] = o[i - 1] + counts[i - 1];
  return o;
}
std::int64_t total_of(const std::vector<std::int64_t>& counts) {
  std::int64_t s = 0;
  for (auto x : counts) s += x;
  return s;
}

std::int64_t tokens_in_common(const std::vector<TokenRange>& a, const std::vector<TokenRange>& b) {
  std::int64_t n = 0;
  for (const TokenRange& s : a)
    for (const TokenRange& t : b)
      n += std::max<std::int64_t>(0, std::min(s.end, t.end) - std::max(s.begin, t.begin));
  return n;
}

const char* to_string(SeqLayout l) {
  switch (l) {
    case SeqLayout::contiguous:
      return "contiguous";
    case SeqLayout::zigzag:
      return "zigzag";
  }
  return "?";
}

SeqLayout parse_seq_layout(const std::string& s) {
  if (s == "contiguous") return SeqLayout::contiguous;
  if (s == "zigzag") return SeqLayout::zigzag;
  throw Error("unknown --seq-layout '" + s + "': use contiguous or zigzag");
}

std::vector<TokenRange> mirrored_chunks(std::int64_t seq, int parts, int c) {
  const std::vector<std::int64_t> chunk = split(seq, 2 * parts), chunk0 = offsets_of(chunk);
  std::vector<TokenRange> q;
  for (const int k : {c, 2 * parts - 1 - c}) {
    const TokenRange t{chunk0[static_cast<size_t>(k)],
                       chunk0[static_cast<size_t>(k)] + chunk[static_cast<size_t>(k)]};
    if (t.size() == 0) continue;
    if (!q.empty() && q.back().end == t.begin)
      q.back().end = t.end;  // adjacent chunks: one range, one attention call
    else
      q.push_back(t);
  }
  return q;
}

SpLayout SpLayout::even(std::int64_t batch, std::int64_t seq, std::int64_t heads, int ranks,
                        SeqLayout l) {
  LAGA_CHECK(ranks >= 1, "sequence parallelism needs at least 1 rank, got --sp ", ranks);
  LAGA_CHECK(seq >= ranks, "--seq ", seq, " is shorter than --sp ", ranks,
             ": every rank must hold at least one token; use a longer sequence or fewer ranks");
  SpLayout lay = custom(batch, split(seq, ranks), split(heads, ranks));
  if (l == SeqLayout::contiguous) return lay;
  // S >= P leaves chunk r (r < P) at least one token, so every rank holds one.
  lay.seq_layout = l;
  for (int r = 0; r < ranks; ++r) {
    auto& ranges = lay.seq_ranges[static_cast<size_t>(r)];
    ranges = mirrored_chunks(seq, ranks, r);
    std::int64_t n = 0;
    for (const TokenRange& t : ranges) n += t.size();
    lay.seq_count[static_cast<size_t>(r)] = n;
  }
  lay.validate();
  return lay;
}

std::int64_t SpLayout::shard_begin(int r) const {
  LAGA_CHECK(seq_layout == SeqLayout::contiguous, "layout: rank ", r,
             "'s shard is not one range under --seq-layout ", to_string(seq_layout),
             "; read its seq_ranges");
  return seq_ranges[static_cast<size_t>(r)].front().begin;
}

std::vector<std::int64_t> SpLayout::positions(int r) const {
  std::vector<std::int64_t> p;
  p.reserve(static_cast<size_t>(seq_count[static_cast<size_t>(r)]));
  for (const TokenRange& t : seq_ranges[static_cast<size_t>(r)])
    for (std::int64_t i = t.begin; i < t.end; ++i) p.push_back(i);
  return p;
}

std::int64_t SpLayout::largest_shard_tokens() const {
  return batch * *std::max_element(seq_count.begin(), seq_count.end());
}

SpLayout SpLayout::custom(std::int64_t batch, std::vector<std::int64_t> seq_counts,
                          std::vector<std::int64_t> head_counts) {
  SpLayout l;
  l.batch = batch;
  l.ranks = static_cast<int>(seq_counts.size());
  l.seq = total_of(seq_counts);
  l.heads = total_of(head_counts);
  const std::vector<std::int64_t> seq0 = offsets_of(seq_counts);
  for (size_t r = 0; r < seq_counts.size(); ++r)
    l.seq_ranges.push_back({{seq0[r], seq0[r] + seq_counts[r]}});
  l.head_offset = offsets_of(head_counts);
  l.seq_count = std::move(seq_counts);
  l.head_count = std::move(head_counts);
  l.validate();
  return l;
}

void SpLayout::validate() const {
  LAGA_CHECK(ranks >= 1 && seq_count.size() == static_cast<size_t>(ranks) &&
                 head_count.size() == static_cast<size_t>(ranks),
             "layout: need one seq count and one head count per rank (", ranks, " ranks)");
  LAGA_CHECK(seq_ranges.size() == static_cast<size_t>(ranks), "layout: need the seq ranges of ",
             ranks, " ranks, got ", seq_ranges.size());
  LAGA_CHECK(batch >= 1, "layout: batch must be >= 1, got ", batch);
  for (int r = 0; r < ranks; ++r) {
    LAGA_CHECK(
        seq_count[static_cast<size_t>(r)] >= 1, "layout: rank ", r,
        " holds no tokens; every rank needs at least one (use a longer --seq or fewer ranks)");
    LAGA_CHECK(head_count[static_cast<size_t>(r)] >= 0, "layout: rank ", r,
               " has a negative head count");
  }
  // The ranks' ranges hold every token once, each rank seq_count of them.
  std::vector<TokenRange> all;
  for (int r = 0; r < ranks; ++r) {
    std::int64_t n = 0;
    for (const TokenRange& t : seq_ranges[static_cast<size_t>(r)]) {
      LAGA_CHECK(t.begin >= 0 && t.end > t.begin && t.end <= seq, "layout: rank ", r,
                 "'s seq range [", t.begin, ", ", t.end, ") is empty or outside [0, ", seq, ")");
      n += t.size();
      all.push_back(t);
    }
    LAGA_CHECK(n == seq_count[static_cast<size_t>(r)], "layout: rank ", r, "'s seq ranges hold ", n,
               " tokens but its seq count is ", seq_count[static_cast<size_t>(r)]);
  }
  std::sort(all.begin(), all.end(),
            [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });
  std::int64_t next = 0;
  for (const TokenRange& t : all) {
    LAGA_CHECK(t.begin == next, "layout: the ranks' seq ranges do not tile [0, ", seq, "): token ",
               std::min(t.begin, next), " is held ", t.begin > next ? "by no rank" : "twice");
    next = t.end;
  }
  LAGA_CHECK(next == seq, "layout: the ranks' seq ranges end at ", next, " of ", seq, " tokens");
}

std::string SpLayout::describe() const {
  std::ostringstream os;
  os << "seq ";
  for (int r = 0; r < ranks; ++r) os << (r ? "+" : "") << seq_count[static_cast<size_t>(r)];
  if (seq_layout != SeqLayout::contiguous) os << " " << to_string(seq_layout);
  os << ", heads ";
  for (int r = 0; r < ranks; ++r) os << (r ? "+" : "") << head_count[static_cast<size_t>(r)];
  return os.str();
}

int HeadContextGrid::default_head_groups(std::int64_t heads, int ranks) {
  return static_cast<int>(std::gcd(heads, static_cast<std::int64_t>(ranks)));
}

int HeadContextGrid::resolve_head_groups(std::int64_t heads, int ranks, int requested) {
  LAGA_CHECK(requested >= 0, "--head-groups must be >= 1 (or left out for laga's rule), got ",
             requested);
  return requested == 0 ? default_head_groups(heads, ranks) : requested;
}

HeadContextGrid HeadContextGrid::make(const SpLayout& lay, int head_groups, GridOrder order) {
  const int P = lay.ranks;
  LAGA_CHECK(head_groups >= 1 && head_groups <= P, "--head-groups ", head_groups,
             " must be between 1 and --sp ", P, " (the ranks form head groups x context groups)");
  LAGA_CHECK(P % head_groups == 0, "--head-groups ", head_groups, " does not divide --sp ", P,
             ": every head group needs the same number of context groups; choose a divisor of ", P,
             " or leave --head-groups out (laga picks gcd(heads, ranks))");
  HeadContextGrid g;
  g.head_groups = head_groups;
  g.context_groups = P / head_groups;
  g.order = order;
  const int Pc = g.context_groups;
  const std::vector<std::int64_t> group_heads =
      head_groups == P ? lay.head_count : split(lay.heads, head_groups);
  const std::vector<std::int64_t> group_offsets = offsets_of(group_heads);
  for (int r = 0; r < P; ++r) {
    const auto grp = static_cast<size_t>(g.head_group(r));
    g.head_count.push_back(group_heads[grp]);
    g.head_offset.push_back(group_offsets[grp]);
    g.queries.push_back(mirrored_chunks(lay.seq, Pc, g.context_group(r)));
  }
  return g;
}

int HeadContextGrid::head_group(int rank) const {
  return order == GridOrder::head_major ? rank / context_groups : rank % head_groups;
}

int HeadContextGrid::context_group(int rank) const {
  return order == GridOrder::head_major ? rank % context_groups : rank / head_groups;
}

int HeadContextGrid::rank_at(int hg, int cg) const {
  return order == GridOrder::head_major ? hg * context_groups + cg : cg * head_groups + hg;
}

std::int64_t HeadContextGrid::query_rows(int rank) const {
  std::int64_t n = 0;
  for (const TokenRange& t : queries[static_cast<size_t>(rank)]) n += t.size();
  return n;
}

std::int64_t HeadContextGrid::key_end(int rank) const {
  const std::vector<TokenRange>& q = queries[static_cast<size_t>(rank)];
  return q.empty() ? 0 : q.back().end;
}

std::string HeadContextGrid::describe() const {
  std::ostringstream os;
  os << head_groups << " head group" << (head_groups == 1 ? "" : "s") << " x " << context_groups
     << " context group" << (context_groups == 1 ? "" : "s") << " (heads ";
  const auto group_heads = [&](int grp) {
    return head_count[static_cast<size_t>(rank_at(grp, 0))];
  };
  bool equal = true;
  for (int grp = 1; grp < head_groups; ++grp) equal = equal && group_heads(grp) == group_heads(0);
  if (equal && head_groups > 1)
    os << group_heads(0) << " per group";
  else
    for (int grp = 0; grp < head_groups; ++grp) os << (grp ? "+" : "") << group_heads(grp);
  os << ")";
  return os.str();
}

}  // namespace laga
