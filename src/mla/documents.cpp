#include "mla/documents.hpp"

#include <sstream>

#include "core/error.hpp"
#include "core/whole_number.hpp"

namespace laga {

namespace {

// Splits text at `sep`, keeping empty pieces (so that "5,,7" is an error
// naming an empty length rather than a silent merge).
std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string::size_type begin = 0;
  for (;;) {
    const auto end = text.find(sep, begin);
    parts.push_back(text.substr(begin, end == std::string::npos ? end : end - begin));
    if (end == std::string::npos) return parts;
    begin = end + 1;
  }
}

}  // namespace

Documents Documents::from_cu_seqlens(const std::string& source, std::int64_t batch,
                                     std::int64_t seq,
                                     const std::vector<std::vector<std::int64_t>>& rows) {
  LAGA_CHECK(batch >= 1 && seq >= 1, source, ": internal: batch ", batch, ", seq ", seq);
  LAGA_CHECK(rows.size() == 1 || std::int64_t(rows.size()) == batch, source, ": ", rows.size(),
             " rows of documents for a batch of ", batch,
             "; give one list shared by every row or one per row");
  for (std::size_t b = 0; b < rows.size(); ++b) {
    const auto& cu = rows[b];
    const std::string where = rows.size() == 1 ? source : cat(source, " (row ", b, ")");
    LAGA_CHECK(cu.size() >= 2, where, ": ", cu.size(),
               " cut points; cu_seqlens is [0, ..., seq] with at least one document");
    LAGA_CHECK(cu.front() == 0, where, ": cu_seqlens starts at ", cu.front(),
               "; it must start at 0");
    LAGA_CHECK(std::int64_t(cu.size()) - 1 <= seq, where, ": ", cu.size() - 1,
               " documents in a sequence of ", seq, " tokens; each document needs a token");
    for (std::size_t k = 1; k < cu.size(); ++k)
      LAGA_CHECK(cu[k] > cu[k - 1], where, ": document ", k - 1, " has length ", cu[k] - cu[k - 1],
                 " (cu_seqlens[", k - 1, "] = ", cu[k - 1], ", cu_seqlens[", k, "] = ", cu[k],
                 "); cu_seqlens must be strictly increasing");
    LAGA_CHECK(cu.back() == seq, where, ": the documents cover ", cu.back(),
               " tokens but the sequence has ", seq, "; cu_seqlens must end at seq");
  }
  Documents d;
  d.batch_ = batch, d.seq_ = seq, d.rows_ = rows;
  return d;
}

Documents Documents::parse_lengths(const std::string& text, std::int64_t batch, std::int64_t seq) {
  std::vector<std::vector<std::int64_t>> rows;
  for (const std::string& row : split(text, '/')) {
    std::vector<std::int64_t> cu{0};
    for (const std::string& piece : split(row, ',')) {
      const std::optional<std::int64_t> parsed = parse_whole_number(piece);
      // A length past int64 keeps the rule; it is refused by its range, as
      // every integer a user types (issue 54, T).
      const bool digits = !piece.empty() &&
                          piece.find_first_not_of("0123456789") == std::string::npos &&
                          (piece.size() == 1 || piece[0] != '0');
      LAGA_CHECK(parsed, "--doc-lens: '", piece, "' is not a whole number >= 1 and <= ", seq,
                 digits ? "" : " (decimal digits only, no leading zeros)", " in '", text,
                 "'; give document lengths as 5,7 (rows split by /, e.g. 5,7/12)");
      const std::int64_t len = *parsed;
      LAGA_CHECK(len >= 1, "--doc-lens: a document of length ", len, " in '", text,
                 "'; every document has at least one token");
      LAGA_CHECK(len <= seq - cu.back(), "--doc-lens: the lengths of row ", rows.size(), " in '",
                 text, "' add up to more than --seq ", seq, "; each row's lengths sum to --seq");
      cu.push_back(cu.back() + len);
    }
    LAGA_CHECK(cu.back() == seq, "--doc-lens: the lengths of row ", rows.size(), " in '", text,
               "' add up to ", cu.back(), ", not --seq ", seq, "; each row's lengths sum to --seq");
    rows.push_back(std::move(cu));
  }
  return from_cu_seqlens("--doc-lens", batch, seq, rows);
}

const std::vector<std::int64_t>& Documents::cu_seqlens(std::int64_t b) const {
  LAGA_CHECK(b >= 0 && b < batch_, "internal: documents of row ", b, " in a batch of ", batch_);
  return rows_.size() == 1 ? rows_.front() : rows_[std::size_t(b)];
}

std::string Documents::describe() const {
  std::ostringstream os;
  for (std::size_t b = 0; b < rows_.size(); ++b) {
    if (b > 0) os << '/';
    for (std::size_t k = 1; k < rows_[b].size(); ++k)
      os << (k > 1 ? "," : "") << rows_[b][k] - rows_[b][k - 1];
  }
  return os.str();
}

std::vector<std::int64_t> Documents::doc_starts() const {
  std::vector<std::int64_t> start(std::size_t(batch_ * seq_));
  for (std::int64_t b = 0; b < batch_; ++b) {
    const auto& cu = cu_seqlens(b);
    for (std::size_t k = 0; k + 1 < cu.size(); ++k)
      for (std::int64_t t = cu[k]; t < cu[k + 1]; ++t) start[std::size_t(b * seq_ + t)] = cu[k];
  }
  return start;
}

std::vector<std::int64_t> Documents::positions(const std::vector<TokenRange>& ranges) const {
  std::int64_t L = 0;
  for (const TokenRange& r : ranges) {
    LAGA_CHECK(r.begin >= 0 && r.begin <= r.end && r.end <= seq_, "internal: positions of tokens [",
               r.begin, ", ", r.end, ") in a sequence of ", seq_);
    L += r.size();
  }
  std::vector<std::int64_t> pos(std::size_t(batch_ * L));
  for (std::int64_t b = 0; b < batch_; ++b) {
    const auto& cu = cu_seqlens(b);
    std::int64_t i = b * L;
    for (const TokenRange& r : ranges) {
      std::size_t k = 0;  // the document holding token t: cu[k] <= t < cu[k + 1]
      for (std::int64_t t = r.begin; t < r.end; ++t) {
        while (cu[k + 1] <= t) ++k;
        pos[std::size_t(i++)] = t - cu[k];
      }
    }
  }
  return pos;
}

double Documents::causal_pairs() const {
  double pairs = 0;
  for (const std::vector<std::int64_t>& cu : rows_)
    for (std::size_t k = 0; k + 1 < cu.size(); ++k) {
      const double len = double(cu[k + 1] - cu[k]);
      pairs += len * (len + 1) / 2;
    }
  // A shared list: one row's pairs, B times (not a sum over B rows).
  return shared() ? pairs * double(batch_) : pairs;
}

}  // namespace laga
