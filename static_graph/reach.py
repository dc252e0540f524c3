"""What a decorated method reaches by name: the user functions its call
can run (a helper function or method, a child link's ``forward``), the
module globals they name, the user classes among the links' classes.
Found from the names the code mentions, not by running it
(link_values.Watch watches what they hold)."""
import dis
import functools
import os
import sys
import sysconfig
import types
import weakref

from static_graph import traced

_ModuleType = types.ModuleType


def code_names(code, out=None):
    """The names ``code`` (and the functions and comprehensions inside it)
    looks up as globals or attributes."""
    out = set() if out is None else out
    out.update(code.co_names)
    for c in code.co_consts:
        if hasattr(c, 'co_names'):
            code_names(c, out)
    return out


# Instructions that look a name up in (or write it to) the globals.
_GLOBAL_OPS = frozenset(('LOAD_GLOBAL', 'LOAD_NAME', 'STORE_GLOBAL',
                         'DELETE_GLOBAL'))


def loaded_globals(code, out=None):
    """The names ``code`` (and the functions and comprehensions inside it)
    looks up as globals, not as attributes: ``self.l`` does not name a
    module's ``l``."""
    out = set() if out is None else out
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            out.add(ins.argval)
    for c in code.co_consts:
        if hasattr(c, 'co_names'):
            loaded_globals(c, out)
    return out


_names_of = {}   # (code object, globals only?) -> sorted names


def global_names(method, only_globals=False):
    """code_names of ``method``'s code, sorted (remembered per code); with
    ``only_globals``, its loaded_globals."""
    code = getattr(method, '__code__', None)
    if code is None:
        return ()
    names = _names_of.get((code, only_globals))
    if names is None:
        names = _names_of[code, only_globals] = tuple(sorted(
            loaded_globals(code) if only_globals else code_names(code)))
    return names


def _module(cls):
    """``cls.__module__`` where a string, else '' (a descriptor on Cython
    3's fused function types, sklearn's: libs31 hunt, an AttributeError
    in the recording)."""
    module = getattr(cls, '__module__', None)
    return module if type(module) is str else ''


def user_classes(classes):
    """The classes in the MROs of ``classes`` defined outside Chainer,
    once each."""
    seen, out = set(), []
    for c in classes:
        for cls in c.__mro__:
            module = _module(cls)
            if cls in seen or cls is object or module == 'chainer' or \
                    module.startswith('chainer.'):
                continue
            seen.add(cls)
            out.append(cls)
    return out


_MAX_FUNCTIONS = 64
# Python's own library (where installed packages are not inside it).
_STDLIB = tuple(set(os.path.join(sysconfig.get_paths()[k], '')
                    for k in ('stdlib', 'platstdlib')))


def _library_file(filename):
    if filename.startswith(traced.INTERNAL_DIRS):
        return True
    return filename.startswith(_STDLIB) and \
        'site-packages' not in filename and 'dist-packages' not in filename


_LRU_WRAPPER = type(functools.lru_cache()(lambda: None))


def _user_function(v):
    """``v`` as a plain Python function of user code (not Chainer's,
    NumPy's, CuPy's, Python's own library's or this package's: a static
    method's or class method's too), or None."""
    if isinstance(v, (staticmethod, classmethod)):
        v = v.__func__
    if type(v) is _LRU_WRAPPER:      # (functools.lru_cache, cache)
        v = getattr(v, '__wrapped__', None)
    for _ in range(4):
        if type(v) is not types.FunctionType:
            return None
        if not _library_file(v.__code__.co_filename):
            return v
        # A library's wrapper made with functools.wraps (this package's
        # own: a decorated child link's forward, a decorated parent
        # method called through super()) runs the function it wraps.
        v = getattr(v, '__wrapped__', None)
    return None


# class -> is it defined in user code? (Weak: a class made per call, in a
# factory, is not kept alive by this.)
_user_class_memo = weakref.WeakKeyDictionary()


def user_class(cls):
    """Is ``cls`` defined outside Chainer, NumPy, CuPy, this package and
    Python's own library (in a script, a notebook, an installed package)?"""
    known = _user_class_memo.get(cls)
    if known is None:
        name = _module(cls) or 'builtins'
        module = sys.modules.get(name)
        filename = getattr(module, '__file__', None)
        if filename is None:    # interactive __main__; builtins
            known = name not in ('builtins', 'sys')
        else:
            known = not _library_file(filename)
        _user_class_memo[cls] = known
    return known


