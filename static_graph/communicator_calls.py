"""ChainerMN's communicator called by the method itself while a call
records (``n = comm.allreduce(count)``, ``comm.bcast_obj(...)``): a reason
to fall back. Replay runs no Python of the method, so it would neither
communicate (a rank replaying skips what the others wait for) nor see
what came back (mpi4py reads and writes the arrays through the buffer
protocol, which no hook of traced.py sees on Python 3.11). ChainerMN's
functions (``chainermn.functions.allreduce``, ``send``, ``recv``) are
nodes, which replay runs; their own calls of the communicator are inside
them (``rec.depth``), not the method's.

The patch goes on the communicators' base class at the first recording
after ChainerMN is imported (importing it here would start MPI), and
stays: outside a recording it passes the call through."""
import os
import sys

from static_graph import traced

_MODULE = 'chainermn.communicators.mpi_communicator_base'
# The methods that communicate (not set_config, get_config, finalize).
_CALLS = ('split', 'alltoall', 'send', 'recv', 'bcast', 'gather',
          'allgather', 'allreduce', 'scatter', 'send_obj', 'recv_obj',
          'bcast_obj', 'gather_obj', 'allreduce_obj', 'bcast_data',
          'multi_node_mean_grad', 'allreduce_grad')


def _watched(name, orig, package):
    def call(self, *args, **kwargs):
        rec = traced.active_recording()
        if rec is not None and not rec.depth and rec.phase == 'forward' \
                and not sys._getframe(1).f_code.co_filename.startswith(
                    package):
            # (ChainerMN's functions call it too, around their nodes:
            # send's shapes, bcast's root; those are theirs.)
            rec.add_reason(
                "the method calls ChainerMN's communicator itself "
                "(comm.%s) at %s; replay would not communicate (use "
                "chainermn.functions, whose nodes replay runs)"
                % (name, traced.user_location(2)))
        return orig(self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = orig.__doc__
    return call


def install():
    """Wrap the communicator's methods (for good); False while ChainerMN
    is not imported (patches._put asks again at the next install)."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return False
    cls = module.MpiCommunicatorBase
    package = os.path.dirname(sys.modules['chainermn'].__file__)
    for name in _CALLS:
        if name in cls.__dict__:
            setattr(cls, name, _watched(name, cls.__dict__[name], package))
    return True
