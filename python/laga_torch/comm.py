"""The forms' data movements as autograd functions over a ProcessGroup, and
their ledger. The C++ side is src/mla/exchange.{hpp,cpp} (docs/forms.md, "The
four data movements"); the ledger's (phase, label) rows and byte rule are
src/comm's and src/mla/comm_model.cpp's (docs/accounting.md).

Every movement is one `redistribute` between two placements of (token ranges
x head range): seq_to_head, head_to_seq, laga2d's query chunks, and the
latent all-gather (each rank's shard to every rank's "all tokens") whose
adjoint, the copies' gradients summed at their owner, is the reduce-scatter.
It runs as one `all_to_all_single` with per-peer split sizes: gloo has it in
torch 1.13 (which lacks gloo's `_allgather_base` and reduce-scatter), NCCL
has it natively, and uneven shards need nothing else.
"""

import torch
import torch.distributed as dist


class Ledger:
    """Bytes per (phase, label), as the C++ Communicator files them: `sent`
    and `received` count what goes to and comes from peers (a rank's own
    block stays local), `calls` every collective made, even at P = 1."""

    def __init__(self):
        self.rows = {}
        self.kernels = {}  # (phase, attention kernel) -> calls (dispatch.py)

    def add(self, phase, label, sent, received):
        row = self.rows.setdefault((phase, label), {"calls": 0, "sent": 0, "received": 0})
        row["calls"] += 1
        row["sent"] += sent
        row["received"] += received

    def clear(self):
        self.rows.clear()
        self.kernels.clear()


class Placement:
    """What a rank holds: ascending, disjoint token ranges x heads [h0, h0+nh)."""

    def __init__(self, ranges, h0, nh):
        self.ranges, self.h0, self.nh = [(b, e) for b, e in ranges if e > b], h0, nh

    def tokens(self):
        return [t for b, e in self.ranges for t in range(b, e)]


class Plan:
    """Rank `rank`'s side of moving (B, tokens, heads, d) from placements
    `src` to placements `dst` (one per rank): per peer, the local token
    indices and head slice it sends, and where what it receives lands."""

    def __init__(self, src, dst, rank, batch, width, label):
        self.rank, self.batch, self.width, self.label = rank, batch, width, label
        P = len(src)
        tok = [p.tokens() for p in src], [p.tokens() for p in dst]
        local = [{t: i for i, t in enumerate(ts)} for ts in tok[0]], \
                [{t: i for i, t in enumerate(ts)} for ts in tok[1]]

        def block(i, j):  # tokens and heads rank i sends rank j
            s = set(tok[1][j])
            ts = [t for t in tok[0][i] if t in s]
            h0 = max(src[i].h0, dst[j].h0)
            h1 = min(src[i].h0 + src[i].nh, dst[j].h0 + dst[j].nh)
            return ts, h0, max(h1, h0)

        self.src_shape = (batch, len(tok[0][rank]), src[rank].nh, width)
        self.dst_shape = (batch, len(tok[1][rank]), dst[rank].nh, width)
        self.send, self.recv = [], []  # (token index tensor, head slice in the local tensor, count)
        for j in range(P):
            ts, h0, h1 = block(rank, j)
            self.send.append(([local[0][rank][t] for t in ts], h0 - src[rank].h0, h1 - src[rank].h0))
            ts, h0, h1 = block(j, rank)
            self.recv.append(([local[1][rank][t] for t in ts], h0 - dst[rank].h0, h1 - dst[rank].h0))

    def sizes(self, side):
        return [self.batch * len(t) * (h1 - h0) * self.width for t, h0, h1 in side]

    def peer_bytes(self, side, elem):
        return sum(n for j, n in enumerate(self.sizes(side)) if j != self.rank) * elem


def _pack(x, side):
    """The blocks of x (B, T, H, d) for each peer, flattened in rank order."""
    parts = []
    for idx, h0, h1 in side:
        i = torch.tensor(idx, dtype=torch.long, device=x.device)
        parts.append(x.index_select(1, i)[:, :, h0:h1].reshape(-1))
    return torch.cat(parts)


