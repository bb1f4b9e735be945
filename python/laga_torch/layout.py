"""SpLayout and HeadContextGrid: a port of src/mla/layout.{hpp,cpp}, the rule
that places tokens and heads on ranks (docs/forms.md, "Uneven shards" and
"laga2d"). Kept line for line with the C++ so the two place identically."""

import math


def _split(n, parts):
    """n near-evenly over parts: the first n % parts one more."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _offsets(counts):
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class SpLayout:
    """Rank r holds tokens [seq_offset[r], +seq_count[r]) of every row and,
    between the seq->head and head->seq exchanges, heads
    [head_offset[r], +head_count[r]). A rank may own zero heads but must hold
    at least one token."""

    def __init__(self, seq_counts, head_counts):
        if len(seq_counts) != len(head_counts) or not seq_counts:
            raise ValueError("layout: need one seq count and one head count per rank")
        for r, n in enumerate(seq_counts):
            if n < 1:
                raise ValueError(f"layout: rank {r} holds no tokens; every rank needs at least one "
                                 "(use a longer sequence or fewer ranks)")
        self.ranks = len(seq_counts)
        self.seq, self.heads = sum(seq_counts), sum(head_counts)
        self.seq_count, self.head_count = list(seq_counts), list(head_counts)
        self.seq_offset, self.head_offset = _offsets(seq_counts), _offsets(head_counts)

    @classmethod
    def even(cls, seq, heads, ranks):
        if ranks < 1:
            raise ValueError(f"sequence parallelism needs at least 1 rank, got group size {ranks}")
        if seq < ranks:
            raise ValueError(f"sequence length {seq} is shorter than the group size {ranks}: every "
                             "rank must hold at least one token; use a longer sequence or fewer ranks")
        return cls(_split(seq, ranks), _split(heads, ranks))

    def tokens(self, r):
        return range(self.seq_offset[r], self.seq_offset[r] + self.seq_count[r])

    def describe(self):
        return ("seq " + "+".join(map(str, self.seq_count)) +
                ", heads " + "+".join(map(str, self.head_count)))


class HeadContextGrid:
    """laga2d's grid: Ph head groups x Pc context groups, rank r in head group
    r // Pc and context group r % Pc; the sequence cut into 2 Pc chunks and
    context group c attends chunks c and 2Pc-1-c (adjacent ones merged)."""

    def __init__(self, layout, head_groups):
        P = layout.ranks
        if not 1 <= head_groups <= P:
            raise ValueError(f"head_groups {head_groups} must be between 1 and the group size {P} "
                             "(the ranks form head groups x context groups)")
        if P % head_groups:
            raise ValueError(f"head_groups {head_groups} does not divide the group size {P}: every "
                             f"head group needs the same number of context groups; choose a divisor "
                             f"of {P} or leave head_groups out (laga picks gcd(heads, ranks))")
        self.head_groups, self.context_groups = head_groups, P // head_groups
        Pc = self.context_groups
        group_heads = layout.head_count if head_groups == P else _split(layout.heads, head_groups)
        group_off = _offsets(group_heads)
        chunk = _split(layout.seq, 2 * Pc)
        chunk0 = _offsets(chunk)
        self.head_count, self.head_offset, self.queries = [], [], []
        for r in range(P):
            g = r // Pc
            self.head_count.append(group_heads[g])
            self.head_offset.append(group_off[g])
            q = []
            for k in (r % Pc, 2 * Pc - 1 - r % Pc):
                b, e = chunk0[k], chunk0[k] + chunk[k]
                if e == b:
                    continue
                if q and q[-1][1] == b:
                    q[-1] = (q[-1][0], e)  # adjacent chunks: one range
                else:
                    q.append((b, e))
            self.queries.append(q)

    @staticmethod
    def default_head_groups(heads, ranks):
        return math.gcd(heads, ranks)

    def query_rows(self, r):
        return sum(e - b for b, e in self.queries[r])

    def key_end(self, r):
        return self.queries[r][-1][1] if self.queries[r] else 0
