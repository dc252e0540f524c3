"""What traced.py knows of NumPy's functions: which give a number, a
string, a shape or a dtype from the values of traced arrays, and which
write into an argument."""
import numpy


# NumPy functions whose result that is no array comes from the shapes
# and dtypes alone.
SHAPE_ONLY = frozenset(('ndim', 'size', 'shape', 'iscomplexobj',
                        'isrealobj', 'isfortran', 'result_type'))


def holds_values(result):
    """Does a NumPy function's ``result`` hold something other than arrays
    (in tuples and lists), None and dtypes: a number, a string
    (numpy.array2string), values read?"""
    if type(result) in (tuple, list):
        return any(holds_values(r) for r in result)
    return not (isinstance(result, numpy.ndarray) or result is None or
                isinstance(result, (numpy.dtype, type)))


# NumPy functions that write into their first argument (its keyword).
# numpy.linalg's functions that raise LinAlgError for some values (a matrix
# not positive definite, a singular one): whether a call raises follows
# the data, so one that did not at recording is no op replay can make (a
# method that catches the error takes the other branch define-by-run).
RAISES_BY_VALUES = frozenset(('cholesky', 'inv', 'solve', 'tensorinv',
                              'tensorsolve', 'matrix_power'))


def by_values(name, func, args):
    """What a call of NumPy's ``func`` on traced arrays reads of their
    values beyond its result's (a value read), or None: whether one of
    RAISES_BY_VALUES raises (``matrix_power`` only with a negative
    exponent, which inverts), or the dtype of ``real_if_close``'s and
    ``numpy.emath``'s results (complex where emath.sqrt meets a negative
    number)."""
    module = getattr(func, '__module__', '')
    if type(module) is not str:
        module = ''
    if name in RAISES_BY_VALUES and 'linalg' in module and not (
            name == 'matrix_power' and len(args) > 1 and
            isinstance(args[1], int) and args[1] >= 0):
        return ('numpy.linalg.%s() (whether it raises depends on the '
                'values)' % name)
    if name == 'real_if_close' or 'scimath' in module:
        return "numpy.%s() (its result's dtype depends on the values)" % name
    return None
INTO = {'copyto': 'dst', 'put': 'a', 'putmask': 'a', 'place': 'arr',
        'fill_diagonal': 'a', 'put_along_axis': 'arr'}


def onto_itself(a, key, value):
    """Is ``a[key] = value`` a copy of ``a``'s memory onto itself (a no-op:
    ChainerMN's batch normalization copies its running statistics back
    from the node that updated them in place, ``self.avg_mean[:] =
    func.running_mean``)?"""
    if not (isinstance(key, slice) and key == slice(None) or
            key is Ellipsis) or not isinstance(value, numpy.ndarray):
        return False
    return same_memory(a.view(numpy.ndarray), value.view(numpy.ndarray))


def same_memory(a, b):
    """Do NumPy arrays ``a`` and ``b`` show the very same memory (address,
    shape, strides, dtype)?"""
    return a.shape == b.shape and a.strides == b.strides and \
        a.dtype == b.dtype and a.__array_interface__['data'][0] == \
        b.__array_interface__['data'][0]


# NumPy functions whose result's shape depends on the values of some of
# their arguments: name -> (positions, keywords) of those arguments.
VALUE_SHAPED = {
    'nonzero': ((0,), ('a',)), 'argwhere': ((0,), ('a',)),
    'flatnonzero': ((0,), ('a',)), 'unique': ((0,), ('ar',)),
    'extract': ((0,), ('condition',)), 'compress': ((0,), ('condition',)),
    'bincount': ((0, 1), ('x', 'weights', 'minlength')),
    'trim_zeros': ((0,), ('filt',)),
    'setdiff1d': ((0, 1), ('ar1', 'ar2')),
    'intersect1d': ((0, 1), ('ar1', 'ar2')),
    'union1d': ((0, 1), ('ar1', 'ar2')),
    'setxor1d': ((0, 1), ('ar1', 'ar2')),
    'delete': ((1,), ('obj',)), 'insert': ((1,), ('obj',)),
    'repeat': ((1,), ('repeats',)),
    'split': ((1,), ('indices_or_sections',)),
    'array_split': ((1,), ('indices_or_sections',)),
    'tile': ((1,), ('reps',)), 'pad': ((1,), ('pad_width',)),
    'resize': ((1,), ('new_shape',)),
    'broadcast_to': ((1,), ('shape',)), 'reshape': ((1,), ('newshape',)),
}


def shape_from_values(name, args, kwargs, traced_type):
    """Does a call of NumPy function ``name`` give a result whose shape
    depends on the values of its ``traced_type`` arguments?"""
    if name == 'where':   # numpy.where(condition): numpy.nonzero
        return len(args) + len(kwargs) == 1
    if name in ('histogram', 'histogram_bin_edges'):
        # bins='auto' and the like: as many bins as the data asks for
        bins = args[1] if len(args) > 1 else kwargs.get('bins')
        return isinstance(bins, str) or isinstance(bins, traced_type)
    spec = VALUE_SHAPED.get(name)
    if spec is None:
        return False
    positions, keywords = spec
    return any(isinstance(args[i], traced_type) for i in positions
               if i < len(args)) or any(
        isinstance(kwargs.get(k), traced_type) for k in keywords)


class LayoutFlags(object):
    """An array's flags as user code reads them during a recording: the
    layout flags are the key's (``if not x.flags.c_contiguous``); a read
    of any other (``owndata``, ``writeable``) or a write is a reason,
    which ``flag(what)`` gives (traced.flag)."""
    _LAYOUT = frozenset((
        'c_contiguous', 'f_contiguous', 'contiguous', 'fortran', 'fnc',
        'forc', 'C_CONTIGUOUS', 'F_CONTIGUOUS', 'CONTIGUOUS', 'FORTRAN',
        'FNC', 'FORC', 'C', 'F'))

    def __init__(self, flags, flag):
        object.__setattr__(self, '_flags', flags)
        object.__setattr__(self, '_flag', flag)

    def __getattr__(self, name):
        if name not in self._LAYOUT:
            self._flag('.flags.%s' % name)
        return getattr(self._flags, name)

    def __getitem__(self, key):
        if key not in self._LAYOUT:
            self._flag('.flags[%r]' % (key,))
        return self._flags[key]

    def __setattr__(self, name, value):
        self._flag('.flags.%s set' % name)
        setattr(self._flags, name, value)

    def __setitem__(self, key, value):
        self._flag('.flags[%r] set' % (key,))
        self._flags[key] = value

    def __repr__(self):
        return repr(self._flags)
