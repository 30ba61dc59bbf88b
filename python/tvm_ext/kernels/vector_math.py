"""Math that vectorizes: what the activations need where LLVM would call a scalar libm function
per lane (it lowers the exp of a vector to one expf call per lane)."""

from __future__ import annotations

from tvm import tirx

__all__ = ["ACTIVATION_FUNCTIONS", "vector_exp"]


def vector_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(x) for float32 in arithmetic that vectorizes: x = n ln2 + r, exp(r) by Cephes' expf
    polynomial, times 2^n built in the exponent bits (TVM's fast_exp; relative error about 1e-7).
    LLVM turns the exp of a vector into one scalar expf call per lane. Selects clamp x to
    [-88.38, 88.38] so a NaN stays a NaN."""
    def f32(c: float) -> tirx.PrimExpr:
        return tirx.const(c, "float32")

    hi, lo = f32(88.3762626647949), f32(-88.3762626647949)
    x = tirx.Select(x > hi, hi, tirx.Select(x < lo, lo, x))
    n = tirx.floor(x * f32(1.44269504088896341) + f32(0.5))
    r = x - n * f32(0.6931471805599453)
    p = f32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f32(c)
    two_to_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return (p * r * r + r + f32(1)) * two_to_n


# What the activation texts may call besides T (TVMScript's tirx), for parsing and for eval.
ACTIVATION_FUNCTIONS = {"_vector_exp": vector_exp}
