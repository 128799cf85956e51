"""Configuration of an EAGLE-3 draft and of speculative decoding.

`Eagle3Config` maps one-to-one onto the `config.json` that SGLang's
`LlamaForCausalLMEagle3` (and the official EAGLE-3 checkpoints) read, so the same
folder loads in our engine, in SGLang and, after `eagle3 export --format speculators`, in vLLM.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_eagle3.errors import UserError

DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
FLOAT_DTYPES = ("bfloat16", "float16", "float32")
_REQUIRED = object()


class ConfigError(UserError, ValueError):
    """A config (draft, target or speculative) that cannot be used; the message names the key."""


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high features: the *inputs* of layers 2, L//2 and L-3.

    Stored in SGLang's convention (`eagle_aux_hidden_state_layer_ids`): id i means "the output
    of layer i", i.e. the input of layer i+1; SGLang captures layer `id + 1`'s input.
    """
    L = num_target_layers
    if L < 4:
        raise ConfigError(f"target has {L} layers; EAGLE-3 needs at least 4 for low/mid/high features")
    return [1, L // 2 - 1, L - 4]


def context_length(hf_config) -> Optional[int]:
    """The tokens a target attends over (its max_position_embeddings; a multimodal config's text part), None where
    its config does not say."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return int(getattr(text, "max_position_embeddings", 0) or 0) or None


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int                      # the target's vocabulary
    draft_vocab_size: int                # rows of the draft lm_head
    target_hidden_size: int              # H of the target; fc reads 3 * target_hidden_size
    aux_layer_ids: list[int]             # eagle_config.eagle_aux_hidden_state_layer_ids
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None
    fc_norm: bool = False                # EAGLE-3.1: one RMSNorm per aux feature before fc
    norm_output: bool = False            # EAGLE-3.1: the next draft step reads the final-normed output
    extra: dict = field(default_factory=dict)  # unknown keys, kept on round-trip

    def __post_init__(self):
        """The checks the loaders make (transformers' LlamaConfig, through which SGLang and vLLM read a draft's
        config.json, and our attention), each naming its keys; llama_config runs transformers' own on top."""
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                              f"{self.num_attention_heads} (transformers' LlamaConfig refuses it)")
        if self.head_dim > 4 and self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} is odd; RoPE rotates pairs of dimensions (transformers' "
                              "LlamaConfig refuses it)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}")
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise ConfigError(f"eagle_aux_hidden_state_layer_ids={self.aux_layer_ids} must be strictly increasing "
                              "(SGLang concatenates the captured layers in layer order)")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu', as in SGLang's draft)")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def rope_parameters(self) -> dict:
        """RoPE as transformers' rope_parameters: rope_type (from either spelling), rope_theta and the scaling keys."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        rope["rope_type"] = rope.pop("type", None) or rope["rope_type"]
        return rope

    def llama_config(self, where: str = "draft config"):
        """The transformers LlamaConfig of the draft's attention and RoPE (what RotaryEmbedding's init functions
        read, and what SGLang and vLLM read a draft's config.json as), with its RoPE type checked. Whatever
        transformers refuses is one ConfigError naming `where` (the file), not its validation traceback."""
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        rope = self.rope_parameters()
        if rope["rope_type"] != "default" and rope["rope_type"] not in ROPE_INIT_FUNCTIONS:
            raise ConfigError(f"{where}: rope_scaling.rope_type={rope['rope_type']!r} is not a RoPE type "
                              f"transformers knows ({', '.join(['default', *sorted(ROPE_INIT_FUNCTIONS)])})")
        try:
            lc = LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                             num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                             max_position_embeddings=self.max_position_embeddings, rope_parameters=rope)
            if rope["rope_type"] != "default":
                ROPE_INIT_FUNCTIONS[rope["rope_type"]](lc, None)
        except Exception as e:     # huggingface_hub's Strict*ValidationError, KeyError, ValueError, TypeError, ...
            text = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"{where}: transformers' LlamaConfig refuses it: {text}") from None
        return lc

    # ---- config.json ------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": [DRAFT_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            **({"fc_norm": True} if self.fc_norm else {}),
            **({"norm_output": True} if self.norm_output else {}),
            "eagle_config": {**d.get("eagle_config", {}),
                             "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        })
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Eagle3Config":
        """The config of a draft's config.json; every key it reads is checked (type and range), and a bad one is a
        ConfigError naming the file and the key, as check-draft reports it."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
        read = _Fields(d, where)
        if d.get("num_hidden_layers", 1) != 1:
            raise ConfigError(f"{where}: num_hidden_layers={d['num_hidden_layers']!r}; an EAGLE-3 draft has exactly "
                              "1 layer")
        eagle = read.dict("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            raise ConfigError(f"{where}: missing eagle_config.eagle_aux_hidden_state_layer_ids (without it SGLang "
                              "guesses the target layers and a mismatch serves at acceptance length ~1.0)")
        if not isinstance(aux, list) or not all(_is_int(i) and i >= 0 for i in aux) or not aux:
            raise ConfigError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids={aux!r} is not a list of "
                              "non-negative integers")
        known = {f.name for f in dataclasses.fields(cls)} | {
            "architectures", "model_type", "num_hidden_layers", "tie_word_embeddings", "rope_parameters",
            "use_aux_norm"}
        if _flag(d, "norm_before_fc", where) or _flag(eagle, "norm_before_fc", where):
            raise ConfigError(f"{where}: norm_before_fc=true (one RMSNorm over the concatenated features) is not "
                              "supported; EAGLE-3.1's fc_norm (one norm per feature) is")
        heads, hidden, vocab = read.positive_int("num_attention_heads"), read.positive_int("hidden_size"), \
            read.positive_int("vocab_size")
        torch_dtype = d.get("torch_dtype") or "bfloat16"
        if torch_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{where}: torch_dtype={torch_dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
        hidden_act = d.get("hidden_act", "silu")
        if not isinstance(hidden_act, str):
            raise ConfigError(f"{where}: hidden_act={hidden_act!r} is not a string")
        fields = dict(
            hidden_size=hidden, intermediate_size=read.positive_int("intermediate_size"),
            num_attention_heads=heads, num_key_value_heads=read.positive_int("num_key_value_heads", heads),
            vocab_size=vocab, draft_vocab_size=read.positive_int("draft_vocab_size", vocab),
            target_hidden_size=read.positive_int("target_hidden_size", hidden),
            aux_layer_ids=list(aux), head_dim=read.positive_int("head_dim", None),
            rms_norm_eps=read.positive_number("rms_norm_eps", 1e-6),   # LlamaConfig's default, as SGLang/vLLM read it
            **rope_settings(d, where), max_position_embeddings=read.positive_int("max_position_embeddings", 8192),
            hidden_act=hidden_act, torch_dtype=torch_dtype,
            bos_token_id=read.token_ids("bos_token_id"), eos_token_id=read.token_ids("eos_token_id", many=True),
            fc_norm=_flag(d, "fc_norm", where) or _flag(d, "use_aux_norm", where),
            norm_output=_flag(d, "norm_output", where),
            extra={k: v for k, v in d.items() if k not in known or k == "eagle_config"},
        )
        try:
            config = cls(**fields)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        config.llama_config(where)
        return config

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, directory: str, flag: str = "") -> "Eagle3Config":
        """The draft config of a folder; flag (e.g. "--draft") names the argument the folder came from."""
        check_draft_folder(directory, flag)
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{_named(flag, directory)}: no config.json (is this a draft folder?)")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, where=path)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: Optional[int] = None,
                   aux_layer_ids: Optional[list[int]] = None) -> "Eagle3Config":
        """A draft shaped like one layer of the target (the paper's and SGLang's choice)."""
        tc = getattr(target_config, "text_config", target_config)
        rope = getattr(tc, "rope_parameters", None) or {}
        rope_theta = getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)
        rope_scaling = _rope_scaling(getattr(tc, "rope_scaling", None) or rope)
        return cls(
            hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size or tc.vocab_size,
            target_hidden_size=tc.hidden_size,
            aux_layer_ids=list(aux_layer_ids or default_aux_layer_ids(tc.num_hidden_layers)),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5), rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            bos_token_id=getattr(tc, "bos_token_id", None), eos_token_id=getattr(tc, "eos_token_id", None),
        )


