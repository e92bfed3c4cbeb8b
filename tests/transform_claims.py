"""The JAX transformations each solver supports: the one statement of them.

The documentation's table (``docs/transforms.md``, filled in by ``tools/mkdocs_hooks.py``
at build time) is rendered from ``CLAIMS``, and ``tests/test_transform_claims.py`` checks
every claim against the test suite: each cell must be backed by a test that runs in CI
(not ``slow``), is marked ``@pytest.mark.transforms(row, transform, ..., option=...)``
and applies that transformation (its source calls ``jax.hessian(`` for ``"hessian"``,
etc.) with that option. A claim no test checks fails the suite.

To change a claim, edit its cell here and mark the test that checks it; for example,
``odeint``'s ``"jvp, jacfwd"`` cell names ``adjoint="forward"``, and a test of it
carries ``@pytest.mark.transforms("odeint", "jvp, jacfwd", option='adjoint="forward"')``.
"""

from __future__ import annotations

#: Works with the solver's defaults.
DEFAULT = ""

#: The columns, and the calls a test's source must contain to check each (any one).
TRANSFORMS = {
    "jit": ("jax.jit(", "@jax.jit"),
    "vmap": ("jax.vmap(",),
    "grad": ("jax.grad(",),
    "jacrev": ("jax.jacrev(",),
    "grad(grad)": ("jax.grad(jax.grad(", "jax.jacrev(jax.jacrev("),
    "jvp, jacfwd": ("jax.jvp(", "jax.jacfwd("),
    "hessian": ("jax.hessian(",),
}

_FORWARD = 'rule="jvp"'

#: The claims of the solvers differentiated by the implicit function theorem; each row
#: below takes a copy (one solver's claim changes in its own row: ``{**_IMPLICIT, ...}``).
_IMPLICIT = {
    "jit": DEFAULT, "vmap": DEFAULT, "grad": DEFAULT, "jacrev": DEFAULT,
    "grad(grad)": DEFAULT, "jvp, jacfwd": _FORWARD, "hessian": _FORWARD,
}

#: Row -> {transform: the option it needs (DEFAULT: none)}; a transform left out is not
#: claimed (it raises, with a message naming what to do instead). A row names one or
#: more public functions (``"bisection, chandrupatla"``): a test of any of them counts.
CLAIMS: dict[str, dict[str, str]] = {
    "fixed_point": dict(_IMPLICIT),
    "root, newton": dict(_IMPLICIT),
    "bisection, chandrupatla": dict(_IMPLICIT),
    "minimize": dict(_IMPLICIT),
    "least_squares": dict(_IMPLICIT),
    "odeint": {
        "jit": DEFAULT, "vmap": DEFAULT, "grad": DEFAULT, "jacrev": DEFAULT,
        # The default adjoint: second order forward over reverse (hessian) and reverse
        # over reverse, every method; third order raises (docs/ode.md).
        "grad(grad)": DEFAULT,
        "jvp, jacfwd": 'adjoint="forward"', "hessian": DEFAULT,
    },
    "custom_root, custom_fixed_point": dict(_IMPLICIT),
}


def names(row: str) -> list[str]:
    """The public functions a row names."""
    return [name.strip() for name in row.split(",")]


def _code(transform: str) -> str:
    return ", ".join(f"`{name.strip()}`" for name in transform.split(","))


def render() -> str:
    """The markdown table of ``CLAIMS``: per row, the transformations that work with the
    defaults, and those that need an option, grouped by option (three columns, so that
    it reads on a phone)."""
    lines = ["| | with the defaults | with an option |", "|---|---|---|"]
    for row, cells in CLAIMS.items():
        default = [_code(t) for t in TRANSFORMS if cells.get(t) == DEFAULT]
        options = {}
        for transform in TRANSFORMS:
            option = cells.get(transform)
            if option:
                options.setdefault(option, []).append(_code(transform))
        with_option = "; ".join(f"`{option}`: " + ", ".join(ts) for option, ts in options.items())
        label = ", ".join(f"`{name}`" for name in names(row))
        lines.append(f"| {label} | {', '.join(default) or '–'} | {with_option or '–'} |")
    return "\n".join(lines)
