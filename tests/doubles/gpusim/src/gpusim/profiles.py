"""Built-in model profiles: the few numbers of a model that SGLang's memory math reads."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any

GIB = 1 << 30


@dataclass
class ModelProfile:
    name: str
    architectures: list[str]
    model_type: str
    weights_gib: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    v_head_dim: int | None = None
    full_attention_layers: int | None = None
    kv_dtype_bytes: int = 2
    torch_dtype: str = "bfloat16"
    draft_weights_gib: float = 0.0
    draft_layers: int = 0
    mamba_conv_state_bytes: int = 0
    mamba_ssm_state_bytes: int = 0
    mamba_ssm_dtype: str = "float32"
    activation_reserve_mib: int = 4096
    cuda_graph_mib: int = 1024
    context_mib: int = 512
    reasoning: bool = False
    eos_token_id: int = 151645
    vocab_size: int = 151936
    aliases: list[str] = field(default_factory=list)

    @property
    def is_hybrid(self) -> bool:
        return self.mamba_conv_state_bytes + self.mamba_ssm_state_bytes > 0

    @property
    def attention_layers(self) -> int:
        if self.full_attention_layers is not None:
            return self.full_attention_layers
        return self.num_layers

    @property
    def mtp_capable(self) -> bool:
        return self.draft_layers > 0

    def mamba_per_req_bytes(self, ssm_dtype: str | None, tp: int = 1) -> tuple[int, int]:
        """(conv, ssm) state bytes of one request on one TP rank."""
        ssm = self.mamba_ssm_state_bytes
        chosen = ssm_dtype or self.mamba_ssm_dtype
        if self.mamba_ssm_dtype == "float32" and chosen in ("bfloat16", "float16"):
            ssm //= 2
        elif self.mamba_ssm_dtype in ("bfloat16", "float16") and chosen == "float32":
            ssm *= 2
        return self.mamba_conv_state_bytes // tp, ssm // tp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_BUILTIN: dict[str, ModelProfile] = {
    "tiny": ModelProfile(
        name="tiny",
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        weights_gib=0.5,
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        context_length=4096,
        activation_reserve_mib=1024,
        cuda_graph_mib=128,
        aliases=["tiny", "tiny-model", "gpusim-tiny"],
    ),
    "qwen3-8b": ModelProfile(
        name="qwen3-8b",
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        weights_gib=15.27,
        num_layers=36,
        num_kv_heads=8,
        head_dim=128,
        context_length=40960,
        activation_reserve_mib=4096,
        cuda_graph_mib=1600,
        reasoning=True,
        aliases=["qwen3-8b", "qwen3-8b-instruct"],
    ),
    # Hybrid Gated-DeltaNet / full-attention model with one MTP layer. Sized so that one
    # request's linear-attention state is 0.26 GiB (fp32 SSM state), which is what makes
    # --max-mamba-cache-size the binding limit on concurrency.
    "qwen3.6-27b": ModelProfile(
        name="qwen3.6-27b",
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5",
        weights_gib=51.8,
        num_layers=64,
        full_attention_layers=16,
        num_kv_heads=4,
        head_dim=256,
        context_length=262144,
        draft_weights_gib=0.85,
        draft_layers=1,
        mamba_conv_state_bytes=10_737_418,
        mamba_ssm_state_bytes=268_435_456,
        mamba_ssm_dtype="float32",
        activation_reserve_mib=6144,
        cuda_graph_mib=2400,
        reasoning=True,
        eos_token_id=248046,
        vocab_size=248320,
        aliases=["qwen3.6-27b", "qwen3.6-27b-fp8", "qwen3.6-27b-instruct"],
    ),
}

PROFILE_FIELDS = {f.name for f in fields(ModelProfile)}


def builtin_names() -> list[str]:
    return sorted(_BUILTIN)


def get_builtin(name: str) -> ModelProfile | None:
    prof = _BUILTIN.get(name.lower())
    return copy.deepcopy(prof) if prof else None


def match_by_model_path(model_path: str) -> ModelProfile | None:
    base = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    for prof in _BUILTIN.values():
        if base in prof.aliases:
            return copy.deepcopy(prof)
    return None


def apply_overrides(prof: ModelProfile, overrides: dict[str, Any] | None) -> ModelProfile:
    if not overrides:
        return prof
    unknown = set(overrides) - PROFILE_FIELDS
    if unknown:
        raise ValueError(f"unknown model profile field(s): {', '.join(sorted(unknown))}")
    data = prof.to_dict()
    data.update(overrides)
    return ModelProfile(**data)
