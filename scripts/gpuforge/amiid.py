"""What an EC2 image id looks like, checked once for the AMI pipeline and the cluster configs alike.

Below both gpuforge.ami and gpuforge.pcluster (it imports neither), so that neither imports the other for it.
"""

from __future__ import annotations

import re

from gpuforge.errors import UserError

# "ami-" plus 8 (resources created before 2016) or 17 characters after the hyphen: Amazon EC2 User Guide,
# "Resource IDs" (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/resource-ids.html). Lower-case hex, as
# EC2 returns them and ParallelCluster's schema accepts.
AMI_ID_RE = re.compile(r"^ami-(?:[0-9a-f]{8}|[0-9a-f]{17})$")


def is_ami_id(value: object) -> bool:
    return isinstance(value, str) and AMI_ID_RE.match(value) is not None


def check_ami_id(ami_id: str) -> str:
    """ami_id itself when it is an AMI id; UserError otherwise."""
    if not is_ami_id(ami_id):
        raise UserError(f"invalid AMI id {ami_id!r}: expected ami- followed by 8 or 17 hex digits")
    return ami_id
