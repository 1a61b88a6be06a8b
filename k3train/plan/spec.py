"""What a plan reads from a composed config: the model's shapes (built on the meta device, so no weight is
allocated) and the costs it hands the planner (k3train/plan/costs.py), every parameter with the optimizer state
k3train gives it, and the recipe (batch, precision, strategy, checkpointing, optimizer, callbacks).

Which parameter goes to Muon and which to AdamW is k3train's own partition (k3train/optim/param_groups.py) on the
meta model; each parameter's FSDP2 unit is the transformer block it lives in, or the root (embeddings, final norm,
LM head, output mix), as k3train/train/parallel.py wraps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from k3train.config import TrainConfig, check_known_keys
from k3train.config_targets import check_target_settings
from k3train.optim.muon import as_matrices
from k3train.optim.param_groups import partition_parameters
from k3train.plan.costs import ModelCosts, PlansCosts


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    kind: str  # "muon" (one momentum buffer) | "adamw" (two moments) | "frozen" (no gradient, no state)
    group: str  # its optimizer group (param_groups.GROUPS), or "frozen"
    routed: bool  # a stacked routed-expert weight [E, out, in]: split over ep ranks
    unit: str  # the FSDP2 unit that gathers it: "layers.<i>" or "root"
    matrices: tuple[int, int, int] | None  # Muon's view [N, A, B] (per head, per expert)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class RunSpec:
    model: object  # KimiK3Config: the shapes
    params: tuple[Param, ...]
    optimizer: str  # "muon_adamw" | "adamw"
    ns_dtype: str | None  # Newton-Schulz dtype ("bf16" | "fp32") on the planned device; None without Muon
    precision: str  # fp32 | bf16 | fp16
    strategy: str  # the configured parallel strategy: ddp | fsdp
    ep: int  # the configured parallel.ep (1 where the config has none)
    cp: int  # the configured parallel.cp (1 where the config has none)
    dp_replicate: int  # the configured parallel.dp_replicate (HSDP's replica groups; 1 where the config has none)
    pp: int  # the configured parallel.pp (pipeline stages; 1 where the config has none)
    reshard_after_forward: bool
    batch_size: int  # sequences per micro-batch, per process
    seq_len: int  # a whole row's; split over cp ranks, each holds seq_len / cp of it
    accumulation: int
    checkpointing: str  # none | block | selective
    qk_clip: bool  # the QK-Clip callback tracks MLA's max logits (fp32 matmuls, a tile at a time)
    flops_per_token: dict  # the model's flops_per_token at seq_len
    costs: ModelCosts  # the model's plan_costs(): what the shapes alone do not give
    documents: bool = False  # data.document_masking: packed documents masked from each other
    pp_schedule: str = "1f1b"  # parallel.pp_schedule, pp_virtual_stages, pp_microbatches (k3train/plan/pipeline.py)
    pp_virtual_stages: int = 1
    pp_microbatches: int | None = None  # None: the accumulation
    # A pipeline rank's part of the model (k3train/plan/pipeline.stage_spec): the layers it holds, the embedding
    # (first) and the final norm, head and loss (last); the whole model by default
    layers: tuple[int, ...] | None = None
    first: bool = True
    last: bool = True

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch's rows (on one rank without context parallelism)."""
        return self.batch_size * self.seq_len

    def rank_tokens(self, cp: int = 1) -> int:
        """Tokens of one micro-batch on one rank when each row is split over cp ranks."""
        check_split(self.seq_len, cp)
        return self.batch_size * self.seq_len // cp

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The layers planned: every one, or a pipeline rank's."""
        return tuple(range(self.model.n_layers)) if self.layers is None else self.layers

    def held_kinds(self) -> list[str]:
        """The mixer kind ("kda" or "mla") of each layer planned."""
        return [self.model.layer_pattern[i] for i in self.layer_ids]

    @property
    def units(self) -> list[str]:
        return ["root", *(f"layers.{i}" for i in self.layer_ids)]


def check_split(seq_len: int, cp: int) -> None:
    if cp < 1 or seq_len % cp:
        raise ValueError(
            f"train.seq_len={seq_len} does not split over cp={cp} ranks: choose a sequence length divisible by {cp}"
        )


