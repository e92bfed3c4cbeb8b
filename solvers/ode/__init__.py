"""ODE integration with adjoint gradients: ``solvers.odeint``.

``odeint(f, y0, ts, *args)`` integrates ``dy/dt = f(y, t, *args)`` (the
``jax.experimental.ode.odeint`` convention: switching is a change of import) and returns
``y`` at every output time.

Methods
  ``"dopri5"`` (default) and ``"tsit5"``: explicit 5(4) pairs for non-stiff problems.
  ``"kvaerno5"``: Kværnø's L-stable, stiffly accurate ESDIRK 5(4) for stiff problems;
  its stage equations are solved by :func:`solvers.newton` (simplified Newton: one
  Jacobian per step, shared by all six implicit stages), and a stage solve that does not
  converge rejects the step instead of raising.
  ``"bdf"``: variable-order (1–5), variable-step NDF/BDF (SciPy's ``BDF``, MATLAB's
  ``ode15s``) for stiff problems; its own order and step-size selection, the Jacobian
  and LU kept across steps, the interpolating polynomial as dense output.
  The Runge–Kutta methods use an embedded error estimate
  in the weighted RMS norm (a step is accepted when
  ``sqrt(mean((err / (atol + rtol·|y|))²)) <= 1``), a PI step-size controller, Hairer's
  automatic first step, and the method's own continuous extension to fill the output
  times (quartic for dopri5 and tsit5, cubic Hermite for kvaerno5): the steps never stop
  at an output time. The whole primal is one ``lax.while_loop``; tolerances are traced
  values, so changing them does not recompile.

Gradients
  Reverse mode through a ``jax.custom_vjp`` (the stepping loop is never differentiated),
  with respect to ``y0``, ``ts``, every floating array in ``args`` and every traced value
  ``f`` closes over:

  - ``adjoint="discrete"`` (default): the exact derivative of the computed outputs. The
    forward pass keeps a checkpoint every ``adjoint_window`` accepted steps; the backward
    pass replays each segment's steps and runs the cotangent back through them (one
    ``jax.vjp`` per step, step sizes held fixed; an implicit method's stage equations by
    the implicit function theorem). Nothing is integrated backwards: stable for any
    stiffness. Second derivatives with every method, forward over reverse
    (``jax.hessian``) and reverse over reverse (``grad(grad)``, ``jacrev(jacrev)``);
    third and higher: ``adjoint="forward"``.
  - ``adjoint="backsolve"``: the continuous adjoint ``a' = -(∂f/∂y)ᵀ a``,
    ``θ̄' = (∂f/∂θ)ᵀ a`` solved backwards with the forward method and the tolerances
    ``adjoint_rtol``/``adjoint_atol`` (default: the forward ones; the parameter
    cotangents left out of the step control, a seminorm), ``y`` integrated backwards with
    ``a`` and restarted from the stored output at every output time. Itself
    differentiable (``grad(grad(...))``); fails (status ``drift``) where integrating the
    state backwards is unstable.
  - ``adjoint="interpolate"``: the same continuous adjoint, with ``y`` not integrated
    backwards: each output interval's forward solution is recomputed from the stored
    output, ``adjoint_window`` steps at a time, and interpolated. First derivatives only.
  - ``adjoint="forward"``: forward sensitivities (a ``jax.custom_jvp``), so ``jax.jvp``,
    ``jax.jacfwd`` and ``jax.hessian`` work too, at any order; for few parameters.
  - ``adjoint="forward_adaptive"``: forward mode through the integration itself, the
    step sizes and stage iterations differentiated too (the derivative of the computed
    outputs with the steps moving as they do): for relaxation oscillations, whose fast
    jumps move along a grid the other rules hold fixed. ``jax.grad`` at first order.

  Memory holds the outputs and a fixed number of checkpoints or steps, never all the
  steps: it does not grow with the number of steps or with ``max_steps``.

Accuracy of the gradient
  The discrete adjoint (and ``"forward"``) differentiate the computed numbers exactly:
  their error is how far the computed solution's derivative is from the exact one, set by
  ``rtol``/``atol`` like the solution's own. The continuous adjoints give the derivative
  of the exact solution, approximated to the tolerances; their error has two parts. The
  backward integration's own error follows ``adjoint_rtol``/``adjoint_atol``: on
  Lotka–Volterra (with an accurate forward pass) it is 4e-4, 4e-7 and 5e-9 (relative,
  max-norm) at adjoint tolerances 1e-4, 1e-6 and 1e-8.
  The forward solution's error (``rtol``/``atol``) reaches the gradient through the
  outputs the loss is evaluated at, and usually dominates: at rtol = atol = 1e-6 the
  gradient is off by 4e-5 (dopri5) or 1e-5 (tsit5) whatever the adjoint tolerances,
  and by 2e-9 at 1e-10. Tighten ``rtol``/``atol`` first, then the adjoint ones if the
  backward pass is looser. Finite differences of ``odeint`` at loose tolerances are not a
  better reference: they differentiate the step-size controller's choices too.

Failures
  ``max_steps`` caps the attempted steps over the whole of ``ts`` (not per output
  interval), forward and backward. Exhausting it, a step size underflow and a non-finite
  state all follow ``on_failure``: by default a :class:`solvers.ConvergenceError` naming
  the time reached (under ``jit`` too), or NaN (``"nan"``), or the outputs reached so far
  with NaN after (``"ignore"``). An explicit method on a stiff problem therefore fails
  loudly instead of returning garbage. Traced output times (under ``jit``) that are not
  finite and strictly increasing are checked at run time: nothing is integrated and the
  status is ``invalid_input``, following ``on_failure`` too. ``full_output=True`` adds an
  :class:`ODEInfo`, whose ``status`` is a code of :mod:`solvers._status` (``max_steps``,
  ``step_underflow``, ``nonfinite``, ``invalid_input``; ``info.status_name`` names it).
"""

from solvers.ode._odeint import METHODS, ODEInfo, ODESolution, odeint

__all__ = ["odeint", "ODEInfo", "ODESolution", "METHODS"]
