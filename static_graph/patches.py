"""What a recording wraps while some thread records, and puts back.

``install()`` (when the first recording starts) replaces
``FunctionNode.apply`` (for good: see ``_put``), ``Variable._get_array``
and ``_get_grad``,
``Reporter.report`` and ``chainer.report``,
Chainer's ``backprop_step``, NumPy's array constructors and shape makers,
the global random generators' functions and Chainer's pure array
functions (``numpy_calls.PURE``) with wrappers that hand each
event to the thread's recording (``current()``); ``uninstall()`` (when the
last one ends) restores all but the first. A recording holds them from its
forward to the end of its recorded backward (``Hold``). Calls while no
recording is current in their thread pass straight through.
"""
import sys
import threading

import numpy

import chainer
import chainer.functions as F
from chainer import _backprop as _backprop_module
from chainer import _backprop_utils
from chainer import function_node
from chainer import reporter as reporter_module
from chainer import variable as variable_module
from chainer.utils import walker_alias

from static_graph import arguments
from static_graph import communicator_calls
from static_graph import device_reads
from static_graph import held_views
from static_graph import key_constants
from static_graph import number_makers
from static_graph import numpy_calls
from static_graph import reports
from static_graph import rng_patches
from static_graph import traced
from static_graph.arrayutil import MISSING

class _Local(threading.local):
    recording = None     # (a class default: a thread that never recorded
    #                       reads it without an AttributeError raised)


_local = _Local()
traced.set_active(_local)

_orig_apply = function_node.FunctionNode.apply
_orig_get_array = variable_module.Variable._get_array
_orig_get_grad = variable_module.Variable._get_grad
_orig_report = reporter_module.Reporter.report
_orig_module_report = reporter_module.report
_orig_backprop_step = _backprop_utils.backprop_step
# NumPy's array constructors do not dispatch on their argument: a traced
# array would come back plain (numpy.asarray(h.array)), its values no
# longer seen. While recording they keep it traced.
_NUMPY_CONSTRUCTORS = ('asarray', 'array', 'ascontiguousarray',
                       'asfortranarray', 'require')
# One that checks the values too (SciPy's linear algebra calls it): replay
# would not repeat the check.
_NUMPY_CHECKS = ('asarray_chkfinite',)
_orig_numpy = dict((name, getattr(numpy, name))
                   for name in _NUMPY_CONSTRUCTORS + _NUMPY_CHECKS)
_VARIABLE_FILE = variable_module.__file__.replace('.pyc', '.py')


_install_lock = threading.Lock()
_install_count = 0


def op_kind(node):
    fn = getattr(node, '_function', None)   # old-style chainer.Function
    return type(fn if fn is not None else node).__name__


def current():
    """The recording active in this thread, or None."""
    return getattr(_local, 'recording', None)


# Callables ``watch(node, inputs)`` told of every function application once
# the wrapper is in (nstep_loop.py's: other uses of an NStep link's weights).
apply_watchers = []


def _patched_apply(self, inputs):
    rec = getattr(_local, 'recording', None)
    if apply_watchers:
        for watch in apply_watchers:
            watch(self, inputs)
    if rec is None or rec.depth:
        return _orig_apply(self, inputs)
    return rec.on_apply(self, inputs)


