"""PyTorch twin of the block-pooling kernel (any device and float dtype; fp32/fp64 math)."""
from __future__ import annotations

import math

import torch

CHUNK_ELEMS = 1 << 25  # elements converted to the work dtype at once (bounds temporaries)


def block_pool_sim(x: torch.Tensor, block: int, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``block`` tokens (the tail block over its valid tokens only):
    pooled mean ``[B, H, nb, D]`` and mean cosine of the tokens to that mean ``[B, H, nb]`` (``work`` dtype).
    """
    B, H, L, D = x.shape
    nb = math.ceil(L / block)
    pooled = torch.zeros(B, H, nb, D, dtype=work, device=x.device)
    sim = torch.zeros(B, H, nb, dtype=work, device=x.device)
    if nb == 0:
        return pooled, sim
    n = torch.clamp(L - torch.arange(nb, device=x.device) * block, max=block).to(work)  # valid tokens per block
    per_head = max(1, nb * block * D)
    step = max(1, CHUNK_ELEMS // per_head)
    flat_x = x.reshape(B * H, L, D)
    pooled_f, sim_f = pooled.view(B * H, nb, D), sim.view(B * H, nb)
    for s in range(0, B * H, step):
        xs = flat_x[s:s + step].to(work)
        if nb * block != L:  # zero-pad the tail: zeros add nothing to sums, norms or dots
            xs = torch.nn.functional.pad(xs, (0, 0, 0, nb * block - L))
        xs = xs.view(-1, nb, block, D)
        mean = xs.sum(2) / n[:, None]                                      # [c, nb, D]
        dots = torch.einsum("cnsd,cnd->cns", xs, mean)                     # [c, nb, block]
        norms = torch.linalg.vector_norm(xs, dim=-1) * torch.linalg.vector_norm(mean, dim=-1)[..., None]
        cos = torch.where(norms > 0, dots / torch.where(norms > 0, norms, 1), 0)  # padded rows: 0
        pooled_f[s:s + step] = mean
        sim_f[s:s + step] = cos.sum(-1) / n
    return pooled, sim
