"""The MAR model (Li et al. 2024): MAE-style encoder/decoder over continuous tokens plus a diffusion head.

Architecture, module registration order and parameter names equal the official ``models/mar.py`` so that
official state dicts load with ``strict=True``. The sampling loop lives in :mod:`mar_probe.engine.loop`.
"""
from __future__ import annotations

import numpy as np
import scipy.stats as stats
import torch
import torch.nn as nn

from .blocks import Block, HookPoint
from .config import MARConfig
from .diffloss import DiffLoss, rng_device


class MAR(nn.Module):
    """Masked autoregressive generator with a per-token diffusion loss."""

    def __init__(self, config: MARConfig):
        super().__init__()
        c = self.config = config
        self.vae_embed_dim, self.img_size, self.vae_stride, self.patch_size = (
            c.vae_embed_dim, c.img_size, c.vae_stride, c.patch_size)
        self.seq_h = self.seq_w = c.seq_h
        self.seq_len, self.token_embed_dim = c.seq_len, c.token_embed_dim
        self.num_classes, self.label_drop_prob, self.buffer_size = c.class_num, c.label_drop_prob, c.buffer_size
        enc, dec = c.encoder_embed_dim, c.decoder_embed_dim
        self.class_emb = nn.Embedding(c.class_num, enc)
        self.fake_latent = nn.Parameter(torch.zeros(1, enc))
        self.mask_ratio_generator = stats.truncnorm((c.mask_ratio_min - 1.0) / 0.25, 0, loc=1.0, scale=0.25)
        self.z_proj = nn.Linear(self.token_embed_dim, enc)
        self.z_proj_ln = nn.LayerNorm(enc, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + self.buffer_size, enc))
        self.encoder_blocks = nn.ModuleList([
            Block(enc, c.encoder_num_heads, c.mlp_ratio, c.attn_dropout, c.proj_dropout)
            for _ in range(c.encoder_depth)])
        self.encoder_norm = nn.LayerNorm(enc, eps=1e-6)
        self.decoder_embed = nn.Linear(enc, dec)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + self.buffer_size, dec))
        self.decoder_blocks = nn.ModuleList([
            Block(dec, c.decoder_num_heads, c.mlp_ratio, c.attn_dropout, c.proj_dropout)
            for _ in range(c.decoder_depth)])
        self.decoder_norm = nn.LayerNorm(dec, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len, dec))
        self.hook_z = HookPoint()  # [B', L, Ddec]: decoder output fed to the diffusion head, all branches
        self.initialize_weights()
        self.diffloss = DiffLoss(self.token_embed_dim, dec, c.diffloss_d, c.diffloss_w, c.num_sampling_steps,
                                 clip_denoised=c.clip_denoised)
        self.diffusion_batch_mul = c.diffusion_batch_mul

    def initialize_weights(self):
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm) and m.weight is not None:
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # ---- token layout -------------------------------------------------------------------------------
    def patchify(self, x):
        """[B, C, H, W] -> [B, L, C*p*p]."""
        b, c, h, w = x.shape
        p = self.patch_size
        x = x.reshape(b, c, h // p, p, w // p, p)
        return torch.einsum("nchpwq->nhwcpq", x).reshape(b, (h // p) * (w // p), c * p * p)

    def unpatchify(self, x):
        """[B, L, C*p*p] -> [B, C, H, W]."""
        b, p, c = x.shape[0], self.patch_size, self.vae_embed_dim
        x = x.reshape(b, self.seq_h, self.seq_w, c, p, p)
        return torch.einsum("nhwcpq->nchpwq", x).reshape(b, c, self.seq_h * p, self.seq_w * p)

    # ---- transformer ---------------------------------------------------------------------------------
    def class_embedding(self, labels, drop_mask=None):
        """Class embedding [B, D]; rows where ``drop_mask`` is True use the CFG ``fake_latent``."""
        emb = self.class_emb(labels)
        if drop_mask is not None:
            m = drop_mask.unsqueeze(-1).to(emb.dtype)
            emb = m * self.fake_latent + (1 - m) * emb
        return emb

    def encoder_input(self, x, mask, class_embedding):
        """Tokens [B, L, C] -> normalised encoder input of the kept rows [B, Nenc, D] (buffer first)."""
        x = self.z_proj(x)
        b, _, d = x.shape
        x = torch.cat([torch.zeros(b, self.buffer_size, d, device=x.device, dtype=x.dtype), x], dim=1)
        keep = torch.cat([torch.ones(b, self.buffer_size, device=x.device, dtype=torch.bool), ~mask.bool()], dim=1)
        x[:, :self.buffer_size] = class_embedding.unsqueeze(1)
        x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
        return x[keep].reshape(b, -1, d)  # [B, Nenc, D]

    def forward_mae_encoder(self, x, mask, class_embedding):
        x = self.encoder_input(x, mask, class_embedding)
        for block in self.encoder_blocks:
            x = block(x)
        return self.encoder_norm(x)

    def decoder_input(self, x, mask):
        """Encoder output [B, Nenc, Denc] -> decoder input over buffer + all tokens [B, S+L, Ddec]."""
        x = self.decoder_embed(x)
        b = x.shape[0]
        keep = torch.cat([torch.ones(b, self.buffer_size, device=x.device, dtype=torch.bool), ~mask.bool()], dim=1)
        padded = self.mask_token.to(x.dtype).expand(b, keep.shape[1], -1).clone()
        padded[keep] = x.reshape(-1, x.shape[-1])
        return padded + self.decoder_pos_embed_learned

    def decoder_output(self, x):
        """Last decoder hidden state [B, S+L, D] -> head condition z [B, L, D]."""
        x = self.decoder_norm(x)[:, self.buffer_size:]
        return self.hook_z(x + self.diffusion_pos_embed_learned)

    def forward_mae_decoder(self, x, mask):
        x = self.decoder_input(x, mask)
        for block in self.decoder_blocks:
            x = block(x)
        return self.decoder_output(x)

    # ---- training ------------------------------------------------------------------------------------
    def forward(self, imgs, labels, generator: torch.Generator | None = None, np_rng=None):
        """Training loss for images (or latents) [B, C, H, W] and labels [B]."""
        x = self.patchify(imgs)
        b, L, _ = x.shape
        orders = sample_orders_torch(b, L, generator, x.device)
        rate = self.mask_ratio_generator.rvs(1, random_state=np_rng)[0]
        num_masked = int(np.ceil(L * rate))
        mask = torch.zeros(b, L, device=x.device).scatter(-1, orders[:, :num_masked], 1.0)
        drop = None
        if self.training:
            drop = torch.rand(b, generator=generator, device=rng_device(generator, x.device)).to(x.device)
            drop = drop < self.label_drop_prob
        z = self.forward_mae_decoder(self.forward_mae_encoder(x, mask, self.class_embedding(labels, drop)), mask)
        return self.forward_loss(z, x, mask, orders[:, :num_masked], generator)

    def forward_loss(self, z, target, mask, masked_idx, generator=None):
        """Diffusion loss on masked tokens: all of them (official), or a random subset per image."""
        k = self.config.diffusion_loss_tokens
        z, target = z.float(), target.float()
        with torch.autocast(z.device.type, enabled=False):  # the head stays in float32 under mixed precision
            return self._head_loss(z, target, mask, masked_idx, k, generator)

    def _head_loss(self, z, target, mask, masked_idx, k, generator=None):
        if k > 0:
            idx = masked_idx[:, :min(k, masked_idx.shape[1])]  # orders are random: a uniform subset
            d = z.shape[-1]
            z = torch.gather(z, 1, idx.unsqueeze(-1).expand(-1, -1, d)).reshape(-1, d)
            target = torch.gather(target, 1, idx.unsqueeze(-1).expand(-1, -1, target.shape[-1]))
            target = target.reshape(-1, target.shape[-1])
            mul = self.diffusion_batch_mul
            return self.diffloss(target=target.repeat(mul, 1), z=z.repeat(mul, 1), generator=generator)
        b, L, _ = target.shape
        mul = self.diffusion_batch_mul
        return self.diffloss(target=target.reshape(b * L, -1).repeat(mul, 1), z=z.reshape(b * L, -1).repeat(mul, 1),
                             mask=mask.reshape(b * L).repeat(mul), generator=generator)


def sample_orders_torch(bsz, seq_len, generator=None, device="cpu"):
    """Random generation orders [B, L] from a torch generator."""
    rng = rng_device(generator, "cpu")
    return torch.stack([torch.randperm(seq_len, generator=generator, device=rng) for _ in range(bsz)]).to(device)