def _user_caller():
    """The frame that called the Variable accessor calling this (past
    variable.py's own frames), or None where that is Chainer's, NumPy's
    or this package's code."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename == _VARIABLE_FILE:
        f = f.f_back
    if f is None or not traced.reads_as_user(f.f_code.co_filename):
        return None
    return f


def _traced_getter(orig, gradient=False):
    """``Variable._get_array`` or ``_get_grad`` handing user code the array
    traced (``h.array``, ``W.grad``: analysis.classify_unknown tells a
    gradient from a constant). A read of an argument's gradient
    (``x.grad`` of a Variable argument, None or not) by the method is a
    reason: replay would neither see the caller's gradient then nor key
    on it."""
    def getter(self):
        a = orig(self)
        rec = getattr(_local, 'recording', None)
        if rec is None or rec.depth:
            return a
        argument = gradient and id(self) in rec.argument_paths
        if gradient and not argument:
            f = _direct_user_caller()
            if f is not None:
                _no_gradient_read(rec, '.grad', f)
            if a is None:
                return a
        if type(a) is not numpy.ndarray and not argument:
            return a
        f = _user_caller()
        if f is None:
            return a
        if argument:
            arguments.gradient_used(rec, self, '.grad', f)
        if type(a) is not numpy.ndarray:
            return a
        return rec.trace(a)

    getter.__name__ = orig.__name__
    return getter


_patched_get_array = _traced_getter(_orig_get_array)
_patched_get_grad = _traced_getter(_orig_get_grad, gradient=True)


def _no_gradient_read(rec, what, frame):
    """The method reads a gradient (``W.grad is None``, the first call of
    an accumulation; ``if W.grad is not None``, where a fresh Parameter's
    is a NaN-filled array and ``cleargrads()`` makes it None): a reason,
    as replay would take the branch it took at every call."""
    if rec.phase == 'forward':
        # (Late: where the method computes with the gradient too, the
        # reason that names its parameter comes first, analysis.py.)
        rec.late_reasons.append(
            'it reads a gradient (%s) at %s:%d; replay would not see '
            'whether there is one, or what it holds'
            % (what, frame.f_code.co_filename, frame.f_lineno))


def _grad_var_getter(orig):
    """``Variable.grad_var``, read: of an argument's copy, a use of its
    gradient (``arguments.gradient_used``); None elsewhere, read by user
    code itself, a read of whether there is one (``_no_gradient_read``)."""
    def getter(self):
        g = orig(self)
        rec = getattr(_local, 'recording', None)
        if rec is None or rec.depth:
            return g
        if id(self) in rec.argument_paths:
            f = _user_caller()
            if f is not None:
                arguments.gradient_used(rec, self, '.grad_var', f)
        else:
            f = _direct_user_caller()
            if f is not None:
                _no_gradient_read(rec, '.grad_var', f)
        return g

    getter.__name__ = orig.__name__
    return getter


def _direct_user_caller():
    """The frame that called the accessor calling this, where that is user
    code (not Chainer's own, a ``Variable.backward`` reading it on the
    caller's behalf), or None."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename == _VARIABLE_FILE and \
            f.f_code.co_name in ('grad', 'grad_var'):
        # (The ``grad`` property, calling _get_grad; ``W.node.grad`` and
        # ``W.node.grad_var``, VariableNode's, calling the Variable's.)
        f = f.f_back
    if f is None or traced.internal_file(f.f_code.co_filename):
        return None
    return f


# The Chainer functions a backward that sets gradients runs in (their
# code, and what the reason calls them): a backward inside the method.
_SETTERS = {variable_module.Variable.backward.__code__: 'y.backward()',
            _backprop_module.backward.__code__: 'chainer.backward()'}
_GRAD_CODE = function_node.grad.__code__


def _setting_backward(frame):
    """What runs this backward step, where it sets gradients: a
    ``Variable.backward``, ``chainer.backward`` or ``chainer.grad`` with
    ``set_grad`` true, however it was called (by position, imported
    before the library, from Chainer's own code); else None
    (``chainer.grad`` without ``set_grad``, a gradient penalty's, only
    computes)."""
    while frame is not None:
        code = frame.f_code
        what = _SETTERS.get(code)
        if what is not None:
            return what
        if code is _GRAD_CODE:
            # (retain_grad keeps every gradient on the way, the outputs'
            # of the method's nodes and of an argument's creator: read by
            # the caller, as set_grad's are.)
            local = frame.f_locals
            for flag in ('set_grad', 'retain_grad'):
                if local.get(flag):
                    return 'chainer.grad(..., %s=True)' % flag
            return None
        frame = frame.f_back
    return None


_orig_grad_var = variable_module.Variable.__dict__['grad_var']
_orig_cleargrad = variable_module.Variable.cleargrad
_orig_zerograd = variable_module.Variable.zerograd
_orig_set_grad = variable_module.Variable._set_grad
_patched_variable = {
    '_get_array': _patched_get_array, '_get_grad': _patched_get_grad,
    'grad_var': property(
        _grad_var_getter(_orig_grad_var.fget),
        arguments.gradient_accessor(_orig_grad_var.fset, '.grad_var =',
                                    _user_caller),
        doc=_orig_grad_var.__doc__),
    'cleargrad': arguments.gradient_accessor(_orig_cleargrad, '.cleargrad()',
                                           _user_caller),
    'zerograd': arguments.gradient_accessor(_orig_zerograd, '.zerograd()',
                                          _user_caller),
    '_set_grad': arguments.gradient_accessor(_orig_set_grad, '.grad =',
                                           _user_caller)}
_orig_variable = {
    '_get_array': _orig_get_array, '_get_grad': _orig_get_grad,
    'grad_var': _orig_grad_var, 'cleargrad': _orig_cleargrad,
    'zerograd': _orig_zerograd, '_set_grad': _orig_set_grad}
# A backward inside the method (arguments.onto_caller).
_wrapped_backward, _orig_backward, _backward_spaces = \
    arguments.backward_wrappers(variable_module.Variable, _backprop_module,
                                function_node)
_patched_variable.update(_wrapped_backward)
_orig_variable.update(_orig_backward)
_wrapped, _unwrapped = arguments.graph_accessors(variable_module.Variable,
                                                 _user_caller)
_patched_variable.update(_wrapped)
_orig_variable.update(_unwrapped)


def _keeps_traced(name):
    orig = _orig_numpy[name]
    TracedArray = traced.TracedArray

    def constructor(a, *args, **kwargs):
        out = orig(a, *args, **kwargs)
        if type(a) is held_views.HeldArray:
            a._used()      # (its backward runs again at every replay)
            return out
        if type(a) is key_constants.KeyConstant and \
                type(out) is numpy.ndarray:
            rec = getattr(_local, 'recording', None)
            return out if rec is None else key_constants.constant(rec, out)
        if type(a) is not TracedArray or type(out) is not numpy.ndarray:
            if type(a) in (list, tuple) and type(out) is numpy.ndarray and \
                    traced.holds_traced(a):
                # numpy.asarray(list(h.array)): a copy of traced values
                return _copied_from_list(name, orig, a, args, kwargs, out)
            return out
        rec = getattr(_local, 'recording', None)
        if rec is None:
            return out
        if numpy.shares_memory(out, traced.plain(a)):
            # A view: traced, and known to be one (a Chainer function
            # taking it sees the recorded buffer behind it).
            return rec.trace(out)
        # A copy (numpy.asarray(x, dtype=numpy.float32)): an op of the
        # recording where it may be one (numpy_calls), else computed from
        # the values.
        made = numpy_calls.compute(rec, orig, 'numpy.' + name,
                                   (a,) + args, kwargs, out)
        return made if made is not None else out.view(TracedArray)

    constructor.__name__ = name
    constructor.__doc__ = orig.__doc__
    return constructor


def _checks_values(name):
    orig = _orig_numpy[name]

    def checked(a, *args, **kwargs):
        if type(a) is held_views.HeldArray:
            a._used()
        elif type(a) is traced.TracedArray:
            traced.flag('numpy.%s(), which checks them' % name)
        return orig(a, *args, **kwargs)

    checked.__name__ = name
    checked.__doc__ = orig.__doc__
    return checked


def _copied_from_list(name, orig, a, args, kwargs, out):
    """``out``, an array NumPy made from a list holding traced arrays: an
    op of the recording where it may be one (a list of arrays, one level),
    else a value read."""
    rec = getattr(_local, 'recording', None)
    if rec is None:
        return out
    made = numpy_calls.compute(rec, orig, 'numpy.' + name, (a,) + args,
                               kwargs, out)
    if made is not None:
        return made
    traced.flag('numpy.%s() of a list holding them' % name)
    return out


_patched_numpy = dict((name, _keeps_traced(name))
                      for name in _NUMPY_CONSTRUCTORS)
_patched_numpy.update((name, _checks_values(name))
                      for name in _NUMPY_CHECKS)


# numpy.arange, numpy.eye, numpy.zeros and the like: a result made by user
# code from Python values alone is a constant of the key, handed to it as
# a KeyConstant (device_reads has CuPy's).
for _name in device_reads.SHAPE_MAKERS + (
        'zeros', 'ones', 'empty', 'full', 'triu_indices', 'tril_indices',
        'diag_indices'):
    _orig_numpy[_name] = getattr(numpy, _name)
    _patched_numpy[_name] = key_constants.maker(_orig_numpy[_name],
                                                device_reads.numbers_only)
_orig_numpy.update(number_makers.ORIGINAL)      # (mgrid, hanning, ...)
_patched_numpy.update(number_makers.PATCHED)


def _patched_report(self, values, observer=None):
    rec = getattr(_local, 'recording', None)
    if rec is not None and not rec.depth and rec.phase == 'forward':
        items = rec.on_report(values, observer)
        # Which arrays replay will rewrite in place is known only once the
        # backward is recorded: report copies (not of what the chain
        # holds, which define-by-run's reporter keeps as is); under
        # keep_graph_on_report, Variables as they are, with their graph.
        keep = chainer.config.keep_graph_on_report
        values = dict((k, reports.recording_value(rec, values[k], code, keep))
                      for k, code in items)
    return _orig_report(self, values, observer)


def _patched_module_report(values, observer=None):
    """``chainer.report`` while no reporter is current does nothing; a
    recording notes it anyway, so that its replays report where a reporter
    is current by then (a warm-up step before the Trainer's loop)."""
    rec = getattr(_local, 'recording', None)
    if rec is not None and not rec.depth and rec.phase == 'forward' and \
            not reporter_module._get_reporters():
        rec.on_report(values, observer)
        return
    return _orig_module_report(values, observer)


def _patched_backprop_step(func, target_input_indexes, grad_outputs,
                           grad_inputs, is_debug):
    rec = getattr(_local, 'recording', None)
    if rec is None or rec.depth or rec.phase != 'backward':
        if rec is not None and not rec.depth and rec.phase == 'forward':
            what = _setting_backward(sys._getframe(1))
            if what is not None:
                # It sets gradients (the parameters', an argument's) that
                # replay would neither compute nor set.
                rec.add_reason('it runs a backward inside the method (%s) '
                               'at %s; replay would not set the gradients '
                               'it sets' % (what, traced.user_location(2)))
        return _orig_backprop_step(func, target_input_indexes, grad_outputs,
                                   grad_inputs, is_debug)
    # Ops this step applies are labelled with the forward op's source.
    label = rec.labels.get(id(func), MISSING)
    rec.backward_label = label if label is not MISSING else \
        'backward of %s' % op_kind(func)
    # See what the node's backward() returns (backprop_step only files it
    # into grad_inputs): wrap it on the instance for this one step.
    start = len(rec.backward_ops)
    returned = []
    d = func.__dict__
    had = d.get('backward', MISSING)
    bound = func.backward

    def backward(indexes, gys):
        gxs = bound(indexes, gys)
        # Ops after this (the sums of gradients backprop_step makes) are
        # not the node's.
        returned.append((gxs, len(rec.backward_ops)))
        return gxs

    d['backward'] = backward
    from static_graph import user_nodes
    held = user_nodes.held_arrays(rec, func)
    if held:
        rec.reading_held = func
    try:
        _orig_backprop_step(func, target_input_indexes, grad_outputs,
                            grad_inputs, is_debug)
    finally:
        rec.reading_held = None
        if had is MISSING:
            d.pop('backward', None)
        else:
            d['backward'] = had
        for attrs, k, a in held:
            attrs[k] = a
    rec.on_backward_step(func, target_input_indexes, grad_outputs, returned,
                         start)


# What install() puts in place, as (namespace dict, {name: patched}, {name:
# original}): one dict update per namespace each way (the 67 global
# generator functions alone took ~30 us as setattr calls, cache cold).
_PATCHES = (
    (variable_module.Variable, _patched_variable, _orig_variable),
    (variable_module.VariableNode,) + arguments.graph_accessors(
        variable_module.VariableNode, _user_caller),
    (reporter_module.Reporter, {'report': _patched_report},
     {'report': _orig_report}),
    (reporter_module.__dict__, {'report': _patched_module_report},
     {'report': _orig_module_report}),
    (chainer.__dict__, {'report': _patched_module_report},
     {'report': _orig_module_report}),
    (_backprop_utils.__dict__, {'backprop_step': _patched_backprop_step},
     {'backprop_step': _orig_backprop_step}),
    (numpy.__dict__, _patched_numpy, _orig_numpy),
) + tuple(_backward_spaces) + tuple(
    (module.__dict__,
     dict((n, fn) for (m, n), fn in rng_patches.PATCHED.items()
          if m == name),
     dict((n, fn) for (m, n), fn in rng_patches.ORIGINAL.items()
          if m == name))
    for name, module in rng_patches.MODULES.items())
for _module, _name, _label in numpy_calls.PURE:
    _orig_fn = getattr(sys.modules[_module], _name)
    _PATCHES += ((sys.modules[_module].__dict__,
                  {_name: numpy_calls.pure_function(_orig_fn, _label)},
                  {_name: _orig_fn}),)
# id(an original function the patches stand in for) -> (it, its patched
# function): a global generator's methods, NumPy's constructors and
# ON_ARRAYS' functions, for a name bound to one before the patches went
# in (``from numpy.random import rand``, ``self.draw = random.random``,
# ``_asarray = numpy.asarray``, ``fn = F.sign`` in a closure): early_bound
# puts the patched function there while a call records. (Modules hold
# those functions: their ids stay theirs.)
_patched_by_id = dict((id(fn), (fn, rng_patches.PATCHED[key]))
                      for key, fn in rng_patches.ORIGINAL.items())
_patched_by_id.update((id(fn), (fn, _patched_numpy[name]))
                      for name, fn in _orig_numpy.items())
for _module, _name, _label in numpy_calls.ON_ARRAYS:
    # (Where Chainer defines it, and as chainer.functions has it: F.sign.)
    _orig_fn = getattr(sys.modules[_module], _name)
    _patched_by_id[id(_orig_fn)] = (
        _orig_fn, numpy_calls.array_function(_orig_fn, _label))
    for _space in (sys.modules[_module].__dict__, F.__dict__):
        if _space.get(_name) is _orig_fn:
            _PATCHES += ((_space,
                          {_name: _patched_by_id[id(_orig_fn)][1]},
                          {_name: _orig_fn}),)
del _module, _name, _label, _orig_fn, _space
for _cupy_patch in (device_reads.patches(MISSING),   # CuPy (GPU) only
                    device_reads.constant_patches()):
    if _cupy_patch is not None:
        _PATCHES += (_cupy_patch,)


def patched_for(v):
    """The patched function standing for ``v`` where ``v`` is one the
    patches replace (see _patched_by_id), else None."""
    hit = _patched_by_id.get(id(v))
    return hit[1] if hit is not None and hit[0] is v else None


_PATCHES += ((chainer.Variable,
               dict((k, numpy_calls.scalar_arithmetic(
                   chainer.Variable.__dict__[k], k))
                    for k in numpy_calls.SCALAR_PATHS),
               dict((k, chainer.Variable.__dict__[k])
                    for k in numpy_calls.SCALAR_PATHS)),)
_orig_walker = walker_alias.WalkerAlias.__dict__['sample_xp']
_PATCHES += ((walker_alias.WalkerAlias,
              {'sample_xp': numpy_calls.walker_sample(_orig_walker)},
              {'sample_xp': _orig_walker}),)


# FunctionNode.apply's wrapper, once installed, stays (``_put`` never puts
# the original back): writing to FunctionNode's class makes Python drop the
# cached attribute lookups of every subclass (some hundreds), and looking
# them up again cost a recording call about as much as the rest of its
# install and uninstall together (about 1 ms of a 12 ms recording of the
# MLP at batch 1: benchmarks/recording.py). With no recording current in
# its thread, the wrapper passes the call straight through: one call and
# one thread-local read, about 0.3 us against an application's 10-30 us.
# Code that put Chainer's own back (a mock.patch around it) gets it again
# at the next install.


def _put(which):
    global _communicator
    fn = function_node.FunctionNode
    if which and fn.apply is not _patched_apply:
        fn.apply = _patched_apply
    if which and not _communicator:
        # ChainerMN imported since: its communicator's methods, wrapped for
        # good, as apply's (a recording watches the classes it reaches;
        # communicator_calls)
        _communicator = communicator_calls.install()
    for where, patched, orig in _PATCHES:
        pairs = patched if which else orig
        if isinstance(where, dict):
            where.update(pairs)
        else:           # a class: its __dict__ is read-only
            for name, fn in pairs.items():
                if fn is MISSING:   # inherited: the patch goes again
                    delattr(where, name)
                else:
                    setattr(where, name, fn)


_communicator = False


def install():
    global _install_count
    with _install_lock:
        if _install_count == 0:
            _put(True)
        _install_count += 1


def uninstall():
    global _install_count
    with _install_lock:
        _install_count -= 1
        if _install_count == 0:
            _put(False)


class Hold(object):
    """The wrappers held installed from a recording's forward to the end
    of its recorded backward (``release``, once; again does nothing):
    one install for both passes instead of one each. Calls in between go
    through the wrappers, which record only while a recording is current. One
    hold at most: a new one lets the last go (a recording's passes each
    install the wrappers anyway; the hold only spares the writes), so
    outputs kept without a backward keep none for long."""

    _last = None

    def __init__(self):
        install()
        self.held = True
        with _install_lock:
            last, Hold._last = Hold._last, self
        if last is not None:
            last.release()

    def release(self):
        with _install_lock:
            held, self.held = self.held, False
        if held:
            uninstall()


orig_apply = _orig_apply


def begin(rec):
    """``rec`` records this thread's events from now on."""
    install()
    _local.recording = rec


def end():
    _local.recording = None
    uninstall()
