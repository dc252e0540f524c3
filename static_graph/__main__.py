"""``python -m static_graph chainer-import --install|--uninstall|--check``:
see static_graph/chainer_import.py."""
import sys

from static_graph import chainer_import


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != 'chainer-import':
        sys.stderr.write('usage: python -m static_graph chainer-import '
                         '--install|--uninstall|--check\n')
        return 2
    return chainer_import.main(argv[1:])


if __name__ == '__main__':
    sys.exit(main())