def _unpack_add(flat, side, shape):
    """The inverse of _pack, summing blocks that land on the same element
    (the adjoint of a placement that holds copies) in rank order."""
    out = flat.new_zeros(shape)
    pieces = flat.split([shape[0] * len(t) * (h1 - h0) * shape[3] for t, h0, h1 in side])
    for (idx, h0, h1), p in zip(side, pieces):
        if idx and h1 > h0:
            i = torch.tensor(idx, dtype=torch.long, device=flat.device)
            out[:, :, h0:h1].index_add_(1, i, p.view(shape[0], len(idx), h1 - h0, shape[3]))
    return out


def _exchange(flat, send_sizes, recv_sizes, group, async_op=False):
    out = flat.new_empty(sum(recv_sizes))
    # A movement copies bits, so bf16 travels as bytes: gloo in torch 1.13
    # refuses bf16 and int16 ("Invalid scalar type"); the bytes are the same.
    if flat.dtype == torch.bfloat16:
        work = dist.all_to_all_single(out.view(torch.uint8), flat.view(torch.uint8),
                                      [2 * n for n in recv_sizes], [2 * n for n in send_sizes],
                                      group=group, async_op=async_op)
    else:
        work = dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=group,
                                      async_op=async_op)
    return out, work


def _start(x, plan, group, ledger, phase, adjoint, async_op):
    """Files the call in the ledger, packs x's blocks and all-to-alls them:
    (flat receive buffer, work). adjoint: the way back, dst -> src."""
    send, recv = (plan.recv, plan.send) if adjoint else (plan.send, plan.recv)
    if ledger is not None:
        ledger.add(phase, plan.label, plan.peer_bytes(send, x.element_size()),
                   plan.peer_bytes(recv, x.element_size()))
    return _exchange(_pack(x.contiguous(), send), plan.sizes(send), plan.sizes(recv), group,
                     async_op=async_op)


def move(x, plan, group, ledger, phase, adjoint=False, started=None):
    """One movement outside autograd: x (src placement) -> dst placement, or
    with adjoint=True the way back (dst -> src), the copies' gradients summed
    at their owner. With `started` (a list) the all-to-all is only started and
    the flat receive buffer is returned: append the work, wait, then unpack."""
    flat, work = _start(x, plan, group, ledger, phase, adjoint, started is not None)
    if started is not None:
        started.append(work)
        return flat
    side, shape = (plan.send, plan.src_shape) if adjoint else (plan.recv, plan.dst_shape)
    return _unpack_add(flat, side, shape)