class _Fields:
    """Typed reads of a config dict: a value of the wrong type or range is a ConfigError naming the file and key."""

    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def _read(self, key: str, default, ok, what: str):
        value = self.d.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.where}: missing required key {key!r}")
            return default
        if not ok(value):
            raise ConfigError(f"{self.where}: {key}={value!r} is not {what}")
        return value

    def positive_int(self, key: str, default=_REQUIRED):
        return self._read(key, default, lambda v: _is_int(v) and v > 0, "a positive integer")

    def positive_number(self, key: str, default=_REQUIRED):
        return self._read(key, default, lambda v: _is_number(v) and v > 0, "a positive number")

    def dict(self, key: str):
        value = self.d.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{self.where}: {key}={value!r} is not an object")
        return value

    def token_ids(self, key: str, many: bool = False):
        def ok(v):
            return (_is_int(v) and v >= 0) or (many and isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v))
        return self._read(key, None, ok, "a token id" + (" or a list of them" if many else ""))


def rope_settings(d: dict, where: str) -> dict:
    """rope_theta and rope_scaling of a config dict, from either spelling (transformers 5 folds them into
    rope_parameters); a value of the wrong type is a ConfigError naming the file and key."""
    read = _Fields(d, where)
    rope_params = read.dict("rope_parameters") or {}
    rope_theta = read.positive_number("rope_theta", None) or rope_params.get("rope_theta", 10000.0)
    if not _is_number(rope_theta) or rope_theta <= 0:
        raise ConfigError(f"{where}: rope_parameters.rope_theta={rope_theta!r} is not a positive number")
    return {"rope_theta": rope_theta, "rope_scaling": _rope_scaling(read.dict("rope_scaling") or rope_params)}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _named(flag: str, directory: str) -> str:
    return f"{flag} {directory}" if flag else directory


