"""Reading an instance's metrics from Prometheus (plugin_utils/_advisor/prometheus.py) against a fake
Prometheus HTTP API on a local port: the range queries it makes and the samples it builds."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import prometheus as _prometheus
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.window import window_stats


class FakePrometheus:
    """Answers /api/v1/query_range from ``series``: {metric name: [(time, value), ...]}."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[float, float]]] = {}
        self.queries: list[dict[str, str]] = []
        self.fail: str | None = None
        # The Authorization header a request must carry (None: any request is answered).
        self.need_auth: str | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                params = dict(urllib.parse.parse_qsl(url.query))
                fake.queries.append({"path": url.path, **params})
                if fake.need_auth is not None and self.headers.get("Authorization") != fake.need_auth:
                    self.answer(401, {"status": "error", "error": "unauthorized"})
                    return
                if fake.fail == "500":
                    self.answer(500, {"status": "error", "error": "boom"})
                    return
                metric = params["query"].split("(", 1)[1].split("{", 1)[0]
                points = fake.series.get(metric)
                result: list[dict[str, Any]] = []
                if points is not None:
                    result = [{"metric": {}, "values": [[t, str(v)] for t, v in points]}]
                    if fake.fail == "two":
                        result = result * 2
                self.answer(200, {"status": "success", "data": {"resultType": "matrix", "result": result}})

            def answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def test_samples_from_range_queries(prometheus: FakePrometheus) -> None:
    prometheus.series = {
        "sglang:num_running_reqs": [(1000.0, 16), (1005.0, 16), (1010.0, 15)],
        "sglang:num_queue_reqs": [(1000.0, 240), (1005.0, 238)],
        "sglang:mamba_usage": [(1000.0, 0.99), (1005.0, 1.0), (1010.0, 0.94)],
        "sglang:generation_tokens_total": [(1000.0, 5000), (1010.0, 17000)],
    }
    names = {"host": "10.0.0.7", "inventory_hostname": "b200-node", "port": 30001, "name": "gpu1"}
    # The default: the labels the monitoring role gives every target.
    assert _prometheus.selector_for(_prometheus.DEFAULT_SELECTOR, **names) == 'host="b200-node",instance_name="gpu1"'
    selector = _prometheus.selector_for('instance="{host}:{port}"', **names)
    assert selector == 'instance="10.0.0.7:30001"'
    samples, problems = _prometheus.read_samples(prometheus.url + "/", selector, 1000.0, 1010.0, 5.0)
    assert problems == []
    assert samples == [
        {"t": 0.0, "num_running_reqs": 16, "num_queue_reqs": 240, "mamba_usage": 0.99, "generation_tokens_total": 5000},
        {"t": 5.0, "num_running_reqs": 16, "num_queue_reqs": 238, "mamba_usage": 1.0},
        {"t": 10.0, "num_running_reqs": 15, "mamba_usage": 0.94, "generation_tokens_total": 17000},
    ]
    first = prometheus.queries[0]
    assert first == {
        "path": "/api/v1/query_range",
        "query": 'max(sglang:num_running_reqs{instance="10.0.0.7:30001"})',
        "start": "1000.000",
        "end": "1010.000",
        "step": "5",
    }
    assert 'sum(sglang:generation_tokens_total{instance="10.0.0.7:30001"})' in [q["query"] for q in prometheus.queries]


def test_no_series_and_errors_are_problems(prometheus: FakePrometheus) -> None:
    samples, problems = _prometheus.read_samples(prometheus.url, 'job="x"', 0.0, 10.0, 5.0)
    assert samples == []
    assert problems == ['Prometheus has no sglang:num_running_reqs{job="x"} between 0 and 10']
    prometheus.series = {"sglang:num_running_reqs": [(0.0, 1)]}
    prometheus.fail = "two"
    _unused, problems = _prometheus.read_samples(prometheus.url, 'job="x"', 0.0, 10.0, 5.0)
    assert "unusable answer (2 series; the query must aggregate them into one)" in problems[0]
    prometheus.fail = "500"
    with pytest.raises(_prometheus.PrometheusError, match=r": 500: \{\"status\": \"error\""):
        _prometheus.range_query(prometheus.url, "up", 0.0, 10.0, 5.0)


def test_unreachable_and_bad_urls() -> None:
    with pytest.raises(_prometheus.PrometheusError, match="no answer: URLError"):
        _prometheus.range_query("http://127.0.0.1:9", "up", 0.0, 10.0, 5.0, timeout=2)
    with pytest.raises(_prometheus.PrometheusError, match="only http:// or https://"):
        _prometheus.range_query("file:///etc/passwd", "up", 0.0, 10.0, 5.0)
    with pytest.raises(_prometheus.PrometheusError, match="use the placeholders"):
        _prometheus.selector_for('instance="{hostname}"', host="h", port=1, name="n")


def test_kv_usage_is_read_as_full_token_usage(prometheus: FakePrometheus) -> None:
    """0.5.14+: token_usage is the fullest pool (the Mamba pool here), the KV cache's usage is
    full_token_usage; the window reads the latter."""
    prometheus.series = {
        "sglang:num_running_reqs": [(1000.0, 16), (1005.0, 16)],
        "sglang:token_usage": [(1000.0, 0.97), (1005.0, 0.97)],
        "sglang:full_token_usage": [(1000.0, 0.03), (1005.0, 0.03)],
    }
    samples, problems = _prometheus.read_samples(prometheus.url, 'instance_name="gpu0"', 1000.0, 1005.0, 5.0)
    assert problems == []
    assert [s["full_token_usage"] for s in samples] == [0.03, 0.03]
    assert any(q["query"] == 'max(sglang:full_token_usage{instance_name="gpu0"})' for q in prometheus.queries)
    stats = window_stats(samples, 16, 941074, "sglang:full_token_usage")
    assert (stats.kv_usage_metric, stats.kv_usage_mean) == ("sglang:full_token_usage", 0.03)


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (PEM files): the CA bundle is the certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-prometheus")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "prometheus.crt", tmp_path / "prometheus.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_https_with_a_ca_bundle_and_basic_auth(prometheus: FakePrometheus, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    prometheus.server.socket = context.wrap_socket(prometheus.server.socket, server_side=True)
    prometheus.need_auth = "Basic " + base64.b64encode(b"advisor:s3cret").decode()
    prometheus.series = {"sglang:num_running_reqs": [(1000.0, 16)]}
    url = prometheus.url.replace("http://", "https://")
    access = _prometheus.Access(ca_path=str(cert), username="advisor", password="s3cret")
    samples, problems = _prometheus.read_samples(url, 'job="x"', 1000.0, 1000.0, 5.0, timeout=5, access=access)
    assert problems == [] and samples == [{"t": 0.0, "num_running_reqs": 16.0}]
    # The system's CA bundle does not know the certificate: no answer, and why.
    status, body = _prometheus.http_get(url + "/api/v1/query_range?query=up", 5, _prometheus.Access())
    assert status is None and "CERTIFICATE_VERIFY_FAILED" in body
    # Without the credentials, Prometheus's 401 is the answer.
    status, _body = _prometheus.http_get(url + "/api/v1/query_range?query=up", 5, _prometheus.Access(ca_path=str(cert)))
    assert status == 401