def held_functions(links, classes=None):
    """The user functions the ``links`` hold as attributes of their own (an
    activation handed to ``__init__``, ``self.act = my_act``; a lambda, a
    ``functools.partial``'s function, a bound method, a callable object's
    ``__call__``, the functions of a list such as ``Sequential``'s
    layers): the call may run them, though its code names only the
    attribute, or not even that (``getattr(self, 'act%d' % i)``). All of
    them: one held but never called by the call (a schedule the training
    loop calls) is watched too, and makes calls record again where it
    reads a global the loop changes (docs/faithfulness.md). Also in a dict
    (``self.acts['relu']``). A class held so (``self.node_cls = Scale``)
    goes to ``classes`` (reachable_functions keeps those of the project's
    own code, as it does classes named as globals)."""
    out, seen = [], set()
    for link in links:
        for k, v in vars(link).items():
            if type(v) in weakref.ProxyTypes:
                continue      # (a dead proxy, or a link's: the watch's)
            if isinstance(v, dict):
                v = list(v.values())
            if isinstance(v, (list, tuple)):
                for x in v[:_MAX_FUNCTIONS]:
                    _add_held(x, out, seen, classes)
            else:
                _add_held(v, out, seen, classes)
    return out


def _add_held(v, out, seen, classes):
    if type(v) in weakref.ProxyTypes:
        return      # (dead, or a link's: the watch's)
    if isinstance(v, type):
        if classes is not None:
            classes.append(v)
        return
    f = _user_function(_called(v))
    if f is not None and f.__code__ not in seen:
        seen.add(f.__code__)
        out.append(f)


def _called(v):
    """What a call of ``v`` runs: a partial's function, a bound method's,
    a callable object's ``__call__`` (one of a user class's, found through
    the classes' dicts: a metaclass ``__getattr__`` may raise), else ``v``
    itself (not a class: the caller's)."""
    while isinstance(v, functools.partial):
        v = v.func
    if isinstance(v, types.MethodType):
        return v.__func__
    if not isinstance(v, types.FunctionType) and callable(v) and \
            not isinstance(v, type) and user_class(type(v)):
        return next((c.__dict__['__call__'] for c in type(v).__mro__
                     if '__call__' in c.__dict__), None)
    return v


def _project_class(cls):
    """A user class defined in the project's own code (a script, a
    notebook, a module of its own), not in an installed package."""
    if not user_class(cls):
        return False
    module = sys.modules.get(_module(cls))
    filename = getattr(module, '__file__', None) or ''
    return 'site-packages' not in filename and \
        'dist-packages' not in filename


def project_module(m):
    """Is module ``m`` one of the project's own (a settings module, a
    module of helpers: not Python's library, not an installed package,
    not Chainer, NumPy, CuPy or this package)?"""
    if type(m) is not _ModuleType:
        return False
    filename = getattr(m, '__file__', None)
    return type(filename) is str and not _library_file(filename) and \
        'site-packages' not in filename and 'dist-packages' not in filename


def named_modules(fn):
    """The project's own modules ``fn`` names as globals (``import
    settings`` then ``settings.scale``)."""
    glob = fn.__globals__
    return [glob[k] for k in global_names(fn, only_globals=True)
            if project_module(glob.get(k))]


