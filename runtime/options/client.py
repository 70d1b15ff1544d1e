"""The options of one attention client process (``eaas attention-client``).

Built once, by the CLI from its flags, by ``eaas serve`` for each client it starts and by the
operator for a fleet's pods; validated at construction; :meth:`AttentionClientOptions.argv`
is the command line that starts a client with them. Torch-free (the operator imports it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from eaas.runtime.common.dtypes import check_serving_dtype
from eaas.runtime.options.api_key import api_key_environment, check_api_keys
from eaas.runtime.options.argv import to_argv


def client_id_of(value: str) -> int:
    """The attention client's integer id (int64 ``client_id`` of the transports' frames) from
    ``--client-id``: a decimal integer as is, any other non-empty string (a pod name) as the
    top 63 bits of its BLAKE2b-64 digest, so it is stable for the name and non-negative.
    Distinct names collide with probability about n^2 / 2^64 (n names).

    Raises:
        ValueError: ``value`` is empty or an integer outside ``[0, 2**63)``.
    """
    v = value.strip()
    if not v:
        raise ValueError("--client-id is empty")
    try:
        cid = int(v)
    except ValueError:
        return int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "big") >> 1
    if cid < 0 or cid >= 2**63:
        raise ValueError(f"--client-id {v}: must be in [0, 2**63)")
    return cid


def check_dispatch_timeout(seconds: float) -> float:
    """``seconds`` when it is a finite number > 0 (the deadline of one MoE layer's round trip).

    Raises:
        ValueError: ``--dispatch-timeout must be > 0 seconds, got X``.
    """
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--dispatch-timeout must be > 0 seconds, got {seconds}")
    return seconds


def check_served_model_name(names: str | None) -> str | None:
    """``names`` (``--served-model-name``: model ids, comma-separated; the first is the one
    responses carry) when it is None (not given: the model folder's name) or names at least
    one id, with no empty one.

    Raises:
        ValueError: ``--served-model-name ...: an empty model id`` naming the value.
    """
    if names is not None and any(not n.strip() for n in names.split(",")):
        raise ValueError(
            f"--served-model-name {names!r}: an empty model id (give one or more ids, "
            "comma-separated, or leave the flag out for the model folder's name)"
        )
    return names


@dataclass(kw_only=True)
class AttentionClientOptions:
    """Everything ``eaas attention-client`` is started with (field ``x_y`` is flag ``--x-y``;
    the flags' help in :mod:`eaas.runtime.cli.attention_client` says what each does).

    Units: ``dispatch_timeout`` seconds, ``spin_us`` microseconds, ``kv_cache_memory`` and
    ``max_request_body`` sizes such as ``"2GiB"``. ``None``: not given (the process's default
    applies: the built-in tiny model, no routing-table source of that kind, ...). The field
    order is the order of the flags in :meth:`argv`.

    Raises (at construction):
        ValueError: a ``--dispatch-timeout`` not > 0, a ``--dtype`` other than float32 /
            bfloat16, a ``--spin-us`` not finite or < 0, no routing-table source without
            ``local_experts``, a ``--failure-report-url`` not http(s), an empty or out-of-range
            ``--client-id``, an empty ``--api-key`` or one with a comma or whitespace. The
            message names the flag.
    """

    model: str | None = None
    client_id: str = "0"
    routing_table: str | None = None
    routing_table_configmap: str | None = None
    push_token_file: str | None = None
    port: int = 8000
    host: str = "127.0.0.1"
    reuse_port: bool = False
    failure_report_url: str | None = None
    dispatch_timeout: float = 5.0
    local_experts: bool = False
    dtype: str = "float32"
    cpu_bf16_compute: str = "auto"
    threads: int = 1
    device: str = "auto"
    served_model_name: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: str | None = None
    max_request_body: str = "32MiB"
    prefill_tokens_while_decoding: str = "auto"
    double_batch_overlap: bool = False
    cuda_graphs: bool = False
    spin_us: float | None = None
    nvshmem_world: int | None = None
    nvshmem_pe: int | None = None
    nvshmem_uid_file: str | None = None
    nvshmem_client_pes: int | None = None
    #: keys of the API's ``Authorization: Bearer`` (``--api-key`` / ``$EAAS_API_KEY``; none: the
    #: API is open). Never on the command line: :meth:`environment` carries them to the process.
    api_key: tuple[str, ...] = field(default=(), metadata={"flag": False}, repr=False)

    def __post_init__(self) -> None:
        self.api_key = check_api_keys(self.api_key)
        check_dispatch_timeout(self.dispatch_timeout)
        check_serving_dtype(self.dtype)
        check_served_model_name(self.served_model_name)
        if self.spin_us is not None and not (math.isfinite(self.spin_us) and self.spin_us >= 0):
            raise ValueError(
                f"--spin-us must be a finite number of microseconds, got {self.spin_us}"
            )
        if not self.local_experts and not self.routing_table and not self.routing_table_configmap:
            raise ValueError(
                "--routing-table or --routing-table-configmap is required unless --local-experts "
                "is given"
            )
        url = self.failure_report_url
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"--failure-report-url must be http:// or https://, got {url!r}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        self.numeric_client_id  # noqa: B018  (raises ValueError on a bad --client-id)

    @property
    def numeric_client_id(self) -> int:
        """:func:`client_id_of` ``client_id``: the id in frames, metrics and failure reports."""
        return client_id_of(self.client_id)

    def argv(self) -> list[str]:
        """``["attention-client", "--model", ...]``: the flags that differ from the defaults,
        plus ``--client-id`` and ``--port`` (prepend the program, e.g. ``eaas``)."""
        return to_argv(self, "attention-client", always=("client_id", "port"))

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The environment to start the client with: ``base`` with ``$EAAS_API_KEY`` holding
        :attr:`api_key` (removed when there is none), so the keys stay out of ``ps``."""
        return api_key_environment(base, self.api_key)
