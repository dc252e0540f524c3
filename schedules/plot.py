"""Draw a memory plan: buffer lifetimes and the arena layout (matplotlib).

Reads only the IR and a ``planner.Plan``: left, each planned buffer as a bar
over the steps it is live (forward then backward); right, the arena: each
buffer a rectangle at its offset over its lifetime, so shared memory shows as
rectangles stacked in time at the same height.
"""
from schedules import ir

_COLORS = {ir.INPUT: '#4c72b0', ir.TEMP: '#55a868', ir.STATE: '#c44e52',
           ir.GRAD_OUT: '#8172b2', 'static': '#dd8452'}


def plot_plan(schedules, plan, path, title=None):
    """Write a PNG of ``plan`` (from ``planner.plan_schedules(schedules)``)
    to ``path``; returns the path."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise ImportError('plotting needs matplotlib: '
                          'pip install chainer-static-graph[plot]')
    buffers = {}
    for s in schedules:
        buffers.update(s.buffers)
    boundary = len(schedules[0].ops) if len(schedules) > 1 else None
    items = sorted(plan.lifetimes.items(), key=lambda kv: (kv[1][0], kv[0]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    mib = 2.0 ** 20

    def color(b):
        buf = buffers[b]
        return _COLORS['static'] if buf.static else _COLORS.get(buf.role,
                                                                 '#999999')

    for row, (b, (first, last)) in enumerate(items):
        ax1.barh(row, last - first + 1, left=first, height=0.8,
                 color=color(b), linewidth=0)
        size = plan.sizes[b]
        if size:
            ax2.add_patch(Rectangle((first, plan.offsets[b] / mib),
                                    last - first + 1, size / mib,
                                    facecolor=color(b), edgecolor='black',
                                    linewidth=0.2))
    steps = max([last for _, (_, last) in items] or [0]) + 1
    ax1.set_xlabel('op step (forward, then backward)')
    ax1.set_ylabel('buffer (by first use)')
    ax1.set_title('buffer lifetimes')
    ax1.set_xlim(0, steps)
    ax2.set_xlim(0, steps)
    ax2.set_ylim(0, max(plan.arena_bytes / mib, 1e-6))
    ax2.set_xlabel('op step')
    ax2.set_ylabel('arena offset (MiB)')
    ax2.set_title('arena layout: %s' % plan.summary().split(': ', 1)[-1])
    for ax in (ax1, ax2):
        if boundary is not None:
            ax.axvline(boundary, color='black', linestyle='--', linewidth=0.8)
    ax1.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()],
               loc='lower right', fontsize='small')
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
