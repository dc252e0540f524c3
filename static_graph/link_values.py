"""The Python values on a chain's links, and in the globals and closure
variables its method names, that a recording depends on.

A method reads its links' attributes as Python values: ``self.temperature``,
``self.act`` (a function), ``self.hp['scale']``, a convolution's ``pad``;
and module globals (``SCALE``, ``MASK``). The recording holds what they
were (a MulConstant's value, the function applied, a shape, an array taken
by reference), so replay is valid only while they still hold. The entry
keeps them, and ``Watch.holds`` compares before every replay:

* scalars (None, bool, numbers, strings, NumPy scalars and dtypes) by value;
* containers (tuple, list, dict, set, frozenset) by value, element by
  element, which sees a list or dict changed in place; a container of more
  than ``MAX_ITEMS`` elements in all (a vocabulary) by identity, and the
  identities of what it and the containers in it hold (places.Contents);
* anything else (a function, a global array) by identity: assigning
  another records again;
* a helper object (an instance of a class defined outside Chainer, NumPy
  and Python's own library, a ``SimpleNamespace``, an ``argparse``
  ``Namespace``: ``self.sched.t``, ``CFG.scale``) by identity and its
  attributes like the others, to ``HELPER_DEPTH`` levels and
  ``MAX_FIELDS`` attributes in all; one past those by identity only;
* the link hooks of the chain's child links (they run inside the call,
  ``link.add_hook``), Chainer's own too, as helper objects.

The links' arrays, Variables and child links are ``entry.link_structure``'s;
so are the names Chainer manages on every link (``_params``, ``_children``,
hooks). Globals and closure variables read by the user functions the
method reaches by name (a helper function or method, a child link's
forward: reach.py) are watched like its own, and those functions' default
argument values.
"""
import argparse
import itertools
import queue
import threading
import types
import weakref

import numpy

import chainer

from static_graph import arrayutil
from static_graph import places
from static_graph import reach
from static_graph.frozen_values import (
    SCALARS, CONTAINERS, _TOO_BIG, _equal, _holds, _numbers_inside,
    _same_kinds, freeze, is_container, variable_array)

HELPER_DEPTH = 3     # self.a.b.c: helper attributes watched to this depth
MAX_FIELDS = 256     # helper-object attributes watched in all
NAMESPACES = _NAMESPACES = (types.SimpleNamespace, argparse.Namespace)

# What Link, Chain and ChainList put in every link's __dict__, the link
# hooks and the device (a new Device object at every ``to_device``, even to
# the same device): checked by entry.link_structure (the parameters' arrays
# and devices, the child links) and entry.link_hooks.
MANAGED = frozenset(
    k for c in (chainer.Link(), chainer.Chain(), chainer.ChainList())
    for k, v in c.__dict__.items() if not isinstance(v, SCALARS)) | \
    frozenset(('_local_link_hooks', '_device', '_static_graph_caches'))


def size(d):
    """How many attributes a link's ``__dict__`` holds, not counting the
    library's caches (cache.HOLDER: a decorated method's first call puts
    them there)."""
    return len(d) - ('_static_graph_caches' in d)

_ModuleType = types.ModuleType


def structural(v):
    """Is ``v`` a link, a Variable or an array: an attribute value that
    ``entry.link_structure`` checks (by identity) rather than the watch?"""
    if type(v) in arrayutil.PROXIES:
        return False      # (the watch's: arrayutil.dead_proxy)
    return isinstance(v, chainer.Variable) or arrayutil.is_link(v) or \
        arrayutil.is_array(v)


# Classes of Chainer and of Python's own library whose objects a link may
# hold, and whose state the call may read or change: link hooks (they run
# inside the call), and, where the code the method reaches names the
# attribute that holds one (``_NAMED``: an optimizer kept on the chain and
# never read by the method changes at every update), function hooks
# (entered inside the method: a TimerHook's history), distributions (a
# learnable prior kept on the chain, whose cached properties the first
# call fills: ``Normal.scale``), an optimizer or its hyperparameters (a
# penalty warmed up by ``self.opt.t``, ``hp.lr``), an iterator
# (``epoch_detail``), an initializer called in the call, an event or a
# queue.
_NAMED = (chainer.FunctionHook, chainer.Distribution, chainer.Optimizer,
          chainer.optimizer.Hyperparameter, chainer.dataset.Iterator,
          chainer.Initializer, threading.Event, queue.Queue)
