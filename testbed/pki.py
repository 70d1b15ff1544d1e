"""Certificates and keys for the local testbed control plane, made with the ``openssl`` CLI.

What: one CA, the kube-apiserver serving certificate (SANs: 127.0.0.1, localhost and the
in-cluster ``kubernetes.default.svc`` names plus the first service IP), one admin client
certificate (``O=system:masters``, used by kubectl, helm, the controller-manager, the scheduler,
kwok and the tests), the aggregation layer's front-proxy client certificate
(``CN=front-proxy-client``), and the RSA key pair the apiserver signs and verifies service-account tokens
with. This mirrors what envtest (sigs.k8s.io/controller-runtime/pkg/envtest) generates for its
apiserver, with client-certificate instead of token authentication.

Why openssl: it is on every Debian/Ubuntu image and keeps the ``cryptography`` package out of
the project's dependencies.

Errors: :class:`subprocess.CalledProcessError` when ``openssl`` fails; ``FileNotFoundError`` when
it is missing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

_DAYS = "3650"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _key(cwd: Path, name: str) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        f"{name}.key",
        cwd=cwd,
    )


def _sign(cwd: Path, name: str, subject: str, ext: str) -> None:
    _key(cwd, name)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=cwd)
    (cwd / f"{name}.ext").write_text(ext)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        _DAYS,
        "-sha256",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=cwd,
    )
    (cwd / f"{name}.csr").unlink()
    (cwd / f"{name}.ext").unlink()


def make_pki(pki_dir: Path, service_ip: str) -> dict[str, Path]:
    """Create all certificates and keys in ``pki_dir`` (created, mode 0700).

    Returns a dict of paths: ``ca_crt, ca_key, apiserver_crt, apiserver_key, admin_crt,
    admin_key, front_proxy_client_crt, front_proxy_client_key, sa_key, sa_pub``.
    """
    pki_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    _key(pki_dir, "ca")
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-subj",
        "/CN=eaas-testbed-ca",
        "-days",
        _DAYS,
        "-sha256",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-out",
        "ca.crt",
        cwd=pki_dir,
    )
    sans = ",".join(
        [
            "IP:127.0.0.1",
            f"IP:{service_ip}",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )
    _sign(
        pki_dir,
        "apiserver",
        "/CN=kube-apiserver",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={sans}\n",
    )
    _sign(
        pki_dir,
        "admin",
        "/O=system:masters/CN=eaas-testbed-admin",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n",
    )
    # the aggregation layer's client certificate (kube-apiserver --proxy-client-cert-file):
    # the apiserver presents it to aggregated API servers (the operator's external metrics API),
    # which verify it against --requestheader-client-ca-file (our CA) and its allowed names
    _sign(
        pki_dir,
        "front-proxy-client",
        "/CN=front-proxy-client",
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n",
    )
    _key(pki_dir, "sa")
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki_dir)
    names = {
        "ca": "ca",
        "apiserver": "apiserver",
        "admin": "admin",
        "front_proxy_client": "front-proxy-client",
    }
    out = {}
    for k, n in names.items():
        out[f"{k}_crt"] = pki_dir / f"{n}.crt"
        out[f"{k}_key"] = pki_dir / f"{n}.key"
    out["sa_key"] = pki_dir / "sa.key"
    out["sa_pub"] = pki_dir / "sa.pub"
    for p in pki_dir.iterdir():
        if p.suffix == ".key":
            p.chmod(0o600)
    return out
