"""Compiled hot loops for f-grams (hash probes, counting, matching): the numba decorator and a prefetch.

Why numba: these loops touch each token once and do one hash-table access per
step; in numpy each step becomes ~15 passes over temporary arrays. numba ships
as a wheel (no compiler at install), compiles on first call and caches the
machine code next to the module (or in the user's cache dir when that is
read-only). nogil: grain's threads match batches in parallel.
"""
import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

compiled = numba.njit(nogil=True, cache=True)  # a CPU loop compiled by numba, not a device kernel

_PREFETCH_TYPE = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] + [ir.IntType(32)] * 3)


@intrinsic
def prefetch(typingctx, array, index):
    """Asks the CPU to start loading array.flat[index] (C-contiguous `array`) into cache; returns at once.

    A probe whose bucket is not in cache stalls on a branch that depends on the
    load; prefetching the buckets of keys a few steps ahead overlaps those loads.
    """
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        function = builder.module.declare_intrinsic("llvm.prefetch", [address.type], _PREFETCH_TYPE)
        read, keep_in_all_levels, data_cache = (ir.Constant(ir.IntType(32), v) for v in (0, 3, 1))
        builder.call(function, [address, read, keep_in_all_levels, data_cache])
        return context.get_dummy_value()

    return types.void(array, index), codegen
