"""nn.MultiheadAttention, sharded by heads.

Shard s owns whole heads: their rows of the q, k and v projections (and biases, and
bias_k / bias_v), and their columns of the output projection. A piece is the
complete attention of those heads followed by their part of the output projection,
so pieces add up to the layer's output. The output bias is cut by elements, each
slice added (and its gradient taken) by exactly one shard. Heads that do not divide
by N give uneven shards; a shard may own no heads and only a slice of the bias.

Backward recomputes a piece's attention from the saved inputs instead of keeping
per-head activations, replaying the RNG when attention dropout is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layer_plan import LayerChunk, LayerPlan, ShardedParam
from .rules import Combine, Concat, Rotate, ShardRule, Sum, Unsupported
from .split import Split, Splitter, units


@dataclass(frozen=True)
class Heads:
    counts: list[int]
    first: list[int]
    index: dict[str, int]  # role -> position in the flat shard
    heads: Split  # heads as a split of (num_heads,): how per-head weights concatenate


@dataclass(frozen=True)
class AttentionCall:
    mask: torch.Tensor | None  # additive, (B or 1, H or 1, L, S)
    causal: bool
    need_weights: bool
    dropout: float
    self_attention: bool  # query is key is value: one packed projection


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


class MultiheadAttentionRule(ShardRule):
    types = (nn.MultiheadAttention,)

    def _roles(self, m: nn.MultiheadAttention) -> list[tuple[str, nn.Module, str]]:
        roles = ([("in_w", m, "in_proj_weight")] if m._qkv_same_embed_dim else
                 [("q_w", m, "q_proj_weight"), ("k_w", m, "k_proj_weight"), ("v_w", m, "v_proj_weight")])
        roles += [("in_b", m, "in_proj_bias"), ("out_w", m.out_proj, "weight"), ("out_b", m.out_proj, "bias"),
                  ("bias_k", m, "bias_k"), ("bias_v", m, "bias_v")]
        return [r for r in roles if getattr(r[1], r[2]) is not None]

    def claimed(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(owner, name) for _, owner, name in self._roles(module)]

    def plan(self, module: nn.Module, splitter: Splitter, fixed: dict[tuple[int, str], Split]) -> LayerPlan:
        if fixed:
            raise Unsupported("tied attention weights")
        m = module
        e, hd = m.embed_dim, m.head_dim
        counts = splitter.counts(m.num_heads)
        params, index = [], {}
        for role, owner, name in self._roles(m):
            shape = tuple(getattr(owner, name).shape)
            if role in ("in_w", "in_b"):
                split = units(shape, 0, counts, hd, sections=3, section_len=e)
            elif role in ("q_w", "k_w", "v_w"):
                split = units(shape, 0, counts, hd)
            elif role == "out_w":
                split = units(shape, 1, counts, hd)
            elif role == "out_b":
                split = splitter.even(shape, 0)
            else:  # bias_k, bias_v: (1, 1, E)
                split = units(shape, 2, counts, hd)
            index[role] = len(params)
            params.append(ShardedParam(owner, name, split))
        first = [sum(counts[:s]) for s in range(len(counts))]
        return LayerPlan(params, detail=Heads(counts, first, index, units((m.num_heads,), 0, counts, 1)))

    def forward(self, module: nn.Module, rotate: Rotate, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        m: nn.MultiheadAttention = module
        same = query is key and key is value
        batched = query.dim() == 3
        if batched and not m.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        elif not batched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint "
                               "(as nn.MultiheadAttention)")
        b, tgt, src = query.shape[0], query.shape[1], key.shape[1]
        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None
        if not causal:
            if attn_mask is not None:
                am = _additive(attn_mask, query.dtype)
                mask = am.view(1, 1, tgt, src) if am.dim() == 2 else am.view(b, m.num_heads, tgt, src)
            if key_padding_mask is not None:
                kp = _additive(key_padding_mask, query.dtype).view(b, 1, 1, src)
                mask = kp if mask is None else mask + kp
            extra = int(m.bias_k is not None) + int(m.add_zero_attn)
            if mask is not None and extra:
                mask = F.pad(mask, (0, extra))  # the added key positions are never masked
        call = AttentionCall(mask, causal, need_weights, m.dropout if m.training else 0.0, same)
        outs = rotate(call, (query,) if same else (query, key, value))
        out, weights = outs if need_weights else (outs, None)
        if batched and not m.batch_first:
            out = out.transpose(0, 1)
        elif not batched:
            out = out.squeeze(0)
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        return out, weights

    def combines(self, layer: LayerChunk, call: AttentionCall) -> list[Combine]:
        return [Sum()] + ([Concat(1, layer.plan.detail.heads)] if call.need_weights else [])

    def uses_rng(self, layer: LayerChunk, call: AttentionCall) -> bool:
        return call.dropout > 0.0

    def forward_piece(self, layer: LayerChunk, call: AttentionCall, inputs: Sequence[torch.Tensor],
                      w: list[torch.Tensor], s: int) -> tuple[torch.Tensor, ...]:
        m: nn.MultiheadAttention = layer.module
        heads: Heads = layer.plan.detail
        idx = heads.index

        def get(role: str) -> torch.Tensor | None:
            return w[idx[role]] if role in idx else None

        query = inputs[0]
        key, value = (query, query) if call.self_attention else (inputs[1], inputs[2])
        b, tgt = query.shape[0], query.shape[1]
        n_heads, hd, width = heads.counts[s], m.head_dim, heads.counts[s] * m.head_dim
        src = key.shape[1] + int(m.bias_k is not None) + int(m.add_zero_attn)
        weights = None
        if n_heads == 0:
            out = query.new_zeros(b, tgt, m.embed_dim)
            weights = query.new_zeros(b, 0, tgt, src)
        else:
            bias = get("in_b")
            bq, bk, bv = bias.chunk(3) if bias is not None else (None, None, None)
            if "in_w" in idx and call.self_attention:
                q, k, v = F.linear(query, get("in_w"), bias).chunk(3, dim=-1)
            else:
                wq, wk, wv = get("in_w").chunk(3) if "in_w" in idx else (get("q_w"), get("k_w"), get("v_w"))
                q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
            if "bias_k" in idx:
                k = torch.cat([k, get("bias_k").expand(b, 1, width)], dim=1)
                v = torch.cat([v, get("bias_v").expand(b, 1, width)], dim=1)
            if m.add_zero_attn:
                k = torch.cat([k, k.new_zeros(b, 1, width)], dim=1)
                v = torch.cat([v, v.new_zeros(b, 1, width)], dim=1)
            q = q.reshape(b, tgt, n_heads, hd).transpose(1, 2)
            k = k.reshape(b, src, n_heads, hd).transpose(1, 2)
            v = v.reshape(b, src, n_heads, hd).transpose(1, 2)
            mask = call.mask
            if mask is not None and mask.shape[1] != 1:
                mask = mask.narrow(1, heads.first[s], n_heads)
            if call.need_weights:
                scores = torch.matmul(q * hd ** -0.5, k.transpose(-2, -1))
                if mask is not None:
                    scores = scores + mask
                weights = torch.softmax(scores, dim=-1)
                if call.dropout > 0.0:
                    weights = F.dropout(weights, call.dropout)
                o = torch.matmul(weights, v)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=call.dropout,
                                                   is_causal=call.causal)
            out = F.linear(o.transpose(1, 2).reshape(b, tgt, width), get("out_w"))
        out_bias = get("out_b")
        if out_bias is not None:
            at, length = layer.plan.params[idx["out_b"]].split.single_range(s)
            out.narrow(-1, at, length).add_(out_bias)
        return (out, weights) if call.need_weights else (out,)
