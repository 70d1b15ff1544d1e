"""Placement: which expert server hosts which (layer, logical expert).

Pure functions only; no I/O. Used by ``eaas serve`` (local mode) and by the operator.

Glossary
--------
logical expert
    Expert ``e`` of MoE layer ``l`` as the model defines it (``0 <= e < num_experts``).
physical expert / replica
    One copy of a logical expert's weights on one expert server.
redundancy
    Minimum number of replicas of every logical expert, each on a distinct server, so that
    ``redundancy - 1`` servers can die without any expert losing its last replica.
placement
    For every server index ``s`` in ``[0, num_servers)``, the sorted list of ``(layer, expert)``
    pairs it hosts. Any ``num_servers >= redundancy`` works: there is no divisibility rule
    (monolithic EP needs ``num_servers | num_experts``).
slot budget
    ``slots_per_server``: replicas one server holds *per MoE layer* (GPU memory). With a budget
    every server is filled to it, and the slots beyond ``num_experts * redundancy`` hold extra
    replicas of the hottest experts (DeepSeek's EPLB "redundant experts", arXiv:2412.19437 §3.4).
expert load
    Tokens routed to a logical expert per interval. A replica's load is its expert's load split
    evenly over the expert's replicas; a server's load is the sum over its replicas.
    Balancedness = ``sum_l mean_s load[l][s] / sum_l max_s load[l][s]``: mean over max server
    load per MoE layer, summed over layers (layers run one after another, so each layer's
    slowest server counts; two layers on two servers with loads 100 and 200, crossed, give
    300 / 400 = 0.75, not the 1.0 of the servers' totals).

Algorithm (per MoE layer; layers are independent)
--------------------------------------------------
1. **Replica counts.** Every expert gets ``redundancy`` replicas. With a slot budget ``C`` the
   ``N * C`` slots are all used: starting from the counts the previous placement already has
   (or ``redundancy`` each), one replica at a time is added to the expert with the highest load
   per replica, or removed from the expert whose load per replica stays lowest (EPLB's
   ``replicate_experts`` greedy, with ``redundancy`` as the floor instead of 1).
2. **Keep.** Every surviving server keeps what it hosted, except replicas above an expert's
   new count and replicas above the server's new target count. Drops are spread over the
   servers (the server with the fewest drops so far goes first).
3. **Place.** The missing replicas, hottest first, go to the least-loaded server with a free slot
   that does not host the expert, preferring a failure domain the expert is not in yet (greedy
   longest-processing-time, as EPLB's ``balanced_packing`` but never two replicas of one expert
   on one server).
4. **Spread** (when servers share failure domains): swap two replicas while that raises the
   number of domains an expert spans toward ``redundancy`` without taking another expert below
   it (every swap strictly improves, so a placement that cannot improve is a fixed point).
5. **Refine** (from scratch, load-aware): swap one replica of the most-loaded server with a
   lighter replica elsewhere while that lowers the layer's maximum load.

After a change with the load known (``load-balanced``, ``expert_load`` given, ``previous``
given: scale-up, scale-down, servers lost, or ``rebalance=True`` for a load shift), each layer
is placed by :func:`~.rescale.rescale_layer`: steps 1-4 with the load (the *load-aware step*)
and with every expert equally loaded (the *load-oblivious step*), each improved by
:func:`~.budget.improve` within the movement budget (swaps, and re-replication: a server drops
a spare replica of a cold expert for one more replica of the most-loaded server's hottest),
and, when the budget allows it, a placement from scratch matched to the servers. The lowest
maximum server load wins, then the fewest moves.

Bounds (per MoE layer; tested on Zipf(1.0), Zipf(1.5) and log-normal loads in
``tests/runtime/test_placement_budget.py``, and on the DeepSeek-V3 shape in
``tests/runtime/test_placement_incremental.py``)
---------------------------------------------------------------------------------------------
Let ``f = max_moved_fraction`` (default :data:`~.place.DEFAULT_MAX_MOVED_FRACTION` = 0.1),
``R`` the layer's replicas after the change and ``C`` the slot budget.

* **Balance**: the layer's maximum server load is at most that of the load-oblivious step and at
  most that of the load-aware step (both without further moves), under the given load. Layers
  run one after another, so balancedness (``sum_l mean_s / sum_l max_s``) is at least that of
  either step. Nothing bounds it against a placement from scratch; measured
  (``bench/placement.py``, docs/measurements/placement.md): at ``f = 0.1`` 0.96-1.0x of it on
  every rescale of 32->33, 40->41, 41->40, 64->40 and 64->65 and on a load drift, 1.0x with no
  limit.
* **Movement**: replicas moved <= ``M + floor(f * R)``, ``M`` being what the step the result
  starts from moves (load-aware or load-oblivious). A step moves only what the change forces:
  with a budget ``C`` kept, a scale-up ``N -> N'`` moves exactly ``M = (N' - N) * C`` (the new
  servers' content; no surviving server changes in the step, so with ``f = 0``,
  ``round-robin`` or no load, none changes at all); a scale-down re-homes at most
  ``k = (N - N') * C`` replicas, each into a slot freed by a surplus replica
  (``M <= max(k, N' * (C' - C))``, ``C'`` the new budget, larger when the survivors must make
  room; in the load-oblivious step a survivor changes at most ``2 * ceil(k / N') + 2`` of its
  replicas). A load shift (``rebalance``) forces nothing: ``M = 0``.
  Under skewed loads the extra ``floor(f * R)`` moves land on survivors: with ``f > 0`` a
  scale-up does change surviving servers (at most ``floor(f * R)`` replicas in all).
* **Fixed point**: with nothing to move (same servers, same budget) and no ``rebalance`` a
  placement in force is returned unchanged.
* Redundancy (>= ``redundancy`` replicas per expert, on distinct servers), failure-domain spread
  (no move lowers an expert's domains below ``min(redundancy, domains)``) and determinism hold
  for every result.

Without a budget (``slots_per_server=None``, exactly ``redundancy`` replicas per expert, server
counts ``floor``/``ceil`` of ``E * R / N``) a scale-up must take the new servers' replicas from
the survivors: each survivor then drops at most ``ceil(E * R / N) - floor(E * R / N')`` per layer
in the step, and the budget is spent on swaps only.

Policies
--------
``round-robin``
    Load-unaware: every expert counts as equally loaded (the layout spreads replicas evenly and
    rotates the servers that get the ``ceil`` share from layer to layer).
``load-balanced``
    Uses ``expert_load`` (missing entries count as the layer's mean, 1.0 without any load).
"""

from .core import POLICIES, LayerExpert, Placement, PlacementError, auto_slots
from .cpus import SCHED_POLICIES, spread_over_cpus
from .metrics import (
    balancedness,
    balancedness_of_loads,
    dispatch_columns,
    moved_replicas,
    server_loads,
)
from .place import DEFAULT_MAX_MOVED_FRACTION, place_experts

__all__ = [
    "DEFAULT_MAX_MOVED_FRACTION",
    "POLICIES",
    "SCHED_POLICIES",
    "LayerExpert",
    "Placement",
    "PlacementError",
    "auto_slots",
    "balancedness",
    "balancedness_of_loads",
    "dispatch_columns",
    "moved_replicas",
    "place_experts",
    "server_loads",
    "spread_over_cpus",
]
