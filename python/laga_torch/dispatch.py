"""The attention dispatch: which kernel computes a flash-style attention call
(o and the log-sum-exp per row, backward from them), chosen per call for
the shape, dtype and device (docs/pytorch.md, "The attention dispatch").

Every form on both tapes calls forward / backward here where it calls flash
attention (tape.Block, ring.ring_forward / ring_backward, fused.py,
attention._FlashAttention): the same operands, the key ranges (row i sees
keys [lo, hi): its document's start to itself), and the same results: o
(B, Sq, H, dv), lse (B, H, Sq) in the accumulation type (natural log of the
scaled scores; 0, with o = 0, for a row that sees no key), and dq, dk, dv.
So what laga's tape keeps for backward is the same whichever kernel runs
(o and lse, never probabilities: the saved-bytes tests hold it).

The kernels (supports() names why one cannot run a call, with the value it
refuses, as flashinfer's dispatch errors do); "auto" takes the first of
PREFERENCE[device] that supports the call: on CUDA FlashAttention-3, -4,
cuDNN, the memory-efficient kernel, flex, the tiles (an order from the
kernels' published speeds, not measured here: no GPU); the tiles on the CPU
(flex's CPU path is unfused), where flex runs when asked for
(MLA(attention_kernel="flex"); tools_torch_dispatch):

  fa3, fa4, cudnn, efficient   varlen kernels (dispatch_varlen.py): the key
         ranges as packed documents (cu_seqlens), one call per mask kind,
         lse brought back to (B, H, Sq); backward from the o and lse given
         (cuDNN / efficient: their backward ops take them; FlashAttention:
         merged_backward's correction of its recompute).
         None has run for real (no GPU); tested against stand-ins with the
         real signatures (tools_torch_dispatch_varlen). NEEDS below says
         what each takes (dtype, heads, head dims, device, GPU generation).
  flex   torch.nn.attention.flex_attention (torch 2.5+) with a block mask
         built from the key ranges (packed documents, laga2d's chunks, a
         ring's rectangles: never a dense mask, never V padded), any head
         dims, a shared key head through enable_gqa; compiled on CUDA, its
         eager (unfused) path on the CPU, which is what the suite runs.
         Backward (CUDA) recomputes the call under autograd from q, k, v,
         corrected to the o and lse given (a ring step's merged row's:
         dispatch_varlen.merged_backward);
         torch's FlexAttention has no CPU backward, so on the CPU the tiles
         differentiate flex's o and lse (flash's backward reads only them).
  tiles  the package's flash tiles in torch ops (attention.flash_forward /
         flash_backward): every torch, every device; the only kernel that
         keeps a non-finite value inside its document (exact products), so
         a call with a NaN or inf operand runs here.

The choice is logged once per (kernel, call kind) on logger `laga_torch`
and, where a ledger records the run, counted in ledger.kernels[(phase,
kernel)] (Ledger.kernels).
"""

import contextlib
import dataclasses
import enum
import logging
import threading
import warnings

import torch

from . import dispatch_varlen as varlen
from .attention import _acc_dtype, _finite, flash_backward as tiles_backward, \
    flash_forward as tiles_forward

log = logging.getLogger("laga_torch")


class Kernel(enum.Enum):
    fa3 = "flash_attn_interface.flash_attn_varlen_func (FlashAttention-3)"
    fa4 = "flash_attn.cute.flash_attn_varlen_func (FlashAttention-4)"
    cudnn = "torch.ops.aten._cudnn_attention_forward (cuDNN SDPA, varlen)"
    efficient = "torch.ops.aten._efficient_attention_forward (memory-efficient SDPA, varlen)"
    flex = "torch.nn.attention.flex_attention with a block mask"
    tiles = "laga_torch's flash tiles in torch ops (attention.flash_forward)"


@dataclasses.dataclass
class Needs:
    """What a varlen kernel takes. present() is None when it can be called,
    else why not; dims(dqk, dv) likewise; capability: the CUDA major versions
    it was built for. (A test widens dtypes and devices to run a stand-in on
    the CPU in float64.)"""
    present: object
    dtypes: tuple
    devices: tuple
    capability: tuple
    dims: object
    gqa: bool


