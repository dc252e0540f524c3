"""The global random generators' module functions as the recorder patches
them (patches.py installs them while a call records): numpy.random's and
Python's random module's functions that are methods of the module's global
generator (``numpy.random.rand``, ``random.random``). A draw from user code
between Chainer functions (a mixup coefficient, a random augmentation) is
not repeated by replay: an array drawn from NumPy's is an op of the
recording (numpy_calls.draw); any other, or a reseeding, a reason to fall
back."""
import random
import sys

import numpy

from static_graph import numpy_calls
from static_graph import traced


def _global_rng_functions(module, instance, skip):
    """The module-level functions of ``module`` that are methods of its
    global generator ``instance`` (numpy.random.rand, random.random...)."""
    return dict((name, fn) for name, fn in vars(module).items()
                if getattr(fn, '__self__', None) is instance and
                not name.startswith('_') and name not in skip)


_SETS_STATE = frozenset(('seed', 'set_state', 'setstate'))


def _flag_draw(module_name, name):
    orig = ORIGINAL[module_name, name]
    as_op = module_name == 'numpy.random' and \
        name not in numpy_calls.NOT_DRAWS

    def draw(*args, **kwargs):
        rec = traced.active_recording()
        if rec is None or rec.depth:
            return orig(*args, **kwargs)
        caller = sys._getframe(1).f_code.co_filename
        user = not caller.startswith(traced.INTERNAL_DIRS)
        if as_op and numpy_calls.recordable(rec) and (
                user or caller.startswith(numpy_calls.DRAWING_DIRS)):
            # An array drawn between Chainer functions: an op of the
            # recording, drawn again at replay (numpy_calls).
            made = numpy_calls.draw(rec, orig, module_name, name, args,
                                    kwargs)
            if made is not None:
                return made
        if user and name in _SETS_STATE:
            rec.add_reason(
                'user code sets the state of the global generator (%s.%s) '
                'at %s; replay would not' % (module_name, name,
                                             traced.user_location(2)))
        elif user:
            rec.add_reason(
                'user code draws random numbers (%s.%s) at %s; replay '
                'would freeze them (use Chainer functions such as '
                'F.dropout or F.gaussian, or pass them in as arguments)'
                % (module_name, name, traced.user_location(2)))
        return orig(*args, **kwargs)

    draw.__name__ = name
    draw.__doc__ = orig.__doc__
    return draw


# The global generators of numpy.random and of Python's random module, whose
# draws user code makes between Chainer functions (a mixup coefficient, a
# random augmentation): not repeated by replay. While recording, such a
# draw (or a reseeding) from user code is a reason to fall back.
MODULES = {'numpy.random': numpy.random, 'random': random}
ORIGINAL = {}
for _m, _inst, _skip in (
        ('numpy.random', numpy.random.mtrand._rand, ('get_state',)),
        ('random', random._inst, ('getstate',))):
    for _name, _fn in _global_rng_functions(
            MODULES[_m], _inst, _skip).items():
        ORIGINAL[_m, _name] = _fn
# numpy.random's functions of its global generator that NumPy defines as
# functions of their own, not as its methods (NumPy 1: seed, and sample
# and ranf, random_sample's other names; augment30 hunt: a reseeding, or
# a mask drawn with them, replayed frozen).
for _name in ('seed', 'sample', 'ranf'):
    if ('numpy.random', _name) not in ORIGINAL and \
            callable(getattr(numpy.random, _name, None)):
        ORIGINAL['numpy.random', _name] = getattr(numpy.random, _name)
del _m, _inst, _skip, _name, _fn
PATCHED = dict((key, _flag_draw(*key)) for key in ORIGINAL)
