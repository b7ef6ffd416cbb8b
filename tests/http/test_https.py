"""The gateway over HTTPS: `dgr up --tls-cert --tls-key` with a CA and a certificate for
127.0.0.1 made here with the `openssl` CLI (the certificate file holds the chain: the server's
certificate, then the CA's). The official client trusting that CA completes and streams a chat;
with the default trust store it fails on the certificate; headless Chromium, with the
certificate's public key pinned, renders the dashboard. One one-worker swarm for the module.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest

from conftest import CHROMIUM, Swarm, WorkerRows, check_dashboard_in_browser, start_swarm, stop_swarm, wait_until

CHAT = [{"role": "user", "content": "Name three colours."}]

OPENSSL_CONFIG = """
[req]
distinguished_name = dn
prompt = no
[dn]
CN = dgr test CA
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[leaf]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@dataclass
class Certs:
    ca: Path  # the CA's certificate, what a client trusts
    chain: Path  # the server's certificate, then the CA's
    key: Path  # the server's private key


def openssl(*args: str, cwd: Path) -> str:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"openssl {' '.join(args)}: {r.stderr}"
    return r.stdout


def make_certs(d: Path) -> Certs:
    (d / "openssl.cnf").write_text(OPENSSL_CONFIG)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-config", "openssl.cnf"]
    openssl("req", "-x509", *ec, "-extensions", "ca", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", cwd=d)
    openssl("req", "-new", *ec, "-subj", "/CN=localhost", "-keyout", "key.pem", "-out", "leaf.csr", cwd=d)
    openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", "openssl.cnf", "-extensions", "leaf", "-out", "leaf.pem", cwd=d)  # fmt: skip
    (d / "chain.pem").write_text((d / "leaf.pem").read_text() + (d / "ca.pem").read_text())
    return Certs(ca=d / "ca.pem", chain=d / "chain.pem", key=d / "key.pem")


def spki_sha256(cert: Path) -> str:
    """Base64 of the SHA-256 of the certificate's SubjectPublicKeyInfo (what Chromium pins)."""
    pem = openssl("x509", "-in", str(cert), "-pubkey", "-noout", cwd=cert.parent)
    der = base64.b64decode("".join(line for line in pem.splitlines() if not line.startswith("-----")))
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


@pytest.fixture(scope="module")
def https() -> tuple[Swarm, Certs]:
    with tempfile.TemporaryDirectory(prefix="dgr-https-") as tmp:
        certs = make_certs(Path(tmp))
        args = ["--workers", "1", "--tls-cert", str(certs.chain), "--tls-key", str(certs.key)]
        s = start_swarm(Path(tmp), args=args, log_name="dgr-up-https.log")
        try:
            yield s, certs
        finally:
            stop_swarm(s)


def trusting_client(s: Swarm, certs: Certs) -> openai.OpenAI:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    c = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=60, http_client=httpx2.Client(verify=ctx))
    s.clients.append(c)
    return c


def test_dgr_up_prints_https_urls(https):
    s, _ = https
    assert s.base_url.startswith("https://127.0.0.1:"), f"dgr up's base_url with TLS: {s.base_url}"
    # The banner follows the ready line on stderr.
    banner = [f"OpenAI API:  {s.base_url}", f"dashboard:   {s.root}/", f"curl -s {s.base_url}/chat/completions"]
    wait_until("dgr up's banner with https:// URLs", lambda: all(b in s.log.read_text() for b in banner), timeout=10)


def test_chat_completes_and_streams_over_https_with_the_ca_trusted(https):
    s, certs = https
    client = trusting_client(s, certs)
    assert s.model in [m.id for m in client.models.list()]
    whole = client.chat.completions.create(model=s.model, messages=CHAT, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content, f"empty chat answer over HTTPS: {whole}"
    assert whole.usage.completion_tokens > 0, whole.usage
    chunks = list(
        client.chat.completions.create(
            model=s.model, messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content, f"streamed {text!r} != whole {whole.choices[0].message.content!r}"
    # The counts, not `cached_tokens`: the repeated prompt is served from the prefix caches.
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # noqa: E731
    assert counts(chunks[-1].usage) == counts(whole.usage), f"stream usage {chunks[-1].usage} != whole usage {whole.usage}"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, f"the repeated prompt hit no cache: {chunks[-1].usage}"
    # /metrics is served over the same TLS.
    with urllib.request.urlopen(f"{s.root}/metrics", context=ssl.create_default_context(cafile=str(certs.ca)), timeout=10) as r:
        assert r.status == 200 and b"dgr_gateway_requests_total" in r.read()


def test_the_default_trust_store_refuses_the_certificate(https):
    s, _ = https
    client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=30)
    s.clients.append(client)
    with pytest.raises(openai.APIConnectionError) as caught:
        client.chat.completions.create(model=s.model, messages=CHAT, max_tokens=4)
    chain, e = [], caught.value
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(x, ssl.SSLCertVerificationError) for x in chain), f"not a certificate error: {chain!r}"


def test_dashboard_renders_over_https_in_chromium_with_the_key_pinned(https):
    s, certs = https
    # Without the pin Chromium refuses the unknown CA: no rendered dashboard.
    with tempfile.TemporaryDirectory(prefix="dgr-chromium-") as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", s.root + "/"]  # fmt: skip
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout
    page = WorkerRows()
    page.feed(dom)
    assert page.ready != "1" and not page.rows, "Chromium rendered the dashboard without trusting its certificate"

    pin = spki_sha256(certs.chain)
    rows = check_dashboard_in_browser(s, "dashboard-https", f"--ignore-certificate-errors-spki-list={pin}")
    assert len(rows) == 1, f"dgr up --workers 1 should list one worker: {rows}"
