"""Ansible lookup: read one SSM SecureString on the control host without ever displaying its value.

amazon.aws.ssm_parameter does the same read, but at -vvvv it logs what it returns ("aws_ssm path lookup
returning: [...]"), and no_log cannot hide what a lookup plugin prints itself. The munge key must not
appear in any output, at any verbosity, so the slurm role reads it with this plugin instead. Errors name
the parameter and what went wrong, never the value. boto3 takes credentials, region and endpoint from
the standard environment (AWS_PROFILE or keys, AWS_REGION, AWS_ENDPOINT_URL for the lab's moto).
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: slurm_ssm_secret
short_description: Read one SSM SecureString without displaying its value
description:
  - Returns the decrypted value of one SSM parameter, read on the control host with boto3.
  - Unlike amazon.aws.ssm_parameter it never passes the value to Ansible's display, at any verbosity.
options:
  _terms:
    description: The name of the SSM parameter.
    required: true
"""

RETURN = r"""
_raw:
  description: The decrypted parameter value, as a one-item list.
  type: list
  elements: str
"""

from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

# Throttling is retried (adaptive), as everywhere else in gpuforge (gpuforge.aws.RETRY_CONFIG).
_RETRIES = {"mode": "adaptive", "max_attempts": 10}


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[str]:
        if len(terms) != 1 or not isinstance(terms[0], str) or not terms[0]:
            raise AnsibleLookupError("slurm_ssm_secret takes exactly one SSM parameter name")
        name = terms[0]
        # Imported here so that roles which never read SSM do not need boto3 to load this plugin.
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            client = boto3.session.Session().client("ssm", config=Config(retries=_RETRIES))
            reply = client.get_parameter(Name=name, WithDecryption=True)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "error")
            raise AnsibleLookupError(
                f"cannot read SSM parameter {name}: {code}; store the value there as a SecureString "
                "and let the control host's AWS identity read and decrypt it"
            ) from None
        except BotoCoreError as exc:
            # These carry no parameter value: missing credentials or region, an unreachable endpoint.
            raise AnsibleLookupError(f"cannot read SSM parameter {name}: {exc}") from None
        return [str(reply["Parameter"]["Value"])]
