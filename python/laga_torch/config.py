"""The block's configuration from the files laga reads (src/mla/config.cpp,
docs/configs.md): DeepSeek's inference ModelArgs JSON (laga's own names) or a
Hugging Face config.json. The same defaults and the same refusals, key by
key, so one file configures the C++ tool and this package alike
(tests/tools/test_torch_refusals.py feeds both the same hostile files and
requires the same verdict)."""

import dataclasses
import json
import math
import numbers
import os
import stat



class ArgumentTypeError(TypeError, ValueError):
    """An argument or field of the wrong type (seq_len 12.7, cu_seqlens of
    floats, a group that is a list, a config field that is a string): a
    TypeError, and a ValueError too, as every bad input of the package is
    (docs/pytorch.md, "Refusals")."""


# src/mla/config.cpp's bounds.
MAX_CONFIG_INT = 1 << 53  # integers: dimensions and lengths, exact in a double
MAX_ROPE_FACTOR = 1e6
MAX_SEQ_LEN = 1 << 40
INT_FIELDS = ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "q_lora_rank", "original_seq_len", "max_seq_len")
FLOAT_FIELDS = ("rope_theta", "rope_factor", "beta_fast", "beta_slow", "mscale", "norm_eps")


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _dump(v):
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def _read_int(j, key, source):
    """The C++ read_key for an integer: absent or null -> None; an integer
    (or an integral float) of at most 2^53 in size; anything else refused."""
    v = j.get(key)
    if v is None:
        return None
    if _is_int(v):
        if v > MAX_CONFIG_INT or v < -MAX_CONFIG_INT:
            raise ValueError(f"{source}: '{key}' is {_dump(v)}, beyond any model dimension (at "
                             f"most {MAX_CONFIG_INT})")
        return int(v)
    if not _is_number(v) or not math.isfinite(v) or math.floor(v) != v:
        raise ValueError(f"{source}: '{key}' must be an integer, got {_dump(v)}")
    if abs(v) > MAX_CONFIG_INT:
        raise ValueError(f"{source}: '{key}' is {_dump(v)}, beyond any model dimension (at most "
                         f"{MAX_CONFIG_INT})")
    return int(v)


