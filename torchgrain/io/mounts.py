"""Which filesystem a local path lies on, and whether its storage is elsewhere.

Read from Linux's ``/proc/self/mountinfo``: the deepest mount that holds the path.
Used to keep shared caches off network filesystems, where a per-user quota fills,
writes are slow, and ``flock`` may not exclude other machines.

Example:
    >>> "nfs4" in NETWORK_FILESYSTEMS, "ext4" in NETWORK_FILESYSTEMS
    (True, False)
"""

from __future__ import annotations

import os
import re

__all__ = ["NETWORK_FILESYSTEMS", "filesystem_type"]

# Filesystems whose storage is elsewhere: often under a per-user quota (a home directory
# on a cluster), slow to write, and where flock may not exclude other machines.
NETWORK_FILESYSTEMS = frozenset(
    [
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "afs",
        "9p",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "orangefs",
        "panfs",
        "wekafs",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
        "fuse.glusterfs",
        "fuse.juicefs",
        "fuse.mount-s3",
        "fuse.blobfuse",
        "fuse.blobfuse2",
        "fuse.cephfs",
    ]
)
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def filesystem_type(path: str | os.PathLike, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` lies on, from ``mountinfo`` (Linux's
    ``/proc/self/mountinfo`` by default), or None where it cannot be told.

    Example:
        >>> info = ("27 1 253:1 / / rw - ext4 /dev/vda rw\\n"
        ...         "31 27 0:45 / /home rw - nfs4 srv:/home rw\\n")
        >>> filesystem_type("/home/u/.cache", info), filesystem_type("/tmp", info)
        ('nfs4', 'ext4')
    """
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, found = -1, None
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        mount = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best:  # the deepest mount holding the path
            best, found = len(mount), tail.split()[0]
    return found
