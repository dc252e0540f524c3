"""Schedule.verify: each rule it checks, on small hand-built schedules
(no Chainer involved)."""
import pytest

from schedules import ir


def _bufs(roles):
    return dict((b, ir.Buffer(b, (2,), 'float32', role))
                for b, role in enumerate(roles))


def _op(kind, inputs, outputs):
    return ir.Op(kind, inputs, outputs)


def _chain():
    """%0 input -> A -> %1 -> B -> %2 output, %3 a parameter B reads."""
    bufs = _bufs([ir.INPUT, ir.TEMP, ir.TEMP, ir.PARAM])
    ops = [_op('A', (0,), (1,)), _op('B', (1, 3), (2,))]
    return bufs, ops


def test_a_well_formed_schedule_verifies():
    bufs, ops = _chain()
    assert ir.Schedule('s', bufs, ops, (0,), (2,)).verify() is True


@pytest.mark.parametrize('ops,inputs,outputs,message', [
    ([_op('A', (0,), (1,)), _op('B', (9,), (2,))], (0,), (2,),
     r'input of op 1 \(B\) %9 is not a buffer'),
    ([_op('A', (0,), (1,)), _op('B', (1,), (9,))], (0,), (2,),
     r'output of op 1 \(B\) %9 is not a buffer'),
    ([_op('B', (1,), (2,)), _op('A', (0,), (1,))], (0,), (2,),
     r'op 0 \(B\) reads %1 before it is defined'),
    ([_op('A', (0,), (1,)), _op('B', (0,), (1,))], (0,), (1,),
     r'%1 is written by op 0 \(A\) and op 1 \(B\)'),
    ([_op('A', (0,), (0,))], (0,), (0,),
     r'op 0 \(A\) overwrites schedule input %0'),
    ([_op('A', (0,), (1,))], (0,), (2,), r'output %2 is never defined'),
    ([_op('A', (0,), (1,))], (9,), (1,), r'schedule input %9 is not a buffer'),
])
def test_each_rule_is_checked(ops, inputs, outputs, message):
    bufs, _ = _chain()
    with pytest.raises(ir.ScheduleError, match=message):
        ir.Schedule('s', bufs, ops, inputs, outputs).verify()


def test_preset_and_stable_roles_count_as_defined():
    # A backward schedule reads what the forward defined (``preset``);
    # parameters, persistents and constants are defined throughout.
    bufs = _bufs([ir.TEMP, ir.TEMP, ir.CONST, ir.GRAD_OUT])
    sched = ir.Schedule('b', bufs, [_op('G', (0, 2, 3), (1,))], (3,), (1,))
    with pytest.raises(ir.ScheduleError, match='reads %0 before'):
        sched.verify()
    assert sched.verify(preset=(0,)) is True