def _read_float(j, key, source):
    """The C++ read_key for a number: absent or null -> None; finite."""
    v = j.get(key)
    if v is None:
        return None
    if not _is_number(v):
        raise ValueError(f"{source}: '{key}' must be a number, got {_dump(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer past any double
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{source}: '{key}' must be finite, got {_dump(v)}")
    return f


# DeepSeek Sparse Attention's indexer keys (DeepSeek-V3.2's config.json), which
# neither laga_torch nor the C++ tool's dense commands run (docs/forms.md, DSA).
DSA_KEYS = ("index_n_heads", "index_head_dim", "index_topk")
# laga's fp8 options of DSA (docs/configs.md): true is refused with the DSA keys.
DSA_FP8_KEYS = ("index_fp8", "kv_fp8_round_trip")
DSA_REFUSAL = ("{source} sets DeepSeek Sparse Attention ({keys}): the lightning indexer and "
               "top-k attention, which laga_torch does not run: it would attend every key, a "
               "different model. `laga plan` costs its DSA forms (docs/planning.md, \"DSA\"); "
               "for its dense MLA alone give a config without the index keys")


def _read_bool(j, key, source):
    v = j.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ValueError(f"{source}: '{key}' must be true or false, got {_dump(v)}")
    return v


def _read_kimi_keys(j, source):
    """Kimi K3's two MLA switches as the C++ read_kimi_keys reads them
    (src/mla/config.cpp), under either key set: true/false or absent/null.
    NoPE with a RoPE scaling block that is not plain is refused, naming both
    keys: nothing rotates, so neither the scaling nor its mscale can apply."""
    f = {}
    for key in ("mla_use_nope", "mla_use_output_gate"):
        v = _read_bool(j, key, source)
        if v is not None:
            f[key] = v
    if not f.get("mla_use_nope"):
        return f
    for k in ("rope_scaling", "rope_parameters"):
        block = j.get(k)
        if not isinstance(block, dict):
            continue
        tk = "type" if "type" in block else "rope_type" if "rope_type" in block else None
        kind = block[tk] if tk else None
        if tk is not None and kind != "default":
            raise ValueError(f"{source}: mla_use_nope is true but '{k}' asks for {_dump(kind)} "
                             "RoPE scaling; with NoPE nothing rotates, so the scaling (and its "
                             f"softmax mscale) cannot apply: remove '{k}' or set mla_use_nope "
                             "false")
    return f


_PLAIN_KEYS = {"type", "rope_type", "rope_theta", "partial_rotary_factor"}
_YARN_KEYS = _PLAIN_KEYS | {"factor", "original_max_position_embeddings", "beta_fast",
                            "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                            "truncate"}


def _read_hf_rope(j, f, source):
    """The RoPE block of a Hugging Face config.json (the C++ read_hf_rope):
    transformers 4's rope_theta + rope_scaling, or transformers 5's
    rope_parameters. Every key of the block is read or refused."""
    scaling, params = j.get("rope_scaling"), j.get("rope_parameters")
    if scaling is not None and params is not None:
        raise ValueError(f"{source}: both 'rope_scaling' (transformers 4) and 'rope_parameters' "
                         "(transformers 5) are given; keep the one your transformers wrote")
    theta = _read_float(j, "rope_theta", source)
    if theta is not None:
        f["rope_theta"] = theta
    rs = scaling if scaling is not None else params
    if rs is None:
        return
    name = "rope_scaling" if scaling is not None else "rope_parameters"
    if not isinstance(rs, dict):
        raise ValueError(f"{source}: '{name}' must be an object or null")
    if params is not None and "rope_theta" in params:
        inner = _read_float(params, "rope_theta", source) or 0.0  # null: 0, refused below
        if j.get("rope_theta") is not None and inner != f["rope_theta"]:
            raise ValueError(f"{source}: rope_theta {f['rope_theta']} and "
                             f"rope_parameters.rope_theta {inner} disagree; give one")
        f["rope_theta"] = inner
    kind = ""
    for k in ("type", "rope_type"):
        v = rs.get(k)
        if v is None:
            continue
        if not isinstance(v, str):
            raise ValueError(f"{source}: {name} '{k}' must be a string, got {_dump(v)}")
        if kind and kind != v:
            raise ValueError(f"{source}: {name} says type '{kind}' and rope_type '{v}'; they "
                             "contradict each other: keep one")
        kind = v
    if params is not None and kind == "default":
        kind = ""  # transformers 5's plain RoPE
    if kind not in ("", "yarn"):
        raise ValueError(f"{source}: {name} type '{kind}' is not supported; laga implements "
                         "DeepSeek-V3's YaRN ('yarn') or plain RoPE")
    if scaling is not None and not kind:
        raise ValueError(f"{source}: rope_scaling gives no 'type' or 'rope_type'")
    allowed = _YARN_KEYS if kind else _PLAIN_KEYS
    for k in rs:
        if k not in allowed:
            raise ValueError(f"{source}: {name} key '{k}' is not read by laga "
                             f"{'for YaRN' if kind else 'for plain RoPE'}; it may change the "
                             "math, so laga refuses it rather than ignore it (remove it if it "
                             "does not apply)")
    if "partial_rotary_factor" in rs:
        prf = _read_float(rs, "partial_rotary_factor", source)
        if prf is not None and prf != 1.0:
            raise ValueError(f"{source}: {name} partial_rotary_factor {prf} rotates part of the "
                             "rope dims; DeepSeek-V3 rotates all qk_rope_head_dim (1.0)")
    if not kind:
        return
    factor = _read_float(rs, "factor", source)
    if factor is not None:
        f["rope_factor"] = factor
    # HF's DeepSeek code defaults the original context to 4096 when absent.
    orig = _read_int(rs, "original_max_position_embeddings", source)
    f["original_seq_len"] = 4096 if orig is None else orig
    # transformers applies YaRN whenever the type is yarn, DeepSeek's code
    # when max > original: laga's flag marks where they differ.
    f["yarn_always"] = f["max_seq_len"] <= f["original_seq_len"]
    for k in ("beta_fast", "beta_slow"):
        v = _read_float(rs, k, source)
        if v is not None:
            f[k] = v
    t = rs.get("truncate")
    if t is not None and t is not True:
        raise ValueError(f"{source}: {name} truncate {_dump(t)}: DeepSeek's YaRN rounds the "
                         "ramp's ends to whole dims (truncate true); laga implements only that")
    ms = _read_float(rs, "mscale", source)
    ms_all = _read_float(rs, "mscale_all_dim", source)
    ms = 1.0 if ms is None else ms
    ms_all = 0.0 if ms_all is None else ms_all
    if ms != ms_all:
        absent = "" if "mscale_all_dim" in rs else ", absent: HF's default"
        raise ValueError(f"{source}: {name} mscale ({ms}) != mscale_all_dim ({ms_all}{absent}); "
                         "HF would then scale cos/sin by their ratio, which DeepSeek's inference "
                         "code (laga's reference) never does; set both to the same value")
    if ms == 0 and f["rope_factor"] > 1:
        raise ValueError(f"{source}: {name} mscale = mscale_all_dim = 0: transformers then "
                         "scales cos/sin by 0.1 ln(factor) + 1 = "
                         f"{0.1 * math.log(f['rope_factor']) + 1}, which DeepSeek's inference "
                         "code (laga's reference) never does; set both to 1.0 as DeepSeek-V3 does")
    af = _read_float(rs, "attention_factor", source)
    if af is not None and af != 1.0:
        raise ValueError(f"{source}: {name} attention_factor {af} scales cos/sin, which "
                         "DeepSeek's inference code (laga's reference) never does; remove it or "
                         "set 1.0")
    f["mscale"] = ms_all


@dataclasses.dataclass
class MLAConfig:
    """The C++ MlaConfig. Built directly, from_json or load, it is checked by
    validate(), the C++ MlaConfig::validate: a ValueError naming the first
    bad field."""
    dim: int
    n_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    original_seq_len: int = 4096
    max_seq_len: int = 4096 * 4  # ModelArgs' default: YaRN on
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    norm_eps: float = 1e-6
    yarn_always: bool = False  # HF's rule: a yarn rope block turns YaRN on whatever the lengths
    # Kimi K3's gated NoPE MLA (docs/mla-math.md, "Gated NoPE MLA"; the C++
    # MlaConfig's keys of the same names): mla_use_nope, no rotation anywhere
    # (the dr dims kept, k_pe shared over heads, never rotated; dr may be 0);
    # mla_use_output_gate, o * sigmoid(x wg^T) before wo.
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False

    def __post_init__(self):
        self.validate()

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotates(self):
        """The C++ MlaConfig::rotates: False under NoPE (mla_use_nope, or
        qk_rope_head_dim 0), when the RoPE tables are empty or identity."""
        return not self.mla_use_nope and self.qk_rope_head_dim > 0

    @property
    def yarn(self):
        """Never with nothing to rotate (the C++ MlaConfig::yarn): no YaRN, no
        mscale on the softmax under NoPE (Kimi K3's scale is (dn + dr)^-1/2)."""
        return self.rotates and (self.yarn_always or self.max_seq_len > self.original_seq_len)

    def validate(self, source="config"):
        """The C++ MlaConfig::validate, and the types its reader enforces.
        Integral fields are made Python ints, number fields floats."""
        for k in INT_FIELDS:
            v = getattr(self, k)
            if not _is_int(v):
                raise ArgumentTypeError(f"{source}: {k} must be an integer, got {v!r} "
                                        f"({type(v).__name__})")
            setattr(self, k, int(v))
        for k in FLOAT_FIELDS:
            v = getattr(self, k)
            if not _is_number(v):
                raise ArgumentTypeError(f"{source}: {k} must be a number, got {v!r} "
                                        f"({type(v).__name__})")
            try:
                v = float(v)
            except OverflowError:
                v = math.inf
            if not math.isfinite(v):
                raise ValueError(f"{source}: {k} must be finite, got {v}")
            setattr(self, k, v)
        for k in ("yarn_always", "mla_use_nope", "mla_use_output_gate"):
            if not isinstance(getattr(self, k), bool):
                raise ArgumentTypeError(f"{source}: {k} must be True or False, got "
                                        f"{getattr(self, k)!r}")
        for k in ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{source}: {k} must be positive, got {getattr(self, k)}")
        # qk_rope_head_dim may be 0: NoPE MLA (src/mla/config.cpp, validate).
        if self.qk_rope_head_dim < 0:
            raise ValueError(f"{source}: qk_rope_head_dim must be 0 (no rope part) or positive, "
                             f"got {self.qk_rope_head_dim}")
        if self.mla_use_nope and self.yarn_always:
            raise ValueError(f"{source}: mla_use_nope is true but yarn_always is set; NoPE "
                             "rotates nothing")
        if self.v_head_dim <= 0:
            raise ValueError(f"{source}: v_head_dim must be positive, got {self.v_head_dim}")
        if self.q_lora_rank < 0:
            raise ValueError(f"{source}: q_lora_rank must be 0 (no q compression) or positive, "
                             f"got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{source}: qk_rope_head_dim must be even (RoPE rotates pairs), got "
                             f"{self.qk_rope_head_dim}")
        if not self.rope_theta > 1.0:
            raise ValueError(f"{source}: rope_theta must be > 1, got {self.rope_theta}")
        # src/mla/config.cpp's ranges (issue 54, T): kMaxRopeTheta, kLeastNormEps.
        if self.rope_theta > 1e12:
            raise ValueError(f"{source}: rope_theta {self.rope_theta} is beyond 1e+12")
        if not 1e-30 <= self.norm_eps < 1:
            raise ValueError(f"{source}: norm_eps {self.norm_eps} must be in [1e-30, 1)")
        if self.original_seq_len <= 0 or self.max_seq_len <= 0:
            raise ValueError(f"{source}: original_seq_len and max_seq_len must be positive, got "
                             f"{self.original_seq_len} and {self.max_seq_len}")
        if self.q_lora_rank > self.dim:
            raise ValueError(f"{source}: q_lora_rank {self.q_lora_rank} is larger than dim "
                             f"{self.dim}; a low-rank query compression is narrower than the model "
                             "(DeepSeek-V3: 1536 of 7168); use 0 for none")
        if self.original_seq_len > MAX_SEQ_LEN or self.max_seq_len > MAX_SEQ_LEN:
            raise ValueError(f"{source}: original_seq_len {self.original_seq_len} / max_seq_len "
                             f"{self.max_seq_len} beyond {MAX_SEQ_LEN} tokens; check the config")
        if self.yarn:
            on = "the rope type is yarn" if self.yarn_always else \
                f"max_seq_len {self.max_seq_len} > original_seq_len {self.original_seq_len}"
            if self.rope_factor > MAX_ROPE_FACTOR:
                raise ValueError(f"{source}: rope_factor {self.rope_factor} is beyond "
                                 f"{MAX_ROPE_FACTOR:g} (the context-extension factor of YaRN; "
                                 "DeepSeek-V3 uses 40)")
            if self.rope_factor < 1.0:
                raise ValueError(f"{source}: rope_factor must be >= 1 when YaRN is on ({on}), "
                                 f"got {self.rope_factor}")
            if not self.beta_fast > self.beta_slow > 0:
                raise ValueError(f"{source}: YaRN needs beta_fast > beta_slow > 0, got "
                                 f"{self.beta_fast} and {self.beta_slow}")
            if self.mscale < 0:
                raise ValueError(f"{source}: mscale must be >= 0, got {self.mscale}")
            if self.beta_fast > 1e6:  # kMaxYarnBeta
                raise ValueError(f"{source}: beta_fast {self.beta_fast} is beyond 1e+06")
            if self.mscale > 100:  # kMaxMscale
                raise ValueError(f"{source}: mscale {self.mscale} is beyond 100")
        if self.n_heads * (self.qk_head_dim + self.v_head_dim) >= 1 << 24 or \
                self.dim >= 1 << 24:
            raise ValueError(f"{source}: dimensions too large (dim {self.dim}, n_heads "
                             f"{self.n_heads})")
        return self

    def softmax_scale(self):
        """(dn + dr)^-1/2, times mscale^2 under YaRN (DeepSeek-V3 MLA.__init__)."""
        s = self.qk_head_dim ** -0.5
        if self.yarn:
            m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            s *= m * m
        return s

    @classmethod
    def from_json(cls, j, source="config"):
        """The C++ MlaConfig::from_json: the same keys, defaults and
        refusals (ValueError naming the key)."""
        if not isinstance(j, dict):
            raise ValueError(f"{source}: expected a JSON object with the model's dimensions")
        text = j.get("text_config")  # a multimodal config (Kimi K3's), as the C++ reads it
        if isinstance(text, dict) and "hidden_size" not in j and "dim" not in j:
            return cls.from_json(text, source + " text_config")
        kimi = _read_kimi_keys(j, source)
        # DeepSeek-V3.2's sparse attention: the C++ tool's dense commands refuse
        # it too (ModelOptions::load, tools/cli_common.cpp): attending every key
        # would be another model.
        dsa = [f"{k} {_dump(j[k])}" for k in DSA_KEYS if j.get(k) is not None]
        dsa += [f"{k} true" for k in DSA_FP8_KEYS if _read_bool(j, k, source)]
        if dsa:
            raise ValueError(DSA_REFUSAL.format(source=source, keys=", ".join(dsa)))

        def need(key):
            v = _read_int(j, key, source)
            if v is None:
                raise ValueError(f"{source}: missing '{key}' (the MLA block needs it; see "
                                 "docs/configs.md)")
            return v

        if "hidden_size" in j:  # Hugging Face config.json
            f = {"dim": need("hidden_size"), "n_heads": need("num_attention_heads")}
            q = _read_int(j, "q_lora_rank", source)  # null means no q compression
            f["q_lora_rank"] = 0 if q is None else q
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                f[k] = need(k)
            # rms_norm_eps is the decoder layers' norms' eps, not q_a/kv_a's: not read.
            max_pos = _read_int(j, "max_position_embeddings", source)
            max_pos = 4096 if max_pos is None else max_pos
            f.update(max_seq_len=max_pos, original_seq_len=max_pos,  # no YaRN unless the rope
                     rope_theta=10000.0, rope_factor=40.0, beta_fast=32.0,  # block says so
                     beta_slow=1.0, mscale=1.0, yarn_always=False)
            _read_hf_rope(j, f, source)
        else:  # DeepSeek inference ModelArgs, or laga's own (adds norm_eps)
            f = {k: need(k) for k in ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim",
                                      "qk_rope_head_dim", "v_head_dim")}
            for k in ("q_lora_rank", "original_seq_len", "max_seq_len"):
                v = _read_int(j, k, source)
                if v is not None:
                    f[k] = v
            for k in FLOAT_FIELDS:
                v = _read_float(j, k, source)
                if v is not None:
                    f[k] = v
            y = _read_bool(j, "yarn_always", source)
            if y is not None:
                f["yarn_always"] = y
        f.update(kimi)
        try:
            return cls(**f)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path):
        """A config file as the C++ from_json_file reads it: a regular file
        holding strict JSON (no NaN or Infinity literals), no key repeated in
        one object."""
        source = f"config '{path}'"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ValueError(f"cannot open config file '{path}': no such file; check the "
                             "path") from None
        except OSError as e:
            raise ValueError(f"cannot open config file '{path}': {e.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"config file '{path}' is a directory; give the JSON file "
                             "(config.json) inside it")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"config file '{path}' is not a regular file (a FIFO, socket or "
                             "device); give a JSON file")
        where = f"config file '{path}'"

        def pairs(items):
            seen = {}
            for k, v in items:
                if k in seen:
                    raise ValueError(f"{where}: key '{k}' appears twice in one object; JSON "
                                     "readers disagree on which wins, so remove one")
                seen[k] = v
            return seen

        def constant(name):
            raise ValueError(f"{where} is not valid JSON: '{name}' is not a JSON number")

        try:
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8-sig")
        except OSError as e:
            raise ValueError(f"cannot open config file '{path}': {e.strerror}; check its "
                             "permissions") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        try:
            j = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        return cls.from_json(j, source)

    def to_json(self):
        """The fields; Kimi K3's keys only when on, as the C++ to_json writes
        them (so every other config's JSON is what it was)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v or k not in ("mla_use_nope", "mla_use_output_gate")}
