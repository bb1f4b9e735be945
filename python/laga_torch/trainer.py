"""What a PyTorch 2 trainer does with the module (docs/pytorch.md,
"Trainers"): autocast's dtype, torch.compile's opaque op, and the
gradient composition DistributedDataParallel and FSDP2 need.

* autocast: MLA.forward runs the block in autocast's dtype (input and
  weights cast once, differentiably) with autocast off inside, so that
  laga's tape keeps one dtype between forward and its hand-written backward
  (autocast's per-op casts gave bf16 activations and fp32 weights there).
* torch.compile: under dynamo MLA.forward is one custom op (`laga::block`,
  torch.library.custom_op, torch 2.4+) that runs the eager forward, checks
  and collectives included, and keeps its autograd graph for the backward
  op (`laga::block_backward`) by a handle: the compiled graph holds no break
  where the module is (its host syncs, collectives and Python loops run
  inside the op, as flash-attn's kernels are opaque ops), and the values
  are the eager module's. The kept graph goes with the handle tensor (a
  weakref finalizer), so a forward whose backward never runs frees it.
* Gradients: each rank's gradient is its part of the objective's, so the
  ranks of a sequence-parallel group must SUM them (sync_gradients does);
  DistributedDataParallel and FSDP2 AVERAGE over their group.
  `sum_over_sequence_ranks` makes a DDP comm hook that sums over the sequence
  ranks and averages over the data-parallel replicas only.
"""

import itertools
import weakref

import torch
import torch.distributed as dist

_MODULES = weakref.WeakValueDictionary()  # id(module) -> MLA, for the opaque op
_GROUPS = {}  # id(group) -> group, for the opaque op
_GRAPHS = {}  # handle -> (out, leaves): the eager graph kept for the backward op
_HANDLES = itertools.count(1)


def register(module):
    _MODULES[id(module)] = module


