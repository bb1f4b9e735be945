#include "cuda/sdpa_ragged.hpp"

#include <algorithm>
#include <limits>

#include "core/error.hpp"

namespace laga::cuda {

RaggedDocuments ragged_documents(const std::int64_t* doc_start, std::int64_t B, std::int64_t S,
                                 std::int64_t H, std::int64_t dqk, std::int64_t dv) {
  LAGA_CHECK(doc_start && B > 0 && S > 0 && H > 0 && dqk > 0 && dv > 0,
             "ragged_documents: needs doc_start and positive extents (B ", B, ", S ", S, ", H ", H,
             ", dqk ", dqk, ", dv ", dv, ")");
  RaggedDocuments r;
  std::int64_t start = 0;  // the global token where the open document began
  auto close = [&](std::int64_t end) {
    const std::int64_t len = end - start;
    LAGA_CHECK(len <= std::numeric_limits<std::int32_t>::max(), "ragged_documents: a document of ",
               len, " tokens is past cuDNN's int32 sequence lengths");
    r.seq_len.push_back(static_cast<std::int32_t>(len));
    r.first_token.push_back(start);
    r.qk_offset.push_back(start * H * dqk);
    r.vo_offset.push_back(start * H * dv);
    r.max_len = std::max(r.max_len, len);
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < S; ++t) {
      const std::int64_t s = doc_start[b * S + t];
      const std::int64_t prev = t == 0 ? 0 : doc_start[b * S + t - 1];
      LAGA_CHECK(s == t || (t > 0 && s == prev), "ragged_documents: batch row ", b, " token ", t,
                 " starts its document at ", s,
                 "; a token's start is its own index (a new "
                 "document) or its predecessor's start",
                 t == 0 ? " (every row's token 0 starts a document)" : "");
      if (s != t) continue;
      const std::int64_t g = b * S + t;  // the document opening here, packed
      if (g > 0) close(g);
      start = g;
    }
  close(B * S);
  r.docs = static_cast<std::int64_t>(r.seq_len.size());
  r.qk_offset.push_back(B * S * H * dqk);
  r.vo_offset.push_back(B * S * H * dv);
  r.first_token.push_back(B * S);
  r.S = S;
  return r;
}

namespace {
std::vector<std::int32_t> narrowed(const std::vector<std::int64_t>& v, const char* tensor) {
  std::vector<std::int32_t> out;
  out.reserve(v.size());
  for (std::int64_t x : v) {
    LAGA_CHECK(x >= 0 && x <= std::numeric_limits<std::int32_t>::max(), "cudnn sdpa: ", tensor,
               "'s ragged offset ", x,
               " is past cuDNN's int32 offsets; pack fewer tokens a call (a smaller --batch or "
               "--seq), or leave the documents unpacked");
    out.push_back(static_cast<std::int32_t>(x));
  }
  return out;
}
}  // namespace

std::vector<std::int32_t> ragged_offsets(const RaggedDocuments& r, std::int64_t per_token,
                                         const char* tensor) {
  std::vector<std::int64_t> v;
  v.reserve(r.first_token.size());
  for (std::int64_t t : r.first_token) v.push_back(t * per_token);
  return narrowed(v, tensor);
}

std::vector<std::int32_t> ragged_stats_offsets(const RaggedDocuments& r, std::int64_t Hq) {
  LAGA_CHECK(r.S > 0 && !r.first_token.empty(), "ragged_stats_offsets: an empty ragged batch");
  std::vector<std::int64_t> v;
  v.reserve(r.first_token.size());
  for (std::int64_t t : r.first_token) {
    const std::int64_t row = t / r.S;  // the end, B S, gives B Hq S
    v.push_back(row * Hq * r.S + (t - row * r.S));
  }
  return narrowed(v, "the softmax stats");
}

}  // namespace laga::cuda
