"""SpLayout and HeadContextGrid: a port of src/mla/layout.{hpp,cpp}, the rule
that places tokens and heads on ranks (docs/forms.md, "Uneven shards", "The
zigzag layout" and "laga2d"). Kept line for line with the C++ so the two
place identically."""

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


SEQ_LAYOUTS = ("contiguous", "zigzag")


def check_seq_layout(seq_layout):
    """The layout's name back, or a ValueError naming the two there are."""
    if seq_layout not in SEQ_LAYOUTS:
        raise ValueError(f"seq_layout '{seq_layout}': expected contiguous (rank r one range, in "
                         "rank order) or zigzag (2P chunks, rank r holding chunks r and 2P-1-r: "
                         "TransformerEngine's load-balanced layout)")
    return seq_layout


def mirrored_chunks(seq, parts, c):
    """Chunks c and 2 parts - 1 - c of the sequence cut into 2 parts
    near-equal chunks (the first seq % (2 parts) one token more), as
    ascending (begin, end) ranges, empty ones dropped and adjacent ones
    merged (c = parts - 1): the zigzag layout's shards and laga2d's context
    groups' query rows (the C++ mirrored_chunks)."""
    chunk = _split(seq, 2 * parts)
    chunk0 = _offsets(chunk)
    q = []
    for k in (c, 2 * parts - 1 - c):
        b, e = chunk0[k], chunk0[k] + chunk[k]
        if e == b:
            continue
        if q and q[-1][1] == b:
            q[-1] = (q[-1][0], e)  # adjacent chunks: one range
        else:
            q.append((b, e))
    return q


class SpLayout:
    """Rank r holds the tokens seq_ranges[r] of every row (ascending
    (begin, end) ranges, seq_count[r] tokens, their rows one after the other
    in the rank's shard: positions(r)) and, between the seq->head and
    head->seq exchanges, heads [head_offset[r], +head_count[r]). A rank may
    own zero heads but must hold at least one token. seq_layout "contiguous":
    rank r one range, in rank order; "zigzag": chunks r and 2P-1-r of 2P
    (docs/forms.md, "The zigzag layout")."""

    def __init__(self, seq_counts, head_counts, seq_ranges=None, seq_layout="contiguous"):
        if len(seq_counts) != len(head_counts) or not seq_counts:
            raise ValueError("layout: need one seq count and one head count per rank")
        for r, n in enumerate(seq_counts):
            if n < 1:
                raise ValueError(f"layout: rank {r} holds no tokens; every rank needs at least one "
                                 "(use a longer sequence or fewer ranks)")
        self.ranks = len(seq_counts)
        self.seq, self.heads = sum(seq_counts), sum(head_counts)
        self.seq_count, self.head_count = list(seq_counts), list(head_counts)
        self.head_offset = _offsets(head_counts)
        self.seq_layout = seq_layout
        if seq_ranges is None:  # contiguous: rank r one range, in rank order
            seq_ranges = [[(b, b + n)] for b, n in zip(_offsets(seq_counts), seq_counts)]
        self.seq_ranges = [list(r) for r in seq_ranges]

    @classmethod
    def even(cls, seq, heads, ranks, seq_layout="contiguous"):
        from .checks import whole  # whole numbers (ints, numpy ints, integer tensors) or refused
        seq, heads, ranks = whole(seq, "seq"), whole(heads, "heads"), whole(ranks, "ranks")
        if heads < 1:
            raise ValueError(f"layout: heads must be at least 1, got {heads}")
        if ranks < 1:
            raise ValueError(f"sequence parallelism needs at least 1 rank, got group size {ranks}")
        if seq < ranks:
            raise ValueError(f"sequence length {seq} is shorter than the group size {ranks}: every "
                             "rank must hold at least one token; use a longer sequence or fewer ranks")
        if check_seq_layout(seq_layout) == "contiguous":
            return cls(_split(seq, ranks), _split(heads, ranks))
        # S >= P leaves chunk r (r < P) at least one token, so every rank holds one.
        ranges = [mirrored_chunks(seq, ranks, r) for r in range(ranks)]
        return cls([sum(e - b for b, e in rr) for rr in ranges], _split(heads, ranks), ranges,
                   seq_layout)

    def positions(self, r):
        """Rank r's tokens' global positions, in its shard's row order."""
        return [t for b, e in self.seq_ranges[r] for t in range(b, e)]

    def describe(self):
        return ("seq " + "+".join(map(str, self.seq_count)) +
                (" zigzag" if self.seq_layout == "zigzag" else "") +
                ", heads " + "+".join(map(str, self.head_count)))


class HeadContextGrid:
    """laga2d's grid: Ph head groups x Pc context groups, rank r in head group
    r // Pc and context group r % Pc (order "head_major"; a2a_p2p's
    "context_major": context group r // Ph, head group r % Ph, a context
    group's ranks consecutive); the sequence cut into 2 Pc chunks and
    context group c attends chunks c and 2Pc-1-c (adjacent ones merged)."""

    def __init__(self, layout, head_groups, order="head_major"):
        P = layout.ranks
        if not 1 <= head_groups <= P:
            raise ValueError(f"head_groups {head_groups} must be between 1 and the group size {P} "
                             "(the ranks form head groups x context groups)")
        if P % head_groups:
            raise ValueError(f"head_groups {head_groups} does not divide the group size {P}: every "
                             f"head group needs the same number of context groups; choose a divisor "
                             f"of {P} or leave head_groups out (laga picks gcd(heads, ranks))")
        self.head_groups, self.context_groups = head_groups, P // head_groups
        self.order = order
        Pc = self.context_groups
        group_heads = layout.head_count if head_groups == P else _split(layout.heads, head_groups)
        group_off = _offsets(group_heads)
        self.head_count, self.head_offset, self.queries = [], [], []
        for r in range(P):
            g = self.head_group(r)
            self.head_count.append(group_heads[g])
            self.head_offset.append(group_off[g])
            self.queries.append(mirrored_chunks(layout.seq, Pc, self.context_group(r)))

    def head_group(self, r):
        return r // self.context_groups if self.order == "head_major" else r % self.head_groups

    def context_group(self, r):
        return r % self.context_groups if self.order == "head_major" else r // self.head_groups

    def rank_at(self, hg, cg):
        return hg * self.context_groups + cg if self.order == "head_major" else \
            cg * self.head_groups + hg

    @staticmethod
    def default_head_groups(heads, ranks):
        return math.gcd(heads, ranks)

    @staticmethod
    def ring_default_head_groups(heads, ranks):
        """a2a_p2p's default: the largest divisor of P below P that divides H
        (1 at P 1 and 2), so that a ring of Pc >= 2 context groups remains."""
        for d in range(ranks - 1, 1, -1):
            if ranks % d == 0 and heads % d == 0:
                return d
        return 1

    def query_rows(self, r):
        return sum(e - b for b, e in self.queries[r])

    def key_end(self, r):
        return self.queries[r][-1][1] if self.queries[r] else 0
