"""A ParallelCluster config as a person writes one, for the tests that edit configs in place.

Comments (own-line and trailing), single and double quotes, flow and block style: `gpuforge publish`
and `gpuforge cluster-config set-ami` must change only the AMI lines and keep everything else as written.
"""

from __future__ import annotations

COMMENTED = """\
# Training cluster for team A: keep this comment.
Region: us-east-1
Image:
  Os: 'ubuntu2204'   # quoted on purpose
  CustomAmi: ami-0123456789abcdef0  # moved by gpuforge publish
HeadNode:
  InstanceType: c5.2xlarge
  Networking:
    SubnetId: "subnet-0123456789abcdef0"
    AdditionalSecurityGroups:
      - sg-0123456789abcdef0
  Ssh: {KeyName: ops}
Scheduling:
  Scheduler: slurm
  SlurmQueues:
    - Name: gpu
      # p5 capacity block, see the runbook.
      ComputeResources:
        - Name: p5
          InstanceType: p5.48xlarge
          MinCount: 0
          MaxCount: 4  # the capacity block's size
      Networking:
        SubnetIds: ["subnet-0123456789abcdef0"]
"""

CUSTOM_AMI_LINE = "  CustomAmi: ami-0123456789abcdef0  # moved by gpuforge publish\n"
assert CUSTOM_AMI_LINE in COMMENTED

# The same config before any image was published into it: no Image.CustomAmi yet.
COMMENTED_WITHOUT_AMI = COMMENTED.replace(CUSTOM_AMI_LINE, "")
