// The canonical reduction over tokens (issue 56; docs/invariance.md, "The
// sum over tokens"): a sum over every token of the global sequence -- a
// weight's gradient dW = sum_t dy_t^T x_t, RMSNorm's weight gradient -- whose
// bits do not depend on how many ranks hold the tokens nor which holds which.
//
// The order is one binary tree over the global token index g = b S + s
// (the B rows of S tokens, flattened), leaves padded to a power of two,
// absent leaves passed over: the tree kernels/gemm_invariant.hpp sums its K
// products by. Every node [i 2^l, (i + 1) 2^l) of that tree has one value,
// whoever computes it. A rank's tokens (in every row, [begin, end)) cut
// into O(log S) maximal aligned nodes -- its pieces -- which it sums with
// the invariant GEMM (a piece is an aligned range, so that GEMM's tree over
// it is the global tree's subtree). The pieces of every rank are gathered
// (all_gather_v, through the Communicator under the caller's label, so the
// ledger records them) and every rank evaluates the global tree from them in
// the one fixed order: left child + right child, from the root down to the
// pieces. P = 1 is the same tree with one rank's pieces.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "mla/layout.hpp"
#include "mla/ops.hpp"

namespace laga::ops {

// Where the tokens of a sum lie: the global sequence is B rows of S tokens;
// rank r holds tokens [begin[r], end[r]) of every row, its local row
// b (end[r] - begin[r]) + (s - begin[r]) (the block's sequence shards,
// mla/layout.hpp).
struct TokenShards {
  std::int64_t B = 0, S = 0;
  std::vector<std::int64_t> begin, end;  // one entry per rank
  int ranks() const { return int(begin.size()); }
  std::int64_t local_rows(int r) const { return B * (end[r] - begin[r]); }
};

// An aligned node of the global tree, clipped at the sequence's end: global
// tokens [start, stop); `row`: its first token's local row on its rank.
struct TreePiece {
  std::int64_t start = 0, stop = 0, row = 0;
};

// Rank r's pieces in token order: its tokens cut into maximal aligned nodes.
std::vector<TreePiece> canonical_pieces(const TokenShards& shards, int r);

// How many pieces rank r has: the closed form of canonical_pieces(shards,
// r).size(), written from the tree and not from that loop (so the tests that
// hold the one to the other check something). In one row, tokens [lo, hi) of
// the N = B S: with t the highest bit where lo and hi differ and M = hi with
// the bits below t cleared, [lo, M) is popcount(M - lo) nodes rising from lo
// and [M, hi) popcount(hi - M) falling to hi. Where hi = N the last node may
// reach past N (it is clipped there): the nodes only rise, to the first
// multiple X >= N of a power of two reached from lo, popcount(X - lo) of them
// (one when lo = 0).
std::int64_t canonical_piece_count(const TokenShards& shards, int r);

// The shards the block's canonical sums run over (mla/pieces.cpp), from the
// layout alone, so the closed forms (mla/comm_model.hpp) read the same
// description: the sequence's (every rank one contiguous range of every row,
// SpLayout::shard_begin), and the heads' columns of a sum over the heads
// (one row of H per_head columns, rank r's heads' [head_offset per_head,
// (head_offset + head_count) per_head)).
TokenShards sequence_shards(const SpLayout& layout);
TokenShards head_column_shards(const SpLayout& layout, std::int64_t per_head);
// allgather_kv's query chunks (docs/invariance.md, "Which forms"): the global
// sequence cut into chunks of kQueryChunk tokens (the last may be short),
// whatever P, chunk c attended whole on the rank holding its first token
// c kQueryChunk; as the index of a sum over the chunks (B 1, S the chunk
// count) rank r's chunks [begin[r], end[r]), one range a rank since the
// shards are (sequence_shards).
inline constexpr std::int64_t kQueryChunk = 64;
TokenShards query_chunk_shards(const SpLayout& layout);

// Test-only: combine in rank order instead -- each rank's pieces summed left
// to right, then the ranks' sums in rank order, the order an all-reduce of
// partial sums has. The invariance tests switch it on to show they catch a
// reduction whose order follows the ranks (docs/invariance.md).
inline std::atomic<bool> canonical_sum_rank_order{false};

// dst (m, n) += sum over every global token t of a_t^T b_t, a (rows, m) and b
// (rows, n) this rank's local rows, in the canonical order above: the same
// bits on every rank and at every P. label: the ledger's label for the
// pieces' all_gather_v (in the communicator's current phase).
// add_here false: the sum is computed (and its collective joined) but not
// added to dst -- the block adds a gradient's sum on rank 0 only, and the
// gradient all-reduce then adds the other ranks' zeros to it, exactly.
template <class T>
void canonical_token_sum(Communicator& comm, Mat<T> dst, In<T> a, In<T> b,
                         const TokenShards& shards, const std::string& label, bool add_here = true);

// RMSNorm's weight gradient dw (C) += sum over every global token t of
// dy_t * (x_t * rstd_t), canonically (canonical_token_sum of ones^T g, in
// fp32 also in a bf16 run: the kernel's own dw is an fp32 sum).
template <class T>
void canonical_rmsnorm_weight_grad(Communicator& comm, Tensor<T>& dw, In<T> dy, In<T> x,
                                   const Tensor<T>& rstd, const TokenShards& shards,
                                   const std::string& label, bool add_here = true);

// The latent's gradient d[c_hat | k_pe] of this rank's tokens, dlat_loc (B L,
// C + dr), from every rank's heads, canonically: per head h the columns
// [dk_nope_h | dv_h | dk_pe_h] of every token (dk (B S, Hr dqk), dv (B S, Hr
// dv)) times [wkv_b_h 0; 0 I_dr], summed over the heads' columns by
// canonical_reduce_scatter (`heads`: each rank's columns, (dn + dv + dr) a
// head).
template <class T>
void canonical_latent_reduce_scatter(Communicator& comm, Mat<T> dlat_loc, In<T> dk, In<T> dv,
                                     In<T> wkv_b_r, std::int64_t Hr, std::int64_t dn,
                                     std::int64_t dr, const TokenShards& heads,
                                     const TokenShards& rows, const std::string& label);

// What the primitives move and hold, in elements (times the tensors' own
// element size: they move T, never narrowed, in a bf16 run too), by the
// ledger's byte rules (communicator.hpp; docs/accounting.md): the closed
// forms a form's invariant-mode collectives add (CommTerms::token_sum,
// CommTerms::head_sum_reduce_scatter in mla/comm_model.hpp), from the pieces'
// closed form (canonical_piece_count) alone. With p_q rank q's pieces and
// p = sum_q p_q:
//   canonical_token_sum of a width-element sum: rank r sends its pieces to
//   each of the P - 1 others, (P - 1) p_r width, and receives theirs, (p -
//   p_r) width; it holds every rank's pieces, p width (the all_gather_v's
//   buffer, comm_buffers). canonical_rmsnorm_weight_grad is a token sum of
//   width C (the norm's weight).
//   canonical_reduce_scatter of n-wide rows (index: the sum's columns, rows:
//   the tokens' owners, R = sum_q R_q rows): rank r sends each other q its
//   pieces' rows of q's tokens, p_r (R - R_r) n, and receives its rows of
//   every other rank's pieces, (p - p_r) R_r n; it holds its send buffer, p_r
//   R n, and its receive buffer, p R_r n, at once (both comm_buffers).
//   canonical_latent_reduce_scatter is one over the heads' columns (dn + dv +
//   dr a head) of C + dr wide rows.
struct PieceBytes {
  std::int64_t sent = 0, received = 0;  // elements
  std::int64_t held = 0;                // elements of comm_buffers the call holds at its peak
};
PieceBytes canonical_token_sum_elements(const TokenShards& shards, int r, std::int64_t width);
PieceBytes canonical_reduce_scatter_elements(const TokenShards& index, const TokenShards& rows,
                                             int r, std::int64_t n);

// The latent's reduce-scatter made canonical: dst (this rank's token rows,
// n) = rows of sum over a global index k of a(:, k) b(k, :), where k -- the
// heads' columns, H (dn + dv) of them -- is sharded as `index` (B 1, S the
// index's extent; rank r holds a's columns and b's rows [begin[r], end[r]))
// and a's rows are every token (B S of them), of which rank q owns `rows`'
// shard. The sum over k follows the same tree over k's global positions at
// every P: each rank's pieces of its k-range, every token's rows, go to the
// rows' owners (all_to_all_v under `label`), which evaluate the tree. A
// bf16 run rounds the result once (a fresh product).
template <class T>
void canonical_reduce_scatter(Communicator& comm, Mat<T> dst, In<T> a, In<T> b,
                              const TokenShards& index, const TokenShards& rows,
                              const std::string& label);

// The same reduce-scatter of a plain sum (absorbed's and laga_fused's latent
// gradient over the heads, docs/invariance.md, "Which forms"): dst (this
// rank's token rows, n) = rows of sum over the index k of parts a_k (every
// token's B S rows, n), k sharded as `index` (B 1; rank r holds k in
// [begin[r], end[r])), parts (end[r] - begin[r], B S, n) this rank's a_k in
// turn. The same tree over k's global positions: each rank sums its pieces'
// parts elementwise in it (a piece is an aligned node), the pieces' rows go
// to the rows' owners (all_to_all_v under `label`), which finish it. Sums
// only: nothing rounded in a bf16 run (the kernels' fp32 gradients summed).
// Its bytes are canonical_reduce_scatter_elements'.
template <class T>
void canonical_parts_reduce_scatter(Communicator& comm, Mat<T> dst, const Tensor<T>& parts,
                                    const TokenShards& index, const TokenShards& rows,
                                    const std::string& label);

}  // namespace laga::ops
