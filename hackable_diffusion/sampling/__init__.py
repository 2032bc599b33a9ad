"""Entropy-bounded block-diffusion sampling.

`config.SamplingConfig` (settings + validation), `entropy_bound` (the pure pieces of one denoising step:
temperature, entropies, acceptance rules, re-noising, stopping, infilling helpers) and `generate` (the module
with the compiled denoising loop inside the block-autoregressive outer loop; the function is
`hackable_diffusion.generate`, or `hackable_diffusion.sampling.generate.generate`).
"""

from hackable_diffusion.sampling import entropy_bound, generate
from hackable_diffusion.sampling.config import SamplingConfig

__all__ = ["SamplingConfig", "entropy_bound", "generate"]