class _Exchange(torch.autograd.Function):
    """Forward: pack this rank's blocks and all-to-all them; returns the flat
    receive buffer (rank-major). Backward: the flat gradient back the other
    way, each block's gradient added where its elements came from (copies
    summed at their owner: the all-gather's adjoint is the reduce-scatter).
    Saves nothing but the plan: a data movement has no state to keep."""

    @staticmethod
    def forward(ctx, x, plan, group, ledger, started):
        ctx.plan, ctx.group, ctx.ledger = plan, group, ledger
        flat, work = _start(x, plan, group, ledger, "forward", False, started is not None)
        if started is not None:
            started.append(work)  # the caller waits before reading `flat`
        return flat

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        if ctx.ledger is not None:
            ctx.ledger.add("backward", plan.label, plan.peer_bytes(plan.recv, grad.element_size()),
                           plan.peer_bytes(plan.send, grad.element_size()))
        flat = _AllToAll.apply(grad.contiguous(), plan.sizes(plan.recv), plan.sizes(plan.send),
                               ctx.group)
        return _unpack_add(flat, plan.send, plan.src_shape), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """The flat all-to-all of _Exchange's backward, itself differentiable (a
    linear map whose adjoint is the all-to-all the other way, so a
    gradient of the gradient (create_graph=True) moves back correctly);
    _unpack_add and _pack are torch ops autograd differentiates."""

    @staticmethod
    def forward(ctx, flat, send_sizes, recv_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        return _exchange(flat, send_sizes, recv_sizes, group)[0]

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes = ctx.sizes
        return _AllToAll.apply(grad.contiguous(), recv_sizes, send_sizes, ctx.group), None, \
            None, None


class _Unpack(torch.autograd.Function):
    """The receive buffer placed into (B, T_dst, H_dst, d); its adjoint packs."""

    @staticmethod
    def forward(ctx, flat, plan):
        ctx.plan = plan
        return _unpack_add(flat, plan.recv, plan.dst_shape)

    @staticmethod
    def backward(ctx, grad):
        return _pack(grad.contiguous(), ctx.plan.recv), None


def _check(x, plan):
    if tuple(x.shape) != plan.src_shape:
        raise ValueError(f"{plan.label}: this rank holds {tuple(x.shape)}, the plan expects "
                         f"{plan.src_shape}")


def redistribute(x, plan, group, ledger=None):
    """x (B, T_src, H_src, d) on this rank -> (B, T_dst, H_dst, d)."""
    _check(x, plan)
    return _Unpack.apply(_Exchange.apply(x, plan, group, ledger, None), plan)


def start_redistribute(x, plan, group, ledger=None):
    """The started form (`overlap`, docs/forms.md "Overlap"): the all-to-all
    is on the wire when this returns; the returned wait() gives the result.
    Backward runs it blocking (same bytes, same values)."""
    _check(x, plan)
    started = []
    flat = _Exchange.apply(x, plan, group, ledger, started)

    def wait():
        started[0].wait()
        return _Unpack.apply(flat, plan)
    return wait


def _global_rank(group, rank):
    """A group rank as the global rank P2POp takes (dist.get_global_rank,
    which torch 1.13 has; the private _get_global_rank where it is missing)."""
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(group, rank)
    return dist.distributed_c10d._get_global_rank(group, rank)


def ring_peers(P, r, ring=None):
    """(to, from) of rank r of P in a ring shift forward: r + 1 and r - 1, or
    in rings of `size` ranks `stride` apart, ring = (size, stride), the next
    and previous member of r's ring (the C++ ring_peers, Ring)."""
    size, stride = ring if ring else (P, 1)
    block = size * stride
    base, place = r - r % block + r % stride, (r % block) // stride
    return base + (place + 1) % size * stride, base + (place - 1) % size * stride


def start_ring_shift(x, recv_numel, group, ledger, phase, label, ring=None):
    """One ring shift (the C++ Communicator::ring_shift, rank r -> r + 1;
    ring = (size, stride): within r's ring, ring_peers):
    sends the flat x to rank r + 1 and receives recv_numel elements from
    rank r - 1, as one batch_isend_irecv; returns (the receive buffer, wait).
    The ledger files it as the C++ does: x's bytes sent, the buffer's
    received, one call. Only called at P > 1 (a ring of one rank has no
    neighbour: the C++ ring makes no shift there and files nothing). bf16
    travels as bytes, as in _exchange (gloo in torch 1.13 refuses bf16)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    out = x.new_empty(recv_numel)
    if ledger is not None:
        ledger.add(phase, label, x.numel() * x.element_size(), recv_numel * x.element_size())
    send, recv = x.contiguous(), out
    if x.dtype == torch.bfloat16:
        send, recv = send.view(torch.uint8), out.view(torch.uint8)
    to, frm = ring_peers(P, r, ring)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, _global_rank(group, to), group),
        dist.P2POp(dist.irecv, recv, _global_rank(group, frm), group)])

    held = [send]  # referenced until the wait: the transfer reads it

    def wait():  # the works dropped once done: a closure kept past the wait holds no gloo work
        for q in reqs:
            q.wait()
        reqs.clear()
        held.clear()
        return out
    return out, wait
