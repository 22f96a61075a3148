"""Errors that the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input or an unmet precondition the user can fix; the message says how."""

    exit_code = 2


class ExternalError(Exception):
    """A tool or service gpuforge drives (Packer, AWS, sshd) failed."""

    exit_code = 1
