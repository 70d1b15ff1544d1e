"""Build (once) the binaries of the local Kubernetes testbed from Go sources.

What: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (from the Go module
``k8s.io/kubernetes``), etcd (``go.etcd.io/etcd/server/v3``'s ``etcdmain``), kwok (the kwok
controller alone, ``sigs.k8s.io/kwok/cmd/kwok``) and helm (``helm.sh/helm/v3/cmd/helm``).

Why from source: there is no Docker engine and no internet except package registries on the
machines this project is developed and tested on, but the Go module proxy is reachable, so
``go build`` is the one way to get real, pinned binaries (the same route envtest's
``setup-envtest`` avoids only by downloading release tarballs).

How: ``k8s.io/kubernetes`` and etcd's server module cannot be ``go install``-ed directly because
their go.mod files use ``replace`` directives (k8s.io/* staging modules live in-tree as
``v0.0.0``). So each of them is built from a small generated helper module (see
:data:`RECIPE`): a go.mod that requires the upstream module and ``replace``s every staging
module with its published ``v0.X.Y`` version (the list is k8s.io/kubernetes's own go.mod
``replace`` block). The helper module sources are generated into the cache directory at build
time; only this recipe is kept in the repository. kwok and helm have no replace directives and
are built with ``go install <pkg>@<version>``.

Binaries land in ``~/.cache/eaas/testbed/<k8s-version>-<recipe hash>/bin/``; the hash covers
this whole recipe and the Go toolchain version, so changing either rebuilds into a fresh
folder. If ``KUBEBUILDER_ASSETS`` points at a folder holding all the binaries, that folder is
used and nothing is built (the same variable envtest uses).

The Go module and build caches stay at Go's defaults (``~/go/pkg/mod``, ``~/.cache/go-build``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

K8S_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"  # the etcd that k8s.io/kubernetes v1.36.3 itself depends on
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"

# k8s.io/kubernetes go.mod's replace block (./staging/src/k8s.io/*), minus sample-cli-plugin,
# which is not published at v0.36.x and which nothing we build imports.
_STAGING = [
    "api",
    "apiextensions-apiserver",
    "apimachinery",
    "apiserver",
    "cli-runtime",
    "client-go",
    "cloud-provider",
    "cluster-bootstrap",
    "code-generator",
    "component-base",
    "component-helpers",
    "controller-manager",
    "cri-api",
    "cri-client",
    "cri-streaming",
    "csi-translation-lib",
    "dynamic-resource-allocation",
    "endpointslice",
    "externaljwt",
    "kms",
    "kube-aggregator",
    "kube-controller-manager",
    "kube-proxy",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "metrics",
    "mount-utils",
    "pod-security-admission",
    "sample-apiserver",
    "sample-controller",
    "streaming",
]

#: Every binary the testbed needs.
BINARIES = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
]


def _staging_version(k8s_version: str) -> str:
    major, minor, patch = k8s_version.lstrip("v").split(".")
    return f"v0.{minor}.{patch}"


def _k8s_gomod(k8s_version: str) -> str:
    sv = _staging_version(k8s_version)
    repl = "\n".join(f"\tk8s.io/{m} => k8s.io/{m} {sv}" for m in _STAGING)
    return (
        "module eaas.local/testbed/kubernetes\n\n"
        "go 1.26.0\n\n"
        "godebug default=go1.26\n\n"
        f"require k8s.io/kubernetes {k8s_version}\n\n"
        f"replace (\n{repl}\n)\n"
    )


def _k8s_ldflags(k8s_version: str) -> str:
    major, minor, _ = k8s_version.lstrip("v").split(".")
    pairs = {
        "gitVersion": k8s_version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.{k}={v}" for k, v in pairs.items()]
    return " ".join(flags)


_ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


def _etcd_gomod(etcd_version: str) -> str:
    return (
        "module eaas.local/testbed/etcd\n\n"
        "go 1.24.0\n\n"
        f"require go.etcd.io/etcd/server/v3 {etcd_version}\n"
    )


#: The build recipe. Each entry is one ``go build`` (helper module) or ``go install``.
RECIPE: list[dict] = [
    {
        "name": "etcd",
        "kind": "module",
        "gomod": _etcd_gomod(ETCD_VERSION),
        "files": {"main.go": _ETCD_MAIN},
        "packages": {"etcd": "."},
        "ldflags": "",
    },
    {
        "name": "kubernetes",
        "kind": "module",
        "gomod": _k8s_gomod(K8S_VERSION),
        "files": {},
        "packages": {
            "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
            "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
            "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
            "kubectl": "k8s.io/kubernetes/cmd/kubectl",
        },
        "ldflags": _k8s_ldflags(K8S_VERSION),
    },
    {
        "name": "kwok",
        "kind": "install",
        "packages": {"kwok": f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}"},
        "ldflags": "",
    },
    {
        "name": "helm",
        "kind": "install",
        "packages": {"helm": f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"},
        "ldflags": f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
    },
]


class BuildError(RuntimeError):
    """A ``go`` command failed or the Go toolchain is missing."""


def go_binary() -> str:
    """Path of the ``go`` tool: ``$GO``, ``go`` on PATH, or ``/usr/local/go/bin/go``.

    Raises:
        BuildError: no Go toolchain found.
    """
    for cand in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise BuildError(
        "no Go toolchain found (set $GO or put `go` on PATH); "
        "or point KUBEBUILDER_ASSETS at prebuilt binaries"
    )


def _go_version(go: str) -> str:
    return subprocess.run(
        [go, "env", "GOVERSION"], capture_output=True, text=True, check=True
    ).stdout.strip()


def recipe_hash(go: str | None = None) -> str:
    """Short hash of :data:`RECIPE` plus the Go toolchain version (the cache key)."""
    go = go or go_binary()
    blob = json.dumps({"recipe": RECIPE, "go": _go_version(go)}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cache_root() -> Path:
    """``$EAAS_CACHE_DIR/testbed`` or ``~/.cache/eaas/testbed``."""
    base = os.environ.get("EAAS_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "eaas") / "testbed"


def _has_all(d: Path) -> bool:
    return all((d / b).is_file() and os.access(d / b, os.X_OK) for b in BINARIES)


def find_bin_dir() -> Path | None:
    """Return a folder holding all :data:`BINARIES` without building, or None.

    ``KUBEBUILDER_ASSETS`` wins when it holds them all.
    """
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and _has_all(Path(assets)):
        return Path(assets)
    try:
        d = cache_root() / f"{K8S_VERSION}-{recipe_hash()}" / "bin"
    except BuildError:
        return None
    return d if _has_all(d) else None


def _run(cmd: list[str], cwd: Path, env: dict, log) -> None:
    log.write(f"$ {' '.join(cmd)}  (in {cwd})\n")
    log.flush()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); see {log.name}")


def build(force: bool = False, echo=print) -> Path:
    """Build every missing binary into the cache and return the ``bin`` folder.

    Prints one line per binary (``[i/n] building kube-apiserver ...`` with timing). Safe to
    call again: binaries already present are kept (unless ``force``). Uses
    ``KUBEBUILDER_ASSETS`` instead when it holds all binaries.

    Raises:
        BuildError: a ``go`` command failed; the log file named in the message has the output.
    """
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        if _has_all(Path(assets)):
            return Path(assets)
        missing = [b for b in BINARIES if not (Path(assets) / b).is_file()]
        raise BuildError(f"KUBEBUILDER_ASSETS={assets} lacks {missing}")
    go = go_binary()
    root = cache_root() / f"{K8S_VERSION}-{recipe_hash(go)}"
    bin_dir, src_dir = root / "bin", root / "src"
    bin_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("CGO_ENABLED", "0")
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -mod=mod").strip()
    env["GOTOOLCHAIN"] = "local"
    todo = [
        (step, name, pkg)
        for step in RECIPE
        for name, pkg in step["packages"].items()
        if force or not (bin_dir / name).is_file()
    ]
    if not todo:
        return bin_dir
    log_path = root / "build.log"
    t_all = time.monotonic()
    with open(log_path, "a") as log:
        for i, (step, name, pkg) in enumerate(todo, 1):
            echo(f"[{i}/{len(todo)}] building {name} ({pkg}) ...")
            t0 = time.monotonic()
            flags = ["-trimpath", "-ldflags", ("-s -w " + step["ldflags"]).strip()]
            tmp_out = bin_dir / f".{name}.tmp"
            if step["kind"] == "module":
                mod = src_dir / step["name"]
                mod.mkdir(parents=True, exist_ok=True)
                (mod / "go.mod").write_text(step["gomod"])
                for fname, text in step["files"].items():
                    (mod / fname).write_text(text)
                _run([go, "build", *flags, "-o", str(tmp_out), pkg], mod, env, log)
            else:
                gobin = src_dir / f"gobin-{name}"
                gobin.mkdir(parents=True, exist_ok=True)
                env_i = dict(env, GOBIN=str(gobin))
                env_i["GOFLAGS"] = env_i["GOFLAGS"].replace("-mod=mod", "").strip()
                _run([go, "install", *flags, pkg], src_dir, env_i, log)
                shutil.move(str(gobin / name), tmp_out)
            os.replace(tmp_out, bin_dir / name)
            echo(f"[{i}/{len(todo)}] built {name} in {time.monotonic() - t0:.0f}s")
    echo(f"testbed binaries ready in {bin_dir} ({time.monotonic() - t_all:.0f}s)")
    return bin_dir


if __name__ == "__main__":  # python -m eaas.testbed.binaries
    try:
        print(build(force="--force" in sys.argv))
    except BuildError as e:
        sys.exit(f"error: {e}")
