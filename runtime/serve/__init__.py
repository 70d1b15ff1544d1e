"""``eaas serve``: a whole EaaS deployment on one machine, one OS process per role.

What it does:

1. Reads the model's :class:`~eaas.runtime.models.arch.ModelInfo`, computes the placement
   ``place_experts(info.moe_layers, info.num_experts, N, R)`` and writes routing table version 1
   (``routing-table.json``) into a fresh run directory.
2. Starts ``N`` expert servers and ``M`` attention clients, each as its own process running the
   SAME entry point a Kubernetes pod runs (``python -m eaas expert-server ...`` /
   ``python -m eaas attention-client ...``, with ``-P``), so ``ps`` shows every process's role. Clients start
   in parallel with the servers (they connect lazily). All children share one fresh
   ``PROMETHEUS_MULTIPROC_DIR``, so ``GET /metrics`` on the API port carries every process's
   series. All ``M`` clients bind the same API port with ``SO_REUSEPORT``.
3. Waits for every child's ready line, then prints
   ``serving <model> on http://HOST:PORT (N expert servers, R replicas, M clients)``.
4. Acts as the local *monitor*: when an expert server exits, it logs it and publishes a new
   routing table version without that server (clients fail over on their own before that and
   hot-reload the new table), starts it again with back-off (:mod:`.restarts`: 1 s doubling to
   60 s, as the kubelet's CrashLoopBackOff) and, once the new process is ready, publishes the
   next version with it back. A dead attention client (or ``vllm serve``) is logged and started
   again with the same back-off: its running requests are lost (their KV cache was in it), the
   other clients on the port keep serving. With ``--no-restart-attention-clients`` it stays
   down, and serve exits once none is left.
5. SIGINT/SIGTERM: terminate the attention clients and wait until they exit (their running
   requests end while the expert servers still answer), then the expert servers; SIGKILL after
   a grace period (a second Ctrl-C: at once), remove the run directory (Unix sockets, routing
   table, metrics files). A signal during start-up stops what started and exits with 128 + the
   signal's number. The run directory holds an owner file (pid, start time): a later serve
   removes the directories whose owner is gone (a SIGKILLed serve cannot). Children get
   ``PR_SET_PDEATHSIG=SIGKILL`` (set between fork and exec), so they die with serve even if
   serve is SIGKILLed, and each leads a process group of its own: a terminal's Ctrl-C reaches
   serve alone (which stops them in the order above), and what a child started (vLLM's
   EngineCore) is SIGKILLed with its group once the child exits. Shared memory of the shm
   transport is memfd-based: nothing in ``/dev/shm``.

Child output: each child's stdout and stderr lines are relayed to serve's stdout in serve's one
format (:func:`~eaas.runtime.serve.children.output_line`: time stamp, ``[name]``, message).
Children run as ``python -P -m eaas ...`` (:func:`~eaas.runtime.serve.children.module_command`),
so a folder named ``eaas`` in the working directory is never imported instead of the package.
"""

from eaas.runtime.serve.children import Child, Children
from eaas.runtime.serve.deployment import (
    Deployment,
    ServeError,
    ServeInterrupted,
    serve,
    write_table,
)
from eaas.runtime.serve.rundir import (
    OWNER_FILE,
    RUN_DIR_PREFIX,
    create_run_dir,
    proc_start_ticks,
    remove_stale_run_dirs,
    stale_run_dirs,
)

__all__ = [
    "OWNER_FILE",
    "RUN_DIR_PREFIX",
    "Child",
    "Children",
    "Deployment",
    "ServeError",
    "ServeInterrupted",
    "create_run_dir",
    "proc_start_ticks",
    "remove_stale_run_dirs",
    "serve",
    "stale_run_dirs",
    "write_table",
]
