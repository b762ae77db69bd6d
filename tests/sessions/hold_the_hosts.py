"""A test session that holds two hosts until it is stopped: run by
test_hosts.py, which stops it with SIGTERM or SIGKILL (not collected on its
own: its name is not test_*)."""

import os
import time
from pathlib import Path


def test_hold_the_hosts(two_hosts):
    Path(os.environ["DISTREPRO_HELD"]).write_text(str(two_hosts))
    time.sleep(3600)
