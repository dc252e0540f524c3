"""ChainerMN for the MNIST example (``--communicator NAME``).

    mpiexec.gforker -n 2 python examples/mnist/train_mnist.py --communicator naive

Without ``--communicator`` every helper here is a pass-through and
ChainerMN is not imported. With it: one communicator for the run, the
training and test sets scattered from rank 0 (each rank trains on its
shard), the optimizer wrapped by ``create_multi_node_optimizer`` (gradients
averaged over the ranks before each update; the first update broadcasts
rank 0's parameters instead), the evaluator by
``create_multi_node_evaluator`` (validation values averaged over the
ranks, so every rank prints the same accuracy), the progress and the
per-epoch report on rank 0 only, and each rank's result line labelled
with its rank.
"""
import os

_comm = None


def add_argument(parser):
    parser.add_argument('--communicator', default=None,
                        help='train data-parallel with ChainerMN over this '
                             'communicator (e.g. naive; run under mpiexec)')


def setup(args):
    """The communicator of this run: created when ``args.communicator``
    is given, else None (the helpers below then pass everything
    through)."""
    global _comm
    _comm = None
    if args.communicator:
        import chainermn
        _comm = chainermn.create_communicator(args.communicator)
    return _comm


def scatter(train_data, test_data, seed):
    """Each rank's shard of the data (the whole sets on one process); the
    training set is shuffled with ``seed`` before it is split."""
    if _comm is None:
        return train_data, test_data
    import chainermn
    return (chainermn.scatter_dataset(train_data, _comm, shuffle=True,
                                      seed=seed),
            chainermn.scatter_dataset(test_data, _comm))


def optimizer(opt):
    """``opt``, wrapped for the ranks (call after ``opt.setup(model)``)."""
    if _comm is None:
        return opt
    import chainermn
    return chainermn.create_multi_node_optimizer(opt, _comm)


def evaluator(ev):
    if _comm is None:
        return ev
    import chainermn
    return chainermn.create_multi_node_evaluator(ev, _comm)


def is_root():
    """Whether this process prints progress and reports (rank 0)."""
    return _comm is None or _comm.rank == 0


def out_dir(out):
    """Rank 0 writes into ``out``, the others into ``out/rank<N>``."""
    return out if is_root() else os.path.join(out, 'rank%d' % _comm.rank)


def label(text):
    """A result line's label, with this process's rank when there are
    several."""
    if _comm is None:
        return text
    return '%s, rank %d of %d' % (text, _comm.rank, _comm.size)
