"""Compile the captured update's CuPy kernels with NVRTC, without a GPU.

    LD_LIBRARY_PATH=<site-packages>/nvidia/cuda_nvrtc/lib \
        PYTHONPATH=. python benchmarks/compile_update_kernels.py

Needs CuPy (it uses CuPy's own code generator, private names of
``cupy._core._kernel``: CuPy 13 with ``nvidia-cuda-nvrtc-cu12`` and
``nvidia-cuda-runtime-cu12``, or CuPy 14 with ``nvidia-cuda-nvrtc``,
``nvidia-cuda-runtime`` and ``nvidia-cuda-cccl`` 13, LD_LIBRARY_PATH then
``<site-packages>/nvidia/cu13/lib``); no Chainer, no device. For each
kernel of ``schedules.update_cuda`` and each dtype pair a step can use
(P/T: float32, float64, float16 rules without fp32, Adam on float16
parameters with float32 T), the source CuPy generates for an
ElementwiseKernel call on 1-D contiguous arrays is compiled for
``compute_90`` with the options CuPy adds. Prints how many compiled, then
compares each with Chainer's own kernel (the same body, its scalars kernel
parameters): the floating-point instructions of both PTX listings (add,
sub, mul, fma, div, sqrt, rsqrt, max, min, conversions; integer index
arithmetic left out), as sequences and as multisets. A compiler may
reorder independent instructions or compute a common subexpression twice
(the same value); what would change a result is another operation or
another FMA contraction, which the multisets show.

Where ``ptxas`` and ``nvdisasm`` are installed next to NVRTC
(``nvidia-cuda-nvcc`` and ``nvidia-cuda-nvdisasm`` 13: ``nvidia/cu13/bin``),
each PTX is also assembled for ``sm_90`` and the SASS arithmetic of both
kernels compared the same way (what the device runs: ``ptxas`` may fuse a
PTX ``mul`` and ``add`` that carry no rounding modifier).
"""
import collections
import re
import itertools
import os
import sys

import numpy
import cupy
from cupy._core import _carray, _kernel
from cupy.cuda import compiler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from schedules import update_cuda as C  # NOQA


def _kinds():
    # CuPy's private ARG_KIND_NDARRAY / ARG_KIND_INDEXER values.
    for nd, ix in itertools.product(range(6), range(6)):
        try:
            _source(C.SGD, 'f', 'f', nd, ix)
            return nd, ix
        except Exception:
            pass
    raise RuntimeError('this CuPy\'s _ArgInfo is not understood')


_CTYPES = {'f': 'float', 'd': 'double', 'e': 'float16'}


def _source(rk, P, T, nd, ix, scalars='array'):
    """The kernel made here, its scalars read as ``scalars`` says:
    'array' (what schedules.update_cuda does: ``const T lr = _s[0];`` at
    the top of the loop body), 'hoisted' (the same reads before the loop,
    CuPy's ``loop_prep``) or 'constant' (from a ``__constant__`` array,
    before the loop: an experiment, nothing here fills it)."""
    ins, outs, body = rk.source()
    preamble, prep = '', ''
    if scalars != 'array':
        ins = ', '.join(rk.arrays() + (['raw %s _s' % rk.ctype]
                                       if scalars == 'hoisted' else []))
        body = rk.body
        ct = _CTYPES[{'P': P, 'T': T}[rk.ctype]]
        src = '_s' if scalars == 'hoisted' else '_sc'
        if scalars == 'constant':
            preamble = '__constant__ %s _sc[%d];\n' % (
                ct, max(1, len(rk.scalars)))
            if not any(a.split()[-2] == rk.ctype for a in rk.arrays()):
                # Adam's T is known from its scalars and dtype carrier only.
                preamble += 'typedef %s %s;\n' % (ct, rk.ctype)
        prep = ''.join('const %s %s = %s[%d];\n' % (ct, n, src, i)
                       for i, n in enumerate(rk.scalars))
    k = cupy.ElementwiseKernel(ins, outs, body, 'static_graph_' + rk.name,
                               preamble=preamble)
    pick = {'P': P, 'T': T}
    in_dt = [pick[p.split()[-2]] for p in ins.split(',')]
    out_dt = [pick[p.split()[-2]] for p in outs.split(',')]
    _, _, type_map = k._decide_params_type(
        tuple(numpy.dtype(d).type for d in in_dt),
        tuple(numpy.dtype(d).type for d in out_dt))
    infos = [_kernel._ArgInfo(nd, cupy._core.core._ndarray_base,
                              numpy.dtype(d).type, 1, True, True)
             for d in in_dt + out_dt]
    infos.append(_kernel._ArgInfo(ix, _carray.Indexer, None, 1, True, True))
    return _kernel._get_elementwise_kernel_code(
        tuple(infos), type_map, k.params, k.operation, k.name, k.preamble,
        prep, '')


