"""The package's refusals that are not a config's (docs/pytorch.md,
"Refusals"): the arguments of MLA and its forward, read as whole numbers and
checked up front, and the ranks' agreement.

Every rank of a group must run the same thing: the same form and variant,
config, module size, S, B, documents, layout and dtype. A rank that differs
would run the form's collectives with other shapes than its peers (gloo
aborts the process, or the ranks wait for each other until the group's
timeout) or, where the shapes happen to match, compute a result that is
neither run's. So MLA.forward and sync_gradients start with `agree`: one
all-gather of a fixed-size digest (FIELDS words of int64: a magic word, the
call, this rank's status, a few flags and one 64-bit hash per field), the
same size on every rank whatever its arguments, so that it cannot hang on
a disagreement. Only when the digests differ (or a rank refused its own
arguments) is there a second exchange: each rank's description of its
fields, or its error, padded to the longest the first exchange announced.
From the same gathered bytes every rank builds the same message and raises
the same error. A rank that refused its arguments locally takes part in the
exchange with its error, so its peers raise with it rather than wait."""

import hashlib
import json
import numbers

import torch
import torch.distributed as dist

from .config import ArgumentTypeError  # noqa: F401 (a TypeError and a ValueError)

MAGIC = 0x6C616761  # "laga"
WORDS = 24  # the digest: 6 header words and up to 18 field hashes
HEADER = 6
TEXT_CAP = 1 << 16  # the second exchange's bytes per rank, at most
STATUS = {0: None, 1: ValueError, 2: ArgumentTypeError}
FLAG_CAN_PLAN, FLAG_NEEDS_PLAN = 1, 2


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------

def whole(v, name, what="a whole number"):
    """v as a Python int: an int (not bool), a numpy integer or a one-element
    integer tensor; anything else a TypeError naming the argument."""
    if isinstance(v, bool):
        raise ArgumentTypeError(f"{name} must be {what}, got the bool {v}")
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype.is_floating_point or v.dtype.is_complex or \
                v.dtype == torch.bool:
            raise ArgumentTypeError(f"{name} must be {what}, got a {v.dtype} tensor of shape "
                                    f"{tuple(v.shape)}")
        return int(v.item())
    if type(v).__module__ == "numpy" and getattr(v, "shape", None) == () and \
            getattr(getattr(v, "dtype", None), "kind", "") in "iu":
        return int(v)  # a 0-d numpy integer array
    raise ArgumentTypeError(f"{name} must be {what}, got {v!r} ({type(v).__name__})")


def flag(v, name):
    """A bool argument (q_latent, overlap): True or False, not a string
    ("off" is truthy) or a number."""
    if not isinstance(v, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {v!r} ({type(v).__name__})")
    return v


def name_arg(v, name, choices):
    if not isinstance(v, str):
        raise ArgumentTypeError(f"{name} must be a string, one of {', '.join(choices)}; got {v!r} "
                                f"({type(v).__name__})")
    return v


def seq_len_arg(seq_len):
    """seq_len: None or a positive whole number (see whole())."""
    if seq_len is None:
        return None
    s = whole(seq_len, "seq_len", "a whole number of tokens (the whole sequence's S)")
    if s < 1:
        raise ValueError(f"seq_len {s}: the whole sequence's length must be at least 1")
    return s


def _offsets(row, where):
    """One cu_seqlens row as a list of ints: whole numbers only (4.7 and 4.0
    are refused, as are bools and strings)."""
    if isinstance(row, torch.Tensor) or type(row).__module__ == "numpy":
        dt = row.dtype
        if (isinstance(dt, torch.dtype) and (dt.is_floating_point or dt.is_complex or
                                             dt == torch.bool)) or \
                (not isinstance(dt, torch.dtype) and getattr(dt, "kind", "") not in "iu"):
            raise ArgumentTypeError(f"{where} has dtype {dt}; it holds token offsets, whole "
                                    "numbers (an integer dtype)")
        if len(row.shape) != 1:
            raise ValueError(f"{where} has shape {tuple(row.shape)}; expected one list of "
                             "offsets")
        return [int(v) for v in row.tolist()]
    if not isinstance(row, (list, tuple)):
        raise ArgumentTypeError(f"{where} must be a list, tuple, numpy array or tensor of "
                                f"offsets, got {type(row).__name__}")
    out = []
    for i, v in enumerate(row):
        if isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim()) or \
                (type(v).__module__ == "numpy" and getattr(v, "shape", ()) != ()):
            raise ValueError(f"{where} mixes offsets and lists at [{i}]")
        out.append(whole(v, f"{where}[{i}]", "a whole number of tokens"))
    return out