def _count(parallel, key: str) -> int:
    """parallel.<key>, a count of ranks or stages (null: 1), refused as the run refuses it where it is not >= 1."""
    value = parallel.get(key, 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"parallel.{key}={value!r} must be a positive integer")
    return value


def build_spec(cfg: DictConfig, device_type: str, vocab_size: int | None = None) -> RunSpec:
    """The composed config as a RunSpec; the model is built on the meta device. vocab_size: what the model's
    `vocab_size: null` takes (the data's), when the config leaves it null."""
    check_known_keys(cfg)
    check_target_settings(cfg)
    train: TrainConfig = OmegaConf.to_object(cfg.train)
    overrides = {} if cfg.model.get("vocab_size") is not None else {"vocab_size": vocab_size}
    if cfg.model.get("vocab_size") is None and vocab_size is None:
        raise ValueError("the model's vocab_size is null (the data's): pass --vocab-size or model.vocab_size=N")
    with torch.device("meta"):
        model = instantiate(cfg.model, **overrides)
    if not isinstance(model, PlansCosts):
        target = cfg.model.get("_target_", "")
        raise ValueError(
            f"model {target}: it gives the planner no costs (plan_costs); KimiK3's do (model=k3*, kimi_linear_*)"
        )
    if train.activation_checkpointing != "none":
        model.set_activation_checkpointing(train.activation_checkpointing)
    optimizer = _optimizer_kind(cfg.optim)
    head_wise = bool(cfg.optim.get("head_wise", True))
    params = tuple(_params(model, optimizer, head_wise))
    parallel_target = str(cfg.parallel.get("_target_", ""))
    return RunSpec(
        model=model.config,
        params=params,
        optimizer=optimizer,
        ns_dtype=_ns_dtype(cfg.optim, device_type) if optimizer == "muon_adamw" else None,
        precision=str(cfg.precision.dtype),
        strategy="fsdp" if parallel_target.endswith("FSDP") else "ddp",
        ep=_count(cfg.parallel, "ep"),
        cp=_count(cfg.parallel, "cp"),
        dp_replicate=_count(cfg.parallel, "dp_replicate"),
        pp=_count(cfg.parallel, "pp"),
        pp_schedule=str(cfg.parallel.get("pp_schedule", "1f1b")),
        pp_virtual_stages=_count(cfg.parallel, "pp_virtual_stages"),
        pp_microbatches=cfg.parallel.get("pp_microbatches"),
        reshard_after_forward=bool(cfg.parallel.get("reshard_after_forward", True)),
        batch_size=train.batch_size,
        seq_len=train.seq_len,
        accumulation=train.gradient_accumulation_steps,
        checkpointing=train.activation_checkpointing,
        qk_clip="qk_clip" in (cfg.get("callbacks") or {}),
        flops_per_token=model.flops_per_token(train.seq_len),
        costs=model.plan_costs(),
        documents=bool(cfg.get("data", {}).get("document_masking", False)),
    )


def _optimizer_kind(optim: DictConfig) -> str:
    target = str(optim.get("_target_", ""))
    if target.endswith("muon_adamw"):
        return "muon_adamw"
    if target.endswith(".adamw"):
        return "adamw"
    raise ValueError(f"optim {target}: the plan knows k3train's adamw and muon_adamw")


def _ns_dtype(optim: DictConfig, device_type: str) -> str:
    setting = str(optim.get("ns_dtype", "auto"))
    if setting != "auto":
        return setting
    if device_type == "cpu":
        from k3train.optim.build import resolve_ns_dtype

        return resolve_ns_dtype("auto", torch.device("cpu"))
    return "bf16"  # every GPU the plan knows multiplies bf16 natively


def _params(model: torch.nn.Module, optimizer: str, head_wise: bool) -> list[Param]:
    assigned = {a.name: a for a in partition_parameters(model, head_wise=head_wise)}
    out = []
    for name, p in model.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        routed = p.ndim == 3 and ".experts." in f".{name}"
        a = assigned.get(name)
        if a is None:
            out.append(Param(name, tuple(p.shape), "frozen", "frozen", routed, unit, None))
            continue
        kind = a.kind if optimizer == "muon_adamw" else "adamw"
        matrices = tuple(as_matrices(p, a.head_split).shape) if kind == "muon" else None
        out.append(Param(name, tuple(p.shape), kind, a.group, routed, unit, matrices))
    return out
