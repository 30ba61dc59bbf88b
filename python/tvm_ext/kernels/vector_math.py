"""Math that vectorizes: what the activations need where LLVM would call a scalar libm function
per lane (it lowers the exp of a vector to one expf call per lane)."""

from __future__ import annotations

from tvm import tirx

__all__ = ["ACTIVATION_FUNCTIONS", "vector_erf", "vector_exp"]


def _f32(c: float) -> tirx.PrimExpr:
    return tirx.const(c, "float32")


def _let(value: tirx.PrimExpr, name: str, body) -> tirx.PrimExpr:
    """`body(v)` with `v` bound to `value` once. The polynomials use their argument many times;
    without the binding each use is a copy of the whole argument expression (an epilogue's
    accumulator, or the exp of erf's polynomial): as a DAG of shared nodes, which TVM's passes
    walk as a tree, one GELU convolution took 13 s to lower (bound: 2.4 s; relu: 0.14 s)."""
    if hasattr(value, "asobject"):  # a TE tensor element (TensorSlice): its load expression
        value = value.asobject()
    if isinstance(value, (tirx.Var, tirx.IntImm, tirx.FloatImm)):
        return body(value)
    var = tirx.Var(name, value.ty)
    return tirx.Let(var, value, body(var))


def vector_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(x) for float32 in arithmetic that vectorizes: x = n ln2 + r, exp(r) by Cephes' expf
    polynomial, times 2^n built in the exponent bits (TVM's fast_exp; relative error about 1e-7).
    LLVM turns the exp of a vector into one scalar expf call per lane. Selects clamp x to
    [-88.38, 88.38] so a NaN stays a NaN."""
    hi, lo = _f32(88.3762626647949), _f32(-88.3762626647949)

    def clamped(x: tirx.PrimExpr) -> tirx.PrimExpr:
        return _let(tirx.Select(x > hi, hi, tirx.Select(x < lo, lo, x)), "exp_x", reduced)

    def reduced(x: tirx.PrimExpr) -> tirx.PrimExpr:
        return _let(tirx.floor(x * _f32(1.44269504088896341) + _f32(0.5)), "exp_n",
                    lambda n: _let(x - n * _f32(0.6931471805599453), "exp_r", lambda r: polynomial(n, r)))

    def polynomial(n: tirx.PrimExpr, r: tirx.PrimExpr) -> tirx.PrimExpr:
        p = _f32(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = p * r + _f32(c)
        two_to_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
        return (p * r * r + r + _f32(1)) * two_to_n

    return _let(x, "exp_in", clamped)


def vector_erf(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """erf(x) for float32 in arithmetic that vectorizes (LLVM calls a scalar erff per lane of a
    vector erf: GELU's epilogue). Norbert Juffa's float32 erff: for |x| <= 0.927734375 an odd
    polynomial x + x p(x^2), above it 1 - exp(q(|x|)) with the sign of x, q a polynomial with
    q(t) ~ log(erfc(t)) and the exp :func:`vector_exp`. Both halves are computed and one is
    selected. Within 1.5 ulp of float64 erf over the whole float32 line (test_gelu_channels_last);
    |x| is clamped to 4 in the second half (erf(4) rounds to 1), so +-inf give +-1, and a NaN
    (every comparison false) takes the first half and stays a NaN.

    |x| and the clamp are abs and min, not Selects: TVM's simplifiers took 1.7 s to lower one
    kernel with the Select form (each Select of a Select multiplied the work of the let-bound
    values after it: ConvNeXt's four GELU convolutions, 8 of its 16 s build), 0.05 s with these.
    """
    def halves(x: tirx.PrimExpr) -> tirx.PrimExpr:
        s = x * x
        p = _f32(-5.96761703e-4)
        for c in (4.99119423e-3, -2.67681349e-2, 1.12819925e-1, -3.76125336e-1, 1.28379166e-1):
            p = p * s + _f32(c)
        small = p * x + x
        return _let(tirx.min(tirx.abs(x), _f32(4)), "erf_t", lambda t: select(x, t, small))

    def select(x: tirx.PrimExpr, t: tirx.PrimExpr, small: tirx.PrimExpr) -> tirx.PrimExpr:
        ts = t * t
        q = (_f32(-1.72853470e-5) * t + _f32(3.83197126e-4)) * ts + (_f32(-3.88396438e-3) * t + _f32(2.42546219e-2))
        for c in (-1.06777877e-1, -6.34846687e-1, -1.28717512e-1):
            q = q * t + _f32(c)
        signed = lambda large: tirx.Select(x < _f32(0), _f32(0) - large, large)  # noqa: E731
        return _let(_f32(1) - vector_exp(q * t - t), "erf_large",
                    lambda large: tirx.Select(tirx.abs(x) > _f32(0.927734375), signed(large), small))

    return _let(x, "erf_x", halves)


# What the activation texts may call besides T (TVMScript's tirx), for parsing and for eval.
ACTIVATION_FUNCTIONS = {"_vector_exp": vector_exp, "_vector_erf": vector_erf}
