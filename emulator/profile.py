"""Model profiles and the per-rank GPU memory model of the emulator (sizes in GiB, "GB" in the logs
as in SGLang): weights, KV pool, static buffers, CUDA graphs, and the activation headroom a prefill
batch must fit in. The model and the demo profile's calibration are in docs/emulator.md, "Memory model".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelInfo", "Profile", "RankMemory", "MemoryError_", "load_model", "plan_rank_memory"]

GIB = 1024.0  # MiB per GiB


class MemoryError_(Exception):
    """A startup memory failure; ``kind`` is 'weights' | 'kv' | 'graph' and ``message`` SGLang's text."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        self.message = message
        super().__init__(message)


@dataclass(frozen=True)
class Profile:
    """Memory and size constants of an emulated model."""

    name: str
    weights_gib_total: float
    context_gib: float = 0.80  # CUDA context + NCCL buffers, before weights
    pool_overhead_gib: float = 5.50  # req_to_token pool, attention workspace, sampler buffers
    graph_step_gib: float = 0.07  # allocator step between pool end and graph capture begin
    graph_gib: float = 0.33  # captured CUDA graphs
    activation_mib_per_token: float = 0.5  # prefill activation memory per token in a batch


@dataclass(frozen=True)
class ModelInfo:
    """What the emulator reads from a model dir's config.json."""

    path: str
    model_type: str
    architecture: str
    dtype: str
    context_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_id: int
    chat_template: str | None
    profile: Profile

    def kv_bytes_per_token(self, tp: int) -> int:
        """K+V bytes per token on one rank (bf16)."""
        heads = max(1, self.num_kv_heads // max(1, tp))
        return 2 * self.num_layers * heads * self.head_dim * 2


@dataclass(frozen=True)
class RankMemory:
    """The numbers one scheduler rank logs and holds, GiB unless named otherwise."""

    total_gib: float
    begin_avail: float
    weights: float
    after_weights: float
    kv: float
    kv_tokens: int
    pool_end_avail: float
    graph_begin_avail: float
    graph: float
    headroom: float

    context: float = 0.8

    @property
    def held_mib(self) -> int:
        """MiB this rank's process holds on its GPU once started (context through graphs)."""
        return int(round((self.context + self.begin_avail - self.headroom) * GIB))


def _estimate_weights_gib(cfg: dict[str, Any]) -> float:
    """Rough bf16 parameter size of a transformer config (only used for non-demo model dirs)."""
    h = int(cfg.get("hidden_size", 4096))
    layers = int(cfg.get("num_hidden_layers", 32))
    heads = int(cfg.get("num_attention_heads", 32))
    kv = int(cfg.get("num_key_value_heads", heads))
    hd = int(cfg.get("head_dim", h // max(1, heads)))
    attn = h * hd * (2 * heads + 2 * kv)
    experts = int(cfg.get("num_experts", cfg.get("n_routed_experts", 0)) or 0)
    if experts:
        mlp = experts * 3 * h * int(cfg.get("moe_intermediate_size", cfg.get("intermediate_size", 4 * h)))
    else:
        mlp = 3 * h * int(cfg.get("intermediate_size", 4 * h))
    vocab = int(cfg.get("vocab_size", 32000))
    params = layers * (attn + mlp) + 2 * vocab * h
    return params * 2 / 2**30


DEMO_PROFILE_WEIGHTS_GIB = 56.0


def load_model(model_path: str, profile: str = "auto") -> ModelInfo:
    """Read ``config.json`` (and ``tokenizer_config.json`` when present) of a model dir.

    Args:
        model_path: the model directory.
        profile: ``auto`` (demo when config.json has ``datagen_demo``), ``demo`` or ``generic``.

    Raises:
        OSError: the directory or its config.json is missing (SGLang fails the same way).
        ValueError: unknown profile.
    """
    cfg_path = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path) or not os.path.isfile(cfg_path):
        raise OSError(
            f"{model_path} is not a local folder and is not a valid model identifier listed on "
            "'https://huggingface.co/models'"
        )
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    template = None
    tok_path = os.path.join(model_path, "tokenizer_config.json")
    if os.path.isfile(tok_path):
        with open(tok_path, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    if profile == "auto":
        profile = "demo" if "datagen_demo" in cfg else "generic"
    if profile == "demo":
        weights = DEMO_PROFILE_WEIGHTS_GIB
    elif profile == "generic":
        weights = _estimate_weights_gib(cfg)
    else:
        raise ValueError(f"unknown --emu-profile {profile!r} (choose auto, demo or generic)")
    h = int(cfg.get("hidden_size", 4096))
    heads = int(cfg.get("num_attention_heads", 32))
    prof = Profile(name=profile, weights_gib_total=weights, activation_mib_per_token=h * 128 / 2**20)
    eos = cfg.get("eos_token_id", 2)
    if isinstance(eos, list):
        eos = eos[0] if eos else 2
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    return ModelInfo(
        path=model_path,
        model_type=str(cfg.get("model_type", "llama")),
        architecture=str(archs[0]),
        dtype="torch." + str(cfg.get("torch_dtype", "bfloat16")),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        num_layers=int(cfg.get("num_hidden_layers", 32)),
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim", h // max(1, heads))),
        eos_token_id=int(eos),
        chat_template=template,
        profile=prof,
    )


def plan_rank_memory(model: ModelInfo, total_mib: int, used_mib: int, fraction: float, tp: int) -> RankMemory:
    """The memory a rank logs and holds, given its GPU's total and what others already use.

    Args:
        model: the model and its memory profile.
        total_mib: the GPU's total memory.
        used_mib: memory other processes already hold on it.
        fraction: ``--mem-fraction-static``.
        tp: tensor-parallel size (weights are split across ranks).

    Raises:
        MemoryError_: a startup phase does not fit; the message is SGLang's for that phase.
    """
    prof = model.profile
    total = total_mib / GIB
    begin = (total_mib - used_mib) / GIB - prof.context_gib
    weights = prof.weights_gib_total / tp
    if weights > begin:
        raise MemoryError_(
            "weights",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{weights:.2f} GiB. GPU 0 has a total capacity of {total:.2f} GiB of which "
            f"{max(begin, 0.0):.2f} GiB is free.",
        )
    after_weights = begin - weights
    kv = after_weights - total * (1.0 - fraction)
    kv_tokens = int(kv * 2**30 // model.kv_bytes_per_token(tp)) if kv > 0 else 0
    if kv_tokens <= 0:
        raise MemoryError_(
            "kv",
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            f"Current value: mem_fraction_static={fraction}",
        )
    after_kv = after_weights - kv
    pool_end = after_kv - prof.pool_overhead_gib
    graph_begin = pool_end - prof.graph_step_gib
    headroom = graph_begin - prof.graph_gib
    if headroom <= 0.05:
        want = prof.pool_overhead_gib + prof.graph_step_gib + prof.graph_gib
        raise MemoryError_(
            "graph",
            "Capture cuda graph failed: CUDA out of memory. Tried to allocate "
            f"{want:.2f} GiB. GPU 0 has a total capacity of {total:.2f} GiB of which "
            f"{max(after_kv, 0.0):.2f} GiB is free.",
        )
    return RankMemory(
        total_gib=total,
        begin_avail=begin,
        weights=weights,
        after_weights=after_weights,
        kv=kv,
        kv_tokens=kv_tokens,
        pool_end_avail=pool_end,
        graph_begin_avail=graph_begin,
        graph=prof.graph_gib,
        headroom=headroom,
        context=prof.context_gib,
    )
