"""A local artifact server and its signed test fixtures.

Vendor downloads that the lab cannot reach (the AWS EFA installer, NVIDIA repositories, wheels)
are served to lab hosts from here in tests, always as test fixtures named as such.
"""
