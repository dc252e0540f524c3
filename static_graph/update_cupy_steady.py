"""A captured-update step on CuPy like the one before it, read in part.

``GpuUpdate._read`` checks every parameter, gradient, state array and hook
and builds the step's device work (a ``Step``: the ops, what they touch,
the scalar segments) from scratch, about 14 microseconds of Python a
parameter. Where the step before was read in full and nothing that decides
that work has changed since, ``Steady`` reuses the work and reads only what
changes from step to step: each rule's scalars, from its hyperparameters
and ``t`` with Chainer's expressions (``update_gpu_readers.read_rule``).

Nothing changed means: the same ``GpuStructure`` (parameters, their rules,
the optimizer's hooks: none), each rule as enabled as before and without
hooks of its own, no loss scale and no fp32 copy, and the same parameter
and state array objects, with gradients at the same places (address,
shape, strides, dtype: a CUDA graph's lent gradients are the same arrays
at every step). A rule whose reader picks another kernel (``amsgrad``
turned on) reads the step in full again. Steps with hooks, loss scaling or
fp32 copies are always read in full (``Steady.of`` returns None for them).
"""
from static_graph import update_cupy as U
from static_graph import update_gpu_readers as G

FLOAT16 = U.FLOAT16


class Changed(Exception):
    """A rule's reader picked other work than the template's."""


class Steady(object):
    """The template of a step read in full (``of``); ``fits`` says whether
    the next step may reuse it, ``read`` reads that step into a Step."""

    __slots__ = ('structure', 'dev', 'checks', 'reads', 'st')

    def __init__(self, structure, dev, checks, reads, st):
        self.structure = structure
        self.dev = dev
        self.checks = checks   # per parameter: (param, rule, updated?,
        #  array, gradient's place, state dict, ((key, state array), ...))
        self.reads = reads     # (rule, dtype, kernel, state keys, sdt)
        self.st = st

    @classmethod
    def of(cls, structure, dev, st):
        """The template of ``st``, the step just read in full for
        ``structure``, or None where it has what ``read`` does not read."""
        if structure.opt_pre or structure.opt_post:
            return None
        checks = []
        reads = iter(st.reads)
        for p, rule in zip(structure.params, structure.rules):
            a, g = p.array, p.grad
            if a is None:
                # (read in full: the rule only counts the step; an array
                # given later changes the work)
                if rule is not None and rule.enabled:
                    return None
                checks.append((p, rule, rule is not None and rule.enabled,
                               None, None, None, ()))
                continue
            if g is None:
                return None      # (read in full: zeros, as Chainer's)
            if rule is None or not rule.enabled:
                # Not updated; its gradient read in full all the same
                # (zeros where there is none, the same checks).
                checks.append((p, rule, False, a, U._where(g), None, ()))
                continue
            if not _plain(p, rule, a):
                return None
            state = rule._state
            r = next(reads, None)
            if r is None or r[0] is not rule or \
                    not isinstance(state, dict) or len(state) != len(r[3]):
                return None
            checks.append((p, rule, True, a, U._where(g), state,
                           tuple((k, state[k]) for k in r[3])))
        if next(reads, None) is not None or \
                len(st.segments) != len(st.reads):
            return None
        return cls(structure, dev, tuple(checks), tuple(st.reads), st)

    def fits(self, structure):
        """May this step reuse the template? Every parameter's array and
        gradient as before (the full read's checks and zeros are for all,
        updated or not), and for a rule that updates, its state too."""
        if structure is not self.structure:
            return False
        for p, rule, enabled, a, gw, state, arrays in self.checks:
            if (rule is not None and rule.enabled) != enabled or \
                    p.array is not a:
                return False
            if a is None:
                continue
            g = p.grad
            if g is None or U._where(g) != gw:
                return False
            if not enabled:
                continue
            if not _plain(p, rule, a) or rule._state is not state or \
                    len(state) != len(arrays):
                return False
            for k, s in arrays:
                if state.get(k) is not s:
                    return False
        return True

    def read(self, opt, bumped):
        """This step's Step: the template's work with this step's scalars.
        Bumps each rule's ``t`` (recorded in ``bumped``, for the caller to
        put back should anything raise); raises Changed where a reader
        picks other work."""
        tmpl = self.st
        st = U.Step(tmpl.cupy)
        st.ops, st.keys, st.zero_d = tmpl.ops, tmpl.keys, tmpl.zero_d
        opt._loss_scaling_isnan = False      # as check_nan_in_grads
        memo = {}
        for rule, dtype, kernel, keys, sdt in self.reads:
            rule.t += 1
            bumped.append(rule)
            k, values, keys_now, sdt_now = G.read_rule(rule, dtype, memo)
            if k is not kernel or keys_now != keys or sdt_now != sdt:
                raise Changed()
            st.scalars(sdt, values)
        return st


def _plain(p, rule, a):
    """No loss scale, no fp32 copy, no hooks of the rule's own."""
    hooks = rule._hookable
    return p._loss_scale is None and not (
        rule._use_fp32_update and a.dtype == FLOAT16) and \
        not hooks._pre_update_hooks and not hooks._post_update_hooks
