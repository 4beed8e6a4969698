"""Our own rules on the rendered manifests (kubectl kustomize output).

Usage: python3 check_rules.py base.yaml single-node.yaml
Fails (exit 1) listing every broken rule.
"""
import sys

import yaml

errors = []


def err(where, msg):
    errors.append(f"{where}: {msg}")


def pod_specs(docs):
    for d in docs:
        if d.get("kind") in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]["spec"]


def check_common(name, docs):
    workloads = list(pod_specs(docs))
    if len(workloads) != 1:
        err(name, f"expected one workload, found {len(workloads)}")
    for wl, spec in workloads:
        where = f"{name}/{wl['kind']}/{wl['metadata']['name']}"
        if spec.get("automountServiceAccountToken") is not False:
            err(where, "automountServiceAccountToken must be false")
        psc = spec.get("securityContext", {})
        if psc.get("runAsNonRoot") is not True:
            err(where, "pod must runAsNonRoot")
        if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            err(where, "seccompProfile must be RuntimeDefault")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            cw = f"{where}/{c['name']}"
            sc = c.get("securityContext", {})
            if sc.get("runAsUser", psc.get("runAsUser")) != 65532:
                err(cw, "must run as uid 65532")
            if sc.get("readOnlyRootFilesystem") is not True:
                err(cw, "root filesystem must be read-only")
            if sc.get("allowPrivilegeEscalation") is not False:
                err(cw, "allowPrivilegeEscalation must be false")
            if sc.get("capabilities", {}).get("drop") != ["ALL"]:
                err(cw, "capabilities must drop ALL")
            ports = {p["containerPort"]: p for p in c.get("ports", [])}
            names = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(probe_name)
                if not probe:
                    if probe_name != "startupProbe":
                        err(cw, f"{probe_name} missing")
                    continue
                if "grpc" not in probe:
                    err(cw, f"{probe_name} must be a native gRPC probe")
                    continue
                port = probe["grpc"]["port"]
                port = names.get(port, port)
                if port not in ports:
                    err(cw, f"{probe_name} port {port} is not a container port")
                if port == names.get("grpc"):
                    err(cw, f"{probe_name} must not use the mTLS gRPC port")
            ready = c.get("readinessProbe", {}).get("grpc", {}).get("service")
            live = c.get("livenessProbe", {}).get("grpc", {}).get("service")
            if ready != "stateseal.v1.RequestState":
                err(cw, "readiness must follow the ledger (service stateseal.v1.RequestState)")
            if live != "stateseal.liveness":
                err(cw, "liveness must not follow the ledger (service stateseal.liveness)")
            mounts = c.get("volumeMounts", [])
            for m in mounts:
                if "subPath" in m or "subPathExpr" in m:
                    err(cw, f"volume {m['name']} uses subPath: it would never receive updates")
            keyset = [m for m in mounts if m["name"] == "keyset"]
            if not keyset:
                err(cw, "no keyset mount")
            elif "secret" not in volumes.get("keyset", {}):
                err(cw, "the keyset must come from a Secret")
            env = config_env(docs)
            ks_path = env.get("STATESEAL_KEYSET", "")
            if keyset and not ks_path.startswith(keyset[0]["mountPath"].rstrip("/") + "/"):
                err(cw, "STATESEAL_KEYSET must be a file inside the keyset directory mount")
            tenants = [m for m in mounts if m["name"] == "tenants"]
            if tenants and "secret" not in volumes.get("tenants", {}):
                err(cw, "the tenants file (bearer digests) must come from a Secret")
            writable = {m["mountPath"] for m in mounts if not m.get("readOnly")}
            if not {"/tmp", env.get("STATESEAL_DATA_DIR")} <= writable:
                err(cw, "the data dir and /tmp must be the writable mounts")


def check_network_policy(name, docs):
    """No rule admits every pod, and no peer can be satisfied by a pod
    labelling itself: each peer needs a namespaceSelector with labels (set by
    cluster operators), and an ipBlock must not be the whole internet."""
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    for d in policies:
        where = f"{name}/NetworkPolicy/{d['metadata']['name']}"
        spec = d["spec"]
        for direction, key in (("ingress", "from"), ("egress", "to")):
            for i, rule in enumerate(spec.get(direction, [])):
                peers = rule.get(key)
                if not peers:
                    err(where, f"{direction}[{i}] has no {key}: it admits every peer")
                    continue
                for peer in peers:
                    if "ipBlock" in peer:
                        if peer["ipBlock"].get("cidr") in ("0.0.0.0/0", "::/0"):
                            err(where, f"{direction}[{i}] admits the whole internet")
                        continue
                    ns = peer.get("namespaceSelector")
                    if ns is None:
                        err(where, f"{direction}[{i}]: a peer without namespaceSelector; "
                                   "scope it to labelled namespaces")
                    elif not ns.get("matchLabels") and not ns.get("matchExpressions"):
                        err(where, f"{direction}[{i}]: namespaceSelector {{}} admits every namespace")


def config_env(docs):
    for d in docs:
        if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "stateseal-config":
            return d.get("data", {})
    return {}


def check_base(docs):
    check_common("base", docs)
    check_network_policy("base", docs)
    kinds = {d["kind"] for d in docs}
    for k in ("Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy"):
        if k not in kinds:
            err("base", f"missing {k}")
    env = config_env(docs)
    if env.get("STATESEAL_LEDGER") != "postgres":
        err("base", "several replicas need the postgres ledger")
    for _, spec in pod_specs(docs):
        pass
    for d in docs:
        if d["kind"] == "Deployment":
            ru = d["spec"]["strategy"]["rollingUpdate"]
            if ru.get("maxUnavailable") != 0:
                err("base", "RollingUpdate maxUnavailable must be 0")


def check_single(docs):
    check_common("single-node", docs)
    check_network_policy("single-node", docs)
    kinds = [d["kind"] for d in docs]
    if "HorizontalPodAutoscaler" in kinds or "Deployment" in kinds:
        err("single-node", "must have no HPA and no Deployment")
    for d in docs:
        if d["kind"] == "StatefulSet":
            if d["spec"].get("replicas") != 1:
                err("single-node", "StatefulSet must have exactly one replica")
            if not d["spec"].get("volumeClaimTemplates"):
                err("single-node", "the sled data dir needs a PersistentVolumeClaim")
    env = config_env(docs)
    if env.get("STATESEAL_LEDGER") != "sled":
        err("single-node", "the single-node overlay uses sled")
    if env.get("STATESEAL_EXPECTED_REPLICAS") != "1":
        err("single-node", "the replica-count guard must be set to 1")


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


if __name__ == "__main__":
    check_base(load(sys.argv[1]))
    check_single(load(sys.argv[2]))
    if errors:
        print("\n".join(errors))
        sys.exit(1)
    print("deploy rules: ok (base and single-node)")
