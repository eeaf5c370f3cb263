"""deploy/: the Kubernetes manifests as kustomize renders them, checked for what the operator
guide promises (a native sidecar, the restricted security context, the probes, a DaemonSet
variant), their kvtierd.conf files accepted by the real kvtierd, and the image's runtime
packages against the shared libraries the built binaries load."""
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / os.environ.get("KVTIER_BUILD", "build") / "bin"


def render(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "kubernetes" / overlay)],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def restricted(container, pod):
    """The restricted Pod Security Standard's container rules, with the pod's defaults."""
    sc = container.get("securityContext", {})
    assert sc.get("allowPrivilegeEscalation") is False, container["name"]
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], container["name"]
    assert not sc.get("capabilities", {}).get("add"), container["name"]
    assert sc.get("readOnlyRootFilesystem") is True, container["name"]
    assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, container["name"]
    assert (sc.get("seccompProfile") or pod.get("seccompProfile")) == {"type": "RuntimeDefault"}


def config_map_conf(docs):
    cm = one(docs, "ConfigMap")
    assert re.fullmatch(r"kvtierd-config-[a-z0-9]+", cm["metadata"]["name"])  # hashed: rolls pods
    return cm, cm["data"]["kvtierd.conf"]


def test_sidecar_is_native_restricted_and_probed_as_documented():
    docs = render("sidecar")
    dep = one(docs, "Deployment")["spec"]["template"]["spec"]
    pod = dep["securityContext"]
    kvtierd = [c for c in dep["initContainers"] if c["name"] == "kvtierd"]
    assert len(kvtierd) == 1 and kvtierd[0]["restartPolicy"] == "Always"  # a native sidecar
    kvtierd = kvtierd[0]
    assert not any(c["name"] == "kvtierd" for c in dep["containers"])
    assert kvtierd["image"] == "kvtier:dev"
    for c in dep["initContainers"] + dep["containers"]:
        restricted(c, pod)
    health = ["kvtierctl", "--addr", "unix:/run/kvtier/kvtier.sock", "health"]
    assert kvtierd["startupProbe"]["exec"]["command"] == health
    assert kvtierd["readinessProbe"]["exec"]["command"] == health
    assert kvtierd["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    cm, _ = config_map_conf(docs)
    names = [v.get("configMap", {}).get("name") for v in dep["volumes"]]
    assert cm["metadata"]["name"] in names  # the volume follows the generated name
    dshm = [v for v in dep["volumes"] if v["name"] == "dshm"][0]
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"


def test_daemonset_shares_only_the_socket_directory_and_maps_tenants_by_uid():
    docs = render("daemonset")
    ds = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    host_paths = [v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v]
    assert host_paths == ["/run/kvtier"]  # not /dev/shm: the segments are memfds
    kvtierd = [c for c in ds["containers"] if c["name"] == "kvtierd"][0]
    restricted(kvtierd, ds["securityContext"])
    # Not ready once draining (/readyz), alive until it exits (/healthz).
    assert kvtierd["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert kvtierd["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert kvtierd["securityContext"]["runAsUser"] == 10001
    ns = one(docs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    _, conf = config_map_conf(docs)
    assert 'same_uid_by_metadata: "off"' in conf
    worker = [d for d in docs if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]
    uid = worker["securityContext"]["runAsUser"]
    assert f"uid: {uid} " in conf and 10001 in worker["securityContext"]["supplementalGroups"]


@pytest.mark.parametrize("overlay", ["sidecar", "daemonset"])
def test_the_rendered_config_starts_kvtierd(overlay, tmp_path):
    _, conf = config_map_conf(render(overlay))
    (tmp_path / "kvtierd.conf").write_text(conf)
    sock = tmp_path / "kvtier.sock"
    p = subprocess.Popen([str(BIN / "kvtierd"), f"--config={tmp_path / 'kvtierd.conf'}",
                          f"--listen=unix:{sock}", "--metrics_port=0",
                          f"--instance=deploy-{overlay}-{os.getpid()}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(200):
            if sock.exists() or p.poll() is not None:
                break
            time.sleep(0.05)
        assert sock.exists(), p.communicate(timeout=10)[0]
    finally:
        p.terminate()
        out = p.communicate(timeout=30)[0]
    assert p.returncode == 0, out


def runtime_packages():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    runtime = text[text.rindex("FROM debian:12-slim"):]
    install = re.search(r"apt-get install -y --no-install-recommends(.*?)&&", runtime, re.S)
    return set(install.group(1).replace("\\", " ").split())


def depends_closure(packages):
    """The installed packages `packages` pull in, themselves included (Depends, Pre-Depends)."""
    seen, todo = set(), list(packages)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        q = subprocess.run(["dpkg-query", "-W", "-f=${Depends}, ${Pre-Depends}", name],
                           capture_output=True, text=True)
        for alt in q.stdout.split(","):
            dep = alt.split("|")[0].strip().split(" ")[0].split(":")[0]
            if dep:
                todo.append(dep)
    return seen


def package_of(path):
    """The installed package holding a library, however usrmerge spells its directory."""
    real = os.path.realpath(path)
    for p in {path, real, real.replace("/usr/lib/", "/lib/", 1), path.replace("/lib/", "/usr/lib/", 1)}:
        q = subprocess.run(["dpkg", "-S", p], capture_output=True, text=True)
        if q.returncode == 0:
            return q.stdout.split(":")[0]
    raise AssertionError(f"no package holds {path}")


def test_the_image_installs_every_library_the_binaries_load():
    have = depends_closure(runtime_packages() | {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"})
    for binary in ("kvtierd", "kvtierctl"):
        ldd = subprocess.run(["ldd", str(BIN / binary)], check=True, capture_output=True,
                             text=True).stdout
        for path in re.findall(r"=> (/\S+)", ldd):
            assert package_of(path) in have, f"{binary} loads {path}, not in the image"
