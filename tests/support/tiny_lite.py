"""What the EfficientNet-Lite photo tests share: a tiny network of the real Lite architecture
(``efficientnet-lite-pytorch``; a few dozen pixels, ~100k weights) with random weights and BatchNorm
statistics measured on random pixels, so that its features vary from picture to picture and
training mode (statistics of the batch) gives other features than eval mode; and textured
synthetic pictures of any size as JPEG or PNG bytes."""

from __future__ import annotations

import io
from typing import Any

import numpy as np


def tiny_lite(size: int, width: float, seed: int) -> Any:
    """EfficientNet-Lite0's blocks at ``size`` px, ``width`` × its channels (head included: the
    features have 1280·``width`` dims, rounded to 8), random weights, in eval mode."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    network = EfficientNet.from_name(
        "efficientnet-lite0", image_size=size, width_coefficient=width, depth_coefficient=0.25, fix_head_stem=False
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in network.modules():
            if isinstance(module, torch.nn.Conv2d):
                module.weight.copy_(
                    torch.randn(module.weight.shape, generator=generator) * (2.0 / module.weight[0].numel()) ** 0.5
                )
        # The package's init gives features of ~1e-8 and, with random statistics, half of them dead and the rest
        # nearly collinear (an adapter fitted on them amplifies float32 noise 10⁶-fold). Statistics measured on a
        # batch, then a random affine, give features that vary from picture to picture.
        norms = [m for m in network.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        momenta = [m.momentum for m in norms]
        for module in norms:
            module.momentum = None  # the running statistics become the calibration batch's own
        network.train()
        network.extract_features(torch.randn(64, 3, size, size, generator=generator))
        for module, momentum in zip(norms, momenta, strict=True):
            module.momentum = momentum
            module.weight.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
            module.bias.copy_(torch.rand(module.num_features, generator=generator) * 0.5)
    return network.eval()


def textured_picture(rng: np.random.Generator, width: int, height: int) -> Any:
    """An RGB picture with structure at three scales: a colour field, blobs and fine grain."""
    from PIL import Image

    def noise(cells_w: int, cells_h: int, spread: float) -> np.ndarray:
        cells = rng.uniform(-spread, spread, size=(cells_h, cells_w, 3)).astype(np.float32)
        channels = [
            Image.fromarray(cells[..., c], mode="F").resize((width, height), Image.Resampling.BICUBIC) for c in range(3)
        ]
        return np.stack([np.asarray(c) for c in channels], axis=-1)

    pixels = rng.uniform(60, 200, size=3) + noise(3, 3, 60) + noise(max(2, width // 6), max(2, height // 6), 50)
    pixels += rng.normal(0, 12, size=(height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def encoded(image: Any, file_format: str, quality: int = 90) -> bytes:
    """``image`` as ``JPEG`` (at ``quality``) or ``PNG`` file bytes."""
    buffer = io.BytesIO()
    image.save(buffer, file_format, **({"quality": quality} if file_format == "JPEG" else {}))
    return buffer.getvalue()