_CHAINER_HELPERS = (chainer.LinkHook,) + _NAMED


def code_names(functions):
    """The attribute, global, closure variable and argument names the code
    of ``functions`` mentions (their nested code too: lambdas,
    comprehensions)."""
    names, todo = set(), [fn.__code__ for fn in functions
                          if hasattr(fn, '__code__')]
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        names.update(code.co_freevars)
        names.update(code.co_varnames)
        for c in code.co_consts:
            if hasattr(c, 'co_names'):
                todo.append(c)
            elif type(c) is str:      # (getattr(self, 'opt'), d['opt'])
                names.add(c)
    return names


def helper_fields(v):
    """The attribute dict of helper object ``v`` (see the module), or None.
    Read without running the object's own code (``__getattr__``)."""
    if arrayutil.dead_proxy(v):
        return None
    if type(v) is weakref.ref:
        # (What it refers to, while that lives: its state is read through
        # it as through the object.)
        target = v()
        return None if target is None else helper_fields(target)
    proxy = type(v) in arrayutil.PROXIES
    if not proxy and isinstance(v, _NAMESPACES):
        return v.__dict__
    # (A proxy's ``__class__`` is its object's; ``isinstance`` sees it.)
    cls = v.__class__ if proxy else type(v)
    if isinstance(v, (type, _ModuleType, chainer.Variable)) or \
            arrayutil.is_link(v) or not (
                reach.user_class(cls) or isinstance(v, _CHAINER_HELPERS)):
        return None
    try:
        if proxy:    # (its object's, where reading it runs none of its code)
            if cls.__getattribute__ is not object.__getattribute__:
                return None
            d = v.__dict__
        else:
            d = object.__getattribute__(v, '__dict__')
    except Exception:      # __slots__ only
        return None
    return d if type(d) is dict else None


def _kept(v):
    """Is ``v`` what a call keeps and replay assigns: an array or a
    Variable that is no Parameter?"""
    return variable_array(v) is not None or arrayutil.is_array(v)


def _held_helpers(c, depth):
    """(``[i]`` or ``['key']``, helper object) for the helper objects a
    list, tuple or dict holds, and those its containers hold, to ``depth``
    levels."""
    items = c.items() if isinstance(c, dict) else enumerate(c) \
        if isinstance(c, (list, tuple)) else ()
    for i, x in items:
        if arrayutil.dead_proxy(x):
            continue     # (the watch's by identity)
        if isinstance(x, CONTAINERS):
            if depth > 1:
                for at, y in _held_helpers(x, depth - 1):
                    yield '[%r]%s' % (i, at), y
        elif not isinstance(x, SCALARS) and helper_fields(x) is not None:
            yield '[%r]' % (i,), x


