// A ring step's partial attention output merged into the rank's running one
// by log-sum-exp (mla/ring.hpp's top derives it):
//   lse' = log(e^lse + e^lse_p),  o = e^(lse - lse') o + e^(lse_p - lse') o_p
// The rank's o (B, L, H, dv) and lse (B, H, L); the call's o_p (Bc, Sq, H, dv)
// and lse_p (Bc, H, Sq), compact for its shape, for batch rows [b0, b0 + Bc)
// and query rows [q_row, q_row + Sq). `first`: the call is the first to
// reach its rows (the diagonal step): they are copied as they are, so a row
// that sees only its own block has the attention kernel's bits.
#pragma once

#include <cstdint>

namespace laga {

struct LseMergeShape {
  std::int64_t Bc = 0, Sq = 0, H = 0, dv = 0;  // the call's extents
  std::int64_t L = 0, b0 = 0, q_row = 0;       // the rank's rows, and where the call's sit
  bool first = false;
};

template <class T>
void lse_merge(const LseMergeShape& s, T* o, T* lse, const T* o_p, const T* lse_p);

// The naive reference, in double: exp and log of the formula as written.
template <class T>
void lse_merge_reference(const LseMergeShape& s, T* o, T* lse, const T* o_p, const T* lse_p);

}  // namespace laga
