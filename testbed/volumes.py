"""A pod's volumes on a process node: configMap, secret, projected (with service-account
tokens from the TokenRequest API), downwardAPI, emptyDir and hostPath, made under the pod's
folder and refreshed like the kubelet's (an atomic ``..data`` symlink swap)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from . import pod as podlogic
from .node import HOST_IP, Node

log = logging.getLogger("eaas.testbed.agent")

VOLUME_SYNC_ANNOTATION = "testbed.eaas.io/volume-sync-seconds"


class PodVolumes:
    """The volumes of one pod, under ``<pod dir>/volumes``."""

    def __init__(self, node: Node, pod_dir: Path):
        self.node = node
        self.dir = pod_dir
        self.volumes: dict[str, dict] = {}  # name -> {"path", "ro", "files", "spec"}
        self.token_cache: dict[str, tuple[float, str]] = {}
        self.next_sync = 0.0

    def setup(self, pod: dict, pod_ip: str) -> None:
        """Make every volume of ``pod`` (content volumes written, emptyDir and hostPath folders
        made as their ``type`` asks).

        Raises:
            podlogic.PodConfigError: a volume type the node agent does not support, a missing
                configMap/secret/key that is not optional, or a hostPath of the wrong kind.
        """
        vdir = self.dir / "volumes"
        for v in pod["spec"].get("volumes") or []:
            name = v["name"]
            files = self._content(v, pod, pod_ip)
            if files is not None:
                path = vdir / name
                path.mkdir(parents=True, exist_ok=True)
                atomic_write(path, files)
                self.volumes[name] = {"path": str(path), "ro": True, "files": files, "spec": v}
            elif "emptyDir" in v:
                path = vdir / name
                path.mkdir(parents=True, exist_ok=True)
                self.volumes[name] = {"path": str(path), "ro": False}
            elif "hostPath" in v:
                hp = v["hostPath"]
                p, typ = Path(hp["path"]), hp.get("type", "")
                if typ == "DirectoryOrCreate":
                    p.mkdir(parents=True, exist_ok=True)
                elif typ == "FileOrCreate":
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.touch(exist_ok=True)
                elif typ == "Directory" and not p.is_dir():
                    raise podlogic.PodConfigError(
                        f"volume {name!r}: hostPath {p} is not a directory"
                    )
                elif typ == "File" and not p.is_file():
                    raise podlogic.PodConfigError(f"volume {name!r}: hostPath {p} is not a file")
                self.volumes[name] = {"path": str(p), "ro": False}
            else:
                kinds = sorted(k for k in v if k != "name")
                raise podlogic.PodConfigError(
                    f"volume {name!r}: type {kinds} is not supported by the testbed node agent"
                )
        self.next_sync = time.monotonic() + self._sync_period(pod)

    def mounts(self, spec: dict, env: dict) -> list[dict]:
        """The mounts (``src``, ``dst``, ``ro``) of the container of ``spec`` (its
        ``volumeMounts``, ``subPath``/``subPathExpr`` expanded with ``env``), for podinit.

        Raises:
            podlogic.PodConfigError: a mount names no volume of the pod.
        """
        mounts = []
        for m in spec.get("volumeMounts") or []:
            v = self.volumes.get(m["name"])
            if v is None:
                raise podlogic.PodConfigError(f"volumeMount {m['name']!r}: no such volume")
            src = v["path"]
            sub = m.get("subPath") or podlogic.expand(m.get("subPathExpr", ""), env)
            if sub:
                src = os.path.join(src, sub)
                if not os.path.exists(src) and not v["ro"]:
                    os.makedirs(src, exist_ok=True)
            mounts.append(
                {"src": src, "dst": m["mountPath"], "ro": v["ro"] or bool(m.get("readOnly"))}
            )
            top = "/" + m["mountPath"].strip("/").split("/")[0]
            if not os.path.lexists(top):
                # a new top-level folder cannot be overlaid; create it (removed at `down`)
                os.makedirs(top, exist_ok=True)
                with open(self.node.state_dir.parent / "host-dirs", "a") as f:  # <state>/nodes/
                    f.write(top + "\n")
        return mounts

    def maybe_sync(self, pod: dict, pod_ip: str, who: str) -> None:
        """Refresh the content volumes when their sync period (``--volume-sync-s``, or the
        pod's annotation) is due; a refresh that fails is logged and retried next period."""
        if time.monotonic() < self.next_sync:
            return
        self.next_sync = time.monotonic() + self._sync_period(pod)
        for v in self.volumes.values():
            if "files" not in v:
                continue
            try:
                files = self._content(v["spec"], pod, pod_ip)
            except Exception as e:
                log.warning("%s: volume refresh failed: %s", who, e)
                continue
            if files is not None and files != v["files"]:
                atomic_write(Path(v["path"]), files)
                v["files"] = files

    def _sync_period(self, pod: dict) -> float:
        ann = (pod["metadata"].get("annotations") or {}).get(VOLUME_SYNC_ANNOTATION)
        try:
            return float(ann) if ann is not None else self.node.volume_sync_s
        except ValueError:
            return self.node.volume_sync_s

    def _content(self, v: dict, pod: dict, pod_ip: str) -> dict | None:
        """Files of a content volume (relpath -> (bytes, mode)), or None if not one."""
        what = f"volume {v['name']!r}"
        ns = pod["metadata"]["namespace"]
        if "configMap" in v:
            return self._keyed("configmap", v["configMap"], 0o644, what, ns)
        if "secret" in v:
            return self._keyed("secret", v["secret"], 0o644, what, ns)
        if "downwardAPI" in v:
            d = v["downwardAPI"]
            return self._downward(
                d.get("items") or [], d.get("defaultMode", 0o644), what, pod, pod_ip
            )
        if "projected" in v:
            p = v["projected"]
            mode = p.get("defaultMode", 0o644)
            out: dict = {}
            sa = pod["spec"].get("serviceAccountName", "default")
            for src in p.get("sources") or []:
                if "configMap" in src:
                    out.update(
                        self._keyed(
                            "configmap", {"defaultMode": mode, **src["configMap"]}, mode, what, ns
                        )
                    )
                elif "secret" in src:
                    out.update(
                        self._keyed(
                            "secret", {"defaultMode": mode, **src["secret"]}, mode, what, ns
                        )
                    )
                elif "downwardAPI" in src:
                    out.update(
                        self._downward(
                            src["downwardAPI"].get("items") or [], mode, what, pod, pod_ip
                        )
                    )
                elif "serviceAccountToken" in src:
                    t = src["serviceAccountToken"]
                    out[t["path"]] = (self._token(sa, t, pod), mode)
                else:
                    raise podlogic.PodConfigError(
                        f"{what}: projected source {sorted(src)} unsupported"
                    )
            return out
        return None

    def _keyed(self, kind: str, src: dict, default_mode: int, what: str, ns: str) -> dict:
        name = str(src.get("name") or src.get("secretName"))
        data = self.node.config_data(kind, name, ns)
        if data is None:
            if src.get("optional"):
                return {}
            raise podlogic.PodConfigError(f"{what}: {kind} {name!r} not found")
        mode = src.get("defaultMode", default_mode)
        items = src.get("items")
        if not items:
            return {k: (v, mode) for k, v in data.items()}
        out = {}
        for it in items:
            if it["key"] not in data:
                if src.get("optional"):
                    continue
                raise podlogic.PodConfigError(f"{what}: key {it['key']!r} not in {kind} {name!r}")
            out[it["path"]] = (data[it["key"]], it.get("mode", mode))
        return out

    def _downward(self, items: list, mode: int, what: str, pod: dict, pod_ip: str) -> dict:
        out = {}
        for it in items:
            if "fieldRef" in it:
                v = podlogic.field_ref(pod, it["fieldRef"]["fieldPath"], pod_ip, HOST_IP)
            elif "resourceFieldRef" in it:
                r = it["resourceFieldRef"]
                ctr = next(
                    (c for c in pod["spec"]["containers"] if c["name"] == r.get("containerName")),
                    pod["spec"]["containers"][0],
                )
                v = podlogic.resource_field_ref(ctr, r["resource"], r.get("divisor"))
            else:
                raise podlogic.PodConfigError(f"{what}: downwardAPI item {sorted(it)} unsupported")
            out[it["path"]] = (v.encode(), it.get("mode", mode))
        return out

    def _token(self, sa: str, src: dict, pod: dict) -> bytes:
        exp = int(src.get("expirationSeconds", 3607))
        key = f"{sa}/{src.get('audience', '')}/{exp}"
        cached = self.token_cache.get(key)
        if cached and time.monotonic() < cached[0]:
            return cached[1].encode()
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [src["audience"]] if src.get("audience") else [],
                "expirationSeconds": exp,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            },
        }
        resp = self.node.core.create_namespaced_service_account_token(
            sa, pod["metadata"]["namespace"], body, _preload_content=False
        )
        token = json.loads(resp.data)["status"]["token"]
        self.token_cache[key] = (time.monotonic() + 0.8 * exp, token)  # kubelet: refresh at 80%
        return token.encode()


def atomic_write(path: Path, files: dict[str, tuple[bytes, int]]) -> None:
    """Write ``files`` (relpath -> (content, mode)) into ``path`` the way the kubelet's
    AtomicWriter does: a fresh ``..<timestamp>`` folder, then one ``rename`` of the ``..data``
    symlink, with each top-level name a symlink into ``..data``; readers never see a mix."""
    ts = path / f"..{time.time_ns()}"
    ts.mkdir()
    for rel, (data, mode) in files.items():
        f = ts / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
        f.chmod(mode)
    data_link = path / "..data"
    old = os.readlink(data_link) if data_link.is_symlink() else None
    tmp = path / "..data_tmp"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(ts.name, tmp)
    os.replace(tmp, data_link)
    tops = {rel.split("/")[0] for rel in files}
    for top in tops:
        link = path / top
        if not link.is_symlink():
            os.symlink(f"..data/{top}", link)
    for entry in path.iterdir():
        if not entry.name.startswith("..") and entry.name not in tops and entry.is_symlink():
            entry.unlink()
    if old and old != ts.name:
        shutil.rmtree(path / old, ignore_errors=True)
