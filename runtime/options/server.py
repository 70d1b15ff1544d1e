"""The options of one expert server process (``eaas expert-server``).

Built once, by the CLI from its flags, by ``eaas serve`` for each server it starts and by the
operator for a pool's pods; validated at construction; :meth:`ExpertServerOptions.argv` is the
command line that starts a server with them. Torch-free (the operator imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from eaas.runtime.common.dtypes import check_serving_dtype
from eaas.runtime.options.argv import to_argv

#: ``--cpu-kernel``: ``auto`` (vLLM's CPU fused-MoE kernel when this Python has vLLM's CPU
#: build, else torch), ``torch``, ``vllm`` (:mod:`eaas.runtime.server.cpu_fused`)
CPU_KERNELS = ("auto", "torch", "vllm")


def check_cpu_kernel(value: str, flag: str = "--cpu-kernel") -> None:
    """Raise ValueError (naming ``flag``) unless ``value`` is one of :data:`CPU_KERNELS`."""
    if value not in CPU_KERNELS:
        raise ValueError(f"{flag} must be one of {', '.join(CPU_KERNELS)}, got {value!r}")


@dataclass(kw_only=True)
class ExpertServerOptions:
    """Everything ``eaas expert-server`` is started with (field ``x_y`` is flag ``--x-y``;
    the flags' help in :mod:`eaas.runtime.cli.expert_server` says what each does).

    ``listen`` is the data-plane endpoint (``unix:PATH``, ``tcp://HOST:PORT``, ``cudaipc:PATH``,
    ``nvshmem:PE``); ``experts`` the ``--experts`` spec (``'1:0-3,7;2:5'``); ``cpus`` a Linux
    CPU list; ``batch_window_us`` microseconds, ``health_stale_s`` seconds. ``None``: not given.
    The field order is the order of the flags in :meth:`argv`.

    Raises (at construction):
        ValueError: a ``--dtype`` other than float32 / bfloat16, a ``--cpu-kernel`` not in
            :data:`CPU_KERNELS`, ``--spare`` with
            ``--experts`` or without a routing-table source, ``--push-token-file`` without
            ``--http-port``. The message names the flag.
    """

    model: str | None = None
    server_id: str = "expert-server-0"
    spare: bool = False
    push_token_file: str | None = None
    routing_table_configmap: str | None = None
    experts: str | None = None
    listen: str
    dtype: str = "float32"
    cpu_bf16_compute: str = "auto"
    cpu_kernel: str = "auto"
    threads: int = 1
    device: str = "auto"
    cpus: str | None = None
    sched_policy: str = "other"
    batch_window_us: float = 0.0
    metrics_port: int = 0
    http_port: int | None = None
    http_host: str = "0.0.0.0"
    health_stale_s: float = 5.0
    nvshmem_world: int | None = None
    nvshmem_pe: int | None = None
    nvshmem_uid_file: str | None = None

    def __post_init__(self) -> None:
        check_serving_dtype(self.dtype)
        check_cpu_kernel(self.cpu_kernel)
        if self.spare and self.experts:
            raise ValueError("--spare starts with no experts: not with --experts")
        if self.spare and not (self.push_token_file or self.routing_table_configmap):
            raise ValueError(
                "--spare needs --push-token-file or --routing-table-configmap (a spare gets its "
                "experts from the routing table)"
            )
        if self.push_token_file and self.http_port is None:
            raise ValueError("--push-token-file needs --http-port (PUT /routing-table)")

    @property
    def learns_from_table(self) -> bool:
        """Whether the hosted experts come from the routing table (pushed or watched)."""
        return bool(self.push_token_file or self.routing_table_configmap)

    def argv(self) -> list[str]:
        """``["expert-server", "--model", ...]``: the flags that differ from the defaults, plus
        ``--server-id`` (prepend the program, e.g. ``eaas``)."""
        return to_argv(self, "expert-server", always=("server_id",))
