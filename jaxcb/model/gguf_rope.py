"""Llama 3's rope scaling as llama.cpp stores it: `rope_freqs.weight`, one divisor per rotary frequency,
turned back into the `RopeScaling` (factor, low/high frequency factors, original context) that
transformers computes the same frequencies from. Pure NumPy; `jaxcb.model.gguf` reads the tensor.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from jaxcb.model.config import RopeScaling
from jaxcb.model.loader import CheckpointError

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's form of Llama 3's rope scaling: a divisor per frequency


def llama3_scaling_from_divisors(divisors: np.ndarray, head_dim: int, theta: float, path: str) -> Optional[RopeScaling]:
    """The Llama 3 rope scaling whose frequencies are `inv_freq / divisors`, or CheckpointError.

    Llama 3 divides the frequency of a long wavelength by `factor`, keeps a short one, and
    between `high` and `low` wavelengths interpolates with s = (L / w - lf) / (hf - lf), which
    rises linearly in 1 / w from 0 at w = low = L / lf to 1 at w = high = L / hf. The divisors
    give back `factor` and that line; L, lf, hf are chosen to draw it, then checked."""
    if np.allclose(divisors, 1.0, rtol=1e-6):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    refusal = CheckpointError(
        f"{path}: {ROPE_FREQS} holds rope frequency divisors {np.round(divisors, 4).tolist()} that no Llama 3 "
        f"rope scaling reproduces; jaxcb cannot serve this model's rope"
    )
    try:
        with np.errstate(divide="raise", over="raise", invalid="raise"):
            scaling = _fit_llama3_scaling(divisors, inv_freq)
    except (ArithmeticError, FloatingPointError, ValueError):
        raise refusal from None
    expected = (inv_freq / divisors).astype(np.float32)
    if not np.allclose(llama3_inv_freq(inv_freq, scaling), expected, rtol=1e-4, atol=0):
        raise refusal
    return scaling


def _fit_llama3_scaling(divisors: np.ndarray, inv_freq: np.ndarray) -> RopeScaling:
    wavelen = 2 * math.pi / inv_freq
    factor = float(divisors.max())
    if factor <= 1.0:
        raise ValueError("Llama 3 only slows frequencies down")
    kept, slowed = np.isclose(divisors, 1.0, rtol=1e-5), np.isclose(divisors, factor, rtol=1e-5)
    between = ~(kept | slowed)
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    below = wavelen[kept].max() if kept.any() else wavelen.min() / 2
    above = wavelen[slowed].min() if slowed.any() else wavelen.max() * 2
    if between.sum() >= 2:
        slope, offset = np.polyfit(1 / wavelen[between], s[between], 1)  # s = slope / w + offset
        low, high = -slope / offset, slope / (1 - offset)
    else:  # no band to fit: put its ends in the gaps between the wavelengths the model has
        low = math.sqrt((wavelen[between].max() if between.any() else below) * above)
        if between.any():
            w, si = wavelen[between][0], s[between][0]
            high = 1 / (1 / low + (1 / w - 1 / low) / si)
        else:
            high = math.sqrt(below * low)
    if not 0 < high < low:
        raise ValueError("the band's ends are out of order")
    length = max(1, round(low))
    return RopeScaling(
        factor=float(f"{factor:.6g}"),
        low_freq_factor=float(f"{length / low:.6g}"),
        high_freq_factor=float(f"{length / high:.6g}"),
        original_max_position_embeddings=length,
    )


def llama3_inv_freq(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """f64[head_dim // 2]: Llama 3's scaled rotary frequencies, as transformers computes them."""
    wavelen = 2 * math.pi / inv_freq
    length = scaling.original_max_position_embeddings
    low, high = length / scaling.low_freq_factor, length / scaling.high_freq_factor
    smooth = (length / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    banded = inv_freq * ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < high, inv_freq, np.where(wavelen > low, inv_freq / scaling.factor, banded))
