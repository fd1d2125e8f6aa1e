"""Mutual TLS for the data plane: every KV, token and link connection between
replicas presents a certificate of the cluster's own CA and accepts only peers
that do.

The CA and the one certificate every replica presents come from a file when
`PDD_CLUSTER_TLS_FILE` names one (Kubernetes: a Secret); otherwise they are generated once per Ray
cluster, by whichever process needs them first, and handed to the others through
Ray's GCS key-value store (put-if-absent, so concurrent starters agree on one).
Why there and not derived from Ray's auth token: a cluster may run without token
auth, and the GCS is already the cluster's trust boundary (whoever can write it
can run code on every node), so keeping the secret there grants no one anything
new. No client of the public API reaches the GCS.

Peers connect by IP, so the name checked is the certificate's fixed DNS name
(`PEER_NAME`): membership of the cluster's CA is the identity.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import json
import os
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from app.ray_private import kv_get, kv_put

PEER_NAME = "pdd-data-plane"
GCS_KEY, GCS_NAMESPACE = "cluster_tls", "pdd"
TLS_FILE_ENV = "PDD_CLUSTER_TLS_FILE"
VALIDITY = datetime.timedelta(days=3650)  # rotation is by regeneration (README, Security)


@dataclass(frozen=True)
class Credentials:
    """PEM texts: the cluster CA's certificate, and the replicas' certificate and key."""

    ca: str
    cert: str
    key: str

    @classmethod
    def generate(cls) -> Credentials:
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdd-serve cluster CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, PEER_NAME)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(PEER_NAME)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        return cls(
            ca=ca.public_bytes(pem).decode(),
            cert=cert.public_bytes(pem).decode(),
            key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode(),
        )

    def to_json(self) -> bytes:
        return json.dumps({"ca": self.ca, "cert": self.cert, "key": self.key}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Credentials:
        return cls(**json.loads(data))

    @classmethod
    def load(cls, path: str) -> Credentials:
        return cls.from_json(Path(path).read_bytes())


class ClusterTLS:
    """The two sides' SSL contexts of one cluster's credentials (TLS 1.3, peer certificates required)."""

    def __init__(self, credentials: Credentials):
        self.server = self._context(ssl.PROTOCOL_TLS_SERVER, credentials)
        self.client = self._context(ssl.PROTOCOL_TLS_CLIENT, credentials)

    @staticmethod
    def _context(protocol: int, credentials: Credentials) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=credentials.ca)
        # the ssl module loads a key only from a file: one private to this process, gone at once
        with tempfile.TemporaryDirectory(prefix="pdd-tls-") as tmp:
            cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert.write_text(credentials.cert)
            key.touch(mode=0o600)
            key.write_text(credentials.key)
            context.load_cert_chain(cert, key)
        return context


@functools.cache
def credentials_file() -> str:
    """This cluster's credentials in a file only this process's user reads (removed at
    exit): how a replica hands them to vLLM's worker, which may be another process
    without Ray. A path, unlike the credentials, may appear in vLLM's logged config."""
    directory = tempfile.mkdtemp(prefix="pdd-tls-")  # mode 0700
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = Path(directory, "credentials.json")
    path.touch(mode=0o600)
    path.write_bytes(cluster_credentials().to_json())
    return str(path)


@functools.cache
def cluster_tls() -> ClusterTLS:
    """This Ray cluster's contexts (the process must be connected to Ray)."""
    return ClusterTLS(cluster_credentials())


def cluster_credentials() -> Credentials:
    """The file `PDD_CLUSTER_TLS_FILE` names (a Kubernetes Secret mounted in every pod,
    app/ops/kuberay.py) when set; otherwise the GCS's, made on first use."""
    if path := os.environ.get(TLS_FILE_ENV):
        return Credentials.load(path)
    stored = kv_get(GCS_KEY, GCS_NAMESPACE)
    if stored is None:
        kv_put(GCS_KEY, Credentials.generate().to_json(), GCS_NAMESPACE, overwrite=False)
        stored = kv_get(GCS_KEY, GCS_NAMESPACE)  # whoever put first won
        assert stored is not None
    return Credentials.from_json(stored)
