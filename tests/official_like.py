"""A stand-in for an official MAR instance: timm's ``Block`` structure (fused ``attn.qkv``, no hook points, no
``hook_z``), rebuilt here because timm and the official code are not installed. Forward passes follow timm's
``Attention``/``Block`` and the official ``forward_mae_decoder`` line by line."""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from mar_probe.models.mar import MAR


class TimmMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(hidden, dim), nn.Dropout(0.0)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class TimmAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop, self.proj, self.proj_drop = nn.Dropout(0.0), nn.Linear(dim, dim), nn.Dropout(0.0)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))


class TimmBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), TimmAttention(dim, num_heads)
        self.ls1, self.drop_path1 = nn.Identity(), nn.Identity()
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), TimmMlp(dim, int(dim * mlp_ratio))
        self.ls2, self.drop_path2 = nn.Identity(), nn.Identity()

    def forward(self, x):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class OfficialLikeMAR(MAR):
    """mar_probe's MAR with timm blocks and the official decoder tail (no hook points at all)."""

    def __init__(self, config):
        super().__init__(config)
        c = config
        self.encoder_blocks = nn.ModuleList([TimmBlock(c.encoder_embed_dim, c.encoder_num_heads, c.mlp_ratio)
                                             for _ in range(c.encoder_depth)])
        self.decoder_blocks = nn.ModuleList([TimmBlock(c.decoder_embed_dim, c.decoder_num_heads, c.mlp_ratio)
                                             for _ in range(c.decoder_depth)])
        del self.hook_z

    def decoder_output(self, x):
        x = self.decoder_norm(x)
        x = x[:, self.buffer_size:]
        x = x + self.diffusion_pos_embed_learned
        return x


def official_like(model: MAR) -> OfficialLikeMAR:
    """An official-structured copy of ``model`` with the same weights (state-dict keys are identical)."""
    twin = OfficialLikeMAR(model.config)
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin.eval()
