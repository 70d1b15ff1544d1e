"""The expert server: a stateless process hosting a set of ``(layer, logical expert)`` weights.

Modules: :mod:`.server` (:class:`~.server.ExpertServer`: the serving loop, dynamic batching,
frame checks), :mod:`.hosting` (hosted experts, copy-on-write snapshots, the per-layer stack),
:mod:`.compute` (the expert compute on the CPU), :mod:`.grouped` (the native grouped kernels on
a CUDA device), :mod:`.http` (``/health``, ``/metrics``, the routing-table endpoints),
:mod:`.main` (start-up and ``python -m eaas.runtime.server.main``).
"""
