"""The invariant mode (MLA(..., invariant=True); docs/pytorch_invariant.md):
out, dx and every parameter gradient bitwise the same at every P, for the
forms whose row says `invariant` (forms.FORMS).

What changes bits when P changes, and what this file does about each:

- A GEMM's result for one row depends on how many rows it is given (torch's
  CPU GEMMs change their blocking with M; measured on torch 1.13 and 2.15,
  float32 and float64) and, on torch 1.13 float32, on how many columns.
  `rows_mm` computes a rank's token rows in blocks of CHUNK rows aligned to
  the GLOBAL sequence (token t at row t mod CHUNK of block t // CHUNK, the
  rows the rank lacks zero), one GEMM call of the same shape per block, so
  a token's row is computed by the same call, at the same place, at every
  P. Per-head GEMMs (`per_head_mm`) give every head's columns the same
  shape whatever the rank's number of heads.
- A reduction over tokens (a weight's gradient, RMSNorm's weight gradient,
  the loss) summed per rank and then all-reduced in an order that depends
  on P. `TokenTree` sums fixed chunks of CHUNK tokens of the global
  sequence (each chunk on one rank, the rank holding its first token; a
  chunk cut by a shard boundary is completed there by one exchange), then
  combines the chunks in ONE binary tree over the global chunk index: node
  (l, j) spans chunks [j 2^l, (j + 1) 2^l) and is its left child plus its
  right child (just its left child where the right one starts past the last
  chunk). Each rank computes the maximal nodes that lie inside its chunks,
  the nodes are exchanged, and every rank finishes the same tree: the same
  additions in the same order at every P.
- A reduction over heads (the latent's gradient, summed over the heads that
  read it, which laga's reduce-scatter sums per rank and then in rank
  order): every head's part is moved to the token's owner
  (head_to_seq) and summed there in the same binary tree over the head
  index (`head_tree_sum`).

- allgather_kv's keys' gradients, summed over the ranks holding the queries
  (its reduce-scatter, in rank order): each query chunk's backward runs
  whole on the chunk's owner and the chunks' dK, dV are summed in the token
  tree (tape._gather_backward_invariant).

Not covered, and refused by the rows (forms.INVARIANT_REFUSAL): the ring
forms' log-sum-exp merge follows the ring's P blocks; laga2d's query chunks
follow P and its keys' gradients are summed over a head group's ranks.
"""

import torch

from .comm import Placement, Plan, _exchange, move

CHUNK = 64  # tokens per leaf of the token tree, and rows per GEMM block (independent of P)

# Test-only mutation (tests/tools/test_torch_invariant.py): sum each rank's
# chunks in order and then the ranks' partials in rank order, the all-reduce
# order the mode replaces. The test requires P > 1 to differ from P 1.
RANK_ORDER_MUTATION = False


def _levels(n):
    """The tree's height over n leaves: 2^levels >= n."""
    return max(n - 1, 0).bit_length()


def tree_nodes(a, b, n):
    """The maximal nodes (l, j) of the binary tree over n leaves whose spans
    [j 2^l, min((j+1) 2^l, n)) lie inside [a, b), in order."""
    out, i, top = [], a, _levels(n)
    while i < b:
        lv = 0
        while lv < top and i % (2 << lv) == 0 and min(i + (2 << lv), n) <= b:
            lv += 1
        out.append((lv, i >> lv))
        i = min(i + (1 << lv), n)
    return out


def tree_value(lv, j, n, known, leaf):
    """Node (lv, j) of the tree over n leaves: known[(lv, j)] where given,
    leaf(j) at level 0, else left + right (left alone where the right child
    starts at or past n). The one summation order of every canonical sum."""
    if (lv, j) in known:
        return known[(lv, j)]
    if lv == 0:
        return leaf(j)
    left = tree_value(lv - 1, 2 * j, n, known, leaf)
    if (2 * j + 1) << (lv - 1) >= n:
        return left
    return left + tree_value(lv - 1, 2 * j + 1, n, known, leaf)


def tree_sum(parts):
    """parts (a list, or a tensor's leading axis) summed in the canonical tree."""
    n = len(parts)
    return tree_value(_levels(n), 0, n, {}, lambda j: parts[j])


def head_tree_sum(x, dim):
    """x summed over `dim` (the head axis, every head present) in the tree."""
    return tree_sum(x.unbind(dim))


