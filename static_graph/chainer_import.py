"""Make Chainer 7.8.1 importable on Python 3.12+ and NumPy 2.

Chainer 7.8.1 was released for Python <= 3.11 and NumPy 1. Three things stop
``import chainer`` on a current machine, all in code that runs at import:

* ``chainer/_environment_check.py`` imports ``numpy.distutils`` (gone on
  Python 3.12 and in NumPy 2) to look for macOS's Accelerate BLAS;
* it imports ``pkg_resources`` (gone from recent setuptools) to compare the
  versions of optional packages (CuPy, iDeep);
* ``chainer/functions/array/as_strided.py`` reads ``numpy.sctypes`` (removed
  in NumPy 2), at import and in its backward.

``prepare()`` imports Chainer with stand-ins for exactly those, then removes
the stand-ins again: ``numpy.distutils`` and ``pkg_resources`` are not left
in ``sys.modules`` and ``numpy.sctypes`` is not left on NumPy (other code
tests for them to tell versions apart); ``as_strided`` gets a view of NumPy
that has ``sctypes``. Where Chainer imports as released (Python 3.11 and
NumPy 1) it does nothing but ``import chainer``.

``import static_graph`` calls it, so a script that imports ``static_graph``
before ``chainer`` runs unchanged on both. For scripts that import
``chainer`` first, ``python -m static_graph chainer-import --install`` adds a
``.pth`` file to the environment's site-packages that does the same at
interpreter start, only when something imports ``chainer``
(``--uninstall`` removes it).
"""
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

PTH_NAME = 'static_graph_chainer_import.pth'


def _sctypes():
    import numpy as n
    return {'int': [n.int8, n.int16, n.int32, n.int64],
            'uint': [n.uint8, n.uint16, n.uint32, n.uint64],
            'float': [n.float16, n.float32, n.float64, n.longdouble],
            'complex': [n.complex64, n.complex128, n.clongdouble],
            'others': [bool, object, bytes, str, n.void]}


def _missing(name):
    """Can ``name`` not be imported here? (NumPy 1.26 still ships
    ``numpy.distutils`` on Python 3.12, where it fails to import.)"""
    if name in sys.modules:
        return False
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            importlib.import_module(name)
        return False
    except Exception:
        return True


def needed():
    """What ``import chainer`` lacks here: a list of names (empty where
    Chainer imports as released)."""
    import numpy
    out = []
    try:
        numpy.sctypes
    except AttributeError:
        out.append('numpy.sctypes')
    for name in ('numpy.distutils', 'pkg_resources'):
        if _missing(name):
            out.append(name)
    return out


class _NumpyWithSctypes(types.ModuleType):
    """NumPy, seen through a module that also has ``sctypes``."""

    def __init__(self):
        super(_NumpyWithSctypes, self).__init__('numpy')
        self.sctypes = _sctypes()

    def __getattr__(self, name):
        import numpy
        return getattr(numpy, name)


def _stub_modules(missing):
    mods = {}
    if 'numpy.distutils' in missing:
        distutils = types.ModuleType('numpy.distutils')
        system_info = types.ModuleType('numpy.distutils.system_info')
        system_info.get_info = lambda name, notfound_action=0: {}
        distutils.system_info = system_info
        distutils.__path__ = []
        mods['numpy.distutils'] = distutils
        mods['numpy.distutils.system_info'] = system_info
    if 'pkg_resources' in missing:
        pr = types.ModuleType('pkg_resources')

        class ResolutionError(Exception):
            pass

        class DistributionNotFound(ResolutionError):
            pass

        class VersionConflict(ResolutionError):
            pass

        def require(requirement):
            # Chainer asks only whether an optional package (CuPy, iDeep)
            # is there in a supported version, to warn; say it is not.
            raise DistributionNotFound(requirement)

        pr.ResolutionError = ResolutionError
        pr.DistributionNotFound = DistributionNotFound
        pr.VersionConflict = VersionConflict
        pr.require = require
        mods['pkg_resources'] = pr
    return mods


@contextlib.contextmanager
def _stand_ins():
    """The stand-ins Chainer's import needs here, for the time it runs;
    then ``as_strided`` gets its view of NumPy with ``sctypes``."""
    import numpy
    missing = needed()
    stubs = _stub_modules(missing)
    add_sctypes = 'numpy.sctypes' in missing
    saved = dict((k, sys.modules.get(k)) for k in stubs)
    sys.modules.update(stubs)
    if add_sctypes:
        numpy.sctypes = _sctypes()
    try:
        yield
        if add_sctypes:
            import chainer.functions.array.as_strided as as_strided
            as_strided.np = _NumpyWithSctypes()
    finally:
        for k, old in saved.items():
            if old is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = old
        if add_sctypes:
            del numpy.sctypes
        for k in stubs:
            # Not left bound on their parent module either.
            parent, _, child = k.rpartition('.')
            if parent and getattr(sys.modules.get(parent), child, None) \
                    is stubs[k]:
                delattr(sys.modules[parent], child)


def prepare():
    """``import chainer``, with the stand-ins it needs here; returns the
    module. Idempotent; a Chainer already imported is left alone."""
    if 'chainer' not in sys.modules:
        uninstall_finder()
        with _stand_ins():
            import chainer  # NOQA
    return sys.modules['chainer']


class _Loader(importlib.abc.Loader):
    """Chainer's own loader, run with the stand-ins; it puts the real one
    back on the module when done."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        spec = module.__spec__
        spec.loader = module.__loader__ = self.inner
        with _stand_ins():
            self.inner.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Gives ``import chainer`` the stand-ins, the first time."""

    def find_spec(self, name, path=None, target=None):
        if name != 'chainer':
            return None
        uninstall_finder()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install_finder():
    """From now on, the first ``import chainer`` goes with the stand-ins it
    needs (what the ``.pth`` file runs at interpreter start; it imports
    nothing until then)."""
    if 'chainer' in sys.modules:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall_finder():
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not isinstance(f, _Finder)]


def _site_dir():
    import sysconfig
    return sysconfig.get_paths()['purelib']


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(
        prog='python -m static_graph chainer-import',
        description='Make "import chainer" work on Python 3.12+/NumPy 2 in '
                    'this environment, for scripts that import chainer '
                    'before static_graph.')
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument('--install', action='store_true',
                   help='add %s to site-packages' % PTH_NAME)
    g.add_argument('--uninstall', action='store_true', help='remove it')
    g.add_argument('--check', action='store_true',
                   help='say what import chainer lacks here')
    args = p.parse_args(argv)
    path = os.path.join(_site_dir(), PTH_NAME)
    if args.check:
        missing = needed()
        sys.stdout.write('import chainer lacks: %s\n' % (
            ', '.join(missing) if missing else 'nothing'))
        return 0
    if args.uninstall:
        if os.path.exists(path):
            os.remove(path)
        sys.stdout.write('removed %s\n' % path)
        return 0
    here = os.path.abspath(__file__)
    with open(path, 'w') as f:
        # Loaded by path, not through the package (whose import would
        # import Chainer at every interpreter start).
        f.write('import importlib.util as u; s = u.spec_from_file_location('
                '"_static_graph_chainer_import", %r); m = '
                'u.module_from_spec(s); s.loader.exec_module(m); '
                'm.install_finder()\n' % here)
    sys.stdout.write('wrote %s\n' % path)
    return 0


if __name__ == '__main__':
    sys.exit(main())
