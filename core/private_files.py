"""Owner-only file modes for the server's data directory and a device's directory.

Both hold secrets or sealed user data; other local users must not list or read them, whatever
the process umask was and whatever modes an existing directory had. :func:`make_private`
sets a tree to directories 0700 and files 0600 (symbolic links are left alone: they are not
followed); the server also runs under umask 077, so what it writes later is private too.
"""

from __future__ import annotations

import os
import stat

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def make_private(root: str | os.PathLike[str]) -> int:
    """Give ``root`` and everything under it owner-only modes; returns how many modes changed."""
    changed = 0
    for folder, dirs, files in os.walk(root):
        for path, wanted in ((folder, PRIVATE_DIR), *((os.path.join(folder, name), PRIVATE_FILE) for name in files)):
            info = os.lstat(path)
            if not stat.S_ISLNK(info.st_mode) and stat.S_IMODE(info.st_mode) != wanted:
                os.chmod(path, wanted)
                changed += 1
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
    return changed


def private_umask() -> int:
    """Set the process umask to 077 (new files 0600, new directories 0700); returns the old one."""
    return os.umask(0o077)


__all__ = ["PRIVATE_DIR", "PRIVATE_FILE", "make_private", "private_umask"]
