"""examples/reinforcement_learning: ``dqn_cartpole.py``'s Q-function (an
MLP), an epsilon-greedy action from ``Q`` on one observation under
``no_backprop_mode`` every step, and its ``update``: ``F.select_item(Q(obs),
action)`` against ``r + gamma * (1 - done) * max_b target_Q(obs')`` (DQN)
or ``target_Q(obs')[argmax_b Q(obs')]`` (double DQN) computed under
``no_backprop_mode``, the mean Huber loss, Adam (eps 1e-2); the target
network a ``copy.deepcopy(Q)`` every few steps. Transitions are synthetic
(a CartPole-sized observation, 2 actions), drawn from a replay buffer."""
import copy

import numpy

import chainer
from chainer import functions as F
from chainer import links as L

from benchmarks.kit import common


class QFunction(chainer.Chain):
    """Q-function represented by a MLP."""

    def __init__(self, obs_size, n_actions, n_units=100):
        super(QFunction, self).__init__()
        with self.init_scope():
            self.l0 = L.Linear(obs_size, n_units)
            self.l1 = L.Linear(n_units, n_units)
            self.l2 = L.Linear(n_units, n_actions)

    def forward(self, x):
        """Compute Q-values of actions for given observations."""
        h = F.relu(self.l0(x))
        h = F.relu(self.l1(h))
        return self.l2(h)


def get_greedy_action(Q, obs):
    """Get a greedy action wrt a given Q-function."""
    obs = Q.xp.asarray(obs[None], dtype=numpy.float32)
    with chainer.no_backprop_mode():
        q = Q(obs).array[0]
    return int(q.argmax())


def mean_clipped_loss(y, t):
    return F.mean(F.huber_loss(y, t, delta=1.0, reduce='no'))


def update(Q, target_Q, opt, samples, gamma=0.99, target_type='double_dqn'):
    """Update a Q-function with given samples and a target Q-function."""
    xp = Q.xp
    obs = xp.asarray([sample[0] for sample in samples], dtype=numpy.float32)
    action = xp.asarray([sample[1] for sample in samples], dtype=numpy.int32)
    reward = xp.asarray([sample[2] for sample in samples],
                        dtype=numpy.float32)
    done = xp.asarray([sample[3] for sample in samples], dtype=numpy.float32)
    obs_next = xp.asarray([sample[4] for sample in samples],
                          dtype=numpy.float32)
    # Predicted values: Q(s,a)
    y = F.select_item(Q(obs), action)
    # Target values: r + gamma * max_b Q(s',b)
    with chainer.no_backprop_mode():
        if target_type == 'dqn':
            next_q = F.max(target_Q(obs_next), axis=1)
        elif target_type == 'double_dqn':
            next_q = F.select_item(target_Q(obs_next),
                                   F.argmax(Q(obs_next), axis=1))
        else:
            raise ValueError('Unsupported target_type: {}'.format(target_type))
        target = reward + gamma * (1 - done) * next_q
    loss = mean_clipped_loss(y, target)
    Q.cleargrads()
    loss.backward()
    opt.update()
    return loss


class Agent(chainer.Chain):
    """Holds Q (whose parameters the kit compares) and, outside its links,
    the target network; not part of the example."""

    def __init__(self, q):
        super(Agent, self).__init__()
        with self.init_scope():
            self.q = q
        self.target_q = copy.deepcopy(q)
        self.targets = [self.target_q]
        self.iteration = 0


def make_case(target_type='dqn', obs_size=4, n_actions=2, n_units=100,
              batch=64, buffer_size=2000, target_update_freq=10,
              epsilon=0.3, reward_scale=1e-2, steps=40):
    def model(static):
        return Agent(common.pick(QFunction, static)(obs_size, n_actions,
                                                    n_units))

    def optimizers(agent):
        return [common.optimizer_with(chainer.optimizers.Adam(eps=1e-2),
                                      agent.q)]

    def batches(rs, n):
        obs = rs.randn(buffer_size, obs_size).astype(numpy.float32)
        D = [(obs[i], int(rs.randint(n_actions)),
              float(rs.rand() * reward_scale), bool(rs.rand() < 0.05),
              obs[(i + 1) % buffer_size]) for i in range(buffer_size)]
        out = []
        for _ in range(n):
            idx = rs.choice(buffer_size, batch, replace=False)
            out.append((rs.randn(obs_size).astype(numpy.float32),
                        float(rs.rand()), int(rs.randint(n_actions)),
                        [D[i] for i in idx]))
        return out

    def step(agent, opts, batch):
        opt, = opts
        obs, u, random_action, samples = batch
        # Select an action epsilon-greedily (the environment is synthetic:
        # the action only counts as an output compared between the twins)
        if u < epsilon:
            action = random_action
        else:
            action = get_greedy_action(agent.q, obs)
        loss = update(agent.q, agent.target_q, opt, samples,
                      target_type=target_type)
        # Update the target network
        if agent.iteration % target_update_freq == 0:
            agent.target_q = copy.deepcopy(agent.q)
            agent.targets.append(agent.target_q)
        agent.iteration += 1
        return numpy.array([loss.array, action], numpy.float64)

    return common.Case(
        'dqn' if target_type == 'dqn' else 'double-dqn',
        'reinforcement_learning', 'QFunction.forward',
        '%s: MLP %d-%d-%d-%d, batch %d, greedy action on 1 observation, '
        'target network deep-copied every %d steps'
        % ('DQN' if target_type == 'dqn' else 'double DQN', obs_size,
           n_units, n_units, n_actions, batch, target_update_freq),
        model, optimizers, batches, step, steps=steps, warmup=5,
        targets=('all',), shapes='fixed',
        extra_links=lambda agent: agent.targets)