def rows_mm(a, w, own):
    """a (B, L, K) @ w (K, N) for the rank's tokens `own` (L global
    positions, the shard's row order), each CHUNK-row block of the global
    sequence one GEMM of shape (B CHUNK, K) x (K, N)."""
    B, L, K = a.shape
    out = a.new_empty(B, L, w.shape[1])
    pos = own.tolist()
    blocks = {}
    for i, t in enumerate(pos):
        blocks.setdefault(t // CHUNK, []).append((i, t % CHUNK))
    dev = a.device
    for c, rows in blocks.items():
        src = torch.tensor([i for i, _ in rows], dtype=torch.long, device=dev)
        at = torch.tensor([r for _, r in rows], dtype=torch.long, device=dev)
        blk = a.new_zeros(B, CHUNK, K)
        blk[:, at] = a[:, src]
        out[:, src] = (blk.reshape(B * CHUNK, K) @ w).view(B, CHUNK, -1)[:, at]
    return out


def per_head(fn, heads, empty):
    """torch.stack([fn(i) for i in range(heads)], 2), or `empty` (the
    shape with 0 heads) on a rank without heads."""
    return torch.stack([fn(i) for i in range(heads)], 2) if heads else empty


def per_head_mm(a, w, heads, n):
    """a (B, T, K) @ w^T for w (heads n, K) one head's n rows at a time:
    (B, T, heads, n)."""
    return per_head(lambda i: a @ w[i * n:(i + 1) * n].t(), heads,
                    a.new_zeros(a.shape[0], a.shape[1], 0, n))


def _pad_chunks(x, n_tokens):
    """x (B, T, W) of T = whole chunks' tokens (the last maybe short) as
    (chunks, B CHUNK, W), zero past the tokens."""
    B, T, W = x.shape
    nc = -(-T // CHUNK)
    p = x.new_zeros(B, nc * CHUNK, W)
    p[:, :T] = x
    return p.view(B, nc, CHUNK, W).transpose(0, 1).reshape(nc, B * CHUNK, W)


def local_token_grad(dy, x):
    """sum over tokens of dy_t^T x_t for dy (B, S, N), x (B, S, K) held whole
    on one rank (a head's rows, after the latent's all-gather): the chunks'
    GEMMs (N, B CHUNK) x (B CHUNK, K) in the canonical tree. (N, K)."""
    S = dy.shape[1]
    d, xs = _pad_chunks(dy, S), _pad_chunks(x, S)
    return tree_value(_levels(len(d)), 0, len(d), {}, lambda c: d[c].t() @ xs[c])


class TokenTree:
    """This rank's part of the canonical sums over the global sequence's
    tokens (see the module docstring): which chunks it owns, the exchange
    that completes them, the nodes it computes."""

    def __init__(self, layout, rank, group, ledger, batch):
        self.layout, self.rank, self.group, self.ledger, self.batch = \
            layout, rank, group, ledger, batch
        S, P = layout.seq, layout.ranks
        self.n = -(-S // CHUNK)
        holder = {}
        for r in range(P):
            for b, e in layout.seq_ranges[r]:
                for c in range(-(-b // CHUNK), -(-e // CHUNK)):
                    holder[c] = r  # the rank holding the chunk's first token
        self.owned = [[c for c in range(self.n) if holder[c] == r] for r in range(P)]
        self.ranges = [[(c * CHUNK, min(c * CHUNK + CHUNK, S)) for c in cs] for cs in self.owned]
        self.nodes = []  # per rank: the maximal nodes inside its chunks
        for cs in self.owned:
            nodes, i = [], 0
            while i < len(cs):  # each run of consecutive chunks
                k = i
                while k + 1 < len(cs) and cs[k + 1] == cs[k] + 1:
                    k += 1
                nodes += tree_nodes(cs[i], cs[k] + 1, self.n)
                i = k + 1
            self.nodes.append(nodes)
        self._plans = {}

    def _plan(self, W, label):
        """The movement of (B, tokens, 1, W) from the shards to the chunks'
        owners (each owner the tokens of its chunks, in chunk order)."""
        if W not in self._plans:
            P = self.layout.ranks
            src = [Placement(self.layout.seq_ranges[r], 0, 1) for r in range(P)]
            dst = [Placement(self.ranges[r], 0, 1) for r in range(P)]
            self._plans[W] = Plan(src, dst, self.rank, self.batch, W, label)
        return self._plans[W]

    def _to_owners(self, x, label):
        """x (B, L, W) of the shard -> (chunks owned, B CHUNK, W), padded."""
        t = move(x.unsqueeze(2), self._plan(x.shape[-1], label), self.group, self.ledger,
                 "backward")[:, :, 0]
        return _pad_chunks(t, t.shape[1])

    def from_owners(self, per_chunk, width, like, label):
        """The owners' rows back to the shards: per_chunk {chunk: (B, n, W)}
        of this rank's chunks -> (B, L, W) of its shard (the exchange's
        adjoint; each token has one copy)."""
        B = self.batch
        rows = [per_chunk[c] for c in self.owned[self.rank]]
        t = torch.cat(rows, 1) if rows else like.new_zeros(B, 0, width)
        return move(t.unsqueeze(2), self._plan(width, label), self.group, self.ledger,
                    "backward", adjoint=True)[:, :, 0]

    def reduce(self, leaf_of, parts, shape, label):
        """The canonical sum of leaf_of(c, *chunk c's parts) (a tensor of
        `shape`) over every chunk c of the sequence, the same tensor on every
        rank. parts: tensors (B, L, W_i) of the shard's tokens (concatenated
        for one exchange); a chunk's part is (B CHUNK, W_i), b-major, zero
        past the sequence."""
        widths = [p.shape[-1] for p in parts]
        both = self._to_owners(torch.cat(parts, -1), label).split(widths, -1)
        mine = {c: i for i, c in enumerate(self.owned[self.rank])}

        def leaf(c):
            return leaf_of(c, *[p[mine[c]] for p in both])

        if RANK_ORDER_MUTATION:
            return self._rank_order(leaf, shape, parts[0])
        known = {}
        for lv, j in self.nodes[self.rank]:
            known[(lv, j)] = tree_value(lv, j, self.n, {}, leaf)
        return tree_value(_levels(self.n), 0, self.n, self._share(known, shape, parts[0]), leaf)

    def _share(self, known, shape, like):
        """Every rank's nodes to every rank: one all-to-all, each rank
        sending its nodes to every peer (a rank without chunks sends none)."""
        P = self.layout.ranks
        if P == 1:
            return known
        numel = 1
        for s in shape:
            numel *= s
        mine = [known[k].reshape(-1) for k in self.nodes[self.rank]]
        flat = torch.cat(mine * P) if mine else like.new_zeros(0)
        counts = [len(self.nodes[r]) * numel for r in range(P)]
        send = [counts[self.rank]] * P
        if self.ledger is not None:
            el = flat.element_size()
            self.ledger.add("backward", "grad_tree", (P - 1) * counts[self.rank] * el,
                            (sum(counts) - counts[self.rank]) * el)
        out, _ = _exchange(flat, send, counts, self.group)
        got, at = {}, 0
        for r in range(P):
            for k in self.nodes[r]:
                got[k] = out[at:at + numel].view(shape)
                at += numel
        return got

    def _rank_order(self, leaf, shape, like):
        """The mutation: this rank's chunks summed in order, then the
        ranks' partials in rank order (what an all-reduce does)."""
        P = self.layout.ranks
        acc = like.new_zeros(shape)
        for c in self.owned[self.rank]:
            acc = acc + leaf(c)
        if P == 1:
            return acc
        flat = acc.reshape(-1)
        out, _ = _exchange(torch.cat([flat] * P), [flat.numel()] * P, [flat.numel()] * P,
                           self.group)
        parts = out.view(P, *acc.shape)
        tot = parts[0]
        for r in range(1, P):
            tot = tot + parts[r]
        return tot

    def weight_grad(self, dy, x, label="grad_tree"):
        """sum over the sequence's tokens of dy_t^T x_t: (N, K), every rank."""
        return self.reduce(lambda c, d, a: d.t() @ a, [dy, x], (dy.shape[-1], x.shape[-1]),
                           label)

    def column_sum(self, v, label="grad_tree"):
        """sum over the sequence's tokens of v_t (B, L, W): (W,), every rank."""
        return self.reduce(lambda c, a: a.sum(0), [v], (v.shape[-1],), label)


def gather_head_rows(g, layout, rank, group, rows_per_head, ledger=None):
    """wkv_b's (or any per-head) gradient rows, each head's computed whole
    on the rank holding it: g (nh rows_per_head, K) of this rank's heads ->
    (H rows_per_head, K) on every rank, by copies (no sums; `grad_rows` in
    the ledger)."""
    P = layout.ranks
    if P == 1:
        return g
    K = g.shape[-1]
    counts = [layout.head_count[r] * rows_per_head * K for r in range(P)]
    flat = g.reshape(-1)
    if ledger is not None:
        el = flat.element_size()
        ledger.add("backward", "grad_rows", (P - 1) * counts[rank] * el,
                   (sum(counts) - counts[rank]) * el)
    out, _ = _exchange(torch.cat([flat] * P) if flat.numel() else flat,
                       [flat.numel()] * P, counts, group)
    return out.view(-1, K)