_SASS_OP = re.compile(r'\b(DFMA|DMUL|DADD|FFMA|FMUL|FADD|HFMA2|HMUL2|HADD2|'
                      r'MUFU\.[A-Z0-9]+)\b')
_FLOAT_OP = re.compile(r'^\s*(?:@%\w+\s+)?((?:add|sub|mul|fma|div|sqrt|rsqrt|'
                       r'max|min|neg|cvt|rcp|abs)\.[\w.]*f(?:16|32|64)\b'
                       r'[\w.]*)')


def _float_ops(ptx):
    if isinstance(ptx, bytes):
        ptx = ptx.decode()
    return [m.group(1) for m in map(_FLOAT_OP.match, ptx.splitlines()) if m]


def _chainer_source(rk, P, T, nd, ix, sk=3):
    # Chainer's kernel: its scalars are kernel parameters (CuPy's
    # ARG_KIND_SCALAR is 3 in CuPy 13).
    k = cupy.ElementwiseKernel(rk.in_params, rk.out_params, rk.body,
                               'chainer_' + rk.name)
    pick = {'P': P, 'T': T}
    infos, in_dt = [], []
    for p in rk.in_params.split(','):
        toks = p.split()
        t = numpy.dtype(pick[toks[-2]]).type
        scalar = toks[-1] in rk.scalars
        in_dt.append(None if scalar else t)
        infos.append(_kernel._ArgInfo(sk, t, t, 0, True, True) if scalar
                     else _kernel._ArgInfo(nd, cupy._core.core._ndarray_base,
                                           t, 1, True, True))
    out_dt = [numpy.dtype(pick[p.split()[-2]]).type
              for p in rk.out_params.split(',')]
    _, _, type_map = k._decide_params_type(tuple(in_dt), tuple(out_dt))
    infos += [_kernel._ArgInfo(nd, cupy._core.core._ndarray_base, d, 1, True,
                               True) for d in out_dt]
    infos.append(_kernel._ArgInfo(ix, _carray.Indexer, None, 1, True, True))
    return _kernel._get_elementwise_kernel_code(
        tuple(infos), type_map, k.params, k.operation, k.name, k.preamble)


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--scalars', default='array',
                        choices=('array', 'hoisted', 'constant'),
                        help='how the kernels made here read their scalars '
                             '(see _source; default: as update_cuda does)')
    variant = parser.parse_args(argv).scalars
    nd, ix = _kinds()
    site = os.path.dirname(os.path.dirname(cupy.__file__))
    inc = os.path.join(os.path.dirname(cupy.__file__), '_core', 'include')
    opts = ['-arch=compute_90', '--device-as-default-execution-space',
            '-ftz=true', '-I' + inc]
    # CuPy 13 (CUDA 12 wheels) or CuPy 14 (CUDA 13: CCCL headers, C++17).
    for sub in ('cupy/_cuda/cuda-12', 'cupy/_cuda/cuda-13',
                'cupy/_cccl/libcudacxx', 'cupy/_cccl/thrust',
                'cupy/_cccl/cub'):
        if os.path.isdir(os.path.join(inc, sub)):
            opts.append('-I' + os.path.join(inc, sub))
    for sub in ('nvidia/cuda_runtime/include', 'nvidia/cu13/include'):
        if os.path.isdir(os.path.join(site, sub)):
            opts.append('-I' + os.path.join(site, sub))
    if os.path.isdir(os.path.join(inc, 'cupy', '_cccl')):
        opts.append('-std=c++17')
    opts = tuple(opts)
    head = ('#include <cupy/complex.cuh>\n#include <cupy/carray.cuh>\n'
            '#include <cupy/atomics.cuh>\n')
    ok, fails = 0, []
    same_seq = same_set = 0
    notes = []
    sass_tools = _sass_tools(site)
    sass_notes = collections.defaultdict(list)

    def ptx(source):
        return compiler._NVRTCProgram(head + source, 'kern.cu', (), (),
                                      method='ptx').compile(opts)[0]
    for rk in C.KERNELS:
        pairs = [('f', 'f'), ('d', 'd'), ('e', 'e')]
        if 'P ' in rk.in_params:
            pairs = [('f', 'f'), ('d', 'd'), ('e', 'f')]    # Adam's T
        for P, T in pairs:
            try:
                mine_ptx = ptx(_source(rk, P, T, nd, ix, variant))
                ok += 1
            except Exception as e:
                fails.append((rk.name, P, T, str(e)[-800:]))
                continue
            theirs_ptx = ptx(_chainer_source(rk, P, T, nd, ix))
            mine, theirs = _float_ops(mine_ptx), _float_ops(theirs_ptx)
            if mine == theirs:
                same_seq += 1
            elif collections.Counter(mine) == collections.Counter(theirs):
                same_set += 1
                notes.append('%s %s/%s: the same instructions, in another '
                             'order' % (rk.name, P, T))
            else:
                notes.append('%s %s/%s: Chainer %s; here %s' % (
                    rk.name, P, T, dict(collections.Counter(theirs)),
                    dict(collections.Counter(mine))))
            if sass_tools:
                a = _sass_ops(mine_ptx, sass_tools)
                b = _sass_ops(theirs_ptx, sass_tools)
                sass_notes[(a == b, collections.Counter(a) ==
                            collections.Counter(b))].append(
                    '%s %s/%s' % (rk.name, P, T))
    print('compiled %d kernel sources for compute_90, %d failed' % (
        ok, len(fails)))
    for f in fails:
        print(f)
    print('against Chainer\'s own kernels: %d the same float instruction '
          'sequence, %d the same multiset in another order, %d other' % (
              same_seq, same_set, ok - same_seq - same_set))
    for n in notes:
        print('  ' + n)
    if sass_tools:
        print('SASS for sm_90 (ptxas, nvdisasm), against Chainer\'s: %d the '
              'same arithmetic sequence; the same multiset in another order: '
              '%s; other: %s' % (
                  len(sass_notes[(True, True)]),
                  ', '.join(sass_notes[(False, True)]) or 'none',
                  ', '.join(sass_notes[(False, False)]) or 'none'))
    return 1 if fails else 0


def _sass_tools(site):
    d = os.path.join(site, 'nvidia', 'cu13', 'bin')
    tools = [os.path.join(d, n) for n in ('ptxas', 'nvdisasm')]
    return tools if all(os.path.exists(t) for t in tools) else None


def _sass_ops(ptx, tools):
    import subprocess
    import tempfile
    ptxas, nvdisasm = tools
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, 'k.ptx'), os.path.join(tmp, 'k.cubin')
        with open(src, 'wb') as f:
            f.write(ptx if isinstance(ptx, bytes) else ptx.encode())
        subprocess.run([ptxas, '-arch=sm_90', src, '-o', cubin], check=True)
        out = subprocess.run([nvdisasm, cubin], check=True,
                             capture_output=True, text=True).stdout
    # HFMA2 with zero operands (-RZ, RZ) is a move of a constant.
    return [m.group(1) for m in map(_SASS_OP.search, (
        ln for ln in out.splitlines() if '-RZ, RZ' not in ln)) if m]


if __name__ == '__main__':
    sys.exit(main())
