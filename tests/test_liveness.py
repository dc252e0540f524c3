"""The one liveness computation (schedules/liveness.py) and its users: the
executor's ``del``, the printout's ``free``, donation and the planner all
read it. No chainer here."""
import glob
import os

from schedules import executor
from schedules import ir
from schedules import liveness
from schedules import planner


def _schedule():
    """%0 input; %1 = A(%0); %2 = B(%1) never read; %3 = C(%1, %4 const);
    %5 = D(%3) output; %6 static written by A."""
    bufs = dict((b, ir.Buffer(b, (2,), 'f4', role)) for b, role in [
        (0, ir.INPUT), (1, ir.TEMP), (2, ir.TEMP), (3, ir.TEMP),
        (4, ir.CONST), (5, ir.TEMP), (6, ir.TEMP)])
    bufs[6].static = True
    bufs[4].storage = bufs[6].storage = object()
    ops = [ir.Op('A', (0,), (1, 6)), ir.Op('B', (1,), (2,)),
           ir.Op('C', (1, 4), (3,)), ir.Op('D', (3, 6), (5,))]
    return ir.Schedule('s', bufs, ops, (0,), (5,))


def test_reads_and_writes():
    live = liveness.of(_schedule())
    assert live.first_write == {1: 0, 6: 0, 2: 1, 3: 2, 5: 3}
    assert live.last_read == {0: 0, 1: 2, 4: 2, 3: 3, 6: 3}
    assert live.first_read[1] == 1
    assert live.last_use(1) == 2 and live.last_use(2) == 1
    assert live.last_use(99) is None
    assert live.dead_after(1, 2) and not live.dead_after(1, 1)


def test_frees_are_what_printout_and_executor_use():
    s = _schedule()
    live = liveness.of(s)
    # read buffers only; never the output, a constant or a static buffer
    assert live.frees(s.outputs) == {0: [0], 2: [1], 3: [3]}
    assert s.last_uses() == live.frees(s.outputs)
    # the executor also drops %2 (written, never read) after its writer
    unread = live.frees(s.outputs, unread=True)
    assert unread == {0: [0], 1: [2], 2: [1], 3: [3]}
    code = executor.compile_schedule(
        ir.Schedule('s', s.buffers, [
            ir.Op(op.kind, op.inputs, op.outputs, fn=lambda a: (a[0], a[0]))
            for op in s.ops], s.inputs, s.outputs), copyto=None)
    del_lines = [line.strip() for line in code.source.splitlines()
                 if line.strip().startswith('del ')]
    assert del_lines == ['del b0', 'del b2', 'del b1', 'del b3'], code.source
    assert 'free %1' in s.format() and 'free %2' not in s.format()


def test_lifetimes_is_the_planners():
    s = _schedule()
    assert planner.liveness is liveness.lifetimes
    # %2: written at 1, never read; %6 static but planned (kept alive by
    # the caller through keep); the constant is not planned
    assert liveness.lifetimes([s]) == {
        0: (0, 0), 1: (0, 2), 2: (1, 1), 3: (2, 3), 5: (3, 3), 6: (0, 3)}
    assert liveness.lifetimes([s], keep=(1,))[1] == (0, 3)


def test_schedules_never_import_chainer():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in glob.glob(os.path.join(here, 'schedules', '*.py')):
        src = open(path).read()
        assert 'import chainer' not in src and 'from chainer' not in src, \
            path
