"""The fleet server's Kubernetes side: informers for its kinds, and its few writes.

Everything here blocks (the ``kubernetes`` client); the server calls it from threads.
The leading replica is the only writer of EdgeDevice and EdgeFleet status, so its writes
are merge patches of the status subresource; the other replicas write their heartbeat
digests (ConfigMaps, ``digest.py``). Each write is counted (the fleet benchmark reports
API-server writes per second).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from hybridllm_common import crd, signing
from hybridllm_operator import kubeconfig

log = logging.getLogger(__name__)

SIGNING_KEY = "key"  # the Secret key holding the fleet's private key (base64 raw bytes)
TOKEN_KEY = "token"
FLEET_LABEL = f"{crd.GROUP}/fleet"
PLURALS = {"EdgeFleet": "edgefleets", "EdgeDevice": "edgedevices", "LLMService": "llmservices"}


def load_config() -> None:
    kubeconfig.load(in_cluster_first=False)


def signing_key_secret(fleet: str) -> str:
    return f"{fleet}-signing-key"


def token_secret(fleet: str, spec: crd.EdgeFleetSpec) -> str:
    return spec.enrollment.token_secret or f"{fleet}-bootstrap"


class Informer:
    """A list-then-watch cache of one kind in one namespace, kept in ``objects`` (name ->
    object, as the API server's JSON); ``on_change`` is called from the watch thread after
    each change. ``call`` is the API's list function and ``args`` its leading arguments
    (``custom`` and ``config_maps`` make the two kinds of the server)."""

    def __init__(
        self,
        what: str,
        call: Callable[..., Any],
        args: tuple[Any, ...],
        on_change: Callable[[str, str, dict[str, Any] | None], None],
        **options: Any,
    ) -> None:
        self.plural, self.call, self.args, self.options = what, call, args, options
        self.objects: dict[str, dict[str, Any]] = {}
        self.on_change = on_change
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._watch: Any = None
        self.thread = threading.Thread(target=self._run, name=f"watch-{what}", daemon=True)

    @classmethod
    def custom(
        cls,
        api: Any,
        namespace: str,
        kind: str,
        on_change: Callable[[str, str, dict[str, Any] | None], None],
    ) -> Informer:
        """EdgeFleets, EdgeDevices or LLMServices of ``namespace``."""
        args = (crd.GROUP, crd.VERSION, namespace, PLURALS[kind])
        return cls(PLURALS[kind], api.list_namespaced_custom_object, args, on_change)

    @classmethod
    def config_maps(
        cls,
        core: Any,
        namespace: str,
        selector: str,
        on_change: Callable[[str, str, dict[str, Any] | None], None],
    ) -> Informer:
        """The ConfigMaps of ``namespace`` with the label ``selector``."""
        return cls(
            "configmaps", core.list_namespaced_config_map, (namespace,), on_change,
            label_selector=selector,
        )  # fmt: skip

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _list(self) -> str:
        response = self.call(*self.args, **self.options, _preload_content=False)
        listing = json.loads(response.data)
        seen = {o["metadata"]["name"]: o for o in listing.get("items", [])}
        for name in set(self.objects) - set(seen):
            self.objects.pop(name, None)
            self.on_change("DELETED", name, None)
        for name, obj in seen.items():
            self.objects[name] = obj
            self.on_change("ADDED", name, obj)
        self.synced.set()
        return str(listing["metadata"].get("resourceVersion", ""))

    def _run(self) -> None:
        version = ""
        delay = 1.0
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._list()
                self._watch = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    _untyped(self.call), *self.args, **self.options, resource_version=version,
                    timeout_seconds=300, allow_watch_bookmarks=True,
                ):  # fmt: skip
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion", version)
                    if event["type"] == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    if event["type"] == "DELETED":
                        self.objects.pop(name, None)
                        self.on_change("DELETED", name, None)
                    else:
                        self.objects[name] = obj
                        self.on_change(event["type"], name, obj)
                delay = 1.0
            except ApiException as exc:
                if exc.status == 410:  # too old: list again
                    version = ""
                    continue
                log.warning("watching %s: %s; again in %.0f s", self.plural, exc.reason, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)
            except Exception as exc:  # noqa: BLE001 - the connection dropped: watch again
                if self._stop.is_set():
                    return
                log.info("watch of %s ended (%s); again in %.0f s", self.plural, exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)


def _untyped(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` without its docstring, from which ``Watch`` would learn a model class to
    build: the events' objects then stay the API server's JSON (a dict) for every kind,
    and an ERROR event (410 Gone) is still raised as an ``ApiException``."""

    def untyped(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return untyped


class Kube:
    """The server's reads and writes beyond the informers."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        config = kubernetes.client.Configuration.get_default_copy()
        config.connection_pool_maxsize = 32  # the status writers run 8 at a time, plus reads
        api = kubernetes.client.ApiClient(config)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.core = kubernetes.client.CoreV1Api(api)
        self.leases = kubernetes.client.CoordinationV1Api(api)
        self.writes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, what: str) -> None:
        with self._lock:
            self.writes[what] = self.writes.get(what, 0) + 1

    def create_device(self, body: dict[str, Any]) -> dict[str, Any]:
        self._count("edgedevice")
        out: dict[str, Any] = self.custom.create_namespaced_custom_object(  # type: ignore[assignment]
            crd.GROUP, crd.VERSION, self.namespace, "edgedevices", body
        )
        return out

    def patch_status(self, kind: str, name: str, status: dict[str, Any]) -> None:
        self._count(f"{PLURALS[kind]}/status")
        self.custom.patch_namespaced_custom_object_status(
            crd.GROUP, crd.VERSION, self.namespace, PLURALS[kind], name, {"status": status}
        )

    def write_config_map(self, name: str, labels: dict[str, str], binary: dict[str, str]) -> None:
        """Create or replace the ConfigMap ``name`` (a digest: one writer, so no conflict
        but a recreation after a delete)."""
        body = {
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels},
            "binaryData": binary,
        }
        self._count("configmap")
        try:
            self.core.replace_namespaced_config_map(name, self.namespace, body)  # type: ignore[arg-type]
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.core.create_namespaced_config_map(self.namespace, body)  # type: ignore[arg-type]

    def delete_config_map(self, name: str) -> None:
        self._count("configmap")
        try:
            self.core.delete_namespaced_config_map(name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def event(self, fleet: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = fleet["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": crd.API_VERSION, "kind": "EdgeFleet", "name": meta["name"],
                "namespace": self.namespace, "uid": meta.get("uid"),
            },
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": "hybridllm-fleet"},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }  # fmt: skip
        self._count("event")
        try:
            self.core.create_namespaced_event(self.namespace, body)  # type: ignore[arg-type]
        except ApiException as exc:
            log.warning("event %s not written: %s", reason, exc.reason)

    def secret_data(self, name: str) -> dict[str, str] | None:
        """A Secret's data, decoded (None: no such Secret)."""
        import base64

        try:
            secret = self.core.read_namespaced_secret(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {
            k: base64.b64decode(v).decode(errors="replace") for k, v in (secret.data or {}).items()
        }

    def secret_value(self, name: str, key: str) -> str | None:
        return (self.secret_data(name) or {}).get(key) or None

    def signing_key_or_problem(self, fleet: dict[str, Any]) -> tuple[Any, str | None]:
        """The fleet's signing key, or None and why where the server may not read its
        Secret (the chart's ``fleet.secretNames`` does not list it): that fleet waits, the
        others go on."""
        try:
            return self.signing_key(fleet), None
        except ApiException as exc:
            if exc.status != 403:
                raise
            name = signing_key_secret(fleet["metadata"]["name"])
            return None, (f"the fleet server may not read Secret {name} (add it to the "
                          "chart's fleet.secretNames)")  # fmt: skip

    def signing_key(self, fleet: dict[str, Any]) -> Any:
        """The fleet's private key from its Secret, made (and owned by the fleet) if missing."""
        name = signing_key_secret(fleet["metadata"]["name"])
        text = self.secret_value(name, SIGNING_KEY)
        if text is not None:
            return signing.private_key_from_text(text)
        key = signing.generate_key()
        body = {
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {FLEET_LABEL: fleet["metadata"]["name"]},
                "ownerReferences": [_owner(fleet)],
            },
            "type": "Opaque",
            "stringData": {SIGNING_KEY: signing.private_key_text(key)},
        }
        try:
            self._count("secret")
            self.core.create_namespaced_secret(self.namespace, body)  # type: ignore[arg-type]
        except ApiException as exc:
            if exc.status != 409:  # another replica made it first: use that one
                raise
            text = self.secret_value(name, SIGNING_KEY)
            assert text is not None
            return signing.private_key_from_text(text)
        log.info("made the signing key of fleet %s (%s)", name, signing.key_id(key))
        return key

    def create_token(self, fleet: str, secret: str, data: dict[str, str]) -> None:
        """The fleet's bootstrap token Secret (``enrollment.BootstrapToken.secret_data``)."""
        body = {
            "metadata": {"name": secret, "namespace": self.namespace,
                         "labels": {FLEET_LABEL: fleet}},
            "type": "Opaque",
            "stringData": data,
        }  # fmt: skip
        self.core.create_namespaced_secret(self.namespace, body)  # type: ignore[arg-type]

    def patch_device(self, name: str, patch: list[dict[str, Any]]) -> dict[str, Any]:
        """A JSON patch (with its ``test`` operations) of an EdgeDevice; the object after."""
        self._count("edgedevice")
        out: dict[str, Any] = self.custom.patch_namespaced_custom_object(  # type: ignore[assignment]
            crd.GROUP, crd.VERSION, self.namespace, "edgedevices", name, patch,
            _content_type="application/json-patch+json",
        )  # fmt: skip
        return out

    def annotate_fleet(self, name: str, key: str, value: str | None) -> None:
        """Set (or, with None, remove) one annotation of an EdgeFleet."""
        self._count("edgefleet")
        self.custom.patch_namespaced_custom_object(
            crd.GROUP, crd.VERSION, self.namespace, "edgefleets", name,
            {"metadata": {"annotations": {key: value}}},
        )  # fmt: skip

    def patch_device_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            crd.GROUP, crd.VERSION, self.namespace, "edgedevices", name, {"spec": spec}
        )


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": obj.get("kind", "EdgeFleet"),
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
    }


def device_body(
    namespace: str,
    fleet: dict[str, Any],
    name: str,
    labels: dict[str, str],
    spec: crd.EdgeDeviceSpec,
) -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": "EdgeDevice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**labels, FLEET_LABEL: fleet["metadata"]["name"]},
            "ownerReferences": [_owner(fleet)],
        },
        "spec": spec.to_wire(),
    }
