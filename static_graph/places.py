"""Places the watch (link_values.Watch) reads as mappings of names to
values, besides dicts: a function's closure cells and default argument
values, the attribute names an object or class has, and whether a weak
reference still refers to its object. The closure and defaults take
writes too (generators.stand_ins, early_bound.stand_ins)."""
import weakref


class Closure(object):
    """A function's closure cells as a mapping (name -> contents)."""

    def __init__(self, names, cells):
        self.cells = dict(zip(names, cells))

    def get(self, k, default=None):
        try:
            return self.cells[k].cell_contents
        except (KeyError, ValueError):   # an empty cell
            return default

    def __setitem__(self, k, v):     # (generators.stand_ins)
        self.cells[k].cell_contents = v


class Defaults(object):
    """A function's default argument values as a mapping (name -> value),
    read from the function at each look (``f.__defaults__`` replaced
    too)."""

    def __init__(self, fn):
        self.fn = fn
        code = fn.__code__
        names = code.co_varnames[:code.co_argcount]
        self.at = dict((k, i - len(names)) for i, k in enumerate(names))
        self.keyword = code.co_varnames[
            code.co_argcount:code.co_argcount + code.co_kwonlyargcount]

    def get(self, k, default=None):
        if k in self.at:
            d = self.fn.__defaults__ or ()
            i = self.at[k]
            return d[i] if -i <= len(d) else default
        return (self.fn.__kwdefaults__ or {}).get(k, default)

    def names(self):
        d = self.fn.__defaults__ or ()
        return [k for k, i in self.at.items() if -i <= len(d)] + \
            sorted(self.fn.__kwdefaults__ or ())

    def __setitem__(self, k, v):     # (early_bound.stand_ins)
        if k in self.at:
            d = list(self.fn.__defaults__)
            d[self.at[k]] = v
            self.fn.__defaults__ = tuple(d)
        else:
            self.fn.__kwdefaults__[k] = v


class Names(object):
    """The attribute names a helper object has now, as a mapping's only
    value (whatever the key)."""

    def __init__(self, fields):
        self.fields = fields

    def get(self, k, default=None):
        return tuple(self.fields)


class ClassNames(Names):
    """How many attributes a class has now (one set on it that shadows a
    base class's adds one), but the one this package sets on a class
    itself (``_static_graph_type_info`` on a FunctionNode class at its
    first recording) and the one ``copy`` and ``pickle`` set on a class
    at its first copy (``__slotnames__``: ``copy.deepcopy(model)``). A
    count, not the names: looked at in every replay's check."""

    def get(self, k, default=None):
        d = self.fields
        return len(d) - (TYPE_INFO in d) - ('__slotnames__' in d)


# What recorder.py sets on a FunctionNode class (its kind, ...).
TYPE_INFO = '_static_graph_type_info'


class Alive(object):
    """Whether a ``weakref.ref`` or proxy still refers to its object, as
    a mapping's only value: the id of that object (of its ``__dict__``,
    for a proxy), or None once it is gone."""
    __slots__ = ('ref',)

    def __init__(self, ref):
        self.ref = ref

    def get(self, k, default=None):
        r = self.ref
        if type(r) is weakref.ref:
            target = r()
            return None if target is None else id(target)
        try:
            return id(r.__dict__)
        except (ReferenceError, AttributeError):
            return None


class Length(object):
    """The number of elements of a container watched by identity only (a
    list of more than MAX_ITEMS elements), as a mapping's only value: an
    element appended at every call is a change."""
    __slots__ = ('container',)

    def __init__(self, container):
        self.container = container

    def get(self, k, default=None):
        try:
            return len(self.container)
        except Exception:      # (a container that no longer tells)
            return None


class ClassAttributes(object):
    """A class's own attributes as a mapping that takes writes
    (generators.stand_ins puts a stand-in for a generator kept on the
    class, and puts it back)."""

    def __init__(self, cls):
        self.cls = cls

    def get(self, k, default=None):
        return self.cls.__dict__.get(k, default)

    def __setitem__(self, k, v):
        setattr(self.cls, k, v)
