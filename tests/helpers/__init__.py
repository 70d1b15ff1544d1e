"""Test helpers shared across the test tiers (``tests/`` is on pytest's ``pythonpath``,
pyproject.toml; import them as ``from helpers.e2e import start_serve``).

* :mod:`helpers.common`: poll until a condition holds (``wait_until``), a free TCP port.
* :mod:`helpers.checkpoints`: tiny Qwen3-MoE and Mixtral checkpoints (random weights).
* :mod:`helpers.cli`: several ``eaas`` command lines run side by side.
* :mod:`helpers.dispatch`: wait until a dispatcher is connected to every expert server.
* :mod:`helpers.engine`: drive an attention-client engine directly.
* :mod:`helpers.server`: forked expert-server processes with random weights.
* :mod:`helpers.e2e`: real ``eaas serve`` / ``eaas expert-server`` processes on loopback.
* :mod:`helpers.k8s`: kubectl, state waits, the operator as a child process, the testbed.
* :mod:`helpers.faults`: fault-under-load scenarios on the process-node testbed.

The session-scoped checkpoint fixtures are in ``tests/conftest.py``.
"""
