"""Certificates (openssl CLI: present wherever Python is, unlike the `cryptography` package)
and kubeconfigs."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

from .base import CLUSTER_NAME, SERVICE_IP, ClusterError

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def _ca(pki: Path, name: str, subject: str) -> None:
    _openssl("req", "-x509", "-new", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt",
             "-days", "3650", "-subj", subject,
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign", cwd=pki)


def ec_cert(pki: Path, name: str, subject: str, usage: str, sans: str | None = None, *,
            ca: str = "ca") -> None:
    """`pki/<name>.crt` and `.key`, EC P-256, signed by `pki/<ca>.crt`; `usage` is the
    extendedKeyUsage (serverAuth, clientAuth), `sans` an openssl subjectAltName value."""
    args = ["req", "-x509", "-new", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt",
            "-days", "3650", "-subj", subject, "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-addext", "basicConstraints=critical,CA:FALSE",
            "-addext", "keyUsage=critical,digitalSignature,keyEncipherment",
            "-addext", f"extendedKeyUsage={usage}"]
    if sans:
        args += ["-addext", f"subjectAltName={sans}"]
    _openssl(*args, cwd=pki)
    (pki / f"{name}.key").chmod(0o600)


def serving_cert(pki: Path, out_dir: Path, cn: str) -> Path:
    """A serving certificate for 127.0.0.1 signed by the cluster CA, as `tls.crt`/`tls.key` in
    `out_dir` (the layout controller-runtime's webhook and metrics servers read)."""
    name = out_dir.name
    ec_cert(pki, name, f"/CN={cn}", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    out_dir.mkdir(parents=True, exist_ok=True)
    (pki / f"{name}.crt").replace(out_dir / "tls.crt")
    (pki / f"{name}.key").replace(out_dir / "tls.key")
    return out_dir


def make_pki(pki: Path) -> None:
    """CA, apiserver serving cert, client certs (admin in system:masters; the controller-manager
    and scheduler as their built-in RBAC users), the service-account signing key pair, and the
    front-proxy CA and client cert of the aggregation layer."""
    pki.mkdir(parents=True, exist_ok=True)
    _ca(pki, "ca", f"/CN={CLUSTER_NAME}-ca")
    sans = ",".join(["IP:127.0.0.1", "IP:::1", f"IP:{SERVICE_IP}", "DNS:localhost",
                     "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                     "DNS:kubernetes.default.svc.cluster.local"])
    ec_cert(pki, "apiserver", "/CN=kube-apiserver", "serverAuth", sans)
    ec_cert(pki, "admin", "/O=system:masters/CN=kuberl-e2e-admin", "clientAuth")
    ec_cert(pki, "controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    ec_cert(pki, "scheduler", "/CN=system:kube-scheduler", "clientAuth")
    # The aggregation layer's front proxy: its own CA and the apiserver's client cert.
    _ca(pki, "front-proxy-ca", f"/CN={CLUSTER_NAME}-front-proxy-ca")
    ec_cert(pki, "front-proxy-client", "/CN=front-proxy-client", "clientAuth",
            ca="front-proxy-ca")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, *,
                     cert: Path | None = None, key: Path | None = None,
                     token: str | None = None) -> None:
    """A self-contained kubeconfig (certificates embedded, so it can be copied anywhere)."""
    if token is not None:
        creds = f"    token: {token}\n"
    else:
        assert cert is not None and key is not None
        creds = (f"    client-certificate-data: {b64(cert)}\n"
                 f"    client-key-data: {b64(key)}\n")
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: {CLUSTER_NAME}\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {b64(ca)}\n"
        f"users:\n- name: {user}\n  user:\n{creds}"
        f"contexts:\n- name: {CLUSTER_NAME}\n  context:\n    cluster: {CLUSTER_NAME}\n"
        f"    user: {user}\n    namespace: default\n"
        f"current-context: {CLUSTER_NAME}\n")
    path.chmod(0o600)