# ---- which kind of model folder ---------------------------------------------------------------------------
DRAFT_KEYS = ("draft_vocab_size", "eagle_config", "speculators_config", "speculators_model_type")
DRAFT_ARCHITECTURES = (DRAFT_ARCHITECTURE, "Eagle3Speculator")


def folder_kind(directory: str) -> tuple[str, str]:
    """("draft" | "target" | "", what it is) from a folder's config.json: a draft's config carries a draft key
    (draft_vocab_size, eagle_config, speculators_config) or a draft architecture; a target's has none and more than
    one decoder layer. "" when it cannot tell (no readable config.json: the caller's own checks name the problem)."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return "", ""
    if not isinstance(d, dict):
        return "", ""
    archs = d.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    key = next((k for k in DRAFT_KEYS if k in d), None)
    if arch in DRAFT_ARCHITECTURES or key:
        return "draft", arch if arch in DRAFT_ARCHITECTURES else f"its config.json has {key}"
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    layers = text.get("num_hidden_layers")
    if _is_int(layers) and layers > 1:
        return "target", f"{arch or d.get('model_type') or 'a model'} with {layers} layers"
    return "", ""


def draft_file(name: str) -> bool:
    """A file a draft folder's loaders read as the draft (config.json, weights: every *.safetensors is a shard to
    them): what writing a draft into a folder replaces, and nothing else."""
    return (name in ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
            or name.endswith(".safetensors") or (name.startswith("pytorch_model") and ".bin" in name))


def check_replaceable(directory: str, flag: str = "--out") -> None:
    """A folder a draft will be written into (its config.json and weights replaced) holds no other kind of model."""
    kind, what = folder_kind(directory)
    if kind == "target":
        raise ConfigError(f"{_named(flag, directory)} holds a target model ({what}), not an EAGLE-3 draft: writing a "
                          f"draft there would replace its config.json and weights; choose another {flag}")


def check_draft_folder(directory: str, flag: str = "") -> None:
    """Refuse a target model's folder where an EAGLE-3 draft folder is expected, in one line."""
    kind, what = folder_kind(directory)
    if kind == "target":
        raise ConfigError(f"{_named(flag, directory)} is a target model folder ({what}), not an EAGLE-3 draft "
                          "(a target goes to --target)")


def check_target_folder(directory: str, flag: str = "--target") -> None:
    """Refuse an EAGLE-3 draft's folder where a target model is expected, in one line."""
    kind, what = folder_kind(directory)
    if kind == "draft":
        raise ConfigError(f"{_named(flag, directory)} is an EAGLE-3 draft folder ({what}), not a target model "
                          "(a draft goes to --draft)")


def _flag(d: dict, key: str, where: str) -> bool:
    v = d.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: {key}={v!r} must be true or false")
    return v


def _rope_scaling(rope: Optional[dict]) -> Optional[dict]:
    """Legacy `rope_scaling` from either spelling; None for plain RoPE (transformers 5 folds the type and
    theta into `rope_parameters`)."""
    if not rope:
        return None
    out = {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = out.get("rope_type", out.get("type", "default"))
    return None if kind == "default" and len(out) <= 1 else out
