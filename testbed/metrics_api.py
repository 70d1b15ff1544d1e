"""Register an operator's external metrics API with the testbed's aggregation layer.

The kube-apiserver proxies ``/apis/external.metrics.k8s.io/v1beta1/...`` to the Service named by
APIService ``v1beta1.external.metrics.k8s.io``. In the testbed every address is loopback (no
kube-proxy, and EndpointSlices may not hold loopback IPs), so the Service is an
``ExternalName`` Service whose name is the listener's IP (``127.0.0.1`` for an operator run as
a local process, a pod IP for one run as a pod); the apiserver's default (ClusterIP) routing
resolves an ExternalName Service to that host. The serving certificate is signed by the
testbed's CA for ``<service>.<namespace>.svc`` (the name the apiserver verifies) and the
APIService carries that CA as ``caBundle``.

Docs: https://kubernetes.io/docs/tasks/extend-kubernetes/configure-aggregation-layer/
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from . import pki as _pki
from .record import Testbed, TestbedError, api

SERVICE = "eaas-external-metrics"
APISERVICE = "v1beta1.external.metrics.k8s.io"


def register_external_metrics(
    tb: Testbed, host: str, port: int, namespace: str = "eaas-system"
) -> dict[str, str]:
    """Make a serving certificate, the ExternalName Service ``namespace/eaas-external-metrics``
    (-> ``host``) and the APIService (``caBundle``: the testbed CA); replaces earlier ones.

    Returns:
        The operator's environment for the listener: ``EAAS_OPERATOR_METRICS_LISTEN``
        (``host:port``), ``EAAS_OPERATOR_METRICS_CERT_FILE``, ``EAAS_OPERATOR_METRICS_KEY_FILE``.

    Raises:
        TestbedError: an API call failed.
    """
    pki_dir = tb.state_dir / "pki"
    name = "external-metrics"
    if not (pki_dir / f"{name}.crt").exists():
        _pki._sign(
            pki_dir,
            name,
            f"/CN={SERVICE}.{namespace}.svc",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            f"subjectAltName=DNS:{SERVICE}.{namespace}.svc,DNS:{SERVICE}.{namespace}.svc."
            f"cluster.local,IP:{host}\n",
        )
        (pki_dir / f"{name}.key").chmod(0o600)
    _ensure(tb, "/api/v1/namespaces", {"metadata": {"name": namespace}})
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": namespace},
        "spec": {"type": "ExternalName", "externalName": host},
    }
    _replace(tb, f"/api/v1/namespaces/{namespace}/services", SERVICE, svc)
    apisvc = {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": APISERVICE},
        "spec": {
            "group": "external.metrics.k8s.io",
            "version": "v1beta1",
            "service": {"namespace": namespace, "name": SERVICE, "port": port},
            "caBundle": base64.b64encode((pki_dir / "ca.crt").read_bytes()).decode(),
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
        },
    }
    _replace(tb, "/apis/apiregistration.k8s.io/v1/apiservices", APISERVICE, apisvc)
    return {
        "EAAS_OPERATOR_METRICS_LISTEN": f"{host}:{port}",
        "EAAS_OPERATOR_METRICS_CERT_FILE": str(Path(pki_dir / f"{name}.crt")),
        "EAAS_OPERATOR_METRICS_KEY_FILE": str(Path(pki_dir / f"{name}.key")),
    }


def _ensure(tb: Testbed, path: str, body: dict) -> None:
    status, out = api(tb, "POST", path, body)
    if status not in (200, 201, 409):
        raise TestbedError(f"POST {path}: {status} {json.dumps(out)[:500]}")


def _replace(tb: Testbed, collection: str, name: str, body: dict) -> None:
    api(tb, "DELETE", f"{collection}/{name}")
    status, out = api(tb, "POST", collection, body)
    if status not in (200, 201):
        raise TestbedError(f"POST {collection}: {status} {json.dumps(out)[:500]}")
