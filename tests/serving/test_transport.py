"""The transport: TLS (and client certificates) with a certificate made here, CORS preflights,
a proxy's root path, a Unix socket, and the flags that set them (vLLM's spellings)."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from openai import AsyncOpenAI

from stallfree import Engine
from stallfree.entrypoints.cli import build_parser, config_from_args
from stallfree.entrypoints.server import RunningServer, create_app, start_server
from tests.engine_util import engine_config

KEY = "sk-transport"
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}


def self_signed(tmp_path: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key (also usable as the
    CA that checks it, and as a client certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@contextlib.asynccontextmanager
async def running(**server: Any) -> AsyncIterator[RunningServer]:
    config = engine_config(
        "tiny", server={"served_model_name": "m", **server}, runtime={"check_mirrors": False}
    )
    engine = Engine(config)
    live = await start_server(create_app(engine))
    try:
        yield live
    finally:
        await live.stop()
        await engine.shutdown()


# ---------------------------------------------------------------------- TLS


async def test_the_openai_client_over_tls_and_plain_http_fails(tmp_path):
    key, cert = self_signed(tmp_path)
    async with running(ssl_keyfile=key, ssl_certfile=cert) as live:
        assert live.url.startswith("https://")
        trusting = httpx.AsyncClient(verify=ssl.create_default_context(cafile=cert))
        client = AsyncOpenAI(
            base_url=live.url + "/v1", api_key="unused", http_client=trusting, max_retries=0
        )
        try:
            [model] = (await client.models.list()).data
            assert model.id == "m"
            done = await client.completions.create(
                model="m", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert done.usage is not None and done.usage.completion_tokens == 3
        finally:
            await client.close()
        plain = f"http://127.0.0.1:{live.port}/health"
        async with httpx.AsyncClient(timeout=5) as http:
            with pytest.raises(httpx.TransportError):
                await http.get(plain)
            # and a client that does not trust the certificate refuses the server
            with pytest.raises(httpx.ConnectError):
                await http.get(live.url + "/health")


async def test_client_certificates_when_required(tmp_path):
    key, cert = self_signed(tmp_path)
    tls = {"ssl_keyfile": key, "ssl_certfile": cert, "ssl_ca_certs": cert, "ssl_cert_reqs": 2}
    async with running(**tls) as live:
        context = ssl.create_default_context(cafile=cert)
        async with httpx.AsyncClient(verify=context, timeout=5) as anonymous:
            with pytest.raises(httpx.TransportError):
                await anonymous.get(live.url + "/health")
        context.load_cert_chain(cert, key)
        async with httpx.AsyncClient(verify=context, timeout=5) as known:
            assert (await known.get(live.url + "/health")).status_code == 200


def test_tls_settings_are_checked():
    with pytest.raises(ValueError, match="both ssl_keyfile and ssl_certfile"):
        engine_config("tiny", server={"ssl_keyfile": "k.pem"})
    with pytest.raises(ValueError, match="needs ssl_ca_certs"):
        engine_config("tiny", server={"ssl_keyfile": "k", "ssl_certfile": "c", "ssl_cert_reqs": 2})
    with pytest.raises(ValueError, match="only with TLS"):
        engine_config("tiny", server={"ssl_ca_certs": "ca.pem"})


# ---------------------------------------------------------------------- CORS


def preflight(origin: str) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }


async def test_cors_answers_only_allowed_origins():
    allowed = "https://app.example"
    server = running(api_key=KEY, allowed_origins=[allowed])
    async with server as live, httpx.AsyncClient(base_url=live.url, timeout=10) as http:
        ok = await http.options("/v1/completions", headers=preflight(allowed))
        # a preflight carries no API key; it is answered before the key is checked
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == allowed
        assert "POST" in ok.headers["access-control-allow-methods"]
        bad = await http.options("/v1/completions", headers=preflight("https://evil.example"))
        assert bad.status_code == 400
        assert "access-control-allow-origin" not in bad.headers
        # the real request from the allowed origin: its answers (even a 401) are readable
        auth = {"Origin": allowed, "Authorization": f"Bearer {KEY}"}
        done = await http.post("/v1/completions", json=COMPLETION, headers=auth)
        assert done.status_code == 200
        assert done.headers["access-control-allow-origin"] == allowed
        refused = await http.post("/v1/completions", json=COMPLETION, headers={"Origin": allowed})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == allowed


async def test_no_cors_headers_by_default():
    async with running() as live, httpx.AsyncClient(base_url=live.url, timeout=10) as http:
        headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        pre = await http.options("/v1/completions", headers=headers)
        assert pre.status_code == 405  # no CORS layer: OPTIONS is just a method not served
        assert not any(h.startswith("access-control-") for h in pre.headers)
        done = await http.post("/v1/completions", json=COMPLETION, headers=headers)
        assert done.status_code == 200
        assert not any(h.startswith("access-control-") for h in done.headers)


# ---------------------------------------------------------------------- root path, Unix socket


async def test_root_path_behind_a_proxy():
    """A proxy serves the API under /llm and strips the prefix before forwarding."""
    async with running(root_path="/llm", api_key=KEY) as live:
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=live.url, timeout=10, headers=auth) as http:
            models = await http.get("/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
            assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
        async with httpx.AsyncClient(base_url=live.url, timeout=10) as keyless:
            # the probes stay open behind the prefix too; the API does not
            assert (await keyless.get("/health")).status_code == 200
            assert (await keyless.get("/metrics")).status_code == 200
            assert (await keyless.get("/v1/models")).status_code == 401


async def test_a_unix_socket_serves_the_api(tmp_path):
    path = str(tmp_path / "stallfree.sock")
    async with running(uds=path):
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://x", timeout=10) as c:
            assert (await c.get("/health")).status_code == 200
            done = await c.post("/v1/completions", json=COMPLETION)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    assert not Path(path).exists() or Path(path).is_socket()


# ---------------------------------------------------------------------- the flags


def _server(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", "--model", "tiny", *flags])).server


def test_transport_flags_fill_the_server_section():
    server = _server(
        "--api-key",
        "a",
        "--api-key",
        "b",
        "--allowed-origins",
        '["https://a.example", "https://b.example"]',
        "--allowed-methods",
        "GET,POST",
        "--allow-credentials",
        "--root-path",
        "/llm",
        "--uds",
        "/tmp/s.sock",
        "--otlp-traces-endpoint",
        "http://collector:4318",
    )
    assert server.api_keys == ("a", "b")
    assert server.allowed_origins == ["https://a.example", "https://b.example"]
    assert server.allowed_methods == ["GET", "POST"]
    assert server.allowed_headers == ["*"]
    assert server.allow_credentials is True
    assert (server.root_path, server.uds) == ("/llm", "/tmp/s.sock")
    assert server.otlp_traces_endpoint == "http://collector:4318"
    assert _server().allowed_origins == [] and _server("--api-key", "k").api_keys == ("k",)


def test_a_bad_origin_list_is_a_flag_error(capsys):
    with pytest.raises(SystemExit):
        _server("--allowed-origins", '["unclosed"')
    assert "not a JSON list" in capsys.readouterr().err


def test_the_probes_stay_out_of_the_access_log_behind_a_root_path():
    import logging

    from stallfree.entrypoints.server.launch import _SkipProbes

    def line(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "%s %s %s", args, None)

    behind = _SkipProbes("/llm")
    assert not behind.filter(line("/llm/health")) and not behind.filter(line("/llm/metrics?x"))
    assert behind.filter(line("/llm/v1/models"))
    assert not _SkipProbes().filter(line("/health")) and _SkipProbes().filter(line("/llm/health"))
