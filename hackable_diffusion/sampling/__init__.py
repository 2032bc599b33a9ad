"""Entropy-bounded block-diffusion sampling.

`config.SamplingConfig` (settings + validation), `rules` (acceptance rules behind the `AcceptanceRule` Protocol),
`checker` (a task's rules traced into the loop: flagged positions re-noised, optional restarts),
`entropy_bound` (the pure pieces of one denoising step: temperature, entropies, acceptance functions, re-noising,
stopping, infilling helpers), and the sampler itself: `prepare` (inputs validated into one object), `denoise`
(the compiled loop of one canvas), `programs` (the bounded compile cache) and `generate` (the block-autoregressive
outer loop; the function is `hackable_diffusion.generate`, or `hackable_diffusion.sampling.generate.generate`).
"""

from hackable_diffusion.sampling import checker, entropy_bound, generate, rules
from hackable_diffusion.sampling.config import SamplingConfig

__all__ = ["SamplingConfig", "checker", "entropy_bound", "generate", "rules"]
