"""Kimi K3 for transformers' `trust_remote_code=True`: the model k3train's HF export writes in the kimi_k3 layout,
with the tensor names and config.json that layout uses (k3train/models/k3/state_dict_adapter.py, hf_config.py).

k3train's HF export copies this file beside the weights (k3train/hf/write.py; config.json's auto_map names
KimiK3ForCausalLM), so it imports only torch and transformers: whoever loads the export may not have k3train. It
computes what k3train's KimiK3 computes (k3train/models/k3/model.py), each step written plainly:

    embed_tokens -> layers -> norm -> lm_head, each layer a mixer (KDA or MLA) then an FFN (dense, or the MoE)

with Kimi K3's five components where config.json turns them on:
- attention residuals (attn_res_block_size): each layer's inputs are a softmax mix over depth of the finished
  blocks' sums (k3train/models/k3/attn_res.py; the wiring in model.py's module docstring);
- SiTU-GLU (hidden_act "situ") in every FFN: b tanh(g / b) sigmoid(g) * c tanh(u / c)
  (k3train/models/common/situ.py);
- the latent MoE (routed_expert_hidden_size): the routed experts between a down projection, an RMSNorm and an up
  projection (k3train/models/k3/moe/layer.py);
- MLA's output gate (mla_use_output_gate): sigmoid(g_proj x) times the attention output before o_proj (mla.py);
- KDA's full-rank output gate (linear_attn_config.use_full_rank_gate): g_proj x in place of g_b_proj(g_a_proj x)
  (k3train/models/kda/layer.py), and the sigmoid decay gate when linear_attn_config.gate_lower_bound is a number.

The KDA recurrence runs one step at a time in fp32 (k3train/models/kda/naive.py's reference), and every forward
reads the whole sequence (no cache): faithful and slow, for checking and small models; k3train's own inference
(python -m k3train.generate) is the fast path. Written for this repository, not taken from another project.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_kimi_k3 import KimiK3Config

MLA_LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: fixed in the layout (hf_config.FIXED_EPS)
KDA_QK_NORM_EPS = 1e-6  # q and k are x / sqrt(sum x^2 + eps), as FLA's kernel normalises them


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def glu(g, u, text):
    """The gated activation of every FFN: silu(g) u, or SiTU-GLU in fp32 cast back."""
    if text.hidden_act != "situ":
        return F.silu(g) * u
    beta, linear_beta = text.activation_situ_beta, text.activation_situ_linear_beta
    gf, uf = g.float(), u.float()
    return (beta * torch.tanh(gf / beta) * torch.sigmoid(gf) * (linear_beta * torch.tanh(uf / linear_beta))).to(g.dtype)


class MLP(nn.Module):
    def __init__(self, text, d_in, d_ff):
        super().__init__()
        self.text = text
        self.gate_proj = nn.Linear(d_in, d_ff, bias=False)
        self.up_proj = nn.Linear(d_in, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_in, bias=False)

    def forward(self, x):
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.text))


class Expert(nn.Module):
    """One routed expert: w1 the gate, w3 the up, w2 the down projection (the released checkpoint's names)."""

    def __init__(self, text, d_in, d_ff):
        super().__init__()
        self.text = text
        self.w1 = nn.Linear(d_in, d_ff, bias=False)
        self.w3 = nn.Linear(d_in, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_in, bias=False)

    def forward(self, x):
        return self.w2(glu(self.w1(x), self.w3(x), self.text))


class Router(nn.Module):
    def __init__(self, text):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(text.num_experts, text.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(text.num_experts))

    def forward(self, x, k, scaling):
        """x [N, d] -> gate weights [N, k] and chosen experts [N, k]: the top k of sigmoid scores plus the bias,
        weighted by their unbiased scores renormalised (fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        chosen = torch.topk(scores + self.e_score_correction_bias.float(), k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20) * scaling, chosen


class MoE(nn.Module):
    """shared experts(x) + the k chosen routed experts' weighted sum, through the latent width when
    routed_expert_hidden_size is set (down projection, experts, RMSNorm, up projection)."""

    def __init__(self, text):
        super().__init__()
        self.text = text
        d, latent = text.hidden_size, text.routed_expert_hidden_size
        width = d if latent is None else latent
        self.gate = Router(text)
        self.experts = nn.ModuleList(Expert(text, width, text.moe_intermediate_size) for _ in range(text.num_experts))
        if text.num_shared_experts:
            self.shared_experts = MLP(text, d, text.num_shared_experts * text.moe_intermediate_size)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            if text.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, text.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.gate(x, self.text.num_experts_per_token, self.text.routed_scaling_factor)
        latent = self.text.routed_expert_hidden_size is not None
        h = self.routed_expert_down_proj(x) if latent else x
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                y = y.index_add(0, token, expert(h[token]) * weights[token, slot, None].to(h.dtype))
        if latent:
            if self.text.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.text.num_shared_experts:
            y = y + self.shared_experts(x)
        return y.view(shape)


class MLA(nn.Module):
    """Multi-head latent attention, NoPE (the shared rope slice of the key unrotated), causal; with
    mla_use_output_gate the output times sigmoid(g_proj x) before o_proj."""

    def __init__(self, text):
        super().__init__()
        d, H = text.hidden_size, text.num_attention_heads
        self.H, self.dn, self.dr, self.dv = H, text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim
        self.r = text.kv_lora_rank
        q_dim = H * (self.dn + self.dr)
        if text.q_lora_rank is None:
            self.q_proj = nn.Linear(d, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, text.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(text.q_lora_rank, MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(text.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.r + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, MLA_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.r, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, d, bias=False)
        if text.mla_use_output_gate:
            self.g_proj = nn.Linear(d, H * self.dv, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, dn + dr)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.r, dr], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, H, dn + dv).split([dn, dv], dim=-1)
        k = torch.cat((k_nope, k_rope[:, :, None].expand(B, T, H, dr)), dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(dn + dr) ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, H * dv)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


class KDA(nn.Module):
    """Kimi Delta Attention: q, k, v through a causal depthwise conv and SiLU, q and k L2-normalised, a per-channel
    log decay g (softplus: -exp(A_log) softplus(f + dt_bias); sigmoid: lower_bound sigmoid(exp(A_log) (f + dt_bias))),
    beta = sigmoid(b_proj x), the delta-rule recurrence, then a per-head RMSNorm times sigmoid(the output gate)."""

    def __init__(self, text):
        super().__init__()
        linear = text.linear_attn_config
        d, self.H, self.K = text.hidden_size, linear["num_heads"], linear["head_dim"]
        dim, conv = self.H * self.K, linear.get("short_conv_kernel_size", 4)
        self.lower_bound = linear.get("gate_lower_bound")
        self.full_rank_gate = linear.get("use_full_rank_gate", False)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, dim, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(dim, dim, conv, groups=dim, padding=conv - 1, bias=False) for _ in range(3)
        )
        self.f_a_proj = nn.Linear(d, self.K, bias=False)
        self.f_b_proj = nn.Linear(self.K, dim, bias=False)
        self.b_proj = nn.Linear(d, self.H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(math.ceil(self.H / 128) * 128))  # the layout pads A_log [H] to 128s
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, dim, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, self.K, bias=False)
            self.g_b_proj = nn.Linear(self.K, dim, bias=False)
        self.o_norm = RMSNorm(self.K, text.rms_norm_eps)
        self.o_proj = nn.Linear(dim, d, bias=False)

    @staticmethod
    def _conv_silu(conv, x):
        T = x.shape[1]
        return F.silu(F.conv1d(x.transpose(1, 2), conv.weight, padding=conv.weight.shape[-1] - 1, groups=x.shape[-1]))[
            ..., :T
        ].transpose(1, 2)

    def forward(self, x):
        B, T, _ = x.shape
        H, K = self.H, self.K
        q, k, v = (
            self._conv_silu(conv, proj(x)).view(B, T, H, K).float()
            for proj, conv in ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        )
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + KDA_QK_NORM_EPS) * K**-0.5
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + KDA_QK_NORM_EPS)
        f = self.f_b_proj(self.f_a_proj(x)).float().view(B, T, H, K) + self.dt_bias.float().view(H, K)
        rate = self.A_log[:H].float().exp()[:, None]
        g = -rate * F.softplus(f) if self.lower_bound is None else self.lower_bound * torch.sigmoid(rate * f)
        beta = torch.sigmoid(self.b_proj(x).float())
        state = q.new_zeros(B, H, K, K)
        out = []
        for t in range(T):  # S <- diag(exp g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T; o_t = S^T q_t
            state = state * g[:, t, :, :, None].exp()
            error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)
            state = state + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], error)
            out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        o = torch.stack(out, dim=1).to(x.dtype)
        logits = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o) * torch.sigmoid(logits.view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, H * K))


def attn_res_mix(sources, norm, proj):
    """sum_i softmax_i(<norm.weight * proj.weight, V_i / rms(V_i)>) V_i over the sources, in fp32."""
    values = [v.float() for v in sources]
    query = norm.weight.float() * proj.weight.float().reshape(-1)
    scores = torch.stack([(v @ query) * torch.rsqrt(v.square().mean(-1) + norm.eps) for v in values], dim=-1)
    probs = scores.softmax(-1)
    return sum(probs[..., i, None] * v for i, v in enumerate(values)).to(sources[0].dtype)


class DecoderLayer(nn.Module):
    def __init__(self, text, index, mixer):
        super().__init__()
        self.index, self.block_size = index, text.attn_res_block_size
        self.self_attn = KDA(text) if mixer == "kda" else MLA(text)
        moe = index >= text.first_k_dense_replace
        if moe:
            self.block_sparse_moe = MoE(text)
        else:
            self.mlp = MLP(text, text.hidden_size, text.intermediate_size)
        self.input_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        if self.block_size is not None:
            for point in ("self_attention_res", "mlp_res"):
                setattr(self, f"{point}_norm", RMSNorm(text.hidden_size, text.rms_norm_eps))
                setattr(self, f"{point}_proj", nn.Linear(text.hidden_size, 1, bias=False))

    @property
    def starts_block(self):
        return self.block_size is not None and self.index % self.block_size == 0

    def ffn(self, x):
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, h, blocks):
        """h: the previous layer's output; blocks: with attention residuals, the finished blocks' sums (the
        embedding first). Returns this layer's output and the blocks after it."""
        if self.block_size is None:
            h = h + self.self_attn(self.input_layernorm(h))
            return h + self.ffn(self.post_attention_layernorm(h)), blocks
        x = attn_res_mix((*blocks, h), self.self_attention_res_norm, self.self_attention_res_proj) if blocks else h
        attn = self.self_attn(self.input_layernorm(x))
        if self.starts_block:
            blocks, s = (*blocks, h), attn
        else:
            s = h + attn
        mixed = attn_res_mix((*blocks, s), self.mlp_res_norm, self.mlp_res_proj)
        return s + self.ffn(self.post_attention_layernorm(mixed)), blocks


class KimiK3TextModel(nn.Module):
    def __init__(self, text):
        super().__init__()
        linear = text.linear_attn_config
        kda = set(linear["kda_layers"])  # 1-based
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(text, i, "kda" if i + 1 in kda else "mla") for i in range(text.num_hidden_layers)
        )
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        if text.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(text.hidden_size, 1, bias=False)

    def forward(self, input_ids):
        h, blocks = self.embed_tokens(input_ids), ()
        for layer in self.layers:
            h, blocks = layer(h, blocks)
        if hasattr(self, "output_attn_res_norm"):
            h = attn_res_mix((*blocks, h), self.output_attn_res_norm, self.output_attn_res_proj)
        return self.norm(h)


class KimiK3LanguageModel(nn.Module):
    """`language_model.` in the checkpoint: the text model (`model.`) and its `lm_head`."""

    def __init__(self, text):
        super().__init__()
        self.model = KimiK3TextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "language_model"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    """input_ids [B, T] -> logits [B, T, V] (and the mean next-token cross-entropy with labels, as transformers
    shifts them). No attention_mask (a padded batch is not supported) and no cache: each call reads the whole
    sequence."""

    _tied_weights_keys = {}  # both tensors are in the checkpoint whatever tie_word_embeddings says

    def __init__(self, config):
        super().__init__(config)
        self.language_model = KimiK3LanguageModel(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.model.embed_tokens

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("KimiK3ForCausalLM reads unpadded sequences only: pass no padding")
        logits = self.language_model.lm_head(self.language_model.model(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}
