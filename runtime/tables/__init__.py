"""The table plane: the routing table and everything that carries it (torch-free, no web
framework; the operator imports it).

- :mod:`~eaas.runtime.tables.table`: :class:`RoutingTable`, the one type of "which expert servers
  host which logical expert", invariants checked at construction, named constructors.
- :mod:`~eaas.runtime.tables.wire`: its JSON forms (plain and compact) and ``RoutingTableError``.
- :mod:`~eaas.runtime.tables.push`: receiving a pushed table (bearer token, validation, version
  decision), shared by attention clients and expert servers.
- :mod:`~eaas.runtime.tables.http`: the one HTTP JSON call with a bearer token (every pusher).
- :mod:`~eaas.runtime.tables.watch`: the ConfigMap watcher (Kubernetes API).
- ``file_watch``: the routing-table file watcher; ``expert_spec``: the ``--experts`` codec.
"""
