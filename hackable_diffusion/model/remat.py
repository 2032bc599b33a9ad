"""Per-layer rematerialisation that survives XLA:CPU: recompute a function's internals in the backward pass.

`jax.checkpoint` marks the recomputation with optimisation barriers so that XLA does not merge it back into the
forward pass. XLA:CPU expands those barriers early in its pipeline, after which common-subexpression elimination
does merge them: `jax.checkpoint` around unrolled layers then saves nothing on CPU (an 8-layer toy's compiled
temporaries are the same with and without it), and a memory report compiled on this CPU would not show
what a GPU saves. `recompute_in_backward` keeps only the inputs and, in the backward pass, recomputes from inputs
offset by `0 * (an element of the cotangent)`: XLA cannot prove that equal to the forward (`0 * x` is not folded
for floats, it may be NaN) and cannot run it before the cotangent exists, so the recomputation stays where it
belongs on every backend (the same toy's temporaries less than halve). Values and gradients are those of the plain
function (the offset is an exact zero for finite cotangents; a non-finite cotangent makes the gradient non-finite
either way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def _instantiate(x: Any) -> Any:
  """A symbolic zero cotangent (an output not involved in differentiation) as an array of zeros."""
  if isinstance(x, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros(x.aval.shape, x.aval.dtype)
  return x


def _tie_to(zero: jax.Array) -> Callable[[Any], Any]:
  """`x -> x + zero` for floating arrays (exactly `x` while `zero` is 0), other leaves unchanged."""
  def one(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
      return x + zero.astype(x.dtype)
    return x
  return one


def recompute_in_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn(state, *args)` (pytrees of arrays in and out) whose backward pass recomputes it from its saved inputs.

  Only the inputs being differentiated get gradients (a frozen weight's would be as large as the weight: a LoRA
  step must not compute them); `args` (activations) are the inputs tied to the cotangent, `state` leaves are not
  (tying a frozen weight would copy it).
  """

  def wrapped(state: Any, *args: Any) -> Any:
    leaves, treedef = jax.tree.flatten((state, args))
    n_state = len(jax.tree.leaves(state))

    def flat_fn(*values):
      st, a = jax.tree.unflatten(treedef, values)
      return fn(st, *a)

    @jax.custom_vjp
    def run(*values):
      return flat_fn(*values)

    def fwd(*primals):
      values = tuple(p.value for p in primals)
      perturbed = tuple(() if p.perturbed else None for p in primals)  # static: () = differentiated
      return flat_fn(*values), (values, perturbed)

    def bwd(residuals, cotangent):
      values, perturbed = residuals
      cotangent = jax.tree.map(_instantiate, cotangent,
                               is_leaf=lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero))
      first = jax.tree.leaves(cotangent)[0]
      tie = _tie_to(jnp.zeros((), jnp.float32) * first.reshape(-1)[0].astype(jnp.float32))
      diff = [i for i, p in enumerate(perturbed) if p is not None]

      def of_diff(*diff_values):
        full = [tie(v) if i >= n_state else v for i, v in enumerate(values)]
        for i, v in zip(diff, diff_values):
          full[i] = v
        return flat_fn(*full)

      _, vjp = jax.vjp(of_diff, *(tie(values[i]) for i in diff))
      out: list[Any] = [None] * len(values)
      for i, c in zip(diff, vjp(cotangent)):
        out[i] = c
      return tuple(out)

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run(*leaves)

  return wrapped