def cu_seqlens_rows(cu_seqlens, batch):
    """cu_seqlens as B lists of ints, from one flat list shared by every row
    or one per row; lists, tuples, numpy arrays and tensors (1-D or 2-D) of
    whole numbers. Each row runs from 0 to S strictly increasing (checked by
    check_documents once S is known)."""
    if cu_seqlens is None:
        return None
    c = cu_seqlens
    if isinstance(c, (str, bytes, dict, set)) or not hasattr(c, "__len__"):
        raise ArgumentTypeError(f"cu_seqlens must be a list, tuple, numpy array or tensor of token "
                                f"offsets, got {type(c).__name__}")
    nd = len(c.shape) if isinstance(c, torch.Tensor) or type(c).__module__ == "numpy" else None
    if nd == 2:
        rows = [_offsets(c[b], f"cu_seqlens row {b}") for b in range(c.shape[0])]
    elif nd is not None and nd != 1:
        raise ValueError(f"cu_seqlens has shape {tuple(c.shape)}; expected offsets (1-D, shared "
                         "by every row) or one row of offsets per batch row (2-D)")
    elif nd == 1:
        rows = [_offsets(c, "cu_seqlens")] * batch
    elif len(c) and all(isinstance(r, (list, tuple)) or
                        (isinstance(r, torch.Tensor) and r.dim() == 1) or
                        (type(r).__module__ == "numpy" and len(getattr(r, "shape", ())) == 1)
                        for r in c):
        rows = [_offsets(r, f"cu_seqlens row {b}") for b, r in enumerate(c)]
    else:
        rows = [_offsets(c, "cu_seqlens")] * batch
    if len(rows) != batch:
        raise ValueError(f"cu_seqlens gives {len(rows)} rows for a batch of {batch}")
    return rows


def check_documents(rows, seq):
    for b, cu in enumerate(rows):
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq:
            raise ValueError(f"cu_seqlens row {b} = {cu}: must run from 0 to the sequence length "
                             f"{seq}")
        if any(e <= s for s, e in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens row {b} = {cu}: must be strictly increasing (every "
                             "document at least one token)")


def group_arg(group):
    """(P, r) of this rank in group (None: the world), or an error naming
    what is wrong: not initialised, not a group, a group without this rank."""
    if not dist.is_initialized():
        raise ValueError("MLA.forward needs torch.distributed initialised (a group of one rank "
                         "is fine)")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"group: this rank (global rank {dist.get_rank()}) is not a member of "
                         "the group given (dist.new_group returned NON_GROUP_MEMBER here); call "
                         "forward only on the group's ranks")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ArgumentTypeError(f"group must be a torch.distributed process group "
                                f"(dist.new_group) or None for the world, got "
                                f"{type(group).__name__}")
    r = dist.get_rank(group)
    if r < 0:
        raise ValueError(f"group: this rank (global rank {dist.get_rank()}) is not a member of "
                         "the group given; call forward only on the group's ranks")
    return dist.get_world_size(group), r


# --------------------------------------------------------------------------
# Agreement
# --------------------------------------------------------------------------

def _hash(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def _device(group):
    """Where the exchange's tensors live: the backend's device."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_texts(group, texts_len_cap, text, device):
    """Every rank's text (str), in rank order: lengths first (one int64
    each), then the bytes padded to the longest. Shape-safe: the second
    exchange's size is what every rank read from the first."""
    P = dist.get_world_size(group)
    data = text.encode()[:texts_len_cap]
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lens = [torch.empty_like(n) for _ in range(P)]
    dist.all_gather(lens, n, group=group)
    lens = [int(t.item()) for t in lens]
    width = max(lens)
    if width == 0:
        return [""] * P
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    buf = buf.to(device)
    bufs = [torch.empty_like(buf) for _ in range(P)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b.cpu()[:k].tolist()).decode(errors="replace") for b, k in zip(bufs, lens)]


def _ranks(rs):
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _grouped(values):
    """{value: [ranks]} in order of first appearance."""
    out = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return out


