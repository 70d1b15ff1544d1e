"""Kubernetes API I/O shared by the reconcilers: raw reads (JSON bodies without the client's
model deserialization), the custom objects and their status,
server-side apply by spec hash, Events, the routing-table ConfigMap and the push-token Secrets.

Every function raises the client's ``ApiException`` for API errors it does not name.
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
import logging
from collections.abc import Callable
from typing import Any, cast

import kopf
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from eaas.operator.crd import ANNOTATION_SPEC_HASH, ANNOTATION_TABLE_VERSION, GROUP, VERSION
from eaas.operator.fleet import new_push_token
from eaas.operator.names import PUSH_TOKEN_KEY, Owner, table_configmap_name
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.watch import TABLE_KEY
from eaas.runtime.tables.wire import RoutingTableError

#: Plurals of the custom resources.
POOLS = "expertpools"
FLEETS = "attentionfleets"
#: Field manager of everything the operator applies (server-side apply).
FIELD_MANAGER = "eaas-operator"
#: Keyword arguments of a kubernetes-client ``patch_*`` call that make it a server-side apply.
APPLY_OPTIONS: dict[str, Any] = {
    "field_manager": FIELD_MANAGER,
    "force": True,
    "_content_type": "application/apply-patch+yaml",
}
#: RFC 3339 time as Kubernetes writes it (UTC, seconds).
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"

#: ``(namespace, ConfigMap name)`` -> ``(resourceVersion, parsed table)``.
TableCache = dict[tuple[str, str], tuple[str, RoutingTable]]


def json_object(obj: object) -> dict[str, Any]:
    """A ``CustomObjectsApi`` read result as a dict (the client types it ``object``: it returns
    the decoded JSON body, which for one object is a dict).

    Raises:
        TypeError: the body is not a JSON object.
    """
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object from the API, got {type(obj).__name__}")
    return obj


def plain(api: k8s.ApiClient, obj: Any) -> Any:
    """Kubernetes model object -> camelCase dict, as the API returns it."""
    return api.sanitize_for_serialization(obj)


def raw(method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call a kubernetes-client read/list method and return the JSON body as a dict, skipping the
    client's slow model deserialization (40 pods with long command lines: ~10x faster)."""
    resp = method(*args, _preload_content=False, **kwargs)
    return json.loads(resp.data)


