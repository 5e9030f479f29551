"""Decoding many conversations at once on a CPU: a KV cache that grows in place, and attention that
reads a prefix all rows share (the system prompt) once per step. Pure PyTorch; used by rollout.ModelAgent.

KVBuffer       one layer's keys/values for a batch of rows, left-padded, with room reserved for the
               tokens still to come: transformers' DynamicLayer torch.cat's the whole cache at every
               decode step (at 16 rows x 2k tokens that copy was 60% of a CPU decode step).
shared_prefix_attention
               a decode step's attention when every row continues the same P-token prefix. The
               prefix's keys/values are stored once, (1, kv_heads, P, head_dim), and read once for all
               rows; each row's own keys/values sit in the KVBuffer. Scores against both are
               concatenated before one softmax, so it equals attention over [prefix ; row].
               Registered with transformers as the attention implementation "shared_prefix"; a
               forward without the shared_prefix= argument falls through to plain SDPA.
Tested in tests/test_rollout.py (sampled log-probs == a teacher-forced recomputation).
"""
import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


class KVBuffer(DynamicLayer):
    """One layer's KV cache: B rows, left-padded to `length`, with `room` free slots after it.
    rows[i]: row i's keys/values as consecutive pieces [(k, v), ...], each (1, kv_heads, m, head_dim).
    keys/values (what attention reads) are views of the filled part."""

    def __init__(self, rows: list[list[tuple]], length: int, room: int):
        super().__init__()
        k0 = rows[0][0][0]
        self.k = k0.new_empty(len(rows), k0.shape[1], length + room, k0.shape[3])   # (B, kv_heads, cap, hd)
        self.v = torch.empty_like(self.k)
        for i, pieces in enumerate(rows):                                # row i ends at `length`
            end = length
            for k, v in reversed(pieces):
                self.k[i, :, end - k.shape[2]:end], self.v[i, :, end - k.shape[2]:end] = k[0], v[0]
                end -= k.shape[2]
            self.k[i, :, :end], self.v[i, :, :end] = 0, 0     # padding: masked, but 0 * NaN would still be NaN
        self.n, self.dtype, self.device, self.is_initialized = length, k0.dtype, k0.device, True
        self.keys, self.values = self.k[:, :, :length], self.v[:, :, :length]

    def update(self, keys, values, *args, **kwargs):
        start, self.n = self.n, self.n + keys.shape[2]
        self.k[:, :, start:self.n], self.v[:, :, start:self.n] = keys, values
        self.keys, self.values = self.k[:, :, :self.n], self.v[:, :, :self.n]
        return self.keys, self.values

    def select(self, rows: torch.Tensor):                                # drop rows that finished
        self.k, self.v = self.k[rows], self.v[rows]
        self.keys, self.values = self.k[:, :, :self.n], self.v[:, :, :self.n]


def first_tokens(pieces: list[tuple], c: int) -> list[tuple]:
    """The first c tokens of consecutive (k, v) pieces, each (1, kv_heads, m, head_dim)."""
    out = []
    for k, v in pieces:
        if c > 0:
            out.append((k[:, :, :c], v[:, :, :c]))
        c -= k.shape[2]
    return out


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, shared_prefix=None, **kw):
    """query (B, heads, 1, hd); key/value (B, kv_heads, n, hd): each row's own part; shared_prefix: per
    layer (k, v), each (1, kv_heads, P, hd). -> (B, 1, heads, hd), as transformers' SDPA wrapper returns."""
    if shared_prefix is None:                       # any other call (prefill, training): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
    pk, pv = shared_prefix[module.layer_idx]         # (1, kv_heads, P, hd)
    B, H, _, D = query.shape                         # one query token per row
    kvh, P = pk.shape[1], pk.shape[2]
    q = query.reshape(B, kvh, H // kvh, D)           # query heads grouped by the kv head they share
    qk = q.permute(1, 0, 2, 3).reshape(kvh, -1, D)   # (kv_heads, B * group, hd)
    s_prefix = (qk @ pk[0].transpose(1, 2)).view(kvh, B, -1, P).permute(1, 0, 2, 3)   # (B, kvh, group, P)
    s_row = q @ key.transpose(2, 3)                  # (B, kvh, group, n)
    if attention_mask is not None:                   # (B, 1, 1, n) bool: False on left padding
        s_row = s_row.masked_fill(~attention_mask, float("-inf"))
    p = torch.softmax(torch.cat([s_prefix, s_row], -1).float() * (scaling or D ** -0.5), -1).to(value.dtype)
    p_prefix = p[..., :P].permute(1, 0, 2, 3).reshape(kvh, -1, P)                     # (kvh, B * group, P)
    out = (p_prefix @ pv[0]).view(kvh, B, -1, D).permute(1, 0, 2, 3) + p[..., P:] @ value   # (B, kvh, group, hd)
    return out.reshape(B, 1, H, D), None             # (B, q_len, heads, hd), as SDPA's wrapper returns


AttentionInterface.register("shared_prefix", shared_prefix_attention)
AttentionMaskInterface.register("shared_prefix", sdpa_mask)
