// The closed-form communication model's gradient all-reduce term, against
// parameter counts worked out by hand from DeepSeek-V3's published attention
// shapes (D 7168, H 128, q_lora_rank 1536, kv_lora_rank 512, dn 128, dr 64,
// dv 128), and against mla_param_shapes, which allocates the gradients: the
// model writes the count out on its own, so the two are a check on each other.
// The query-latent exchange's terms at DeepSeek-V3 against bytes worked out by
// hand, and its crossover against the per-label closed form. A ring pass's
// closed form (ring_pass_bytes) against the ledger of a real one.
#include <gtest/gtest.h>

#include <algorithm>

#include "comm/local_comm.hpp"
#include "core/error.hpp"
#include "mla/comm_model.hpp"
#include "mla/params.hpp"

namespace laga {
namespace {

std::int64_t count_of(const std::vector<std::pair<std::string, Shape>>& shapes) {
  std::int64_t n = 0;
  for (const auto& [name, shape] : shapes) {
    std::int64_t k = 1;
    for (auto e : shape) k *= e;
    n += k;
  }
  return n;
}

// P = 2: rank r sends every chunk but its own in the reduce-scatter and its
// own in the all-gather, so each rank sends (and receives) n elements.
std::int64_t grad_bytes_at_p2(const MlaConfig& cfg, int rank) {
  const SpLayout lay = SpLayout::even(1, 2, cfg.n_heads, 2);
  const CommPrediction p = predict_comm(cfg, lay, Form::laga, rank, 4, false, true);
  const auto it = p.find({Phase::grad_sync, "grad_allreduce"});
  EXPECT_NE(it, p.end());
  EXPECT_EQ(it->second.calls, 1);
  EXPECT_EQ(it->second.sent, it->second.received);
  return it->second.sent;
}

TEST(CommModel, GradSyncCountsDeepSeekV3Parameters) {
  // wq_a 1536x7168, q_norm 1536, wq_b (128*192)x1536, wkv_a 576x7168,
  // kv_norm 512, wkv_b (128*256)x512, wo 7168x(128*128): 187,107,328.
  const std::int64_t v3 =
      1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128;
  const MlaConfig cfg = MlaConfig::preset("deepseek-v3");
  EXPECT_EQ(count_of(mla_param_shapes(cfg)), v3);
  for (int r : {0, 1}) EXPECT_EQ(grad_bytes_at_p2(cfg, r), 4 * v3) << "rank " << r;

  // rq = 0 (the paper preset): one wq (128*192)x7168 instead of the bottleneck.
  const std::int64_t paper =
      128 * 192 * 7168 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 128 * 128;
  const MlaConfig p = MlaConfig::preset("paper");
  ASSERT_EQ(p.q_lora_rank, 0);
  EXPECT_EQ(count_of(mla_param_shapes(p)), paper);
  EXPECT_EQ(grad_bytes_at_p2(p, 0), 4 * paper);
}

TEST(CommModel, OneCallPerLabelAndPhase) {
  MlaConfig cfg;
  cfg.q_lora_rank = 24;
  const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, 3);
  // Every form makes one call per label but a ring pass, one call per ring
  // step: P - 1 for a pass of blocks, P for the one that also brings each
  // block home (its label starts with "d", a gradient's); the head-parallel
  // forms' labels are these.
  for (Form f : all_forms())
    for (const auto& [key, b] : predict_comm(cfg, lay, f, 1, 4, true, true)) {
      const std::int64_t calls = b.kind != CollectiveKind::ring_shift ? 1
                                 : key.second[0] == 'd'               ? lay.ranks
                                                                      : lay.ranks - 1;
      EXPECT_EQ(b.calls, calls) << to_string(f) << " " << key.second;
    }
  std::vector<FormVariant> variants{Form::explicit_form, Form::absorbed, Form::laga, Form::laga2d};
  variants.push_back({Form::laga, QueryExchange::latent});
  variants.push_back({Form::laga2d, QueryExchange::latent, 3});  // Pc 1: all-gathered
  variants.push_back({Form::laga2d, QueryExchange::latent, 1});  // Pc 3: sent to the chunks
  for (FormVariant f : variants) {
    const CommPrediction p = predict_comm(cfg, lay, f, 1, 4, true, true);
    // forward and backward: q (per head, or its latent), out and (explicit)
    // k, v or (else) the latent; plus the gradient all-reduce.
    EXPECT_EQ(p.size(), f.form == Form::explicit_form ? 9u : 7u) << to_string(f);
    const bool latent = f.queries == QueryExchange::latent;
    const bool to_chunks = latent && f.form == Form::laga2d && f.head_groups == 1;
    for (Phase ph : {Phase::forward, Phase::backward}) {
      EXPECT_EQ(p.count({ph, "q_a2a"}), latent ? 0u : 1u) << to_string(f);
      EXPECT_EQ(p.count({ph, "q_latent_ag"}), latent && !to_chunks ? 1u : 0u) << to_string(f);
      EXPECT_EQ(p.count({ph, "q_latent_a2a"}), to_chunks ? 1u : 0u) << to_string(f);
    }
    for (const auto& [key, b] : p) EXPECT_EQ(b.calls, 1) << to_string(f) << " " << key.second;
  }
}

// The figures at DeepSeek-V3 (rq 1536, H 128, dqk 192, dv 128,
// C + dr 576), S 4096, P 8, fp32, forward, per rank (L = 512, 16 heads each),
// worked out by hand: explicit's q, k (k_pe expanded), v and out all-to-alls
// send the 7/8 of their rows that leave the rank; laga swaps k and v for the
// latent sent to 7 peers; --q-latent swaps q for the 1536-wide query latent
// sent to 7 peers.
TEST(CommModel, QueryLatentAtDeepSeekV3) {
  const MlaConfig v3 = MlaConfig::preset("deepseek-v3");
  const SpLayout lay = SpLayout::even(1, 4096, v3.n_heads, 8);
  const std::int64_t q = 512 * 112 * 192 * 4, v = 512 * 112 * 128 * 4, out = v;
  const std::int64_t latent = 7 * 512 * 576 * 4, q_latent = 7 * 512 * 1536 * 4;
  const auto forward = [&](FormVariant f) {
    return predicted_sent(predict_comm(v3, lay, f, 3, 4, true, true), Phase::forward);
  };
  EXPECT_EQ(forward(Form::explicit_form), q + q + v + out);                          // 146.80 MB
  EXPECT_EQ(forward(Form::laga), q + latent + out);                                  // 81.66 MB
  EXPECT_EQ(forward({Form::laga, QueryExchange::latent}), q_latent + latent + out);  // 59.64 MB
  // Backward: each collective's adjoint moves the same bytes back.
  const CommPrediction p =
      predict_comm(v3, lay, {Form::laga, QueryExchange::latent}, 3, 4, true, true);
  EXPECT_EQ(p.at({Phase::backward, "q_latent_ag"}).sent, q_latent);
  EXPECT_EQ(p.at({Phase::backward, "q_latent_ag"}).received, q_latent);
  EXPECT_EQ(predicted_sent(p, Phase::backward), q_latent + latent + out);
}

// laga2d with one head group at DeepSeek-V3, S 4096, P 8 (Pc 8), by hand:
// 16 chunks of 256 tokens, context group c attends chunks c and 15 - c; rank
// 3 holds tokens [1536, 2048) = chunks 6 and 7, which ranks 6 and 7 attend,
// and attends chunks 3 (held by rank 1) and 12 (rank 6). Per-head queries
// move all 128 heads of those 512 rows; the query latent moves 1536 per row,
// a copy to each rank that attends it (here one head group: one copy).
TEST(CommModel, Laga2dQueryLatentAtDeepSeekV3) {
  const MlaConfig v3 = MlaConfig::preset("deepseek-v3");
  const SpLayout lay = SpLayout::even(1, 4096, v3.n_heads, 8);
  const auto at = [&](QueryExchange q, int groups, Phase ph, const char* label) {
    return predict_comm(v3, lay, {Form::laga2d, q, groups}, 3, 4, true, true).at({ph, label});
  };
  const std::int64_t rows = 512, per_head = rows * 128 * 192 * 4, latent = rows * 1536 * 4;
  EXPECT_EQ(at(QueryExchange::heads, 1, Phase::forward, "q_a2a").sent, per_head);
  EXPECT_EQ(at(QueryExchange::heads, 1, Phase::forward, "q_a2a").received, per_head);
  const PredictedBytes f = at(QueryExchange::latent, 1, Phase::forward, "q_latent_a2a");
  EXPECT_EQ(f.sent, latent);
  EXPECT_EQ(f.received, latent);
  EXPECT_EQ(f.kind, CollectiveKind::all_to_all);
  const PredictedBytes b = at(QueryExchange::latent, 1, Phase::backward, "q_latent_a2a");
  EXPECT_EQ(b.sent, latent);
  EXPECT_EQ(b.received, latent);
  // Two head groups (Pc 4, 8 chunks of 512): rank 3 (group 0, context 3)
  // holds chunk 3, which context group 3 attends: ranks 3 (itself) and 7
  // get it, so one copy leaves; it attends chunks 3 (its own) and 4 (rank
  // 4's): one chunk arrives.
  const PredictedBytes g2 = at(QueryExchange::latent, 2, Phase::forward, "q_latent_a2a");
  EXPECT_EQ(g2.sent, latent);
  EXPECT_EQ(g2.received, latent);
}

// The crossover: query_exchange_cost is the per-token factor of the two
// closed-form entries (on uneven layouts too), and with even heads the latent
// gather sends less exactly while P < ceil(H dqk / rq), 16 for DeepSeek-V3
// (where the two are equal: 1536 * 15 = 24576 * 15 / 16).
TEST(CommModel, QueryLatentCrossover) {
  const MlaConfig v3 = MlaConfig::preset("deepseek-v3");
  EXPECT_EQ(query_latent_crossover(v3), 16);
  EXPECT_EQ(query_latent_crossover(MlaConfig::preset("paper")), 0);  // rq 0: no query latent
  for (int P : {2, 4, 8, 16, 32, 64, 128}) {
    const SpLayout lay = SpLayout::even(1, 4096, v3.n_heads, P);
    const QueryExchangeCost c = query_exchange_cost(v3, lay, 0);
    EXPECT_EQ(c.latent_sends_less(), P < 16) << "P " << P;
    EXPECT_EQ(c.heads_per_token * P, 128 * 192 * (P - 1)) << "P " << P;
    EXPECT_EQ(c.latent_per_token, 1536 * (P - 1)) << "P " << P;
  }
  MlaConfig cfg;
  cfg.q_lora_rank = 24;
  const SpLayout uneven = SpLayout::custom(2, {5, 1, 4, 3}, {3, 0, 4, 1});
  for (int r = 0; r < uneven.ranks; ++r) {
    const QueryExchangeCost c = query_exchange_cost(cfg, uneven, r);
    const std::int64_t per_token = 2 * uneven.seq_count[std::size_t(r)] * 4;
    const auto sent = [&](QueryExchange q, const char* label) {
      return predict_comm(cfg, uneven, {Form::laga, q}, r, 4, false, false)
          .at({Phase::forward, label})
          .sent;
    };
    EXPECT_EQ(sent(QueryExchange::heads, "q_a2a"), c.heads_per_token * per_token) << r;
    EXPECT_EQ(sent(QueryExchange::latent, "q_latent_ag"), c.latent_per_token * per_token) << r;
  }
}

// A forward and a backward ring pass of uneven blocks on P in-process ranks,
// double-buffered as a ring attention runs it: each rank's ledger equals
// ring_pass_bytes, which knows nothing of the steps.
TEST(CommModel, RingPassBytesEqualTheLedgerOfARealPass) {
  for (int P : {1, 2, 3, 5}) {
    std::vector<std::int64_t> blocks(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) blocks[static_cast<size_t>(j)] = 3 + 2 * j + (j == 1 ? 7 : 0);
    std::vector<Ledger> ledgers(static_cast<size_t>(P));
    run_local_ranks(P, [&](Communicator& c) {
      const int r = c.rank();
      for (RingDirection d : {RingDirection::forward, RingDirection::backward}) {
        const int step = d == RingDirection::forward ? 1 : -1;
        std::vector<float> held(static_cast<size_t>(blocks[static_cast<size_t>(r)]), 1.0f), next;
        for (int s = 1; s < P; ++s) {
          const int origin = ((r - step * s) % P + P) % P;  // the block arriving now
          next.assign(static_cast<size_t>(blocks[static_cast<size_t>(origin)]), 0.0f);
          c.ring_shift(held.data(), static_cast<std::int64_t>(held.size()), next.data(),
                       static_cast<std::int64_t>(next.size()), to_string(d), d);
          std::swap(held, next);
        }
      }
      ledgers[static_cast<size_t>(r)] = c.ledger();
    });
    for (int r = 0; r < P; ++r) {
      for (RingDirection d : {RingDirection::forward, RingDirection::backward}) {
        SCOPED_TRACE(cat("rank ", r, " of ", P, " ", to_string(d)));
        const PredictedBytes want = ring_pass_bytes(blocks, r, 4, d);
        EXPECT_EQ(want.kind, CollectiveKind::ring_shift);
        const auto& e = ledgers[static_cast<size_t>(r)].entries();
        const auto it = e.find({Phase::forward, to_string(d)});
        if (P == 1) {
          EXPECT_EQ(it, e.end());
          EXPECT_EQ(want.calls, 0);
          continue;
        }
        ASSERT_NE(it, e.end());
        EXPECT_EQ(it->second.calls, want.calls);
        EXPECT_EQ(it->second.bytes_sent, want.sent);
        EXPECT_EQ(it->second.bytes_received, want.received);
      }
    }
  }
  EXPECT_THROW(ring_pass_bytes({1, 2}, 2, 4), Error);
}

}  // namespace
}  // namespace laga
