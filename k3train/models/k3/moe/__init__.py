"""The sigmoid-routed MoE with a balancing bias (DeepSeek-V3 / Kimi Linear / Kimi K3); its shared experts, like the
dense FFN, are SwiGLU (k3train/models/common/swiglu.py). One job a module, imported one way (each imports only those
above it):

    router.py           Router: fp32 logits, sigmoid scores, top-k on scores + bias, renormalised gate weights
    balancing.py        Balancer: how the bias moves (Quantile Balancing, aux-free, none), also across ranks
    grouped_swiglu.py   GroupedSwiGLU: the routed experts' FFNs, expert by expert or by grouped GEMM
    experts.py          RoutedExperts: the stacked routed experts
    dispatch.py         LocalDispatch and AllToAllDispatch (expert parallelism): the token slots to the experts and back
    layer.py            MoE: the parts composed, with the latent projections; replayed_routes, shard_experts
    reference.py        reference_moe_forward: the plain, slow MoE the tests hold the fast path to
"""

from k3train.models.k3.moe.balancing import (
    BALANCING,
    Balancer,
    check_equal_tokens,
    global_load,
    global_quantile_bias,
    quantile_bias,
    quantile_rank,
    required_bias,
)
from k3train.models.k3.moe.dispatch import AllToAllDispatch, Dispatched, Dispatcher, LocalDispatch
from k3train.models.k3.moe.experts import EXPERT_IMPLEMENTATIONS, RoutedExperts
from k3train.models.k3.moe.grouped_swiglu import AllExperts, GroupedSwiGLU, OneExpert
from k3train.models.k3.moe.layer import MoE, replayed_routes, shard_experts
from k3train.models.k3.moe.reference import reference_moe_forward
from k3train.models.k3.moe.router import Router, expert_counts

__all__ = [
    "BALANCING",
    "EXPERT_IMPLEMENTATIONS",
    "AllExperts",
    "AllToAllDispatch",
    "Balancer",
    "Dispatched",
    "Dispatcher",
    "GroupedSwiGLU",
    "LocalDispatch",
    "MoE",
    "OneExpert",
    "RoutedExperts",
    "Router",
    "check_equal_tokens",
    "expert_counts",
    "global_load",
    "global_quantile_bias",
    "quantile_bias",
    "quantile_rank",
    "reference_moe_forward",
    "replayed_routes",
    "required_bias",
    "shard_experts",
]