def raw_or_none(method: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """:func:`raw`, or None when the object does not exist (404).

    Raises:
        ApiException: any API error but 404.
    """
    try:
        return raw(method, *args, **kwargs)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


def now() -> str:
    """The current time, RFC 3339 (:data:`TIME_FORMAT`)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime(TIME_FORMAT)


def seconds_since(stamp: str) -> float | None:
    """Seconds since an RFC 3339 ``...Z`` time (None: empty or unparsable)."""
    if not stamp:
        return None
    try:
        then = _dt.datetime.strptime(stamp, TIME_FORMAT).replace(tzinfo=_dt.timezone.utc)
    except ValueError:
        return None
    return (_dt.datetime.now(_dt.timezone.utc) - then).total_seconds()


def event(body: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
    """Post a Kubernetes Event about the object ``body`` (a custom object read from the API)."""
    obj = kopf.Body(cast(kopf.RawBody, body))
    (kopf.warn if warning else kopf.info)(obj, reason=reason, message=message)


def get_custom(
    custom: k8s.CustomObjectsApi, namespace: str, plural: str, name: str
) -> dict[str, Any] | None:
    """The custom object ``plural/name``, or None when it does not exist.

    Raises:
        ApiException: any API error but 404.
    """
    try:
        return json_object(
            custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def get_live(
    custom: k8s.CustomObjectsApi, namespace: str, plural: str, name: str
) -> dict[str, Any] | None:
    """The custom object, or None when it is gone or being deleted (nothing left to reconcile).

    Raises:
        ApiException: any API error but 404.
    """
    body = get_custom(custom, namespace, plural, name)
    return None if body is None or body["metadata"].get("deletionTimestamp") else body


def write_status(
    custom: k8s.CustomObjectsApi,
    namespace: str,
    name: str,
    old: dict[str, Any],
    new: dict[str, Any],
    plural: str = POOLS,
) -> bool:
    """Merge-patch ``status`` if it changed; True if written."""
    if all(old.get(k) == v for k, v in new.items()):
        return False
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, plural, name, {"status": new}
    )
    return True


def apply(manifest: dict[str, Any], *, read: Any, patch: Any) -> Any:
    """Server-side apply of ``manifest`` under the field manager :data:`FIELD_MANAGER` (forced:
    the operator owns the fields it sets) when the object is absent or its ``eaas.io/spec-hash``
    differs; the API server creates or merges it. Returns the live object (a kubernetes-client
    model).

    ``read()`` reads the object; ``patch(manifest, **options)`` calls its kubernetes-client
    ``patch_namespaced_*`` method with the apply options (typed ``Any``: the client types the
    body as its model class, which accepts the dict too).

    Raises:
        ApiException: any API error but 404 on the read.
    """
    try:
        live = read()
    except ApiException as exc:
        if exc.status != 404:
            raise
        live = None
    want = manifest["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    if live is not None and (live.metadata.annotations or {}).get(ANNOTATION_SPEC_HASH) == want:
        return live
    return patch(manifest, **APPLY_OPTIONS)


def secret_token(secret: dict[str, Any]) -> str:
    """The push token a Secret holds under ``PUSH_TOKEN_KEY`` ("" : none)."""
    return base64.b64decode((secret.get("data") or {}).get(PUSH_TOKEN_KEY, "")).decode().strip()


def read_token(core: k8s.CoreV1Api, namespace: str, secret_name: str) -> str | None:
    """The push token in Secret ``secret_name`` (None: no such Secret)."""
    secret = raw_or_none(core.read_namespaced_secret, secret_name, namespace)
    return None if secret is None else secret_token(secret)


def ensure_token_secret(
    core: k8s.CoreV1Api,
    cache: dict[tuple[str, str, str], str],
    owner: Owner,
    name: str,
    manifest: Callable[[Owner, str], dict[str, Any]],
) -> str:
    """The bearer token stored under ``PUSH_TOKEN_KEY`` in Secret ``name`` (owned by ``owner``),
    creating the Secret from ``manifest(owner, new_push_token())`` when it is missing (a 409 from
    a racing create is read back). The token never changes once made, so it is cached in
    ``cache`` per (namespace, Secret name, owner uid): a recreated owner gets a new Secret and
    token.

    Used for a pool's server push token (``server_push_secret``) and a fleet's push token
    (``push_secret``).

    Raises:
        kopf.TemporaryError: the Secret exists but has no token (retried in 5 s).
        ApiException: any other API error than 404 on read / 409 on create.
    """
    key = (owner.namespace, name, owner.uid)
    hit = cache.get(key)
    if hit:
        return hit
    secret = raw_or_none(core.read_namespaced_secret, name, owner.namespace)
    if secret is None:
        try:
            raw(core.create_namespaced_secret, owner.namespace, manifest(owner, new_push_token()))
        except ApiException as exc:
            if exc.status != 409:
                raise
        secret = raw(core.read_namespaced_secret, name, owner.namespace)
    token = secret_token(secret)
    if not token:
        raise kopf.TemporaryError(f"Secret {name} has no {PUSH_TOKEN_KEY!r}", delay=5)
    cache[key] = token
    return token


def table_version_of(cm: dict[str, Any]) -> int:
    """The routing-table version annotation of a table ConfigMap (0: none)."""
    return int((cm["metadata"].get("annotations") or {}).get(ANNOTATION_TABLE_VERSION, "0") or 0)


def parse_table(cache: TableCache, namespace: str, cm: dict[str, Any]) -> RoutingTable:
    """Parse the ConfigMap's table, reusing the last parse while its resourceVersion is unchanged.

    Raises:
        RoutingTableError: the ConfigMap holds no valid table.
    """
    key = (namespace, cm["metadata"]["name"])
    hit = cache.get(key)
    if hit and hit[0] == cm["metadata"]["resourceVersion"]:
        return hit[1]
    table = RoutingTable.from_json((cm.get("data") or {}).get(TABLE_KEY, ""))
    cache[key] = (cm["metadata"]["resourceVersion"], table)
    return table


def read_table_cm(
    core: k8s.CoreV1Api, cache: TableCache, owner: Owner, logger: logging.Logger | kopf.Logger
) -> tuple[dict[str, Any] | None, RoutingTable | None, int]:
    """The pool's routing-table ConfigMap (None: absent), its table (None: absent or invalid,
    with a warning) and its version annotation (0: absent).

    Raises:
        ApiException: any API error but 404.
    """
    cm_name = table_configmap_name(owner.name)
    cm = raw_or_none(core.read_namespaced_config_map, cm_name, owner.namespace)
    if cm is None:
        return None, None, 0
    try:
        return cm, parse_table(cache, owner.namespace, cm), table_version_of(cm)
    except RoutingTableError:
        logger.warning("ConfigMap %s holds no valid routing table; rewriting it", cm_name)
        return cm, None, table_version_of(cm)


def write_table_cm(
    core: k8s.CoreV1Api,
    cache: TableCache,
    manifest: dict[str, Any],
    table: RoutingTable,
    cm: dict[str, Any] | None,
) -> dict[str, Any]:
    """Create the table ConfigMap ``manifest`` (``cm`` None) or replace ``cm`` with it under
    optimistic concurrency (its resourceVersion); remember the parse. Returns the written
    ConfigMap.

    Raises:
        ApiException: any API error (409: the ConfigMap changed meanwhile; the next step
            retries).
    """
    meta = manifest["metadata"]
    if cm is None:
        written = raw(core.create_namespaced_config_map, meta["namespace"], manifest)
    else:
        meta["resourceVersion"] = cm["metadata"]["resourceVersion"]
        written = raw(core.replace_namespaced_config_map, meta["name"], meta["namespace"], manifest)
    cache[(meta["namespace"], meta["name"])] = (written["metadata"]["resourceVersion"], table)
    return written
