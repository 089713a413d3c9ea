"""Verified JWT identity: `jwt:CLAIM` keys a client by a claim of a
bearer token whose signature checks out, and by nothing a client can forge.

Keys are made here: an HS256 secret passed through the environment, an RSA key
as a PEM public key file, an EC P-256 key in a JWKS file. Every limit allows one
request an hour, keyed [jwt:sub, ip]: a 200 means a new bucket, and a token that
does not verify must land in the client's ip bucket, never in a bucket of its own."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway.config import ConfigError
from gateway.config.model import JwtConfig, JwtFailure, JwtKey
from gateway.identity.jwt import VERIFIED_MEMO_SIZE, JwtVerifier, bearer_token
from gateway.testing import config_from_yaml, running_gateway
from tests.processes import GatewayProcess
from tests.raw_client import raw_request, request_bytes

SECRET = "s3cret-of-at-least-thirty-two-bytes!!"
ENV = {"JWT_SECRET": SECRET}


@pytest.fixture(scope="module")
def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key():
    return ec.generate_private_key(ec.SECP256R1())


def pem(private_key) -> bytes:
    return private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def jwt_config(upstream: str, jwt_block: str) -> str:
    return f"""
jwt: {jwt_block}
limits:
  per_user: {{rate: 1/hour, burst: 1, key: [jwt:sub, ip]}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [per_user]
"""


def token(claims: dict, key=SECRET, algorithm="HS256", **headers) -> str:
    return jwt.encode({"exp": int(time.time()) + 600, **claims}, key, algorithm=algorithm, headers=headers or None)


async def status_with(url: str, authorization: str | None = None, *extra: tuple[str, str]) -> int:
    lines = [("Authorization", authorization)] if authorization is not None else []
    status, _, _ = await raw_request(url, request_bytes("/echo", [*lines, *extra]))
    return status


def bearer(value: str) -> str:
    return "Bearer " + value


async def test_a_verified_claim_keys_the_bucket(upstream):
    config = config_from_yaml(jwt_config(upstream, "{secret_env: JWT_SECRET}"), environ=ENV)
    async with running_gateway(config) as gw:
        assert await status_with(gw.url, bearer(token({"sub": "alice"}))) == 200
        assert await status_with(gw.url, bearer(token({"sub": "alice", "iat": 1}))) == 429  # another token, same sub
        assert await status_with(gw.url, "bearer " + token({"sub": "bob"})) == 200  # the scheme is case-insensitive
        assert await status_with(gw.url) == 200  # no token: the ip bucket, still full


def hs256_by_hand(claims: dict, secret: bytes) -> str:
    """An HS256 token signed with any bytes, which PyJWT would refuse to sign with (a PEM key)."""
    encode = jwt.utils.base64url_encode
    signing_input = encode(b'{"alg":"HS256","typ":"JWT"}') + b"." + encode(json.dumps(claims).encode())
    return (signing_input + b"." + encode(hmac.new(secret, signing_input, hashlib.sha256).digest())).decode()


def forged_tokens() -> dict[str, str]:
    """Tokens for a fresh `sub` each that must not verify against SECRET."""
    now = int(time.time())
    good = token({"sub": "mallory-sig"})
    head, payload, signature = good.split(".")
    swapped = jwt.utils.base64url_encode(json.dumps({"sub": "mallory-swap", "exp": now + 600}).encode()).decode()
    return {
        "expired": token({"sub": "mallory-expired", "exp": now - 60}),
        "not-yet-valid": token({"sub": "mallory-nbf", "nbf": now + 600}),
        "other-secret": token({"sub": "mallory-other"}, key="another-secret-of-thirty-two-bytes!!"),
        "unsigned-alg-none": jwt.encode({"sub": "mallory-none", "exp": now + 600}, None, algorithm="none"),
        "signature-stripped": f"{head}.{payload}.",
        "payload-swapped": f"{head}.{swapped}.{signature}",
        "hs512-same-secret": token({"sub": "mallory-hs512"}, algorithm="HS512"),
        "garbage": "not.a.token",
        "empty-parts": "..",
        # 8 KB, under aiohttp's 8190-byte header line; its JSON nests past Python's recursion limit.
        "deeply-nested-header": jwt.utils.base64url_encode(b"[" * 3000 + b"]" * 3000).decode() + f".{payload}.{signature}",
    }


@pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")  # HS512 signed with an HS256-sized secret
async def test_an_invalid_expired_or_unsigned_token_never_selects_a_bucket(upstream):
    config = config_from_yaml(jwt_config(upstream, "{secret_env: JWT_SECRET}"), environ=ENV)
    async with running_gateway(config) as gw:
        # Each forged token names a sub never seen; were any believed, it would get a bucket (200).
        first = True
        for name, forged in forged_tokens().items():
            assert await status_with(gw.url, bearer(forged)) == (200 if first else 429), name
            first = False  # the first fell back to the ip bucket and emptied it
        assert await status_with(gw.url) == 429  # that was this client's ip bucket
        assert await status_with(gw.url, bearer(token({"sub": "carol"}))) == 200


async def test_with_on_invalid_reject_a_bad_token_gets_401_and_no_token_falls_back(upstream):
    config = config_from_yaml(jwt_config(upstream, "{secret_env: JWT_SECRET, on_invalid: reject}"), environ=ENV)
    async with running_gateway(config) as gw:
        status, headers, body = await raw_request(
            gw.url, request_bytes("/echo", [("Authorization", bearer(token({"sub": "x", "exp": 1})))])
        )
        assert status == 401
        assert headers["www-authenticate"] == ['Bearer error="invalid_token"']
        assert headers["content-type"] == ["application/problem+json; charset=utf-8"]
        assert json.loads(body)["title"] == "Unauthorized"
        assert await status_with(gw.url) == 200  # no bearer token at all: the next source, ip
        assert await status_with(gw.url, "Basic dXNlcjpwYXNz") == 429  # not a bearer token: the same ip bucket


async def test_rs256_verifies_with_a_public_key_file(upstream, rsa_key, tmp_path):
    key_file = tmp_path / "jwt.pem"
    key_file.write_bytes(pem(rsa_key))
    async with running_gateway(jwt_config(upstream, f"{{public_key_file: '{key_file}', issuer: auth.test}}")) as gw:
        assert await status_with(gw.url, bearer(token({"sub": "dave", "iss": "auth.test"}, rsa_key, "RS256"))) == 200
        assert await status_with(gw.url, bearer(token({"sub": "dave", "iss": "auth.test"}, rsa_key, "RS256"))) == 429
        # The wrong issuer, and HS256 signed with the public key as its secret, are forgeries.
        assert await status_with(gw.url, bearer(token({"sub": "eve", "iss": "evil.test"}, rsa_key, "RS256"))) == 200
        confused = hs256_by_hand({"sub": "eve2", "iss": "auth.test", "exp": int(time.time()) + 60}, pem(rsa_key))
        assert await status_with(gw.url, bearer(confused)) == 429  # the ip bucket, emptied by eve


async def test_es256_verifies_with_a_jwks_file_picking_the_key_by_kid(upstream, ec_key, rsa_key, tmp_path):
    ec_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key()))
    rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**ec_jwk, "kid": "ec-1"}, {**rsa_jwk, "kid": "rsa-1"}]}))
    async with running_gateway(jwt_config(upstream, f"{{jwks_file: '{jwks}', audience: api}}")) as gw:
        assert await status_with(gw.url, bearer(token({"sub": "frank", "aud": "api"}, ec_key, "ES256", kid="ec-1"))) == 200
        assert await status_with(gw.url, bearer(token({"sub": "frank", "aud": "api"}, rsa_key, "RS256", kid="rsa-1"))) == 429
        # Signed by the EC key but naming the RSA key's kid, or no kid, or the wrong audience: not believed.
        assert await status_with(gw.url, bearer(token({"sub": "g1", "aud": "api"}, ec_key, "ES256", kid="rsa-1"))) == 200
        assert await status_with(gw.url, bearer(token({"sub": "g2", "aud": "api"}, ec_key, "ES256"))) == 429
        assert await status_with(gw.url, bearer(token({"sub": "g3", "aud": "web"}, ec_key, "ES256", kid="ec-1"))) == 429


async def test_an_authorization_header_given_twice_or_named_in_connection_is_rejected(upstream):
    config = config_from_yaml(jwt_config(upstream, "{secret_env: JWT_SECRET}"), environ=ENV)
    async with running_gateway(config) as gw:
        good = bearer(token({"sub": "henry"}))
        assert await status_with(gw.url, good, ("Authorization", bearer(token({"sub": "ivan"})))) == 400
        assert await status_with(gw.url, good, ("Connection", "Authorization")) == 400
        assert await status_with(gw.url, good) == 200  # neither was charged


def test_the_gateway_process_reads_the_hs256_secret_from_its_environment(tmp_path):
    """As users run it: `python -m gateway run -c FILE` with the secret in the environment."""
    config = jwt_config("http://127.0.0.1:9", "{secret_env: JWT_SECRET, on_invalid: reject}").replace(
        "routes:", "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nroutes:"
    )
    with GatewayProcess(config, env=ENV) as gw:
        bad = request_bytes("/x", [("Authorization", bearer(token({"sub": "x"}, key="y" * 40)))])
        good = request_bytes("/x", [("Authorization", bearer(token({"sub": "x"})))])
        assert asyncio.run(raw_request(gw.url, bad))[0] == 401
        assert asyncio.run(raw_request(gw.url, good))[0] == 502  # verified, charged, and on to a closed port


@pytest.mark.parametrize(
    ("jwt_block", "environ", "message"),
    [
        ("{secret_env: JWT_SECRET}", {}, "jwt.secret_env: environment variable JWT_SECRET is not set"),
        ("{secret_env: JWT_SECRET}", {"JWT_SECRET": "short"}, "jwt.secret_env: an HS256 secret needs at least 32 bytes, got 5"),
        ("{}", ENV, "jwt: expected exactly one of secret_env (HS256), public_key_file or jwks_file (RS256, ES256)"),
        ("{public_key_file: /nonexistent.pem}", ENV, "jwt.public_key_file: cannot read '/nonexistent.pem': No such file or directory"),
        ("{secret_env: JWT_SECRET, on_invalid: ignore}", ENV, "jwt.on_invalid: expected next or reject, got 'ignore'"),
        ("{secret_env: JWT_SECRET, leeway: 5}", ENV, "jwt.leeway:"),
    ],
)
def test_a_bad_jwt_block_is_a_one_line_config_error(jwt_block, environ, message):
    with pytest.raises(ConfigError) as caught:
        config_from_yaml(jwt_config("http://127.0.0.1:1", jwt_block), environ=environ)
    text = str(caught.value)
    assert text.startswith("<test>: " + message), text
    assert "\n" not in text and SECRET not in text


def test_key_files_that_hold_no_usable_public_key_are_config_errors(tmp_path, rsa_key):
    private = tmp_path / "private.pem"
    private.write_bytes(
        rsa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    with pytest.raises(ConfigError, match=r"jwt.public_key_file: .* holds no PEM public key"):
        config_from_yaml(jwt_config("http://127.0.0.1:1", f"{{public_key_file: '{private}'}}"))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key))]}))
    with pytest.raises(ConfigError, match=r"jwt.jwks_file: .* private or symmetric key"):
        config_from_yaml(jwt_config("http://127.0.0.1:1", f"{{jwks_file: '{jwks}'}}"))
    jwks.write_text("{not json")
    with pytest.raises(ConfigError, match=r"jwt.jwks_file: .* is not JSON"):
        config_from_yaml(jwt_config("http://127.0.0.1:1", f"{{jwks_file: '{jwks}'}}"))


def test_jwt_sources_and_the_jwt_block_need_each_other():
    no_block = jwt_config("http://127.0.0.1:1", "{secret_env: JWT_SECRET}").replace("jwt: {secret_env: JWT_SECRET}", "")
    with pytest.raises(ConfigError, match=r"limits.per_user.key\[0\]: a jwt:CLAIM source needs a top-level `jwt` block"):
        config_from_yaml(no_block)
    unused = jwt_config("http://127.0.0.1:1", "{secret_env: JWT_SECRET}").replace("[jwt:sub, ip]", "[ip]")
    with pytest.raises(ConfigError, match=r"<test>: jwt: no limit's `key` has a jwt:CLAIM source"):
        config_from_yaml(unused, environ=ENV)


# --- pure: the verifier and its memo of verified tokens -------------------------------------


def hs256_verifier(clock, leeway: float = 0.0) -> JwtVerifier:
    return JwtVerifier(
        JwtConfig(keys=(JwtKey(algorithm="HS256", key=SECRET.encode()),), issuer=None, audience=None,
                  leeway=leeway, on_invalid=JwtFailure.NEXT),
        clock=clock,
    )


def test_a_remembered_token_stops_counting_once_it_expires():
    now = [time.time()]
    verifier = hs256_verifier(lambda: now[0], leeway=5)
    remembered = token({"sub": "kim", "exp": int(now[0]) + 60})
    assert verifier.claims(remembered)["sub"] == "kim"
    now[0] += 64  # within exp + leeway: still the remembered claims
    assert verifier.claims(remembered)["sub"] == "kim"
    now[0] += 2  # past exp + leeway: the memo never outlives the token
    assert verifier.claims(remembered) is None


def test_a_remembered_token_ends_when_pyjwt_would_refuse_it_whatever_its_exp():
    now = [time.time()]
    verifier = hs256_verifier(lambda: now[0])
    fractional = token({"sub": "lee", "exp": int(now[0]) + 60.9})  # PyJWT reads int(exp): 60
    beyond_float = token({"sub": "max", "exp": 10**400})  # a valid integer no float holds
    assert verifier.claims(fractional)["sub"] == "lee"
    assert verifier.claims(beyond_float)["sub"] == "max"
    now[0] = int(now[0]) + 60.5
    assert verifier.claims(fractional) is None
    assert verifier.claims(beyond_float)["sub"] == "max"


def test_the_memo_of_verified_tokens_stays_bounded_and_keeps_no_forgeries():
    verifier = hs256_verifier(time.time)
    for i in range(VERIFIED_MEMO_SIZE + 10):
        assert verifier.claims(token({"sub": f"user-{i}"}))
        assert verifier.claims(token({"sub": f"forged-{i}"}, key="another-secret-of-thirty-two-bytes!!")) is None
    assert len(verifier._verified) <= VERIFIED_MEMO_SIZE  # the memo itself: no public view of it
    assert not any("forged" in claims["sub"] for claims, _ in verifier._verified.values())


@pytest.mark.parametrize(
    ("authorization", "expected"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("BEARER abc", "abc"), ("Basic abc", None), ("Bearer", None), ("Bearerabc", None)],
)
def test_the_bearer_token_is_read_from_the_authorization_value(authorization, expected):
    assert bearer_token(authorization) == expected