def _fa_dims(name, pairs, most):
    def dims(dqk, dv):
        if (dqk, dv) in pairs or (dqk == dv and dqk <= most and dqk % 8 == 0):
            return None
        return (f"head dims {dqk}/{dv} ({name}: equal dims up to {most}, multiples of 8, or "
                f"{', '.join(f'{a}/{b}' for a, b in pairs)})")
    return dims


def _sdpa_dims(name, most):
    def dims(dqk, dv):
        if dqk <= most and dv <= most and dqk % 8 == 0 and dv % 8 == 0:
            return None
        return f"head dims {dqk}/{dv} ({name}: each up to {most}, multiples of 8)"
    return dims


def _module_present(find, name):
    return lambda: None if find() is not None else f"{name} is not importable"


def _cudnn_present():
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if v is None or v < 91800:
        return (f"cuDNN {v} (torch's varlen cuDNN attention needs 9.18+, "
                "torch.nn.attention.varlen)")
    return None


def _op_present(name):
    return lambda: None if hasattr(torch.ops.aten, name) else         f"torch {torch.__version__} has no torch.ops.aten.{name}"


_HALF = (torch.float16, torch.bfloat16)
NEEDS = {
    Kernel.fa3: Needs(_module_present(varlen.fa3_module, "flash_attn_interface (FlashAttention-3)"),
                      _HALF, ("cuda",), (9,), _fa_dims("fa3", ((192, 128),), 256), True),
    Kernel.fa4: Needs(_module_present(varlen.fa4_module, "flash_attn.cute (FlashAttention-4)"),
                      _HALF, ("cuda",), (9, 10), _fa_dims("fa4", ((192, 128),), 128), True),
    Kernel.cudnn: Needs(lambda: _op_present("_cudnn_attention_forward")() or _cudnn_present(),
                        _HALF, ("cuda",), (9, 10), _sdpa_dims("cudnn", 256), False),
    Kernel.efficient: Needs(_op_present("_efficient_attention_forward"),
                            _HALF + (torch.float32,), ("cuda",), (5, 6, 7, 8, 9, 10, 12),
                            _sdpa_dims("efficient", 256), False),
}

# Per device: flex's fused kernel is its compiled CUDA form; on the CPU flex
# runs unfused (the whole (Sq, Sk) score matrix per call, and a block mask
# built by vmap), slower than the tiles, so "auto" takes the tiles there and
# flex runs on the CPU when asked for (attention_kernel="flex": the suite).
# The varlen kernels are CUDA-only; their order is the published one (FA3 on
# Hopper, FA4 on Blackwell where FA3 refuses the capability), unmeasured.
PREFERENCE = {"cuda": (Kernel.fa3, Kernel.fa4, Kernel.cudnn, Kernel.efficient, Kernel.flex,
                       Kernel.tiles)}
DEFAULT_PREFERENCE = (Kernel.tiles,)
REQUESTS = ("auto",) + tuple(k.name for k in Kernel)

_state = threading.local()
_logged = set()


