"""Distinct image creation times for moto: a test-double extension, imported only into moto_server.

EC2 reports an image's CreationDate to the second, and the pipeline orders its images by it
(newest kept, oldest pruned). Tests that register several images used to sleep a second between
them so that the order was defined; here each new image is dated at least one second after the
previous one of this server instead (never before the wall clock), so the order of registration is
the order of the dates without the waiting. Nothing else in moto reads this clock.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from moto.core.utils import utcnow
from moto.ec2.models import amis

_lock = threading.Lock()
_last: list[datetime] = []


def image_clock() -> datetime:
    """The wall clock, or one second after the last image's date if that is not later."""
    with _lock:
        now = utcnow().replace(microsecond=0)
        if _last and now <= _last[-1]:
            now = _last[-1] + timedelta(seconds=1)
        _last[:] = [now]
        return now


def install() -> None:
    """Date the images moto creates in this process (RegisterImage, CreateImage, CopyImage) by image_clock."""
    amis.utcnow = image_clock  # type: ignore[attr-defined]
