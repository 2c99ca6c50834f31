"""The Helm chart checked by Helm itself (the Helm v4 SDK from PyPI, helm-python-sdk: no binary, no
cluster), run by .ci/check-deploy and imported by tests/unit/test_deploy_files.py:

- `helm lint --strict` and `helm template` over several value sets (defaults, a second release, many
  replicas, metrics off, scheduling and an existing Secret), every rendered object validated against
  the Kubernetes schemas (kubernetes-validate) and within Kubernetes' name limits;
- invalid value sets refused, each with the message that names the value (values.schema.json, or the
  template's own `fail`);
- two releases of one job name share no object name and select none of each other's pods;
- every PERSIA container probed for its own role: readiness asks `persia-launcher health <role>`, liveness
  and startup add --live (alive through a long checkpoint load); NATS starts on the full /healthz; the
  serving Deployment rendered exactly when serving.enabled;
- deploy/k8s equals the chart rendered as `helm install adult` in every object, field by field (the
  chart's own labels and the generated Secret aside);
- the chart's copies of the NATS configs and of the example's configs match the repository's.

    python .ci/check_helm.py [CHART] [K8S_DIR]     (K8S_VERSION: the schemas, default 1.30.0)

Exits 1 naming every failed check.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RAW_RELEASE = "adult"  # deploy/k8s is this release of the chart with its default values
# labels only Helm's rendering carries: who manages the object and which chart made it
CHART_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/version", "helm.sh/chart")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
# the kinds whose names Kubernetes holds to a DNS-1035 label (63), the rest to a subdomain (253)
LABEL_KINDS = ("Service",)

MANY = {"nats": {"replicas": 5, "streamReplicas": 5}, "ps": {"replicas": 16}, "embeddingWorker": {"replicas": 8},
        "nnWorker": {"replicas": 8}, "dataLoader": {"replicas": 4}}
SCHEDULED = {
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccount": {"create": True, "annotations": {"iam.gke.io/gcp-service-account": "persia@p.iam"}},
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "persia", "effect": "NoSchedule"}],
    "credentials": {"existingSecret": "persia-made-before"},
    "ps": {"nodeSelector": {"pool": "highmem"},
           "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
               {"matchExpressions": [{"key": "mem", "operator": "In", "values": ["high"]}]}]}}}},
    "nnWorker": {"serviceAccountName": "trainer"},
    "image": {"repository": "registry.example/persia-nats", "tag": "0.1.0-cuda", "pullPolicy": "Always"},
}
# name: (release, values); each must lint --strict clean, render and validate
GOOD: dict[str, tuple[str, dict[str, Any]]] = {
    "defaults": (RAW_RELEASE, {}),
    "second release": ("adult-b", {"jobName": "adult"}),
    "many replicas": ("big", MANY),
    "metrics off": ("quiet", {"metrics": {"enabled": False}}),
    "single NATS node": ("one", {"nats": {"replicas": 1, "streamReplicas": 1}}),
    "scheduling, service account, existing Secret": ("sched", SCHEDULED),
    "stream loader": ("stream", {"dataLoader": {"fromStream": True}}),
    "long release name": ("a-release-name-long-enough-to-be-shortened-by-the-chart", {}),
    "serving": ("served", {"serving": {"enabled": True, "replicas": 2, "modelKwargs": {"dense_dim": 5, "hidden": [8]},
                                       "nodeSelector": {"pool": "serving"}}}),
}
# name: (values, what the refusal must say)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "ps.replicas 0": ({"ps": {"replicas": 0}}, "at '/ps/replicas': minimum: got 0, want 1"),
    "ps.replicas a string": ({"ps": {"replicas": "two"}}, "at '/ps/replicas': got string, want integer"),
    "nats.replicas even": ({"nats": {"replicas": 2}}, "at '/nats/replicas': value must be one of 1, 3, 5, 7"),
    "metrics.port 0": ({"metrics": {"port": 0}}, "at '/metrics/port': minimum: got 0, want 1"),
    "metrics.port past 65535": ({"metrics": {"port": 70000}}, "at '/metrics/port': maximum: got 70,000, want 65,535"),
    "upper-case jobName": ({"jobName": "Adult"}, "at '/jobName': 'Adult' does not match pattern"),
    "jobName too long": ({"jobName": "j" * 54}, "at '/jobName': maxLength: got 54, want 53"),
    "unknown key": ({"ps": {"replica": 3}}, "at '/ps': additional properties 'replica' not allowed"),
    "image.pullPolicy": ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of"),
    "no memory limit": ({"ps": {"resources": {"limits": {"memory": None}}}}, "at '/ps/resources/limits'"),
    "more stream copies than nodes": ({"nats": {"replicas": 1}},
                                      "nats.streamReplicas 3 exceeds nats.replicas 1"),
    "serving.replicas 0": ({"serving": {"enabled": True, "replicas": 0}}, "at '/serving/replicas': minimum: got 0"),
    "serving.model without a callable": ({"serving": {"model": "model.py"}}, "at '/serving/model': 'model.py' does "
                                                                             "not match pattern"),
    "serving.modelKwargs not a map": ({"serving": {"modelKwargs": "dense_dim=5"}},
                                      "at '/serving/modelKwargs': got string, want object"),
}
# what each probe of a PERSIA container asks `persia-launcher health` (common/health.py): started and
# live while it answers at all (a checkpoint load included), ready once it can do its job
PROBE_MODE = {"startupProbe": "live", "livenessProbe": "live", "readinessProbe": "ready"}
LONG_RUNNING = ("Deployment", "StatefulSet")


def helm() -> Any:
    try:
        import helm_python
    except ImportError:
        sys.exit("check_helm: helm-python-sdk is missing (pip install helm-python-sdk, or bash .ci/bootstrap)")
    return helm_python


def render(chart: Path, values: dict[str, Any], release: str, namespace: str = "default") -> list[dict[str, Any]]:
    """`helm template` (the install's own path: the schema, then the templates): its objects, in order."""
    with helm().Chart.load(chart) as c:
        manifests = c.render(values, name=release, namespace=namespace, is_install=True)
    return [d for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def notes(chart: Path, values: dict[str, Any], release: str) -> str:
    with helm().Chart.load(chart) as c:
        return c.render(values, name=release, namespace="default")[f"{chart.name}/templates/NOTES.txt"]


def refusal(chart: Path, values: dict[str, Any], release: str = "bad") -> str | None:
    """Why `helm template` refuses these values (None: it renders them)."""
    h = helm()
    try:
        render(chart, values, release)
    except h.HelmError as exc:
        return str(exc)
    return None


def lint(chart: Path, values: dict[str, Any], kube_version: str) -> list[str]:
    """`helm lint --strict`'s errors and warnings (strict: a warning fails)."""
    report = helm().lint(str(chart), values, strict=True, kube_version=f"v{kube_version}")
    found = [f"{m['path']}: {m['error'].strip()}" for m in report["messages"] if m["severity"] >= 2]
    return found + [e.strip() for e in report["errors"] if not any(e.strip() in f for f in found)]


def name_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Names Kubernetes would refuse, or that break a label it derives from them."""
    out = []
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        limit = 63 if kind in LABEL_KINDS else 253
        if len(name) > limit or not (DNS_LABEL if kind in LABEL_KINDS else DNS_SUBDOMAIN).match(name):
            out.append(f"{kind}/{name}: not a valid name (at most {limit} characters)")
        spec = d.get("spec") or {}
        # controller-revision-hash: <name>-<hash of up to 10 characters>, a label value (63)
        if kind == "StatefulSet" and len(name) > 52:
            out.append(f"StatefulSet/{name}: {len(name)} characters, over 52: its revision label would exceed 63")
        # every pod's hostname: <statefulset>-<ordinal> or <indexed job>-<index>, a DNS label
        last = (spec.get("replicas", 1) if kind == "StatefulSet" else spec.get("completions", 1)) - 1
        if kind in ("StatefulSet", "Job") and len(f"{name}-{last}") > 63:
            out.append(f"{kind}/{name}: its pods' hostname {name}-{last} exceeds 63 characters")
        for k, v in ((d["metadata"].get("labels") or {}) | ((spec.get("template") or {}).get("metadata") or {})
                     .get("labels", {})).items():
            if len(str(v)) > 63:
                out.append(f"{kind}/{name}: label {k}={v} exceeds 63 characters")
    return out


def nats_problems(docs: list[dict[str, Any]]) -> list[str]:
    """The rendered NATS cluster: its route port asks the route password, and it lists one route per
    node, each a variable the StatefulSet composes from the Secret's password, listed after it (a
    $(VAR) expands only to an earlier entry)."""
    cm = next((d for d in docs if d["kind"] == "ConfigMap" and "nats-cluster.conf" in (d.get("data") or {})), None)
    sts = next((d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-nats")), None)
    if cm is None or sts is None:
        return ["no NATS ConfigMap with nats-cluster.conf, or no NATS StatefulSet"]
    conf = "\n".join(line.split("#", 1)[0] for line in cm["data"]["nats-cluster.conf"].splitlines())
    out = []
    if not re.search(r"authorization\s*\{[^}]*\buser:\s*route\b[^}]*\bpassword:\s*\$PERSIA_ROUTE_PASSWORD\b", conf):
        out.append("nats-cluster.conf: the cluster block has no authorization { user: route, password: "
                   "$PERSIA_ROUTE_PASSWORD }: any server that reaches the route port joins the cluster")
    listed = re.search(r"\broutes:\s*\[([^\]]*)\]", conf)
    routes = listed.group(1).split() if listed else []
    if len(routes) != sts["spec"]["replicas"] or any(not r.startswith("$PERSIA_NATS_ROUTE_") for r in routes):
        out.append(f"nats-cluster.conf: routes {routes}: one $PERSIA_NATS_ROUTE_<i> per node "
                   f"({sts['spec']['replicas']}) expected")
    env = [e["name"] for e in sts["spec"]["template"]["spec"]["containers"][0].get("env", [])]
    values = {e["name"]: e.get("value", "") for e in sts["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    for r in routes:
        var = r[1:]
        if var not in env or "PERSIA_ROUTE_PASSWORD" not in env or env.index(var) < env.index("PERSIA_ROUTE_PASSWORD"):
            out.append(f"StatefulSet/{sts['metadata']['name']}: {var} is not defined after PERSIA_ROUTE_PASSWORD")
        elif not values[var].startswith("nats-route://route:$(PERSIA_ROUTE_PASSWORD)@"):
            out.append(f"StatefulSet/{sts['metadata']['name']}: {var}={values[var]}: no route password")
    return out


def _launcher_args(argv: list[str]) -> list[str]:
    """persia-launcher's arguments in a command line (after sh -c, exec, timeout N), or []."""
    if len(argv) >= 3 and argv[0] == "sh" and argv[1] == "-c":
        argv = shlex.split(argv[2])
    while argv and (argv[0] in ("exec", "timeout") or argv[0].isdigit()):
        argv = argv[1:]
    return argv[1:] if argv and argv[0] == "persia-launcher" else []


def probe_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Probes that do not mean what they say: every long-running PERSIA container is probed for its own
    role, readiness without --live and liveness (and startup) with it; NATS starts on the full /healthz."""
    out = []
    for d in docs:
        if d["kind"] not in LONG_RUNNING:
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            where = f"{d['kind']}/{d['metadata']['name']} container {c['name']}"
            argv = (c.get("command") or []) + (c.get("args") or [])
            if "nats-server" in argv:
                path = (((c.get("startupProbe") or {}).get("httpGet")) or {}).get("path")
                if path != "/healthz":
                    out.append(f"{where}: startupProbe must ask /healthz (JetStream current, its streams led), "
                               f"not {path}")
                continue
            role = _launcher_args(argv if c.get("command") else ["persia-launcher", *argv])[:1]
            if not role:
                continue
            for probe, mode in PROBE_MODE.items():
                if probe not in c:
                    if probe != "startupProbe":
                        out.append(f"{where}: runs {role[0]} without a {probe}")
                    continue
                pargs = _launcher_args(list((c[probe].get("exec") or {}).get("command") or []))
                if pargs[:2] != ["health", role[0]]:
                    out.append(f"{where}: {probe} runs {pargs[:2]}, not `persia-launcher health {role[0]}`")
                elif ("--live" in pargs) != (mode == "live"):
                    out.append(f"{where}: {probe} must ask {'liveness (--live)' if mode == 'live' else 'readiness'}"
                               f" of {role[0]}: {' '.join(pargs)}")
    return out


def validate(docs: list[dict[str, Any]], kube_version: str) -> list[str]:
    import kubernetes_validate

    out = []
    for d in docs:
        try:
            kubernetes_validate.validate(d, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            out.append(f"{d['kind']}/{d['metadata']['name']}: {path}: {exc.message}")
    return out


def collisions(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """Objects two releases both own, and selectors of one that match the other's pods."""
    names_a = {(d["kind"], d["metadata"]["name"]) for d in a}
    out = [f"{kind}/{name}: in both releases" for kind, name in sorted(names_a & {(d["kind"], d["metadata"]["name"])
                                                                                  for d in b})]
    pods_b = [((d["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {} for d in b
              if d["kind"] in ("StatefulSet", "Deployment", "Job")]
    for d in a:
        spec = d.get("spec") or {}
        sel = spec.get("selector") if d["kind"] == "Service" else (
            (spec.get("selector") or spec.get("podSelector") or {}).get("matchLabels"))
        if d["kind"] == "Job" or not sel:
            continue
        if any(all(pod.get(k) == v for k, v in sel.items()) for pod in pods_b):
            out.append(f"{d['kind']}/{d['metadata']['name']}: selects the other release's pods")
    return out


def _comparable(d: dict[str, Any]) -> dict[str, Any]:
    """An object as it acts: no chart-only labels, a ConfigMap's YAML files parsed (comments are
    documentation), its other files without trailing blanks, env lists by name (order only matters
    to $(VAR) references, which check-deploy's nats-server test covers)."""
    d = copy.deepcopy(d)

    def strip(node: Any) -> None:
        if isinstance(node, dict):
            for key in ("labels",):
                if isinstance(node.get(key), dict):
                    for label in CHART_LABELS:
                        node[key].pop(label, None)
            if isinstance(node.get("env"), list):
                node["env"] = {e["name"]: e for e in node["env"]}
            for v in node.values():
                strip(v)
        elif isinstance(node, list):
            for v in node:
                strip(v)

    strip(d)
    if d["kind"] == "ConfigMap":
        d["data"] = {k: yaml.safe_load(v) if k.endswith((".yml", ".yaml")) else
                     "\n".join(line.rstrip() for line in v.strip().splitlines())
                     for k, v in (d.get("data") or {}).items()}
    return d


def _diff(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                out.append(f"{path}.{k}: only in the chart: {b[k]!r}"[:300])
            elif k not in b:
                out.append(f"{path}.{k}: only in deploy/k8s: {a[k]!r}"[:300])
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [x for i, (p, q) in enumerate(zip(a, b, strict=True)) for x in _diff(p, q, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: deploy/k8s {a!r}, the chart {b!r}"[:400]]


def raw_differences(chart: Path, k8s_dir: Path) -> list[str]:
    """What differs between deploy/k8s and `helm install adult` with the default values: objects one
    has and the other lacks, and every differing field. The chart's Secret aside: deploy/k8s takes
    the one deploy/gen-credentials.sh writes, of the same name."""
    raw = {}
    for f in sorted([*k8s_dir.glob("*.yml"), *k8s_dir.glob("*.yaml")]):
        for d in yaml.safe_load_all(f.read_text()):
            if d:
                raw[(d["kind"], d["metadata"]["name"])] = d
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in render(chart, {}, RAW_RELEASE) if d["kind"] != "Secret"}
    out = [f"{k}/{n}: only in deploy/k8s" for k, n in sorted(set(raw) - set(rendered))]
    out += [f"{k}/{n}: only in the chart" for k, n in sorted(set(rendered) - set(raw))]
    for key in sorted(set(raw) & set(rendered)):
        out += _diff(_comparable(raw[key]), _comparable(rendered[key]), f"{key[0]}/{key[1]}")
    return out


def copies(chart: Path) -> list[str]:
    out = []
    for name in ("nats.conf", "nats-jetstream.conf", "nats-auth.conf"):
        f = chart / "files" / name
        if not f.is_file() or f.read_text() != (ROOT / "deploy" / name).read_text():
            out.append(f"{chart}/files/{name} is not a copy of deploy/{name}")
    values = yaml.safe_load((chart / "values.yaml").read_text()) or {}
    example = ROOT / "examples" / "adult-income" / "config"
    for key, src in (("globalConfig", "global_config.yml"), ("embeddingConfig", "embedding_config.yml")):
        if values.get(key) != yaml.safe_load((example / src).read_text()):
            out.append(f"{chart}/values.yaml: {key} is not {example / src}")
    return out


def main(chart: Path, k8s_dir: Path, kube_version: str) -> int:
    failures: list[str] = []

    def fail(msg: str) -> None:
        failures.append(msg)
        print(f"FAIL {msg}")

    h = helm()
    print(f"Helm SDK {h.helm_sdk_version()} (helm-python-sdk {h.__version__}), Kubernetes schemas {kube_version}")
    rendered: dict[str, list[dict[str, Any]]] = {}
    for label, (release, values) in GOOD.items():
        problems = [f"lint --strict: {p}" for p in lint(chart, values, kube_version)]
        try:
            docs = render(chart, values, release)
        except h.HelmError as exc:
            fail(f"value set '{label}': helm template failed: {exc}")
            continue
        rendered[label] = docs
        problems += validate(docs, kube_version) + name_problems(docs) + nats_problems(docs) + probe_problems(docs)
        serving = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-serving")]
        if bool(serving) != bool(values.get("serving", {}).get("enabled")):
            problems.append(f"{len(serving)} serving Deployment(s), with serving.enabled "
                            f"{values.get('serving', {}).get('enabled', False)}")
        for p in problems:
            fail(f"value set '{label}' (release {release}): {p}")
        print(f"{'FAIL' if problems else 'ok  '} {label}: release {release}, {len(docs)} objects, "
              f"lint --strict {'clean' if not any(p.startswith('lint') for p in problems) else 'FAILED'}, "
              f"{len(problems)} problems")
    for label, (values, expected) in BAD.items():
        why = refusal(chart, values)
        linted = lint(chart, values, kube_version)
        if why is None:
            fail(f"invalid value set '{label}': helm template rendered it")
        elif expected not in why:
            fail(f"invalid value set '{label}': refused, but not for the expected reason ({expected!r}): {why}")
        else:
            print(f"ok   refused: {label}: {expected}")
        # lint does not run a template's `fail` (it renders leniently): the schema's refusals only
        if "at '/" in expected and not any(expected in m for m in linted):
            fail(f"invalid value set '{label}': helm lint --strict passes it")
    if "defaults" in rendered and "second release" in rendered:
        for p in collisions(rendered["defaults"], rendered["second release"]):
            fail(f"two releases of job adult: {p}")
    diffs = raw_differences(chart, k8s_dir)
    for p in diffs:
        fail(f"{k8s_dir} vs the chart (release {RAW_RELEASE}): {p}")
    print(f"{k8s_dir} vs `helm template {RAW_RELEASE}`: {len(diffs)} differences")
    for p in copies(chart):
        fail(p)
    return 1 if failures else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    chart_dir = Path(args[0] if args else os.environ.get("HELM_CHART", ROOT / "deploy" / "helm" / "persia"))
    k8s = Path(args[1] if len(args) > 1 else os.environ.get("K8S_DIR_TO_CHECK", ROOT / "deploy" / "k8s"))
    sys.exit(main(chart_dir, k8s, os.environ.get("K8S_VERSION", "1.30.0")))