def _flex_api():
    """flex_attention and create_block_mask where torch has them with
    return_lse (2.5+), else None."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    import inspect
    if "return_lse" not in inspect.signature(flex_attention).parameters:
        return None
    return flex_attention, create_block_mask


def _varlen_supports(kernel, q, k, v, kr):
    need = NEEDS[kernel]
    why = need.present()
    if why is not None:
        return why
    if q.dtype not in need.dtypes:
        return (f"dtype {q.dtype} ({kernel.name}: "
                f"{', '.join(str(d).replace('torch.', '') for d in need.dtypes)})")
    H, Hk = q.shape[2], k.shape[2]
    if H % Hk or (not need.gqa and H != Hk):
        return (f"{H} query heads over {Hk} key heads ({kernel.name}: "
                f"{'a divisor' if need.gqa else 'equal heads'})")
    why = need.dims(q.shape[3], v.shape[3])
    if why is not None:
        return why
    if q.device.type not in need.devices:
        return f"device {q.device.type} ({kernel.name}: {', '.join(need.devices)} only)"
    if q.device.type == "cuda":
        major = torch.cuda.get_device_capability(q.device)[0]
        if major not in need.capability:
            return (f"GPU capability {major}.x ({kernel.name}: "
                    f"{', '.join(f'{c}.x' for c in need.capability)})")
    if kernel is Kernel.cudnn and kr is not None:
        for b, q0, q1, k0, k1 in varlen.Runs(kr).by_mask[varlen.Mask.causal]:
            if q1 - q0 != k1 - k0:
                return (f"a causal run of {q1 - q0} query rows over {k1 - k0} keys (cudnn "
                        "aligns a packed causal mask top-left: equal lengths only)")
    return None


def supports(kernel, q, k, v, finite, backward=False, kr=None):
    """None when `kernel` can run this call, else why not, naming the value
    (kr: the call's key ranges, where a kernel's mask depends on them)."""
    if kernel is Kernel.tiles:
        return None
    if not finite:
        return ("an operand holds a NaN or inf: only the tiles keep it inside its document "
                "(exact products)")
    if kernel in NEEDS:
        return _varlen_supports(kernel, q, k, v, kr)
    if kernel is Kernel.flex:
        if _flex_api() is None:
            return (f"torch {torch.__version__} has no torch.nn.attention.flex_attention with "
                    "return_lse (torch 2.5+)")
        if q.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {q.dtype} (flex: float64, float32, bf16, fp16)"
        if q.device.type not in ("cpu", "cuda"):
            return f"device {q.device.type} (flex: cpu or cuda)"
        if backward and q.device.type == "cpu":
            return (f"backward on device cpu (torch {torch.__version__}'s FlexAttention has no "
                    "CPU backward; the tiles differentiate flex's o and lse)")
        H, Hk = q.shape[2], k.shape[2]
        if H % Hk:
            return f"{H} query heads over {Hk} key heads (flex's GQA needs a divisor)"
        return None
    raise ValueError(f"attention kernel {kernel!r}: expected one of "
                     f"{', '.join(k.name for k in Kernel)}")


def choose(q, k, v, request="auto", backward=False, kr=None):
    """(kernel, finite) of one call: the request ("auto": the first kernel
    of PREFERENCE that supports the call), refused naming why when a
    requested kernel cannot run it."""
    finite = _finite(q, k, v)
    if request != "auto":
        if request not in REQUESTS:
            raise ValueError(f"attention kernel '{request}': expected "
                             f"{', '.join(REQUESTS)}")
        kern = Kernel[request]
        why = supports(kern, q, k, v, finite, backward, kr)
        if why is not None:
            if not finite or backward:  # a non-finite call is the tiles' whatever was asked
                return Kernel.tiles, finite
            raise ValueError(f"attention_kernel '{request}' cannot run this call: {why}; use "
                             "kernel 'auto' (the first that can) or 'tiles'")
        return kern, finite
    whynot = []
    for kern in PREFERENCE.get(q.device.type, DEFAULT_PREFERENCE):
        why = supports(kern, q, k, v, finite, backward, kr)
        if why is None:
            key = (kern, q.device.type, q.dtype, backward, tuple(whynot))
            if key not in _logged:
                _logged.add(key)
                log.info("laga_torch attention %s: %s (%s) for %s %s, dqk %d, dv %d%s",
                         "backward" if backward else "forward", kern.name,
                         kern.value, q.device.type, str(q.dtype).replace("torch.", ""),
                         q.shape[3], v.shape[3],
                         "".join(f"; not {n}: {w}" for n, w in whynot))
            return kern, finite
        whynot.append((kern.name, why))
    raise AssertionError("the tiles support every call")


@contextlib.contextmanager
def context(ledger=None, request="auto"):
    """The run's ledger (to count the kernels chosen) and kernel request,
    for the calls made inside (MLA.forward; the tapes' backwards)."""
    old = getattr(_state, "ctx", None)
    _state.ctx = (ledger, request)
    try:
        yield
    finally:
        _state.ctx = old


def current():
    return getattr(_state, "ctx", None) or (None, "auto")


def _note(ledger, phase, kern):
    if ledger is not None and hasattr(ledger, "kernels"):
        ledger.kernels[(phase, kern.name)] = ledger.kernels.get((phase, kern.name), 0) + 1


# --------------------------------------------------------------------------
# flex
# --------------------------------------------------------------------------

def _block_mask(kr, B, Sq, Sk, device):
    _, create_block_mask = _flex_api()
    lo, hi = kr.lo, kr.hi

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[b, q_idx]) & (kv_idx < hi[b, q_idx])
    return create_block_mask(mask_mod, B, None, Sq, Sk, device=device.type)


