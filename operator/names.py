"""Names, labels and the owner identity of what the operator makes (pure).

Names are deterministic, so a restarted operator finds what it made before:

* expert-server pod ``<pool>-<index>``, ``0 <= index < spec.replicas``;
* routing-table ConfigMap ``<pool>-routing-table`` (key ``routing-table.json``);
* expert-load ConfigMap ``<pool>-expert-load`` (key ``expert-load.json``, read, never written);
* attention fleet Deployment and Service ``<fleet>``;
* the fleet's push-token Secret ``<fleet>-push-token`` (key ``token``);
* the clients' ServiceAccount, Role and RoleBinding ``<fleet>-client`` (read the pool's
  routing-table ConfigMap).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaas.operator.crd import API_VERSION, LABEL_FLEET, LABEL_POOL, LABEL_ROLE

SERVER_ROLE = "expert-server"
CLIENT_ROLE = "attention-client"
LOAD_KEY = "expert-load.json"
PUSH_TOKEN_KEY = "token"
PUSH_TOKEN_MOUNT_DIR = "/etc/eaas/push-token"
GPU_RESOURCE = "nvidia.com/gpu"
MANAGED_BY = "eaas-operator"


# ---------------------------------------------------------------------------------------------
# identity and names
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Owner:
    """The custom object that owns what we build.

    Attributes:
        kind: ``ExpertPool`` or ``AttentionFleet``.
        name, namespace, uid: from its metadata.
        generation: ``metadata.generation`` (0 if absent).
    """

    kind: str
    name: str
    namespace: str
    uid: str
    generation: int = 0

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(
            kind=body["kind"],
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation") or 0),
        )

    def reference(self) -> dict[str, Any]:
        """ownerReference with ``controller`` and ``blockOwnerDeletion`` (GC deletes dependants)."""
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def server_name(pool: str, index: int) -> str:
    """Pod name of expert server ``index`` of ``pool``."""
    return f"{pool}-{index}"


def table_configmap_name(pool: str) -> str:
    """Name of the pool's routing-table ConfigMap."""
    return f"{pool}-routing-table"


def push_secret_name(fleet: str) -> str:
    """Name of the fleet's push-token Secret."""
    return f"{fleet}-push-token"


def client_account_name(fleet: str) -> str:
    """Name of the fleet clients' ServiceAccount, Role and RoleBinding."""
    return f"{fleet}-client"


def failure_report_path(namespace: str, fleet: str) -> str:
    """Path of the operator's failure-report endpoint for one fleet's clients."""
    return f"/v1/failure-reports/{namespace}/{fleet}"


def server_labels(pool: str) -> dict[str, str]:
    """Labels shared by all expert-server pods of ``pool`` (the scale selector)."""
    return {LABEL_POOL: pool, LABEL_ROLE: SERVER_ROLE}


def client_labels(fleet: str) -> dict[str, str]:
    """Labels shared by the attention-client pods of ``fleet`` (Deployment and Service selector)."""
    return {LABEL_FLEET: fleet, LABEL_ROLE: CLIENT_ROLE}


def selector_string(labels: Mapping[str, str]) -> str:
    """Label-selector string form (``a=b,c=d``, sorted) as the ``scale`` subresource wants it."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def content_hash(obj: Any, n: int = 10) -> str:
    """First ``n`` hex digits of the SHA-256 of ``obj`` as canonical JSON."""
    return hashlib.sha256(
        json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()[:n]
