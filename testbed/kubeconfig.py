"""The testbed's kubeconfig: the admin's client certificate, inline."""

from __future__ import annotations

import base64
import json
from pathlib import Path


def write_kubeconfig(path: Path, server: str, pki: dict) -> None:
    """Write the admin kubeconfig of the apiserver at ``server`` to ``path`` (mode 0600), with
    the CA, certificate and key files of ``pki`` (:func:`.pki.make_pki`) inline."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "eaas-testbed",
        "clusters": [
            {
                "name": "eaas-testbed",
                "cluster": {"server": server, "certificate-authority-data": b64(pki["ca_crt"])},
            }
        ],
        "users": [
            {
                "name": "eaas-testbed-admin",
                "user": {
                    "client-certificate-data": b64(pki["admin_crt"]),
                    "client-key-data": b64(pki["admin_key"]),
                },
            }
        ],
        "contexts": [
            {
                "name": "eaas-testbed",
                "context": {
                    "cluster": "eaas-testbed",
                    "user": "eaas-testbed-admin",
                    "namespace": "default",
                },
            }
        ],
        "preferences": {},
    }
    path.write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
    path.chmod(0o600)