def agree(group, what, fields, error=None, flags=0):
    """Every rank of group calls this at the same point. fields: {name:
    description} (ordered, at most WORDS - HEADER), compared across ranks by
    hash; error: this rank's refusal of its own arguments (ValueError or
    TypeError) or None. Raises on every rank the same error when any rank
    refused, or the calls or fields differ; returns each rank's flags.
    At P 1 the local error is raised as it is."""
    P = dist.get_world_size(group)
    if P == 1:
        if error is not None:
            raise error
        return [flags]
    names = list(fields)
    assert len(names) <= WORDS - HEADER
    status = 0 if error is None else (2 if isinstance(error, TypeError) else 1)
    text = json.dumps({"what": what, "error": str(error) if error else None, "fields": fields})
    words = [MAGIC, _hash(what), status, min(len(text.encode()), TEXT_CAP), flags, len(names)]
    words += [_hash(f"{n}={fields[n]}") for n in names]
    words += [0] * (WORDS - len(words))
    device = _device(group)
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    got = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(got, mine, group=group)
    got = [[int(v) for v in t.cpu().tolist()] for t in got]
    rank_flags = [g[4] for g in got]
    if all(g[0] == MAGIC and g[2] == 0 for g in got) and \
            all(g[:2] + g[5:] == got[0][:2] + got[0][5:] for g in got):
        return rank_flags
    # Something differs: every rank's description, the same bytes on every rank.
    texts = gather_texts(group, TEXT_CAP, text, device)
    info = []
    for g, t in zip(got, texts):
        try:
            info.append(json.loads(t) if g[0] == MAGIC else None)
        except ValueError:  # cut at TEXT_CAP
            info.append({"what": "?", "error": t, "fields": {}})
    raise _message(P, what, got, info)


def _message(P, what, got, info):
    if any(i is None for i in info):
        bad = [r for r, i in enumerate(info) if i is None]
        return ValueError(f"{what}: {_ranks(bad)} of {P} sent something that is not laga's "
                          "agreement check: every rank of the group must call laga_torch at the "
                          "same point")
    calls = _grouped([i["what"] for i in info])
    if len(calls) > 1:
        where = "; ".join(f"{_ranks(rs)} in {c}" for c, rs in calls.items())
        return ValueError(f"the ranks are in different calls: {where}; every rank of the group "
                          "must make the same laga_torch calls in the same order")
    errs = [(r, STATUS[g[2]], i["error"][len(what) + 2:] if i["error"].startswith(what + ": ")
             else i["error"]) for r, (g, i) in enumerate(zip(got, info)) if g[2]]
    if errs:
        kind = errs[0][1]
        groups = {}
        for r, k, m in errs:
            groups.setdefault((k.__name__, m), []).append(r)
        failing = [r for r, _, _ in errs]
        if len(groups) == 1 and len(failing) == P:
            return kind(info[0]["error"])
        parts = "; ".join(f"{_ranks(rs)} of {P}: {m}" for (_, m), rs in groups.items())
        ok = [r for r in range(P) if r not in failing]
        tail = f" (every rank raises this, {_ranks(ok)} too)" if ok else ""
        return kind(f"{what}: {parts}{tail}")
    diffs = []
    for n in info[0]["fields"]:
        vals = [i["fields"].get(n, "?") for i in info]
        g = _grouped(vals)
        if len(g) <= 1:
            continue
        try:  # a dict (the config): only the keys that differ
            dicts = [json.loads(v) for v in vals]
            assert all(isinstance(d, dict) for d in dicts)
        except (ValueError, AssertionError):
            diffs.append(f"{n}: " + "; ".join(f"{_ranks(rs)} {v}" for v, rs in g.items()))
            continue
        for k in sorted({k for d in dicts for k in d}):
            kg = _grouped([json.dumps(d.get(k)) for d in dicts])
            if len(kg) > 1:
                diffs.append(f"{n} {k}: " + "; ".join(f"{_ranks(rs)} {v}"
                                                      for v, rs in kg.items()))
    if not diffs:  # a hash differs where the texts, cut short, do not show it
        diffs = ["fields past the description's length"]
    return ValueError(f"{what}: the ranks disagree: " + " | ".join(diffs) + ". " +
                      TAILS.get(what, "Every rank of the group must give the same arguments"))


