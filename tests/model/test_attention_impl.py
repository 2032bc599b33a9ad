"""`attention.attention_implementation`: which blocks get cuDNN flash attention (its decision table; cuDNN itself
cannot run here), and that `attend` passes the choice to `jax.nn.dot_product_attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.model import attention
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize("platform, dtype, head_dim, q_len, kv_len, cc, want", [
    ("gpu", BF16, 256, 256, 1280, 9.0, "cudnn"),  # sliding layers of the 26B shape on an H100/H200
    ("gpu", F16, 128, 256, 512, None, "cudnn"),
    ("gpu", BF16, 128, 256, 512, 8.0, "cudnn"),  # A100: up to 128
    ("gpu", BF16, 256, 256, 512, 8.0, "xla"),  # A100: 256 is too wide
    ("gpu", BF16, 512, 256, 512, 9.0, "xla"),  # the full layers' 512-dim heads
    ("gpu", BF16, 36, 256, 512, 9.0, "xla"),  # not a multiple of 8
    ("gpu", BF16, 256, 255, 512, 9.0, "xla"),  # odd query length
    ("gpu", BF16, 256, 256, 511, 9.0, "xla"),  # odd key length
    ("gpu", F32, 256, 256, 512, 9.0, "xla"),  # fp32: XLA
    ("tpu", BF16, 256, 256, 512, None, "xla"),
    ("cpu", BF16, 256, 256, 512, None, "xla"),
])
def test_decision_table(platform, dtype, head_dim, q_len, kv_len, cc, want):
  assert attention.attention_implementation(platform, dtype, head_dim, q_len, kv_len, cc) == want


def test_attend_passes_the_choice(monkeypatch):
  """`attend` asks `attention_implementation` with the block's shapes and hands the answer to jax."""
  asked, passed = [], []
  decide, dpa = attention.attention_implementation, jax.nn.dot_product_attention

  def spy_decide(*args):
    asked.append(args)
    return decide(*args)

  def spy_dpa(q, *args, implementation=None, **kwargs):
    passed.append(implementation)
    if implementation == "cudnn":  # no cuDNN here: its output shape only
      return jnp.zeros_like(q)
    return dpa(q, *args, implementation=implementation, **kwargs)

  monkeypatch.setattr(attention, "attention_implementation", spy_decide)
  monkeypatch.setattr(jax.nn, "dot_product_attention", spy_dpa)
  q = jnp.ones((1, 6, 4, 8), BF16)
  kv = jnp.ones((1, 10, 2, 8), BF16)
  mask = jnp.ones((1, 6, 10), bool)
  out = attention.attend(q, kv, kv, mask, BF16)
  assert asked == [("cpu", BF16, 8, 6, 10, None)]
  assert passed == []  # 'xla': the einsum (the same computation, faster on XLA:CPU); only cuDNN goes to jax
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(attention.attend_einsum(q, kv, kv, mask, BF16), np.float32))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a GPU: cuDNN is handed to jax
  monkeypatch.setattr(attention, "_device_compute_capability", lambda: 9.0)
  jax.eval_shape(lambda a, b: attention.attend(a, b, b, mask, BF16), q, kv)
  assert asked[-1] == ("gpu", BF16, 8, 6, 10, 9.0) and passed == ["cudnn"]


def test_sliding_layers_hand_cudnn_even_lengths(monkeypatch):
  """The banded encoder (26B shape: prompt 8,192, window 1,024) and the windowed decoder prefix give
  `attention_implementation` even query and key lengths, so sliding layers qualify for cuDNN in training too."""
  seen = []
  decide = attention.attention_implementation
  monkeypatch.setattr(attention, "attention_implementation", lambda *a: seen.append(a) or decide(*a))
  b, l, n, nkv, d, window = 1, 8192, 8, 4, 256, 1024
  sds = jax.ShapeDtypeStruct
  jax.eval_shape(lambda q, k, v, valid, st: attention.encoder_attention(q, k, v, valid, st, window, BF16),
                 sds((b, l, n, d), BF16), sds((b, l, nkv, d), BF16), sds((b, l, nkv, d), BF16), sds((b, l), bool),
                 sds((b,), jnp.int32))
  assert seen and seen[-1][2:5] == (d, 256, 1280)  # chunk 256 x span 1,280 (not 1,279)
  assert decide("gpu", BF16, d, 256, 1280, 9.0) == "cudnn"

  monkeypatch.setattr(attention, "BAND_MIN_CAPACITY", 16)
  cfg = get_preset("tiny", sliding_window=8)  # canvas 8: window - 1 + 8 = 15 keys would be odd
  model = init_model(cfg)
  ids = jnp.full((1, 20), 5, jnp.int32)
  _, cache = model.encode(ids, model.init_cache(1, 32))
  seen.clear()
  model.decode(jnp.full((1, cfg.canvas_length), 5, jnp.int32), cache)
  sliding = [a for a in seen if a[2] == cfg.head_dim]
  assert sliding and all(a[4] == 16 and a[3] % 2 == 0 for a in sliding), sliding


def test_attend_falls_back_to_xla_when_cudnn_refuses(monkeypatch, caplog):
  """A block handed to cuDNN that cuDNN refuses while it is traced (here: no GPU at all) runs the XLA path, with a
  warning, and gives `attend_einsum`'s values."""
  monkeypatch.setattr(attention, "attention_implementation", lambda *a: "cudnn")
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 6, 4, 8)), BF16)
  kv = jnp.asarray(rng.standard_normal((1, 10, 2, 8)), BF16)
  mask = jnp.ones((1, 6, 10), bool)
  with caplog.at_level("WARNING"):
    out = attention.attend(q, kv, kv, mask, BF16)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(attention.attend_einsum(q, kv, kv, mask, BF16), np.float32))
  assert "cuDNN attention refused" in caplog.text
