"""Inputs for the gated delta rule tests, shared by every implementation."""

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int = 2
    t: int = 64
    hk: int = 2
    hv: int = 4
    dk: int = 32
    dv: int = 32
    chunk: int = 64
    dtype: str = "float32"
    h0: bool = True
    l2norm: bool = False
    cu_seqlens: tuple | None = None
    gates: str = "random"  # random | edges | strong | vanishing | channels | bursts | zeros
    beta_max: float = 1.0  # beta in [0, beta_max]; 2: negative eigenvalues of I - beta k k^T
    per_channel: bool = False  # KDA: g [B, T, HV, K], one log decay per key channel

    def __str__(self):
        return self.name


def make_inputs(case: Case, seed: int = 0):
    """(q, k, v, g, beta, h0) in the case's dtype; h0 in float32 or None."""
    rng = np.random.default_rng(seed)
    b, t = case.b, case.t
    n = b if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    q = rng.standard_normal((b, t, case.hk, case.dk))
    k = rng.standard_normal((b, t, case.hk, case.dk))
    if not case.l2norm:
        # Unit keys keep I - beta k k^T a contraction, as l2norm does in models.
        q = q / np.sqrt(case.dk)
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, case.hv, case.dv))
    gshape = (b, t, case.hv, case.dk) if case.per_channel else (b, t, case.hv)
    if case.gates == "edges":
        # Per token: no decay (g = 0), full decay (g = -30), no write (beta = 0),
        # full write (beta = 1), in every combination.
        g = rng.choice([0.0, -30.0, -0.5], size=gshape)
        beta = rng.choice([0.0, 1.0, 0.5], size=(b, t, case.hv))
    elif case.gates in ("strong", "vanishing"):
        # Gates far below zero: a chunk's cumulative sums reach -1000s, where
        # float32 cannot resolve a difference of two of them. "strong" sets
        # half the gates to 0 (decays of exactly 1 between strong ones).
        g = rng.uniform(-69.0, -31.0, size=gshape)
        if case.gates == "strong":
            g[rng.random(g.shape) < 0.5] = 0.0
    elif case.gates == "channels":
        # Per channel (KDA): barely decaying channels (g in [-1e-3, 0]) beside
        # hard-decaying ones (-30 per step), fixed per channel.
        g = -rng.uniform(0.0, 1e-3, size=gshape)
        g = np.where(rng.random((b, 1) + gshape[2:]) < 0.5, -30.0, g)
    elif case.gates == "bursts":
        # Hard steps (-30 .. -60) at random tokens, barely decaying ones
        # (-1e-3 .. 0) between: the decay between two tokens after a burst is
        # ~1, read off cumulative sums of -100s.
        g = -rng.uniform(0.0, 1e-3, size=gshape)
        g = np.where(rng.random(gshape) < 0.15, rng.uniform(-60.0, -30.0, size=gshape), g)
    elif case.gates == "zeros":
        # Decays of exactly zero (g = -inf, the state wiped) and gates whose chunk sums pass float32's range
        # (-1e38) at random tokens (KDA: random channels), ordinary decays between them.
        g = np.log(rng.uniform(0.6, 1.0, size=gshape))
        at = rng.random(gshape)
        g[at < 0.08] = -np.inf
        g[(at >= 0.08) & (at < 0.12)] = -1e38
    else:
        g = np.log(rng.uniform(0.6, 1.0, size=gshape))
    if case.gates != "edges":
        beta = rng.uniform(0.0, case.beta_max, size=(b, t, case.hv))
    h0 = rng.standard_normal((n, case.hv, case.dk, case.dv)) * 0.5 if case.h0 else None
    dt = jnp.dtype(case.dtype)
    out = [jnp.asarray(x, dt) for x in (q, k, v, g, beta)]
    return (*out, None if h0 is None else jnp.asarray(h0, jnp.float32))


CASES = [
    Case("gva2_T63_c16", t=63, chunk=16),
    Case("gva4_T64_c32_l2", hk=2, hv=8, t=64, chunk=32, h0=False, l2norm=True),
    Case("T1_c64", t=1, chunk=64),
    Case("T200_c128_l2", t=200, chunk=128, l2norm=True, b=1),
    Case("K64_V128_T100", t=100, dk=64, dv=128, b=1, chunk=64),
    Case("K128_V64_T70", t=70, dk=128, dv=64, b=1, hk=1, hv=2, chunk=32),
    Case("packed", b=1, t=130, chunk=32, cu_seqlens=(0, 5, 5, 70, 130)),
    Case("packed_short_c64", b=1, t=90, chunk=64, cu_seqlens=(0, 40, 47, 90), h0=False, l2norm=True),
    Case("edges", t=80, chunk=16, gates="edges"),
    Case("strong_c64", b=1, t=128, chunk=64, gates="strong"),
    Case("vanishing_c32", b=1, t=96, chunk=32, gates="vanishing"),
    Case("bf16", t=100, chunk=64, dtype="bfloat16", l2norm=True),
    Case("bf16_packed", b=1, t=100, chunk=16, dtype="bfloat16", cu_seqlens=(0, 33, 100)),
    Case("beta2_c32_l2", t=96, chunk=32, l2norm=True, beta_max=2.0),
    Case("beta2_strong_c64", b=1, t=128, chunk=64, gates="strong", beta_max=2.0),
]


def by_name(cases, *names):
    """The cases of these names, in this order."""
    table = {c.name: c for c in cases}
    return [table[n] for n in names]


# KDA: the cases above that the per-channel gate changes (its hard gates at every chunk size:
# test_kda.test_any_gate_at_every_chunk_size)
KDA_CASES = [
    Case("kda_gva2_T63_c16", t=63, chunk=16, per_channel=True),
    Case("kda_gva4_T64_c32_l2", hk=2, hv=8, t=64, chunk=32, h0=False, l2norm=True, per_channel=True),
    Case("kda_T1_c64", t=1, chunk=64, per_channel=True),
    Case("kda_K64_V128_T100_c64", t=100, dk=64, dv=128, b=1, chunk=64, per_channel=True),
    Case("kda_packed_c32", b=1, t=130, chunk=32, cu_seqlens=(0, 5, 5, 70, 130), per_channel=True),
    Case("kda_edges_c16", t=80, chunk=16, gates="edges", per_channel=True),
    Case("kda_bursts_c128", b=1, t=200, chunk=128, gates="bursts", per_channel=True, l2norm=True),
    Case("kda_bf16_c64", t=100, chunk=64, dtype="bfloat16", l2norm=True, per_channel=True),
    Case("kda_beta2_c32_l2", t=96, chunk=32, l2norm=True, beta_max=2.0, per_channel=True),
]
