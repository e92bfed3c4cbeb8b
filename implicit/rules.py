"""Ready custom-derivative rules: the cases of JAX's "Custom derivative rules" notebook.

* :func:`log1pexp` — numerical stability: ``log(1 + e^x)`` whose derivative is
  finite at any ``x`` (plain autodiff gives ``nan`` beyond ``x ≈ 88`` in float32).
* :func:`with_derivative` and :func:`x_over_1p_sqrt` — enforcing a differentiation
  convention (a one-sided derivative at the boundary of a domain).
* :func:`clip_gradient` — reverse-mode gradient clipping.
* :func:`debug_backward` — look at (or log) cotangents on the backward pass.

Every rule works under ``jax.jit`` and ``jax.vmap``; :func:`log1pexp` and the
functions built by :func:`with_derivative` are ``jax.custom_jvp`` rules (forward and
reverse mode, any order), :func:`clip_gradient` and :func:`debug_backward` are
``jax.custom_vjp`` rules (reverse mode only, by nature).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "clip_gradient",
    "debug_backward",
    "log1pexp",
    "with_derivative",
    "x_over_1p_sqrt",
]


# --------------------------------------------------------------------------------------
# Numerical stability: log(1 + e^x)
# --------------------------------------------------------------------------------------


@jax.custom_jvp
def log1pexp(x):
    """Compute ``log(1 + e^x)`` (softplus) with a stable value and derivative at any ``x``.

    The value is ``logaddexp(0, x)``, exact for large ``|x|``; the derivative
    ``e^x / (1 + e^x) = 1 - 1 / (1 + e^x)`` is evaluated as the logistic sigmoid, so it
    never forms ``0 * inf`` (the naive ``jnp.log(1. + jnp.exp(x))`` has a ``nan``
    gradient once ``e^x`` overflows), and the second derivative as
    ``sigmoid(x) sigmoid(-x)``. A ``jax.custom_jvp`` rule: ``jit``, ``vmap``, ``grad``,
    ``jvp`` and higher derivatives all work.

    Args:
      x: a floating array (or a Python/NumPy scalar), evaluated elementwise.

    Returns:
      ``log(1 + e^x)`` with the shape and floating dtype of ``x``.

    Example:
      >>> import jax
      >>> from implicit.rules import log1pexp
      >>> print(log1pexp(3.0), jax.grad(log1pexp)(3.0))
      3.0485873 0.95257413
      >>> print(jax.grad(log1pexp)(100.0))
      1.0
    """
    return jnp.logaddexp(0.0, x)


@jax.custom_jvp
def _sigmoid(x):
    # 1 / (1 + e^-x), whose own derivative sigmoid(x) sigmoid(-x) is formed without the
    # cancellation of sigmoid(x) (1 - sigmoid(x)): accurate second derivatives of
    # log1pexp for large |x|.
    return jax.nn.sigmoid(x)


_sigmoid.defjvps(lambda x_dot, ans, x: ans * _sigmoid(-x) * x_dot)
log1pexp.defjvps(lambda x_dot, ans, x: _sigmoid(x) * x_dot)


# --------------------------------------------------------------------------------------
# Differentiation convention: a given derivative for an elementwise function
# --------------------------------------------------------------------------------------


def with_derivative(fun: Callable, deriv: Callable) -> Callable:
    """Give an elementwise scalar function the derivative ``deriv`` (a ``jax.custom_jvp``).

    The result computes ``fun(x)``; its JVP is ``deriv(x) * x_dot`` (elementwise), so
    reverse mode is ``deriv(x) * cotangent``. Use it to impose a convention where
    autodiff of ``fun``'s implementation is wrong or undefined, e.g. a one-sided
    derivative at the edge of a domain. The rule calls ``fun`` for the primal value, so
    higher derivatives differentiate ``deriv`` (by plain autodiff).

    Args:
      fun: ``fun(x) -> y``, elementwise: ``y`` has the shape and dtype of ``x``.
      deriv: ``deriv(x) -> dy/dx``, elementwise, broadcastable to ``x``.

    Returns:
      A ``jax.custom_jvp`` function with ``fun``'s name and docstring.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from implicit.rules import with_derivative
      >>> f = with_derivative(jnp.sqrt, lambda x: 0.5 / jnp.sqrt(jnp.maximum(x, 1e-12)))
      >>> print(f(4.0), jax.grad(f)(4.0))
      2.0 0.25
    """
    if not callable(fun):
        raise TypeError(f"with_derivative: `fun` must be callable, got {type(fun).__name__}.")
    if not callable(deriv):
        raise TypeError(f"with_derivative: `deriv` must be callable, got {type(deriv).__name__}.")

    wrapped = jax.custom_jvp(fun)

    def _tangent(x_dot, ans, x):
        t = jnp.asarray(deriv(x)) * x_dot
        ans_dtype = jnp.result_type(ans)
        return t if t.dtype == ans_dtype else lax.convert_element_type(t, ans_dtype)

    wrapped.defjvps(_tangent)
    return wrapped


def x_over_1p_sqrt(x):
    """Compute ``x / (1 + sqrt(x))`` on ``[0, inf)`` with the one-sided derivative at 0.

    As a function on the half-line ``R+ = [0, inf)``, ``f(x) = x / (1 + sqrt(x))`` is
    differentiable at 0 with ``f'(0) = 1`` (the right derivative); its derivative is
    ``f'(x) = (sqrt(x) + 2) / (2 (sqrt(x) + 1)^2)``. Plain autodiff treats ``f`` as a
    function on the real line and returns ``nan`` at 0; this rule (built with
    :func:`with_derivative`) returns 1. Negative inputs are outside the domain
    (``nan``); the second derivative at 0 is ``-inf`` mathematically.

    Args:
      x: a non-negative floating array, evaluated elementwise.

    Returns:
      ``x / (1 + sqrt(x))`` with the shape and dtype of ``x``.

    Example:
      >>> import jax
      >>> from implicit.rules import x_over_1p_sqrt
      >>> print(x_over_1p_sqrt(4.0), jax.grad(x_over_1p_sqrt)(0.0))
      1.3333334 1.0
    """
    return x / (1 + jnp.sqrt(x))


def _x_over_1p_sqrt_deriv(x):
    s = jnp.sqrt(x)
    return (s + 2) / (2 * (s + 1) ** 2)


x_over_1p_sqrt = with_derivative(x_over_1p_sqrt, _x_over_1p_sqrt_deriv)


# --------------------------------------------------------------------------------------
# Gradient clipping
# --------------------------------------------------------------------------------------


def _clip_leaf(g, lo, hi):
    if g.dtype == jax.dtypes.float0 or not jnp.issubdtype(g.dtype, jnp.inexact):
        return g  # integer/boolean leaves carry float0 cotangents: nothing to clip
    lo = None if lo is None else jnp.asarray(lo).astype(g.dtype)
    hi = None if hi is None else jnp.asarray(hi).astype(g.dtype)
    return jnp.clip(g, min=lo, max=hi)


@jax.custom_vjp
def _clip_gradient(x, lo, hi):
    return x


def _clip_gradient_fwd(x, lo, hi):
    return x, (lo, hi)


def _clip_gradient_bwd(res, g):
    lo, hi = res
    g_x = jax.tree_util.tree_map(lambda leaf: _clip_leaf(leaf, lo, hi), g)
    return g_x, None, None  # `None`: zero cotangent for the bounds, whatever their dtype


_clip_gradient.defvjp(_clip_gradient_fwd, _clip_gradient_bwd)


def clip_gradient(x, lo=None, hi=None):
    """Identity on the forward pass; clip the reverse-mode cotangent of ``x`` to ``[lo, hi]``.

    ``y = x``, and on the backward pass the cotangent ``g`` arriving at ``y`` leaves as
    ``clip(g, lo, hi)`` (elementwise, every leaf of a pytree ``x``). This is not a
    mathematical derivative: it is the classic gradient-clipping heuristic, so it is a
    ``jax.custom_vjp`` rule (reverse mode only; ``jax.jvp`` raises). ``lo`` and ``hi``
    may be traced arrays; they receive a zero cotangent. Works under ``jit``/``vmap``.

    Args:
      x: any pytree of arrays (the value passed through).
      lo: lower bound for the cotangent, a scalar or an array broadcastable to every
        leaf of ``x``; ``None`` for no lower bound.
      hi: upper bound, likewise; ``None`` for no upper bound. Expects ``lo <= hi``.

    Returns:
      ``x`` unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from implicit.rules import clip_gradient
      >>> clip_sin = lambda x: jnp.sin(clip_gradient(x, -0.75, 0.75))
      >>> print(clip_sin(0.0), jax.grad(clip_sin)(0.0), jax.grad(clip_sin)(3.0))
      0.0 0.75 -0.75
    """
    return _clip_gradient(x, lo, hi)


# --------------------------------------------------------------------------------------
# Debugging the backward pass
# --------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _debug_backward(x, fn):
    return x


def _debug_backward_fwd(x, fn):
    return x, x


def _debug_backward_bwd(fn, x, g):
    jax.debug.callback(fn, x, g)
    return (g,)


_debug_backward.defvjp(_debug_backward_fwd, _debug_backward_bwd)


def debug_backward(x, fn: Callable[[Any, Any], Any]):
    """Identity on the forward pass; call ``fn(x, cotangent)`` on the backward pass.

    ``y = x``; when reverse-mode autodiff reaches ``y`` with cotangent ``g`` it calls
    ``fn(x, g)`` (primal value and cotangent, as concrete arrays with ``x``'s pytree
    structure) through ``jax.debug.callback``, so it also runs under ``jit``, and
    passes ``g`` on unchanged. The notebook's ``pdb`` trick, usable in compiled code:
    ``fn`` may print, log, store or raise. Under ``vmap`` ``fn`` is called once per
    batch element. ``fn``'s return value is ignored.

    Args:
      x: any pytree of arrays (the value passed through).
      fn: ``fn(x, g)`` called on the backward pass with the primal ``x`` and its
        cotangent ``g`` (same structure as ``x``).

    Returns:
      ``x`` unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from implicit.rules import debug_backward
      >>> show = lambda x, g: print(f"x={float(x):.1f} g={float(g):.4f}")
      >>> foo = lambda x: jnp.sin(debug_backward(x**2, show))
      >>> print(jax.jit(jax.grad(foo))(3.0))
      x=9.0 g=-0.9111
      -5.4667816
    """
    if not callable(fn):
        raise TypeError(f"debug_backward: `fn` must be callable, got {type(fn).__name__}.")
    return _debug_backward(x, fn)