class Watch(object):
    """The values the recording saw on the links and in the globals the
    method names (see the module)."""

    def __init__(self, snapshot, functions=(), classes=(), root_hooks=False,
                 held=(), around=()):
        """``snapshot``: [(link __dict__, copy of it, path)] before the
        call; ``functions``: the undecorated method and the functions it
        reaches (``reachable_functions``: a helper function or method, a
        child link's forward), whose module globals and closure variables
        named in their code are watched too (``named_globals``: those
        globals, kept for generators.snapshot); ``classes``: the links'
        classes, whose scalar and container class attributes are too
        (those of Chainer's own classes excepted); ``root_hooks``: the
        chain's own link hooks run inside the call too (a decorated
        ``loss`` that calls ``self(x)``), not only its links'; ``held``:
        [(path, link)] of link_state.held_links, whose attributes are
        watched as a helper object's (a change the call makes is one
        replay would not repeat; their arrays, Variables and links are
        entry.link_structure's), with the names they hold (one added,
        shadowing a class attribute), their classes' attributes and their
        hooks (not of those in ``around``, ids of the __dicts__ of held
        links that hold the chain: an owner's hooks run around its
        forward, outside the call)."""
        self.pairs, self.values = [], []
        self.frozen = []     # (dict, name, frozen container, container)
        self.objects = []    # (dict, name, object): compared by identity
        # id(mapping) -> how a message names its keys (a link's path)
        self.prefix = {}
        pairs, values = self.pairs, self.values
        for d, before, path in snapshot:
            self.prefix[id(d)] = path
            for k, v in before.items():
                if type(v) in arrayutil.PROXIES:   # (dead or not)
                    self._add(d, k, v)
                elif isinstance(v, SCALARS):     # most: the hot loop
                    pairs.append((d, k))
                    values.append(v)
                elif k not in MANAGED and not structural(v):
                    self._add(d, k, v)
        self.n_link_pairs = len(self.pairs)
        self.n_link_frozen = len(self.frozen)
        self.n_link_objects = len(self.objects)
        for d, _, path in snapshot:
            hooks = d.get('_local_link_hooks')
            if hooks and (path != '/' or root_hooks):
                # A child link's hooks run inside the call (the decorated
                # chain's own run around its forward): watched as helper
                # objects, so their state set between calls (a scale)
                # records again, and one the call changes (a counter, a
                # timer's history, an activation kept) is a change replay
                # would not repeat.
                self._add_hooks(hooks, 'self%s link hook ' % (
                    path.rstrip('/').replace('/', '.')))
        # (Weakly: an owner may hold one weakly, and it may go.)
        self.held = [(path, weakref.ref(link)) for path, link in held]
        for path, link in held:
            d = link.__dict__
            self.prefix[id(d)] = path
            names = places.Names(d)
            self.prefix[id(names)] = ''
            self.pairs.append((names, 'the attribute names of self%s'
                               % path.rstrip('/').replace('/', '.')))
            self.values.append(tuple(d))
            for k, v in list(d.items()):
                if k not in MANAGED and (arrayutil.dead_proxy(v) or
                                         not structural(v)):
                    self._add(d, k, v)
            hooks = d.get('_local_link_hooks')
            if hooks and id(d) not in around:
                self._add_hooks(hooks, 'self%s link hook ' % (
                    path.rstrip('/').replace('/', '.')))
        # Global link hooks (``with hook:``) run in every link's call,
        # inside the call: their state as a helper object's.
        glob = chainer._get_link_hooks()
        if glob:
            self._add_hooks(glob, 'global link hook ')
        self.code_names = code_names(functions)
        self.classes_seen = set()
        self._add_class_attributes(
            list(classes) + [link.__class__ for _, link in held])
        self.named_globals = reach.named_globals(functions)
        for glob, k in self.named_globals:
            self._add(glob, k, glob[k])
        self._add_module_attributes(functions)
        # (closure or defaults, name): generators.snapshot and
        # early_bound.stand_ins
        self.named_closures = []
        for fn in functions:
            cells = fn.__closure__
            if cells:
                env = places.Closure(fn.__code__.co_freevars, cells)
                self.prefix[id(env)] = 'closure variable '
                for k in fn.__code__.co_freevars:
                    v = env.get(k, _TOO_BIG)
                    if v is not _TOO_BIG and type(v) is not _ModuleType:
                        self._add(env, k, v)
                        self.named_closures.append((env, k))
            if getattr(fn, '__defaults__', None) or \
                    getattr(fn, '__kwdefaults__', None):
                # (A mutable default the caller or the method changes.)
                env = places.Defaults(fn)
                self.prefix[id(env)] = 'default argument '
                for k in env.names():
                    self._add(env, k, env.get(k))
                    self.named_closures.append((env, k))
        self._add_helper_fields()
        self.values = tuple(self.values)
        self._kinds()

    def trace_arrays(self, rec):
        """Hand the call the NumPy arrays of the watched globals, helper
        objects' attributes, lists and dicts (of any size) as traced views,
        as the links' own are (link_state.trace_held_arrays): a branch on
        their values (``if GATE > 0``, ``self.gates[0]``) is a value read,
        which replay would freeze. Returns what ``put_back_arrays`` puts
        back."""
        out = []
        for d, k, v in self.objects[self.n_link_objects:]:
            if type(d) is dict and type(v) is numpy.ndarray and d.get(k) is v:
                view = d[k] = rec.trace(v)
                out.append((d, k, v, view))
        # (No copy to compare after the call, for a big bank: writes
        # through the views are seen, Recording.is_recorded.)
        for c, k, v in places.array_slots(
                [c for _, _, _, c in self.frozen] +
                [d.container for d, _ in self.pairs
                 if type(d) is places.Contents]):
            rec.container_held.add(id(v))
            view = c[k] = rec.trace(v, check=False)
            out.append((c, k, v, view))
        return out

    @staticmethod
    def put_back_arrays(traced_arrays):
        for d, k, v, view in traced_arrays:
            try:
                if d[k] is view:    # (not where the call assigned another)
                    d[k] = v
            except (IndexError, KeyError):     # (the call removed it)
                pass

    def _add_class_attributes(self, classes):
        """The scalar and container class attributes of the user classes
        in the MROs of ``classes``, once per class, and the others the
        code names, by identity (a method replaced on the class,
        ``Net.predict = other``; a descriptor object, watched as a helper
        object)."""
        names = self.code_names
        # (Their metaclasses' too, those of your own: ``type(self).scale``
        # defined on one; not Python's ``type`` and ``ABCMeta``.)
        metas = [m for m in reach.user_classes(
            [type(c) for c in classes if type(c) is not type])
            if m is not type and reach.user_class(m)]
        for cls in reach.user_classes(classes) + metas:
            if cls in self.classes_seen:
                continue
            self.classes_seen.add(cls)
            d = cls.__dict__
            self.prefix[id(d)] = 'class attribute %s.' % cls.__name__
            for k, v in d.items():
                if k in reach.IMPLICIT or not k.startswith('__') and (
                        k in names or isinstance(v, SCALARS + CONTAINERS)):
                    self._add(d, k, v)
            # (One set on it that shadows a base class's: ``Net.scale =
            # 2.0`` where only ``Base`` had one.)
            fields = places.ClassNames(d)
            self.prefix[id(fields)] = ''
            self.pairs.append((fields, 'the attribute names of class %s'
                               % cls.__name__))
            self.values.append(fields.get(None))

    def _add_module_attributes(self, functions):
        """The attributes the code names of the project's own modules it
        names (``settings.scale``, ``settings.NS.s``; ``proj.settings.scale``
        through a package, three modules deep), or that a link holds
        (``self.cfg = settings``), as globals are; ``modules``: them."""
        todo = [(m, 1) for fn in functions for m in reach.named_modules(fn)]
        todo += [(v, 1) for _, _, v in self.objects
                 if reach.project_module(v)]
        seen, out = set(), []
        while todo:
            m, depth = todo.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            out.append(m)
            d = m.__dict__
            self.prefix[id(d)] = 'module attribute %s.' % m.__name__
            for k in self.code_names:
                v = d.get(k, _TOO_BIG)
                if v is _TOO_BIG or k.startswith('__'):
                    continue
                if type(v) is not _ModuleType:
                    self._add(d, k, v)
                elif depth < 3 and reach.project_module(v):
                    self._add(d, k, v)
                    todo.append((v, depth + 1))
        self.modules = out

    def _add_hooks(self, hooks, prefix):
        """Watch link hooks ``hooks`` ({name: hook}) as helper objects,
        named with ``prefix``."""
        self.prefix[id(hooks)] = prefix
        for name, hook in list(hooks.items()):
            self._add(hooks, name, hook)

    def _kinds(self):
        """What ``holds`` compares beyond ``==``: the values' types (one
        C-level pass), and ``_same_kinds`` only where equal values can
        differ inside (a tuple holding numbers: 2.0 and 2; a zero's
        sign): strings and names need no second look."""
        self.value_types = tuple(map(type, self.values))
        self.deep = tuple(i for i, v in enumerate(self.values)
                          if _numbers_inside(v))

    def _add_helper_fields(self):
        """Watch the attributes of the helper objects watched so far (by
        identity), and of the helpers those hold, to HELPER_DEPTH levels
        and MAX_FIELDS attributes in all: ``self.sched.t`` changed by the
        training loop records again, and one the call itself changes
        (``self.counter.n += 1``) is a change replay would not repeat.
        After the links' own entries: changed_by_call counts these."""
        self.in_containers = set()   # ids of those helpers' attributes
        # [(their attributes, a copy, a name)]: what the call assigns
        # there, replay assigns too (link_state.attr_changes)
        self.helper_snapshot = []
        todo = [(self.name_of(d, k), v, 1, False, k)
                for d, k, v in self.objects]
        for d, k, _, c in self.frozen:
            # Helpers held in a list, tuple or dict (a Sequential's
            # callable-object layers, ``self.acts['scale']``, memnn's
            # memories): an array or Variable the call assigns there
            # (``memory.m = self.encoder(...)``) replay assigns too, as a
            # link attribute's (``helper_snapshot``, drop_call_outputs).
            todo.extend((self.name_of(d, k) + at, x, 1, True, k)
                        for at, x in _held_helpers(c, 2))
        seen = set()
        budget = MAX_FIELDS
        for name, v, depth, contained, k in todo:
            fields = helper_fields(v)
            if fields is None or id(v) in seen or len(fields) > budget or \
                    depth == 1 and isinstance(v, _NAMED) and \
                    k not in self.code_names:
                # (Held by a helper object, whose methods the method may
                # run without naming it: watched, named or not.)
                continue
            seen.add(id(v))
            budget -= len(fields) + 1
            self.prefix[id(fields)] = name + '.'
            # An attribute set later that was not there (one shadowing a
            # class default: ``self.n += 1`` with ``n = 0`` on the class).
            names = places.Names(fields)
            self.prefix[id(names)] = ''
            self.pairs.append((names, 'the attribute names of ' + name))
            self.values.append(names.get(None))
            self._add_class_attributes([type(v)])
            # (What the call assigns there, replay assigns too; a direct
            # helper's change makes the next call record again.)
            self.helper_snapshot.append((fields, dict(fields), name))
            if contained:
                self.in_containers.add(id(fields))
            for k, x in list(fields.items()):
                self._add(fields, k, x)
                if depth < HELPER_DEPTH and not isinstance(
                        x, SCALARS + CONTAINERS):
                    todo.append((name + '.' + k, x, depth + 1, contained,
                                 k))

    def containers(self):
        """(how a message names it, container) for the containers watched
        (a link's or helper object's attribute, a global, a closure
        variable, a class or module attribute)."""
        return [(self.name_of(d, k), c) for d, k, _, c in self.frozen
                if is_container(c)] + \
            [(self.name_of(d, k), v) for d, k, v in self.objects
             if is_container(v)]

    def name_of(self, d, k):
        """How a message names attribute or global ``k`` of ``d``."""
        prefix = self.prefix.get(id(d), 'global ')
        if prefix.startswith('/'):    # a link's path
            prefix = 'attribute self%s.' % prefix.rstrip('/').replace(
                '/', '.')
        return prefix + k

    def _add(self, d, k, v):
        if arrayutil.dead_proxy(v):
            self.objects.append((d, k, v))
            return
        if isinstance(v, SCALARS):
            self.pairs.append((d, k))
            self.values.append(v)
            return
        if type(v) is weakref.ref or type(v) in arrayutil.PROXIES:
            # (What it refers to may go while it stays: a link dropped,
            # which define-by-run's ``ref()`` no longer finds.)
            alive = places.Alive(v)
            self.prefix[id(alive)] = self.prefix.get(id(d), 'global ') + \
                k + ' '
            self.pairs.append((alive, 'refers to the same object'))
            self.values.append(alive.get(None))
        frozen = freeze(v) if isinstance(v, CONTAINERS) or \
            type(v) is itertools.count or \
            variable_array(v) is not None else None
        if frozen is None:
            self.objects.append((d, k, v))
            # (Too big to compare by value: the objects it and the
            # containers in it hold, so that an element added or replaced
            # in place shows: ``self.hist.append(h)``, ``self.c[i] = h``.)
            held = places.Contents(v) if is_container(v) else None
            if held is not None and held.watched():
                self.prefix[id(held)] = self.name_of(d, k) + ' '
                self.pairs.append((held, 'contents'))
                self.values.append(held)
        else:
            self.frozen.append((d, k, frozen, v))

    def drop_call_outputs(self):
        """After the recording call: the arrays and Variables it put on
        the helper objects a list or dict holds in place of others
        (memnn's ``memory.m = self.encoder(...)``) are no longer watched,
        so the next call, which finds them there, replays (and assigns its
        own there: ``helper_snapshot``). One the call put where there was
        none or None is watched: the next call records again."""
        gone = set()
        entries = [(d, k, v) for d, k, v in self.objects] + \
            [(d, k, c) for d, k, _, c in self.frozen] + \
            [(d, k, v) for (d, k), v in zip(self.pairs, self.values)]
        for d, k, then in entries:
            if id(d) not in self.in_containers:
                continue
            # (Not one that was None or another value: a branch on it;
            # not a link: replay assigns arrays and Variables only. Whether
            # it holds one is the key's: cache.kept.)
            now = d.get(k, _TOO_BIG)
            if now is not then and _kept(now) and _kept(then):
                gone.add((id(d), k))
        if gone:
            self.objects = [e for e in self.objects
                            if (id(e[0]), e[1]) not in gone]
            self.frozen = [e for e in self.frozen
                           if (id(e[0]), e[1]) not in gone]
            kept = [i for i, (d, k) in enumerate(self.pairs)
                    if (id(d), k) not in gone]
            self.pairs = [self.pairs[i] for i in kept]
            self.values = tuple(self.values[i] for i in kept)
            self._kinds()

    def changed_containers(self):
        """The watched containers (a link's, a helper object's, a
        global) whose contents the recorded call changed (a dict memo
        filled, a list appended to)."""
        return [v for d, k, frozen, v in self.frozen
                if d.get(k) is v and is_container(v) and
                not _holds(v, frozen)] + \
            [d.container for d in self._refilled(len(self.pairs))]

    def _refilled(self, upto):
        """The places.Contents of the first ``upto`` watched values (of
        containers too big to compare by value) whose contents changed."""
        return [d for (d, k), then in zip(self.pairs[:upto], self.values)
                if type(d) is places.Contents and
                d.get(k, None, True) is not then]

    def changed_by_call(self):
        """What the recorded call itself changed, which replay does not
        repeat: the contents of a container a link still holds (a memo
        filled, a list appended to), or any watched global, closure
        variable or helper-object attribute (assigning an attribute of a
        link is decorator._attr_changes')."""
        out = [self.name_of(d, k) for d, k, frozen, v in self.frozen[
            :self.n_link_frozen] if d.get(k) is v and not _holds(v, frozen)]
        out += [self.name_of(d, 'contents')
                for d in self._refilled(self.n_link_pairs)]
        return out + [self.name_of(d, k) for d, k in self._changed(
            self.n_link_pairs, self.n_link_frozen, self.n_link_objects)]

    def _changed(self, pairs_from=0, frozen_from=0, objects_from=0):
        """(dict, name) of the watched values that no longer hold."""
        out = []
        for d, k, v in self.objects[objects_from:]:
            if d.get(k, _TOO_BIG) is not v:
                out.append((d, k))
        for d, k, frozen, _ in self.frozen[frozen_from:]:
            if not _holds(d.get(k, _TOO_BIG), frozen):
                out.append((d, k))
        for (d, k), then in zip(self.pairs[pairs_from:],
                                self.values[pairs_from:]):
            now = d.get(k, None, True) if type(d) is places.Contents \
                else d.get(k)
            # (An array or Variable where a number or None was: changed,
            # without ``==``, whose bool() of a traced array is a read.)
            if now is not then and (_kept(now) or not _equal(now, then)):
                out.append((d, k))
        return out

    def first_change(self):
        """How a message names the first watched value that changed, or
        None."""
        changed = self._changed()
        return self.name_of(*changed[0]) if changed else None

    def holds(self):
        """Do the links and globals still hold the recorded values? (The
        hot path of every replay.)"""
        for d, k, v in self.objects:
            if d.get(k) is not v:
                return False
        for d, k, frozen, _ in self.frozen:
            if not _holds(d.get(k), frozen):
                return False
        now = tuple([d.get(k) for d, k in self.pairs])
        try:
            if now != self.values or \
                    tuple(map(type, now)) != self.value_types:
                return False
            then = self.values
            for i in self.deep:    # (tuples holding numbers, zeros)
                if not _same_kinds((now[i],), (then[i],)):
                    return False
            return True
        except Exception:
            # One now holds what cannot be compared with ==: a Variable
            # (whose == raises) or an array where None was recorded
            # (recurrent state: StatefulGRU's h). Not the recorded value.
            return all(v is w or type(v) is type(w) and v == w
                       for v, w in zip(now, self.values))
