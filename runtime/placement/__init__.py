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
    Balancedness = mean server load / max server load (1.0 is perfect), summed over layers
    (layers run one after another, so each layer's slowest server counts).

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
5. **Refine** (load-aware and from scratch, or when ``rebalance_swaps`` allows it): swap one
   replica of the most-loaded server with a lighter replica elsewhere while that lowers the
   layer's maximum load.

Movement bound (what a rescale costs, stated per MoE layer)
-----------------------------------------------------------
Let ``C`` be the slot budget before and after (the operator's automatic budget keeps the
survivors' budget when scaling up, see ``slots_per_server``), loads unchanged, no
``rebalance_swaps`` and no failure-domain swap needed (each such swap moves 2 more replicas).
Tested in ``tests/runtime/test_placement_incremental.py`` for 4→5, 8→9, 40→41, 41→40, 40→64 and
64→40 on the DeepSeek-V3 shape.

* ``N -> N' > N``: no surviving server changes (step 1 only adds replicas, every survivor is full,
  so all new replicas land on the new servers). Replicas moved = ``(N' - N) * C`` per layer, i.e.
  the new servers' content: a fraction ``(N' - N) / N'`` of all replicas.
* ``N -> N' < N``: the removed servers' replicas of experts that would fall below their count
  (at most ``k = (N - N') * C`` per layer) are re-homed on survivors, each into a slot freed by
  dropping a surplus replica. A surviving server changes at most ``2 * ceil(k / N') + 2``
  replicas per layer (drops spread evenly, plus one for an occasional distinctness repair).
  Replicas moved: at most ``max(k, N' * (C' - C))`` per layer (``C'``: the new budget, larger
  when the survivors must make room), about the removed servers' share ``(N - N') / N``.

Without a budget (``slots_per_server=None``, exactly ``redundancy`` replicas per expert, server
counts ``floor``/``ceil`` of ``E * R / N``) a scale-up must take the new servers' replicas from
the survivors: each survivor then drops at most ``ceil(E * R / N) - floor(E * R / N')`` per layer.

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
from .metrics import balancedness, dispatch_columns, moved_replicas, server_loads
from .place import place_experts

__all__ = [
    "POLICIES",
    "SCHED_POLICIES",
    "LayerExpert",
    "Placement",
    "PlacementError",
    "auto_slots",
    "balancedness",
    "dispatch_columns",
    "moved_replicas",
    "place_experts",
    "server_loads",
    "spread_over_cpus",
]
