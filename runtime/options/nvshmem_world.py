"""The membership side of an NVSHMEM world, without torch or nvshmem4py (pure).

Who is which processing element (PE), how a process joins (:class:`WorldConfig`: the
``--nvshmem-*`` flags / env vars) and the environment a launcher or the operator gives each
member (:func:`world_env`). Split from :mod:`eaas.runtime.transport.nvshmem` so that the
operator (which never imports torch) builds pod environments with the same code; that module
re-exports every name here. Design: docs/gpu.md "nvshmem:PE" and "Elastic membership".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


class MembershipError(RuntimeError):
    """No spare PE left (a new NVSHMEM world is needed) or a PE/role misuse."""


@dataclass
class PeMembership:
    """Who holds which PE of one fixed-size NVSHMEM world (pure logic, no NVSHMEM calls).

    Args:
        world_size: ``max_pes`` of the world.
        clients: PEs of the attention clients (fixed for the world's life).

    Every other PE starts as a spare. :meth:`join` hands a spare to a server, :meth:`leave`
    returns it, :meth:`retire` removes a dead PE for good.
    """

    world_size: int
    clients: frozenset[int]
    servers: dict[str, int] = field(default_factory=dict)
    retired: set[int] = field(default_factory=set)

    def __post_init__(self):
        bad = [p for p in self.clients if not 0 <= p < self.world_size]
        if bad:
            raise MembershipError(f"client PEs {bad} outside the world of {self.world_size}")

    @property
    def spares(self) -> list[int]:
        """Free PEs, ascending."""
        used = set(self.clients) | set(self.servers.values()) | self.retired
        return [p for p in range(self.world_size) if p not in used]

    def join(self, server_id: str) -> int:
        """Give ``server_id`` a spare PE (idempotent). Raises MembershipError when none is left:
        the caller must start a new world (re-init)."""
        if server_id in self.servers:
            return self.servers[server_id]
        free = self.spares
        if not free:
            raise MembershipError(
                f"no spare PE left in the NVSHMEM world of {self.world_size} "
                f"({len(self.servers)} servers, {len(self.retired)} retired): start a new world"
            )
        self.servers[server_id] = free[0]
        return free[0]

    def leave(self, server_id: str) -> int:
        """Return ``server_id``'s PE to the spare pool (after the routing table dropped it)."""
        try:
            return self.servers.pop(server_id)
        except KeyError:
            raise MembershipError(f"server {server_id} holds no PE") from None

    def retire(self, server_id: str) -> int:
        """The server's process died: its PE is never handed out again in this world."""
        pe = self.leave(server_id)
        self.retired.add(pe)
        return pe

    def endpoint(self, server_id: str) -> str:
        """``nvshmem:PE`` of a joined server (what the routing table publishes)."""
        if server_id not in self.servers:
            raise MembershipError(f"server {server_id} holds no PE")
        return f"nvshmem:{self.servers[server_id]}"


@dataclass(frozen=True)
class WorldLayout:
    """PE numbers of one NVSHMEM world: clients first, then servers, then spares.

    Attributes:
        clients: attention clients (``C``): PEs ``0 .. C-1``.
        servers: expert servers started with experts (``S``): PEs ``C .. C+S-1``.
        spares: idle expert-server processes already in the world (docs/gpu.md "Elastic
            membership"): PEs ``C+S .. C+S+spares-1``.
    """

    clients: int
    servers: int
    spares: int

    def __post_init__(self):
        if self.clients < 1 or self.servers < 0 or self.spares < 0:
            raise ValueError(
                f"an NVSHMEM world needs >= 1 client and >= 0 servers / spares, got "
                f"{self.clients} / {self.servers} / {self.spares}"
            )

    @property
    def world_size(self) -> int:
        """``max_pes`` = clients + servers + spares."""
        return self.clients + self.servers + self.spares

    def pe(self, role: str, index: int) -> int:
        """PE of the ``index``-th ``role`` (``client`` | ``server`` | ``spare``).

        Raises:
            ValueError: unknown role or an index outside the role's count.
        """
        base = {"client": 0, "server": self.clients, "spare": self.clients + self.servers}
        count = {"client": self.clients, "server": self.servers, "spare": self.spares}
        if role not in base:
            raise ValueError(f"role must be client, server or spare, got {role!r}")
        if not 0 <= index < count[role]:
            raise ValueError(f"{role} index {index} outside 0..{count[role] - 1}")
        return base[role] + index

    def membership(self) -> PeMembership:
        """The world's :class:`PeMembership` with the started servers joined as
        ``server-<i>`` (the spares free)."""
        m = PeMembership(self.world_size, frozenset(range(self.clients)))
        for i in range(self.servers):
            m.servers[f"server-{i}"] = self.pe("server", i)
        return m


ENV_WORLD_SIZE = "EAAS_NVSHMEM_WORLD_SIZE"
ENV_PE = "EAAS_NVSHMEM_PE"
ENV_UID_FILE = "EAAS_NVSHMEM_UID_FILE"
#: Identical pods (an AttentionFleet's Deployment) claim a client PE instead of being given one.
ENV_CLIENT_PES = "EAAS_NVSHMEM_CLIENT_PES"


@dataclass(frozen=True)
class WorldConfig:
    """How one process joins the NVSHMEM world (``eaas`` flags ``--nvshmem-world``,
    ``--nvshmem-pe``, ``--nvshmem-uid-file`` or the env vars of :func:`world_env`).

    Attributes:
        world_size: ``max_pes``.
        pe: this process's PE.
        uid_file: where PE 0 writes the world's unique id and the other PEs read it (a path on
            storage every member sees, e.g. a shared volume).
    """

    world_size: int
    pe: int
    uid_file: str

    def __post_init__(self):
        if self.world_size < 2:
            raise ValueError(f"--nvshmem-world must be >= 2 PEs, got {self.world_size}")
        if not 0 <= self.pe < self.world_size:
            raise ValueError(f"--nvshmem-pe {self.pe} outside the world of {self.world_size} PEs")
        if not self.uid_file:
            raise ValueError("--nvshmem-uid-file is required with --nvshmem-world")

    @classmethod
    def from_options(
        cls, world_size: int | None, pe: int | None, uid_file: str | None
    ) -> WorldConfig | None:
        """The config from the three CLI options, or None when none is given.

        Raises:
            ValueError: some but not all are given, or bad values (the message names the flag).
        """
        given = [v is not None and v != "" for v in (world_size, pe, uid_file)]
        if not any(given):
            return None
        if not all(given):
            raise ValueError(
                "--nvshmem-world, --nvshmem-pe and --nvshmem-uid-file go together "
                f"(env {ENV_WORLD_SIZE}, {ENV_PE}, {ENV_UID_FILE})"
            )
        assert world_size is not None and pe is not None and uid_file is not None
        return cls(int(world_size), int(pe), str(uid_file))


def world_env(
    layout: WorldLayout, role: str, index: int, uid_file: str, *, ibgda: bool = True
) -> dict[str, str]:
    """Environment of one member process (what a launcher or the operator sets on its pod):
    :data:`ENV_WORLD_SIZE`, :data:`ENV_PE`, :data:`ENV_UID_FILE` and :func:`ibgda_env`.

    Raises:
        ValueError: see :meth:`WorldLayout.pe`.
    """
    return {
        ENV_WORLD_SIZE: str(layout.world_size),
        ENV_PE: str(layout.pe(role, index)),
        ENV_UID_FILE: uid_file,
        **ibgda_env(ibgda),
    }


def check_listen_pe(endpoint: str, config: WorldConfig | None) -> None:
    """``--listen nvshmem:PE`` needs the world options, with the same PE.

    Raises:
        ValueError: no world configured, or a PE other than ``--nvshmem-pe``.
    """
    if not endpoint.startswith("nvshmem:"):
        return
    pe = parse_endpoint(endpoint)
    if config is None:
        raise ValueError(
            f"--listen {endpoint} needs the NVSHMEM world: --nvshmem-world, --nvshmem-pe, "
            "--nvshmem-uid-file"
        )
    if pe != config.pe:
        raise ValueError(f"--listen {endpoint} is not this process's --nvshmem-pe {config.pe}")


def parse_endpoint(endpoint: str) -> int:
    """``nvshmem:3`` -> 3. Raises ValueError otherwise."""
    if not endpoint.startswith("nvshmem:"):
        raise ValueError(f"not an nvshmem endpoint: {endpoint!r}")
    tail = endpoint[len("nvshmem:") :]
    if not tail.isdigit():
        raise ValueError(f"nvshmem endpoint needs a PE number, got {endpoint!r}")
    return int(tail)


def ibgda_env(enable: bool = True) -> dict[str, str]:
    """NVSHMEM settings that turn on IBGDA (GPU-initiated RDMA) where the NIC supports it.

    Source: NVSHMEM docs, "Using the NVSHMEM InfiniBand GPUDirect Async Transport"
    (``NVSHMEM_IB_ENABLE_IBGDA``). Set them in the process environment before init.
    """
    return {"NVSHMEM_IB_ENABLE_IBGDA": "1" if enable else "0"}


def client_env(layout: WorldLayout, uid_file: str, *, ibgda: bool = True) -> dict[str, str]:
    """Environment of an attention client that claims its PE (:func:`claim_client_pe`): the
    world size, the uid file, :data:`ENV_CLIENT_PES` (how many client PEs there are) and
    :func:`ibgda_env`. For identical pods, which cannot each be given a PE."""
    return {
        ENV_WORLD_SIZE: str(layout.world_size),
        ENV_CLIENT_PES: str(layout.clients),
        ENV_UID_FILE: uid_file,
        **ibgda_env(ibgda),
    }


def claim_client_pe(uid_file: str, clients: int, holder: str) -> int:
    """Claim the lowest free client PE ``0 .. clients-1`` of the world whose unique id lives in
    ``uid_file``: an exclusive create of ``<uid_file>.client-<PE>`` holding ``holder`` (the
    pod name), atomic on one file system, so concurrent claimers get distinct PEs. A holder
    that already claimed one (a restarted container of the same pod) gets it back.

    Args:
        uid_file: the world's unique-id file (its directory is the shared volume).
        clients: client PEs of the world (``>= 1``).
        holder: this process's stable name (the pod name: ``HOSTNAME``); not empty.

    Returns:
        the claimed PE.

    Raises:
        ValueError: bad arguments.
        MembershipError: every client PE is held by another holder (more clients than the
            world has client PEs, or a client was replaced: the world must be restarted).
    """
    if clients < 1:
        raise ValueError(f"--nvshmem-client-pes must be >= 1, got {clients}")
    if not holder or "\n" in holder:
        raise ValueError(f"a client PE holder needs a one-line name, got {holder!r}")
    held = {}
    for pe in range(clients):
        path = f"{uid_file}.client-{pe}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = f.read().strip()
            except OSError:
                owner = "?"
            if owner == holder:
                return pe
            held[pe] = owner
            continue
        with os.fdopen(fd, "w") as f:
            f.write(holder + "\n")
        return pe
    raise MembershipError(
        f"no free client PE in 0..{clients - 1} of the NVSHMEM world at {uid_file}: held by "
        f"{held}; the world has a fixed set of PEs, start a new world to replace a client"
    )
