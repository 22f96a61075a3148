"""Log output that never shows AWS credentials, request signatures or session tokens.

`gpuforge -vv` turns on botocore's wire log, which includes the Authorization header (the access key id
and the signature), the X-Amz-Security-Token header, the canonical request and string to sign, and
response bodies (an STS or SSO reply carries a secret key and a session token). Every log line goes
through RedactingFormatter, which replaces those values, and the credentials in the environment
wherever they appear, with a marker.
"""

from __future__ import annotations

import logging
import os
import re

MARK = "[redacted]"
_ENV_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
# Values shorter than this are not treated as secrets (moto's fixed test value "testing" is 7 long,
# real key ids are 20 characters, secret keys 40, session tokens hundreds).
_MIN_SECRET_LEN = 16

_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Access key ids: long-term (AKIA), temporary (ASIA) and the other IAM unique-id prefixes.
    (re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|AIPA|ANPA|ANVA|APKA)[A-Z0-9]{16}\b"), MARK),
    # SigV4 Authorization header and presigned-URL query parameters.
    (re.compile(r"(Credential=)[^\s,&'\"]+"), rf"\g<1>{MARK}"),
    (re.compile(r"(Signature=)[^\s,&'\"]+"), rf"\g<1>{MARK}"),
    (
        re.compile(r"((?:X-Amz-Security-Token|X-Amz-Credential|X-Amz-Signature)=)[^\s&'\"]+", re.IGNORECASE),
        rf"\g<1>{MARK}",
    ),
    # Header dictionaries and canonical requests: 'X-Amz-Security-Token': b'...' / x-amz-security-token:...
    (
        re.compile(
            r"((?:x-amz-security-token|authorization|x-amz-signature)['\"]?\s*[:=]\s*b?['\"]?)[^'\"\n]+",
            re.IGNORECASE,
        ),
        rf"\g<1>{MARK}",
    ),
    # botocore.auth logs "Signature:\n<hex>" and the string to sign, whose last line is a hash.
    (re.compile(r"(Signature:\s*)[0-9a-f]{64}"), rf"\g<1>{MARK}"),
    # Credentials in response bodies (STS, SSO, IMDS; XML or JSON) and in Python reprs.
    (
        re.compile(
            r"((?:SecretAccessKey|SessionToken|secretAccessKey|sessionToken|Token|secret_key|token)"
            r"['\"]?\s*(?:>|:|=)\s*b?['\"]?)[^<'\"\s,}]+"
        ),
        rf"\g<1>{MARK}",
    ),
]


def _environment_secrets() -> list[str]:
    values = (os.environ.get(name, "") for name in _ENV_SECRETS)
    return sorted({v for v in values if len(v) >= _MIN_SECRET_LEN}, key=len, reverse=True)


def redact(text: str) -> str:
    """text with every credential, signature and token replaced by MARK."""
    for secret in _environment_secrets():
        text = text.replace(secret, MARK)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


# In the wire log every 64-digit hex value is a signature or one of its inputs (payload hash, canonical
# request hash); none of them helps debugging, so all go.
_WIRE_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")
_HEX_DIGEST = re.compile(r"\b[0-9a-f]{64}\b")


class RedactingFormatter(logging.Formatter):
    """A Formatter whose whole output (message, arguments, traceback) is redacted."""

    def format(self, record: logging.LogRecord) -> str:
        text = redact(super().format(record))
        if record.name.startswith(_WIRE_LOGGERS):
            text = _HEX_DIGEST.sub(MARK, text)
        return text


def configure(verbosity: int) -> None:
    """0: gpuforge INFO; 1 (-v): gpuforge DEBUG; 2 (-vv): also botocore's wire log. All redacted."""
    root = logging.getLogger()
    # A process that already logs (a test runner, a program calling main()) keeps its own handlers.
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(RedactingFormatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity else logging.INFO)
    # boto's own INFO lines (credential and endpoint discovery) are noise to a CLI user.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)
