"""The block's configuration from the files laga reads (src/mla/config.cpp,
docs/configs.md): DeepSeek's inference ModelArgs JSON (laga's own names) or a
Hugging Face config.json. The same defaults and the same refusals, so one
file configures the C++ tool and this package alike."""

import dataclasses
import json
import math


@dataclasses.dataclass
class MLAConfig:
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

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self):
        return self.yarn_always or self.max_seq_len > self.original_seq_len

    def softmax_scale(self):
        """(dn + dr)^-1/2, times mscale^2 under YaRN (DeepSeek-V3 MLA.__init__)."""
        s = self.qk_head_dim ** -0.5
        if self.yarn:
            m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            s *= m * m
        return s

    @classmethod
    def from_json(cls, j, source="config"):
        if not isinstance(j, dict):
            raise ValueError(f"{source}: expected a JSON object with the model's dimensions")

        def need(key):
            if j.get(key) is None:
                raise ValueError(f"{source}: missing '{key}' (the MLA block needs it; see "
                                 "docs/configs.md)")
            return j[key]

        if "hidden_size" in j:  # Hugging Face config.json
            max_pos = j.get("max_position_embeddings") or 4096
            c = cls(dim=need("hidden_size"), n_heads=need("num_attention_heads"),
                    kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
                    qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
                    q_lora_rank=j.get("q_lora_rank") or 0, max_seq_len=max_pos,
                    original_seq_len=max_pos)
            if j.get("rope_theta") is not None:
                c.rope_theta = j["rope_theta"]
            rs = j.get("rope_scaling") or j.get("rope_parameters")
            kind = (rs or {}).get("type") or (rs or {}).get("rope_type") or ""
            if rs and kind not in ("", "default", "yarn"):
                raise ValueError(f"{source}: rope type '{kind}': laga implements only yarn")
            if kind == "yarn":
                c.rope_factor = rs.get("factor", c.rope_factor)
                # HF's DeepSeek code defaults the original context to 4096.
                c.original_seq_len = rs.get("original_max_position_embeddings", 4096)
                # transformers applies YaRN whenever the type is yarn, DeepSeek's
                # code when max > original: laga's flag marks where they differ.
                c.yarn_always = c.max_seq_len <= c.original_seq_len
                c.beta_fast = rs.get("beta_fast", c.beta_fast)
                c.beta_slow = rs.get("beta_slow", c.beta_slow)
                ms, ms_all = rs.get("mscale", 1.0), rs.get("mscale_all_dim", 0.0)
                if ms != ms_all:
                    raise ValueError(f"{source}: rope_scaling mscale ({ms}) != mscale_all_dim "
                                     f"({ms_all}); HF would then scale cos/sin by their ratio, "
                                     "which DeepSeek's inference code (laga's reference) never "
                                     "does; set both to the same value")
                c.mscale = ms_all
        else:  # DeepSeek inference ModelArgs, or laga's own (adds norm_eps)
            c = cls(dim=need("dim"), n_heads=need("n_heads"), kv_lora_rank=need("kv_lora_rank"),
                    qk_nope_head_dim=need("qk_nope_head_dim"),
                    qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"))
            for k in ("q_lora_rank", "rope_theta", "rope_factor", "original_seq_len",
                      "max_seq_len", "beta_fast", "beta_slow", "mscale", "norm_eps",
                      "yarn_always"):
                if j.get(k) is not None:
                    setattr(c, k, j[k])
        for k in ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim"):
            if getattr(c, k) <= 0:
                raise ValueError(f"{source}: '{k}' must be positive, got {getattr(c, k)}")
        if c.qk_rope_head_dim % 2:
            raise ValueError(f"{source}: qk_rope_head_dim must be even (RoPE rotates pairs)")
        return c

    @classmethod
    def load(cls, path):
        with open(path) as f:
            return cls.from_json(json.load(f), path)

    def to_json(self):
        return {k: v for k, v in dataclasses.asdict(self).items()}