def _flex_call(q, k, v, bm, scale):
    """o (B, Sq, H, dv) and lse (B, H, Sq) of flex_attention on (B, S, H, d)
    operands (a shared key head through enable_gqa)."""
    flex_attention, _ = _flex_api()
    H, Hk = q.shape[2], k.shape[2]
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    fn = flex_attention
    if q.device.type == "cuda":  # flex's fused kernel is its compiled form
        fn = _compiled_flex()
    with warnings.catch_warnings():  # eager on the CPU: its unfused path, as intended here
        warnings.simplefilter("ignore")
        o, lse = fn(*args, block_mask=bm, scale=scale, enable_gqa=Hk != H, return_lse=True)
    return o.transpose(1, 2), lse


_COMPILED = []


def _compiled_flex():
    if not _COMPILED:
        _COMPILED.append(torch.compile(_flex_api()[0], dynamic=False))
    return _COMPILED[0]


def _flex_forward(q, k, v, kr, scale):
    B, Sq, H, _ = q.shape
    bm = _block_mask(kr, B, Sq, k.shape[1], q.device)
    with torch.no_grad():  # (forward only: flex refuses operands that want a CPU backward)
        o, lse = _flex_call(q.detach(), k.detach(), v.detach(), bm, scale)
    # A row that sees no key: o = 0, lse = 0 (the tiles' and the C++ kernel's
    # convention; flex gives lse -inf there).
    sees = (kr.lo < kr.hi)[:, None]  # (B, 1, Sq)
    lse = torch.where(sees, lse, lse.new_zeros(())).to(_acc_dtype(q.dtype))
    o = torch.where(sees.transpose(1, 2)[..., None], o, o.new_zeros(()))
    return o.to(q.dtype), lse


def _flex_backward(q, k, v, o, lse, do, kr, scale):
    """dq, dk, dv: the call recomputed under autograd (flex's backward reads
    its own forward's saved state), corrected to the forward's o and lse
    where they are a ring step's merged row's (dispatch_varlen.merged_backward)."""
    B, Sq, H, _ = q.shape
    bm = _block_mask(kr, B, Sq, k.shape[1], q.device)
    sees = kr.lo < kr.hi

    def call(a, b, c):
        o_l, lse_l = _flex_call(a, b, c, bm, scale)
        return torch.where(sees[:, :, None, None], o_l, o_l.new_zeros(())), lse_l
    return varlen.merged_backward(call, q, k, v, o, lse, do, sees, scale, _acc_dtype(q.dtype))


# --------------------------------------------------------------------------
# The entry points: attention.flash_forward / flash_backward's signatures
# --------------------------------------------------------------------------

def forward(q, k, v, kr, scale, block=64, exact=None, phase="forward"):
    """o (B, Sq, H, dv) and lse (B, H, Sq) of the call, by the kernel chosen
    for it (block: the tiles' size; the other kernels tile themselves)."""
    ledger, request = current()
    if 0 in (q.shape[0], q.shape[1], q.shape[2], k.shape[1]):
        return tiles_forward(q, k, v, kr, scale, block, exact)
    kern, finite = choose(q, k, v, request, kr=kr)
    _note(ledger, phase, kern)
    if kern is Kernel.flex:
        return _flex_forward(q, k, v, kr, scale)
    if kern in NEEDS:
        return varlen.forward(kern.name, q, k, v, kr, scale, _acc_dtype(q.dtype))
    return tiles_forward(q, k, v, kr, scale, block, exact)


def backward(q, k, v, o, lse, do, kr, scale, block=64, exact=None):
    """dq, dk, dv from what forward kept (q, k, v, o, lse), by the kernel
    chosen for the call (the same rule as forward's, on q, k, v and dO)."""
    ledger, request = current()
    if 0 in (q.shape[0], q.shape[1], q.shape[2], k.shape[1]):
        return tiles_backward(q, k, v, o, lse, do, kr, scale, block, exact)
    kern, finite = choose(q, k, v, request, backward=True, kr=kr)
    if kern is not Kernel.tiles and not _finite(do):
        kern = Kernel.tiles
    _note(ledger, "backward", kern)
    if kern is Kernel.flex:
        dq, dk, dv = _flex_backward(q, k, v, o, lse, do, kr, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if kern in NEEDS:
        dq, dk, dv = varlen.backward(kern.name, q, k, v, o, lse, do, kr, scale,
                                     _acc_dtype(q.dtype))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return tiles_backward(q, k, v, o, lse, do, kr, scale, block, exact)