def reachable_functions(method, classes=(), named_only=(), links=(),
                        classes_out=None):
    """``method`` and the user functions its call can reach by name, at
    most ``_MAX_FUNCTIONS``: functions its code names as globals, methods
    of the user classes among ``classes`` (the links' classes) its code
    names as attributes (``self.helper(h)``), those classes' own
    ``forward`` and ``__call__`` (a child link's), and so on from each.
    Found by the names the code mentions, not by running it: a function
    named on a branch not taken counts too. The methods of ``named_only``
    (the classes of links held other than as children) count only where
    the code names them. The functions ``links`` hold come first, after
    ``method`` (``held_functions``); last, the methods of the classes of
    the project's own code the functions name as globals (a FunctionNode
    of one's own: ``Scale().apply(...)``), each appended to
    ``classes_out`` (its class attributes are watched as the links'
    classes' are)."""
    user = user_classes(classes)
    held_classes = []
    todo = [method] + held_functions(links, held_classes)
    for cls in user:
        for k in IMPLICIT:
            todo.extend(_user_function(f)
                        for f in _functions_of(cls.__dict__.get(k)))
    user = user + [c for c in user_classes(named_only) if c not in user]
    seen, out, named = set(), [], []
    for v in held_classes:
        _name_class(v, classes_out, named)
    methods_added = False
    i = 0
    while len(out) < _MAX_FUNCTIONS:
        if i == len(todo):
            if methods_added or not named:
                break
            methods_added = True      # (last: the named classes' methods)
            for c in named:
                for v in c.__dict__.values():
                    if isinstance(v, property):
                        v = v.fget
                    todo.append(_user_function(v))
            continue
        fn = todo[i]
        i += 1
        code = getattr(fn, '__code__', None)
        if code is None or code in seen or \
                getattr(fn, '__globals__', None) is None:
            continue
        seen.add(code)
        out.append(fn)
        glob = fn.__globals__
        # (What a decorator's wrapper calls: the function in its closure.)
        found = [_cell_value(c) for c in fn.__closure__ or ()]
        modules = named_modules(fn)
        for name in global_names(fn):
            found.append(glob.get(name))
            found.extend(cls.__dict__.get(name) for cls in user)
            found.extend(m.__dict__.get(name) for m in modules)
        for v in found:
            if isinstance(v, type):
                _name_class(v, classes_out, named)
                continue
            for f in _functions_of(v):
                f = _user_function(f)
                if f is not None and f.__code__ not in seen:
                    todo.append(f)
    return out


def _name_class(cls, classes_out, named):
    """A class the call may use (named as a global, held by a link): one of
    the project's own code goes to ``classes_out`` (its class attributes
    are watched) and its MRO's project classes to ``named`` (their
    methods are reached last)."""
    if classes_out is not None and cls not in classes_out and \
            _project_class(cls):
        classes_out.append(cls)
        named.extend(c for c in user_classes((cls,))
                     if _project_class(c) and c not in named)


# What a link's class runs without its name in the code: a child link's
# call, and attribute access (``self.scale`` computed by ``__getattr__``).
IMPLICIT = ('forward', '__call__', '__getattr__', '__getattribute__',
            '__setattr__')


def _functions_of(v):
    """The functions behind a name: a property's getter and setter (``self
    .gain``), a ``partialmethod``'s function, a descriptor's ``__get__``
    (an object of a user class on a class), the functions a dict, list or
    tuple holds (a registry, ``ACTS['swish'](h)``), else the value
    itself."""
    if type(v) in weakref.ProxyTypes:
        return ()      # (dead or not: a link's, the watch's)
    if isinstance(v, property):
        return (v.fget, v.fset)
    if isinstance(v, functools.partialmethod):
        return (v.func,)
    if isinstance(v, functools.singledispatchmethod):
        return tuple(v.dispatcher.registry.values())
    if isinstance(v, (dict, list, tuple)):
        out = []
        _registry(v, out, 2)
        return out
    try:
        get = getattr(type(v), '__get__', None)
    except Exception:      # (a metaclass whose __getattr__ raises)
        return (v,)
    if get is not None and type(get) is types.FunctionType:
        # (A plain function's __get__ is no Python's.) A decorator object
        # runs the function it holds, too.
        out = [v, get]
        try:
            fields = object.__getattribute__(v, '__dict__')
        except Exception:      # (__slots__, or a class that refuses it)
            fields = None
        if type(fields) is dict:
            _registry(list(fields.values()), out, 1)
        return out
    return (v,)


def _registry(v, out, depth):
    """The functions a dict, list or tuple holds (``depth`` levels deep:
    ``ACTS['conv']['act']``, ``(('relu', fn), ...)``), through partials,
    bound methods and callable objects' ``__call__``."""
    items = v.values() if isinstance(v, dict) else v
    for x in list(items)[:_MAX_FUNCTIONS]:
        if type(x) in weakref.ProxyTypes:
            continue
        if isinstance(x, (dict, list, tuple)):
            if depth > 1:
                _registry(x, out, depth - 1)
            continue
        x = _called(x)
        if type(x) is types.FunctionType:
            out.append(x)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:      # an empty cell
        return None


def named_globals(functions):
    """(globals dict, name) for the module globals ``functions`` name
    (modules left out: F, numpy are never rebound in practice), once
    each."""
    seen, out = set(), []
    for fn in functions:
        glob = fn.__globals__
        for k in global_names(fn, only_globals=True):
            if k not in glob or (id(glob), k) in seen or \
                    type(glob[k]) is _ModuleType:
                continue   # a builtin, an attribute name, a module
            seen.add((id(glob), k))
            out.append((glob, k))
    return out
