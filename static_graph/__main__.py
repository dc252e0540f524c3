"""``python -m static_graph chainer-import --install|--uninstall|--check``:
see static_graph/chainer_import.py."""
import sys

from static_graph import chainer_import


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    usage = ('usage: python -m static_graph chainer-import '
             '--install|--uninstall|--check\n')
    if argv[:1] in (['-h'], ['--help']):
        sys.stdout.write(usage)
        return 0
    if not argv or argv[0] != 'chainer-import':
        sys.stderr.write(usage)
        return 2
    return chainer_import.main(argv[1:])


if __name__ == '__main__':
    sys.exit(main())
