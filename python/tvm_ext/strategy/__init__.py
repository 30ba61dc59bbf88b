"""Dispatch strategies: which tvm_ext kernel serves which Relax op, and the calls that replace it.

:mod:`.base` (the Decision, op tables, the emitter interface) <- :mod:`.decide` (the one
decision; the CUDA convolution rule in :mod:`.cuda_engine`) <- :mod:`.fusion` (epilogue
patterns) <- :mod:`.dispatch` (lowering and legalization), which drives a target's emitter,
:mod:`.cpu` or :mod:`.cuda`.
"""