def autocast_dtype(x):
    """autocast's dtype for x's device where autocast is on there (and x is a
    floating tensor), else None. torch 2.4+ asks by device type; 1.13 has
    the cpu and cuda pairs."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    dev = x.device.type
    try:
        on = torch.is_autocast_enabled(dev)
        return torch.get_autocast_dtype(dev) if on else None
    except TypeError:  # torch < 2.4
        if dev == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        if dev == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return None


def compiling():
    """Whether dynamo is tracing this call (False on a torch without it)."""
    comp = getattr(torch, "compiler", None)
    if comp is not None and hasattr(comp, "is_compiling"):
        return comp.is_compiling()
    return False


def _define_ops():
    """laga::block and laga::block_backward, where torch has custom_op."""
    if not hasattr(torch.library, "custom_op"):
        return None
    from typing import List, Optional, Tuple

    @torch.library.custom_op("laga::block", mutates_args=())
    def block(x: torch.Tensor, weights: List[torch.Tensor], module: int, group: int,
              seq_len: int, cu_json: str, cu_tensor: Optional[torch.Tensor],
              needs_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        import json
        mla = _MODULES[module]
        names = [n for n, _ in mla.named_parameters()]
        cu = cu_tensor if cu_tensor is not None else (json.loads(cu_json) if cu_json else None)
        args = (_GROUPS.get(group), cu, seq_len if seq_len >= 0 else None)
        handle = next(_HANDLES)
        with torch.autocast(x.device.type, enabled=False):
            if not needs_grad:
                with torch.no_grad():
                    out = mla.run_block(x, *args, weights=dict(zip(names, weights)))
                return out, torch.zeros((), dtype=torch.long)
            with torch.enable_grad(), _autograd_recorded(), \
                    torch.autocast(x.device.type, enabled=False):
                leaves = [t.detach().requires_grad_(True) for t in [x] + list(weights)]
                out = mla.run_block(leaves[0], *args, weights=dict(zip(names, leaves[1:])))
        _GRAPHS[handle] = (out, leaves)
        h = torch.tensor(handle, dtype=torch.long)
        # The graph lives as long as the handle: a forward whose backward
        # never runs (its output dropped) frees it with the handle.
        weakref.finalize(h, _GRAPHS.pop, handle, None)
        return out.detach(), h

    @block.register_fake
    def _(x, weights, module, group, seq_len, cu_json, cu_tensor, needs_grad):
        mla = _MODULES[module]
        return x.new_empty(x.shape[:2] + (mla.cfg.dim,)), x.new_empty((), dtype=torch.long)

    @torch.library.custom_op("laga::block_backward", mutates_args=())
    def block_backward(handle: torch.Tensor, dout: torch.Tensor, x: torch.Tensor,
                       weights: List[torch.Tensor]) -> List[torch.Tensor]:
        key = int(handle)
        if key not in _GRAPHS:
            raise RuntimeError("laga::block_backward: the forward's graph is gone (a second "
                               "backward through a compiled MLA, or one after its forward ran "
                               "without grad); call backward once per forward")
        out, leaves = _GRAPHS.pop(key)
        with _autograd_recorded(), torch.autocast(dout.device.type, enabled=False):
            grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]

    @block_backward.register_fake
    def _(handle, dout, x, weights):
        return [torch.empty_like(x)] + [torch.empty_like(w) for w in weights]

    def setup_context(ctx, inputs, output):
        x, weights = inputs[0], inputs[1]
        ctx.save_for_backward(output[1], x, *weights)

    def backward(ctx, dout, _dhandle):
        handle, x, *weights = ctx.saved_tensors
        g = block_backward(handle, dout.contiguous(), x, weights)
        return g[0], list(g[1:]), None, None, None, None, None, None

    block.register_autograd(backward, setup_context=setup_context)
    return block


def _autograd_recorded():
    """A custom op's implementation runs with autograd's dispatch keys
    excluded (below autograd): include them again so the eager forward
    inside records its graph (the backward op differentiates it). This
    clears autocast's exclusion too: the callers turn autocast off again
    inside it."""
    C = torch._C
    ex = C._dispatch_tls_local_exclude_set()
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), ex - ex)


_BLOCK = _define_ops()  # at import: dynamo cannot trace an op's definition


def opaque_forward(mla, x, group, cu_seqlens, seq_len, amp):
    """MLA.forward under dynamo: one call of laga::block (its checks and
    collectives inside), with autocast's casts outside it."""
    if _BLOCK is None:
        raise RuntimeError(f"torch.compile of laga_torch.MLA needs torch.library.custom_op "
                           f"(torch 2.4 or later); this is torch {torch.__version__}")
    weights = [p for _, p in mla.named_parameters()]
    if amp is not None:
        x, weights = x.to(amp), [w.to(amp) for w in weights]
    gid = 0
    if group is not None:
        gid = id(group)
        _GROUPS[gid] = group
    cu_json, cu_tensor = "", None
    if isinstance(cu_seqlens, torch.Tensor):
        cu_tensor = cu_seqlens
    elif cu_seqlens is not None:  # (a JSON text built by hand: dynamo cannot trace json)
        cu_json = "[" + ", ".join(
            "[" + ", ".join(str(int(v)) for v in r) + "]" if isinstance(r, (list, tuple))
            else str(int(r)) for r in cu_seqlens) + "]"
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or
                                               any(w.requires_grad for w in weights))
    out, _ = _BLOCK(x, weights, id(mla), gid, -1 if seq_len is None else int(seq_len), cu_json,
                    cu_tensor, needs_grad)
    return out


def sum_over_sequence_ranks(dp_replicas=1):
    """A DistributedDataParallel comm hook (register_comm_hook(group, hook)):
    each gradient bucket summed over the DDP group (the `state` it is
    registered with; None: the world), divided by the number of
    data-parallel replicas only.

    Each rank of a sequence-parallel group holds its part of the
    objective's gradient (its tokens' losses, and what its collectives'
    adjoints brought back from its peers), so the group's ranks must sum;
    DDP's own hook averages over every rank: 1/sp_size of the right
    gradient when the DDP group is the sequence group. `dp_replicas` is how
    many sequence groups the DDP group holds (its size / the sequence
    group's; 1 when the DDP group is one sequence's): they average, as data
    parallelism does.

        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, laga_torch.sum_over_sequence_ranks(dp_replicas=1))
    """
    from .checks import whole
    dp_replicas = whole(dp_replicas, "dp_replicas")
    if dp_replicas < 1:
        raise ValueError(f"dp_replicas {dp_replicas}: expected the number (>= 1) of "
                         "data-parallel replicas in the DDP group")

    def sum_over_sequence_ranks_hook(state, bucket):
        buf = bucket.buffer()
        if dp_replicas > 1:
            buf.div_(dp_replicas)
        fut = dist.all_reduce(buf, group=state, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    return sum_over_sequence_ranks_hook
