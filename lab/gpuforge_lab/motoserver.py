"""`python -m gpuforge_lab.motoserver`: moto's own server with gpuforge's test-double extensions."""

from __future__ import annotations

from moto import server

from gpuforge_lab import moto_clock, moto_ext

if __name__ == "__main__":
    moto_ext.install()
    moto_clock.install()
    server.main()
