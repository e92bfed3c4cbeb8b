"""Butcher tableaus of the Runge–Kutta pairs, with their dense-output polynomials.

Every tableau is stored as NumPy arrays (converted to the state's dtype where used):
``a`` (s×s, strictly lower for explicit methods, with diagonal ``gamma`` for ESDIRK),
``b`` (solution weights), ``b_error`` (solution minus embedded weights), ``c`` (stage
times) and ``dense`` (s×d): the continuous extension
``y(t0 + θh) = y0 + h Σ_i Σ_d dense[i, d] θ^(d+1) k_i``. All three methods are FSAL:
the last stage is the derivative at the new point.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Tableau", "DOPRI5", "TSIT5", "KVAERNO5", "TABLEAUS"]


class Tableau(NamedTuple):
    name: str
    a: np.ndarray
    b: np.ndarray
    b_error: np.ndarray
    c: np.ndarray
    dense: np.ndarray
    error_order: int  # the local error estimate is O(h^error_order)
    implicit: bool = False
    gamma: float = 0.0
    predictor: np.ndarray | None = None  # ESDIRK: stage-derivative extrapolation


def _lower(rows, s):
    a = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        a[i, : len(row)] = row
    return a


# --- Dormand–Prince 5(4) (Shampine's coefficients), 4th-order continuous extension ----

_DP_A = _lower(
    [
        [1 / 5],
        [3 / 40, 9 / 40],
        [44 / 45, -56 / 15, 32 / 9],
        [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729],
        [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656],
        [35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84],
    ],
    7,
)
_DP_B = np.array([35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0])
_DP_BHAT = np.array(
    [5179 / 57600, 0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40]
)
_DP_CMID = np.array(
    [
        6025192743 / 30085553152,
        0,
        51252292925 / 65400821598,
        -2691868925 / 45128329728,
        187940372067 / 1594534317056,
        -1776094331 / 19743644256,
        11237099 / 235043384,
    ]
) / 2


def _dopri5_dense():
    # The quartic through y0, y1, y(1/2) with slopes k_1 (at 0) and k_7 (at 1), each a
    # linear combination of the stages (Shampine 1986), written as θ-polynomial weights.
    e1, e7 = np.eye(7)[0], np.eye(7)[6]
    b, m = _DP_B, _DP_CMID
    return np.stack(
        [
            e1,  # θ
            -4 * e1 + e7 - 5 * b + 16 * m,  # θ²
            5 * e1 - 3 * e7 + 14 * b - 32 * m,  # θ³
            -2 * e1 + 2 * e7 - 8 * b + 16 * m,  # θ⁴
        ],
        axis=1,
    )


DOPRI5 = Tableau(
    name="dopri5",
    a=_DP_A,
    b=_DP_B,
    b_error=_DP_B - _DP_BHAT,
    c=np.array([0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0]),
    dense=_dopri5_dense(),
    error_order=5,
)

# --- Tsitouras 5(4) with its own 4th-order interpolant ---------------------------------

_TS_A = _lower(
    [
        [0.161],
        [-0.008480655492356988544426874250230774675121177393430391537369234245294192976164141156943, 0.3354806554923569885444268742502307746751211773934303915373692342452941929761641411569],  # noqa: E501
        [2.897153057105493432130432594192938764924887287701866490314866693455023795137503079289, -6.359448489975074843148159912383825625952700647415626703305928850207288721235210244366, 4.362295432869581411017727318190886861027813359713760212991062156752264926097707165077],  # noqa: E501
        [5.325864828439256604428877920840511317836476253097040101202360397727981648835607691791, -11.74888356406282787774717033978577296188744178259862899288666928009020615663593781589, 7.495539342889836208304604784564358155658679161518186721010132816213648793440552049753, -0.09249506636175524925650207933207191611349983406029535244034750452930469056411389539635],  # noqa: E501
        [5.861455442946420028659251486982647890394337666164814434818157239052507339770711679748, -12.92096931784710929170611868178335939541780751955743459166312250439928519268343184452, 8.159367898576158643180400794539253485181918321135053305748355423955009222648673734986, -0.07158497328140099722453054252582973869127213147363544882721139659546372402303777878835, -0.02826905039406838290900305721271224146717633626879770007617876201276764571291579142206],  # noqa: E501
        [0.09646076681806522951816731316512876333711995238157997181903319145764851595234062815396, 0.01, 0.4798896504144995747752495322905965199130404621990332488332634944254542060153074523509, 1.379008574103741893192274821856872770756462643091360525934940067397245698027561293331, -3.290069515436080679901047585711363850115683290894936158531296799594813811049925401677, 2.324710524099773982415355918398765796109060233222962411944060046314465391054716027841],  # noqa: E501
    ],
    7,
)
_TS_B = _TS_A[6].copy()
_TS_BHAT = np.array(
    [
        0.09468075576583945807478876255758922856117527357724631226139574065785592789071067303271,  # noqa: E501
        0.009183565540343253096776363936645313759813746240984095238905939532922955247253608687270,  # noqa: E501
        0.4877705284247615707855642599631228241516691959761363774365216240304071651579571959813,  # noqa: E501
        1.234297566930478985655109673884237654035539930748192848315425833500484878378061439761,  # noqa: E501
        -2.707712349983525454881109975059321670689605166938197378763992255714444407154902012702,  # noqa: E501
        1.866628418170587035753719399566211498666255505244122593996591602841258328965767580089,  # noqa: E501
        1 / 66,
    ]
)


def _tsit5_dense():
    # Tsitouras' interpolant b_i(θ), each a quartic in θ with zero constant term.
    P = np.polynomial.polynomial
    t = [0.0, 1.0]  # the polynomial θ

    def prod(*factors):
        out = [1.0]
        for f in factors:
            out = P.polymul(out, f)
        return out

    b1 = -1.0530884977290216 * np.asarray(
        prod(t, [-1.3299890189751412, 1.0], [0.7139816917074209, -1.4364028541716351, 1.0])
    )
    b2 = 0.1017 * np.asarray(prod(t, t, [1.2949852507374631, -2.1966568338249754, 1.0]))
    b3 = 2.490627285651252793 * np.asarray(
        prod(t, t, [1.57803468208092486, -2.38535645472061657, 1.0])
    )
    b4 = -16.54810288924490272 * np.asarray(
        prod([-1.21712927295533244, 1.0], [-0.61620406037800089, 1.0], t, t)
    )
    b5 = 47.37952196281928122 * np.asarray(
        prod([-1.203071208372362603, 1.0], [-0.658047292653547382, 1.0], t, t)
    )
    b6 = -34.87065786149660974 * np.asarray(prod([-1.2, 1.0], [-0.666666666666666667, 1.0], t, t))
    b7 = 2.5 * np.asarray(prod([-1.0, 1.0], [-0.6, 1.0], t, t))
    rows = [np.pad(p, (0, 5 - len(p)))[1:5] for p in (b1, b2, b3, b4, b5, b6, b7)]
    return np.stack(rows)


TSIT5 = Tableau(
    name="tsit5",
    a=_TS_A,
    b=_TS_B,
    b_error=_TS_B - _TS_BHAT,
    c=np.array([0, 0.161, 0.327, 0.9, 0.9800255409045096857298102862870245954942137979563024768854764293221195950761080302604, 1.0, 1.0]),  # noqa: E501
    dense=_tsit5_dense(),
    error_order=5,
)

# --- Kvaerno 5(4): L-stable, stiffly accurate ESDIRK, explicit first stage ---------------

_G = 0.26
_KV_A = _lower(
    [
        [_G],
        [0.13, 0.84033320996790809],
        [0.22371961478320505, 0.47675532319799699, -0.06470895363112615],
        [0.16648564323248321, 0.10450018841591720, 0.03631482272098715, -0.13090704451073998],
        [0.13855640231268224, 0, -0.04245337201752043, 0.02446657898003141, 0.61943039072480676],
        [
            0.13659751177640291,
            0,
            -0.05496908796538376,
            -0.04118626728321046,
            0.62993304899016403,
            0.06962479448202728,
        ],
    ],
    7,
)
_KV_A[np.arange(1, 7), np.arange(1, 7)] = _G
# Stage-derivative predictors (OrdinaryDiffEq.jl via diffrax, with α21 = 1).
_KV_PRED = _lower(
    [
        [1.0],
        [-1.366025403784441, 2.3660254037844357],
        [-0.19650552613122207, 0.8113579546496623, 0.38514757148155954],
        [0.10375304369958693, 0.937994698066431, -0.04174774176601781, 0],
        [-0.17281112873898072, 0.6235784481025847, 0.5492326806363959, 0, 0],
        list(_KV_A[5, :5]) + [_G],
    ],
    7,
)
_KV_B = _KV_A[6].copy()


def _hermite_dense(b):
    # Cubic Hermite through (y0, k_1) and (y1, k_7); y1 - y0 = h Σ b_i k_i.
    e1, e7 = np.eye(7)[0], np.eye(7)[6]
    return np.stack([e1, 3 * b - 2 * e1 - e7, e1 + e7 - 2 * b], axis=1)


KVAERNO5 = Tableau(
    name="kvaerno5",
    a=_KV_A,
    b=_KV_B,
    b_error=_KV_B - _KV_A[5],  # the embedded solution is the sixth stage value
    c=_KV_A.sum(axis=1),
    dense=_hermite_dense(_KV_B),
    error_order=5,
    implicit=True,
    gamma=_G,
    predictor=_KV_PRED,
)

TABLEAUS = {t.name: t for t in (DOPRI5, TSIT5, KVAERNO5)}