TAILS = {"MLA.forward": "Every rank of the group must give the same form, options, config, "
                        "module and weights (load or broadcast the same), sequence (seq_len, "
                        "batch, cu_seqlens, layout) and dtype; a rank that differs would compute "
                        "neither run (nothing has run)",
         "sync_gradients": "Every rank of the group must sum the same module's gradients (the "
                           "same parameters, shapes and dtypes, and grad_reduce); nothing was "
                           "summed"}


def describe(v, limit=300):
    """A field's description for the message: short, the same text for the
    same value on every rank."""
    t = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return t if len(t) <= limit else t[:limit - 40] + f"... ({len(t)} chars, hash " \
        f"{_hash(t) & 0xFFFFFFFF:08x})"


# --------------------------------------------------------------------------
# The functional layer (forms.mla_attention)
# --------------------------------------------------------------------------

def functional_args(form, q, c_kv, k_pe, wkv_b, sp, cfg, q_latent, overlap):
    """mla_attention's arguments against the config and this rank's Sp: a
    ValueError / ArgumentTypeError naming the argument and the shape it
    needs, before any collective. (Every rank checks the same rule on the
    same agreed layout; MLA.forward's agreement check is the module's.)"""
    from .config import MLAConfig
    if not isinstance(cfg, MLAConfig):
        raise ArgumentTypeError(f"cfg must be an MLAConfig, got {type(cfg).__name__}")
    name_arg(form, "form", ())
    flag(overlap, "overlap")
    for n in ("group", "layout", "rank", "batch", "doc_start"):
        if not hasattr(sp, n):
            raise ArgumentTypeError(f"sp must be a laga_torch.forms.Sp (this rank's layout, "
                                    f"group, documents and RoPE table), got {type(sp).__name__}")
    B, L = sp.batch, sp.layout.seq_count[sp.rank]
    H, C, dn, dr, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
        cfg.qk_rope_head_dim, cfg.v_head_dim
    want = {"c_kv": (c_kv, (B, L, C)), "k_pe": (k_pe, (B, L, dr)),
            "wkv_b": (wkv_b, (H * (dn + dv), C))}
    if q_latent is None:
        want["q"] = (q, (B, L, H, dn + dr))
    else:
        if not isinstance(q_latent, (tuple, list)) or len(q_latent) != 2:
            raise ArgumentTypeError("q_latent must be None or the pair (qn (B, L, rq), wq_b "
                                    f"(H dqk, rq)), got {type(q_latent).__name__}")
        want["q_latent[0] (qn)"] = (q_latent[0], (B, L, cfg.q_lora_rank))
        want["q_latent[1] (wq_b)"] = (q_latent[1], (H * (dn + dr), cfg.q_lora_rank))
    dtypes = set()
    for n, (t, shape) in want.items():
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{n} must be a tensor of shape {shape}, got "
                                    f"{type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{n} has shape {tuple(t.shape)}; rank {sp.rank} needs {shape} "
                             f"(B {B}, its {L} tokens, the config's dimensions)")
        dtypes.add((t.dtype, t.device))
    if len(dtypes) > 1:
        raise ValueError(f"mla_attention's tensors are of different dtypes or devices: "
                         f"{sorted(map(str, dtypes))}")


def functional_checked(form, q, c_kv, k_pe, wkv_b, sp, cfg, q_latent, overlap, check_ranks):
    """functional_args on this rank, then (check_ranks) the ranks' agreement
    on the form, variant, config, layout, batch, documents and dtype."""
    error = None
    try:
        functional_args(form, q, c_kv, k_pe, wkv_b, sp, cfg, q_latent, overlap)
    except (ValueError, TypeError) as e:
        error = e
    if not check_ranks:
        if error is not None:
            raise error
        return
    if not all(hasattr(sp, n) for n in ("group", "layout", "rank", "batch", "doc_start")):
        raise error  # no group to tell: sp itself is what is wrong
    group = sp.group
    group_arg(group)
    fields = {"form": describe(f"{form} q_latent={q_latent is not None} overlap={overlap}")}
    if error is None:
        lay = sp.layout
        docs = sp.doc_start.detach().cpu().numpy().tobytes()
        fields.update(config=describe(cfg.to_json(), 4000), layout=describe(lay.seq_ranges),
                      batch=str(sp.batch), dtype=f"{c_kv.dtype} on {c_kv.device.type}",
                      documents=f"hash {_hash(docs.hex()) & 0xFFFFFFFFFFFF:012x}")
    agree(group, "mla_attention", fields, error)
